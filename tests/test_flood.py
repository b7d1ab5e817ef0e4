"""Floods of hostile frames, each one rejected, must not grow the daemon's memory: ZeroMQ
queues a few frames per peer (RCVHWM), and frames past a request's three are never copied.

Memory is read from /proc (Linux): VmHWM is the peak resident size, so a growth that came and
went during the flood counts too; the arena is populated before the flood, so none of it is
the arena's.
"""

import sys

import pytest
import zmq

from expertd.paths import daemon_paths
from harness import TINY_CACHE_GB, Daemon, query_stats, wait_until

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="reads the daemon's memory from /proc")]

BOUND_MB = 100  # DESIGN.md: daemon RSS - arena <= 100 MB
# A DEMAND whose body nests 60000 arrays: under the 64 KiB frame limit, refused by the parser.
HOSTILE = [b"1", b"\x02", b"\x81\xa5layer" + b"\x91" * 60000 + b"\xc0"]


@pytest.fixture(scope="module")
def blobs(models):
    return models.blobs(seed=23)


def _memory_mb(pid: int) -> dict:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmHWM", "RssAnon"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def _dealers(ctx, endpoint: str, n: int) -> list:
    socks = []
    for _ in range(n):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    return socks


def test_a_flood_of_rejected_frames_from_many_sockets_does_not_grow_the_daemon(blobs,
                                                                              isolated_env):
    """32 sockets send 300 frames of 60 KB each without waiting (576 MB in all; before RCVHWM
    the daemon grew by ~370 MB and kept most of it): the daemon grows by less than 100 MB,
    answers STATS in the middle of the flood, and rejects every frame."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        before = _memory_mb(d.pid)
        ctx = zmq.Context()
        socks = _dealers(ctx, daemon_paths(blobs).endpoint, 32)
        try:
            sent = 0
            for _ in range(300):
                for sock in socks:
                    try:
                        sock.send_multipart(HOSTILE, zmq.NOBLOCK, copy=False)  # one buffer
                        sent += 1
                    except zmq.Again:
                        pass  # our own queue is full: the daemon reads slower than we send
            during = query_stats(blobs)  # answers within the client's usual timeout
            assert during["bad_requests"] < sent, "the flood was over before STATS was asked"
            wait_until(lambda: query_stats(blobs)["bad_requests"] >= sent, 40,
                       f"the daemon to reject all {sent} frames")
            after = _memory_mb(d.pid)
        finally:
            for sock in socks:
                sock.close()
            ctx.term()
        assert after["VmHWM"] - before["VmHWM"] < BOUND_MB, (before, after)
        assert after["RssAnon"] - before["RssAnon"] < BOUND_MB, (before, after)
        assert query_stats(blobs)["internal_errors"] == 0


def test_the_frames_past_a_requests_three_are_dropped_uncopied(blobs, isolated_env):
    """One message of 1000 frames of 60 KB (60 MB, which ZeroMQ holds whole until it is
    complete): the daemon refuses it in one reply without copying it as well (it grew by
    twice its size before)."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        before = _memory_mb(d.pid)
        ctx = zmq.Context()
        sock, = _dealers(ctx, daemon_paths(blobs).endpoint, 1)
        try:
            sock.send_multipart([b"7", b"\x07"] + [b"\x91" * 60000] * 1000, copy=False)
            assert sock.poll(10_000), "no reply to the message of 1000 frames"
            rid, op, body = sock.recv_multipart()
        finally:
            sock.close()
            ctx.term()
        assert rid == b"7" and b"expected 3 frames, got 1002" in body
        after = _memory_mb(d.pid)
        assert after["VmHWM"] - before["VmHWM"] < BOUND_MB, (before, after)
        assert query_stats(blobs)["bad_requests"] == 1
