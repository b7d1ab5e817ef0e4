"""Floods must not grow the daemon's memory (docs/ARCHITECTURE.md, Bars: daemon RSS - arena < 100 MB under any
flood ZeroMQ lets us bound) nor keep STATS from being answered: rejected messages from many
peers, frames past MAXMSGSIZE, a thousand connections each holding a frame open. What ZeroMQ
cannot bound, one message of many frames, is measured here too (README, security).

Memory is read from /proc (Linux): VmHWM is the peak resident size, so a growth that came and
went during the flood counts too; the arena is populated before the flood, so none of it is
the arena's.
"""

import os
import resource
import signal
import subprocess
import sys

import pytest
from harness import TINY_CACHE_GB, Daemon, ZmtpPeer, query_stats, wait_until
from harness.zmtp import frame, header

from expertd.connection import Connection
from expertd.protocol import PROTOCOL_VERSION, Op
from expertd.serving.clients import MAX_CLIENTS
from expertd.serving.peers import MAX_FRAME

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="reads the daemon's memory from /proc")]

BOUND_MB = 100
# A DEMAND whose body nests 60000 arrays: under the 64 KiB body limit, refused by the parser.
HOSTILE = [b"1", b"\x02", b"\x81\xa5layer" + b"\x91" * 60000 + b"\xc0"]


def _memory_mb(pid: int) -> dict:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmHWM", "RssAnon"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def _grew(before: dict, after: dict) -> None:
    assert after["VmHWM"] - before["VmHWM"] < BOUND_MB, (before, after)
    assert after["RssAnon"] - before["RssAnon"] < BOUND_MB, (before, after)


def test_a_flood_of_rejected_messages_from_many_peers_does_not_grow_the_daemon(blobs,
                                                                              isolated_env):
    """32 peers send 300 messages of 60 KB each without waiting (576 MB in all; a ROUTER with
    no high-water mark grew by ~370 MB and kept most of it): the daemon grows by less than
    100 MB, answers STATS in the middle of the flood, and rejects every message.

    The daemon is stopped (SIGSTOP) while the flood and the STATS request are queued, so that
    it meets them together however fast it is: STATS must be answered before the flood is."""
    # A long client timeout: libzmq's heartbeats must not close connections while it is stopped.
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB, "--client-timeout", "120") as d:
        before = _memory_mb(d.pid)
        peers = [Connection(blobs) for _ in range(32)]
        asker = Connection(blobs)
        try:
            for conn in (*peers, asker):  # every connection made before the daemon stops
                conn.request(Op.STATS)
            os.kill(d.pid, signal.SIGSTOP)
            try:
                sent = 0
                for _ in range(300):
                    for peer in peers:
                        sent += peer.send_frames(HOSTILE, wait=False)  # queued by the client
                rid = asker.send(Op.STATS, {})
            finally:
                os.kill(d.pid, signal.SIGCONT)
            assert sent == 300 * len(peers)
            during = asker.wait(rid, 30)
            assert during["bad_requests"] < sent, "STATS was answered only after the flood"

            def rejected():
                for peer in peers:
                    while peer.poll(0):  # the error replies
                        peer.recv()
                return query_stats(blobs)["bad_requests"] >= sent

            wait_until(rejected, 60, f"the daemon to reject all {sent} messages")
            after = _memory_mb(d.pid)
        finally:
            for conn in (*peers, asker):
                conn.close()
        _grew(before, after)
        assert query_stats(blobs)["internal_errors"] == 0


def test_a_frame_past_the_limit_is_refused_at_its_length(blobs, isolated_env):
    """A frame of 1.2 GB announced (a ROUTER without MAXMSGSIZE would take it whole): libzmq
    closes the connection at the frame's length, before it keeps any of it. A message of many
    small frames within the limit gets its error reply."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        before = _memory_mb(d.pid)
        with ZmtpPeer(blobs) as peer:
            peer.send_raw(frame(b"7", more=True) + frame(b"\x07", more=True)
                          + header(1_200_000_000) + b"\x91" * 60000)
            assert peer.closed()
        with Connection(blobs) as conn:
            conn.send_frames([b"8", b"\x07"] + [b"\x91"] * 10000)
            assert conn.poll(10.0), "no reply to a message of many frames"
            rid, _, body = conn.recv()
        assert rid == b"8" and "expected 3 frames, got more than 3" in body["error"]
        _grew(before, _memory_mb(d.pid))
        stats = query_stats(blobs)
        assert stats["bad_requests"] == 1 and stats["peers_closed"] >= 1


def test_one_message_of_many_frames_costs_the_daemon_its_size(blobs, isolated_env):
    """What ZeroMQ cannot bound: a ROUTER assembles a message whole before the daemon sees any
    of it, and MAXMSGSIZE bounds each frame, not their number. 1,000 frames of 60 KB (60 MB)
    from one peer: the daemon holds all of it once (not more), answers it with an error, and
    serves on. README's security section gives bench/flood.py's figure for 1.2 GB."""
    size = 1000 * 60000
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        before = _memory_mb(d.pid)
        with Connection(blobs) as conn:
            conn.send_frames([b"9", b"\x07"] + [b"\x91" * 60000] * 1000)
            assert conn.poll(30.0), "no reply to a message of 60 MB"
            rid, _, body = conn.recv()
        assert rid == b"9" and body["code"] == 2, body  # BAD_REQUEST
        grew = _memory_mb(d.pid)["VmHWM"] - before["VmHWM"]
        print(f"one message of {size / 1e6:.0f} MB in 1,000 frames: the daemon's peak grew by "
              f"{grew:.0f} MiB")
        assert grew < size / 2**20 + BOUND_MB, grew
        assert query_stats(blobs)["internal_errors"] == 0


def _open_holding_a_frame(blob_dir) -> ZmtpPeer:
    """A connection that greets as a DEALER, then sends all but the last byte of a request
    whose body frame is of the largest length allowed, and holds it open."""
    peer = ZmtpPeer(blob_dir)
    peer.send_raw(frame(b"r", more=True) + frame(bytes([Op.DEMAND]), more=True)
                  + header(MAX_FRAME) + b"\0" * (MAX_FRAME - 1))
    return peer


def test_a_thousand_connections_holding_frames_open(blobs, isolated_env):
    """1,000 connections each hold a request whose last frame is of the largest size, all but
    one byte (libzmq allocates an announced frame whole): the daemon grows by less than
    100 MB, answers STATS from new connections throughout, and a client that said hello
    before the flood is served all along."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        before = _memory_mb(d.pid)
        client = Connection(blobs)
        floods = []
        try:
            client.request(Op.HELLO, {"version": PROTOCOL_VERSION, "client": client.client_id,
                                      "pid": os.getpid()})
            for wave in range(10):
                floods += [_open_holding_a_frame(blobs) for _ in range(100)]
                query_stats(blobs)
                lease = client.request(Op.DEMAND, {"layer": 0, "experts": [wave]})["lease"]
                client.send(Op.RELEASE, {"lease": lease})
            wait_until(lambda: query_stats(blobs)["peers"] >= 1000, 30,
                       "the daemon to hold the thousand connections")
            after = _memory_mb(d.pid)
        finally:
            for peer in floods:
                peer.close()
            client.close()
        _grew(before, after)
        assert query_stats(blobs)["internal_errors"] == 0


def _hello(conn: Connection, pid: int | None = None) -> dict:
    conn.send(Op.HELLO, {"version": PROTOCOL_VERSION, "client": conn.client_id,
                         "pid": os.getpid() if pid is None else pid})
    assert conn.poll(10.0), "no reply to a hello"
    return conn.recv()[2]


def test_one_process_attaches_a_few_clients_at_most_and_is_known_by_its_real_pid(
        blobs, isolated_env):
    """One process saying hello on 96 connections filled every client slot of the daemon
    (others were refused as busy). The kernel names a connection's process: one process has
    16 clients at most, another still gets in, and status shows the real pid whatever the
    hello claimed."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB):
        held = [Connection(blobs) for _ in range(20)]
        try:
            replies = [_hello(conn, pid=424242) for conn in held]
            assert [r["ok"] for r in replies] == [True] * 16 + [False] * 4
            assert f"process {os.getpid()} has 16 clients attached already" in \
                replies[-1]["error"]
            assert {c["pid"] for c in query_stats(blobs)["client_pools"]} == {os.getpid()}
            other = subprocess.run(
                [sys.executable, "-c", "import sys; from expertd.connection import Connection; "
                 "from expertd.protocol import PROTOCOL_VERSION, Op\n"
                 f"with Connection({str(blobs)!r}) as c:\n"
                 "    r = c.request(Op.HELLO, {'version': PROTOCOL_VERSION, "
                 "'client': c.client_id, 'pid': 1})\n"
                 "    print(r['ok'])"], capture_output=True, text=True, timeout=60)
            assert other.stdout.strip() == "True", other.stderr
        finally:
            for conn in held:
                conn.close()


def test_hellos_are_capped_and_clients_go_with_their_connections(blobs, isolated_env):
    """At most MAX_CLIENTS clients: past that a hello is refused as busy, and STATS is still
    answered. A client is forgotten when its connection closes (the socket monitor), so
    connecting, saying hello and leaving in a loop fills nothing."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB,
                "--clients-per-process", str(2 * MAX_CLIENTS)) as d:
        held = [Connection(blobs) for _ in range(MAX_CLIENTS + 20)]
        try:
            replies = [_hello(conn) for conn in held]
            assert [r["ok"] for r in replies] == [True] * MAX_CLIENTS + [False] * 20
            assert "clients are connected already" in replies[-1]["error"]
            assert query_stats(blobs)["clients"] == MAX_CLIENTS
        finally:
            for conn in held:
                conn.close()
        wait_until(lambda: query_stats(blobs)["clients"] == 0, 10,
                   "the clients to go with their connections")
        for _ in range(2 * MAX_CLIENTS):
            with Connection(blobs) as conn:
                assert _hello(conn)["ok"]
        wait_until(lambda: d.stats()["clients_disconnected"] == 3 * MAX_CLIENTS, 10,
                   "every client to go with its connection")
        assert d.stats()["clients_timed_out"] == 0


def test_bad_requests_are_logged_a_line_a_second(blobs, isolated_env):
    """A burst of a thousand bad requests, each answered: a few lines in the log, not a
    thousand (before, the log rotated its history away within seconds under a flood)."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        with Connection(blobs) as conn:
            for n in range(1000):
                conn.send_frames([b"%d" % n, b"\x07"])  # two frames: a bad request
            answered = 0
            while answered < 1000:
                assert conn.poll(10.0), f"{answered} of 1000 answered"
                answered += 1
                conn.recv()
        assert d.stats()["bad_requests"] == 1000
        lines = [line for line in d.log_text().splitlines() if "bad request from" in line]
        assert 1 <= len(lines) <= 10, lines
        assert "more since the last line" in lines[-1] or len(lines) == 1, lines


def test_the_daemon_raises_its_descriptor_limit(blobs, isolated_env):
    """libzmq accepts every connection and aborts its process when accept() meets the
    descriptor limit (EMFILE in ipc_listener.cpp): the daemon raises its soft limit to the hard
    one (10240 at most on macOS), so only a flood of that many connections, from a process of
    its own user, reaches it (README, security)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        with open(f"/proc/{d.pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max open files"))
        soft = line.split()[3]
    want = "unlimited" if hard == resource.RLIM_INFINITY else str(min(hard, 1 << 20))
    assert soft in (want, str(1 << 20)), line


def test_a_stats_after_a_bad_request_counts_it(blobs, isolated_env):
    """STATS asked in one run share a reply only while nothing happened between them: a bad
    request between two is counted in the second."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB), ZmtpPeer(blobs) as peer:
        stats = [b"s", bytes([Op.STATS]), b"\x80"]
        peer.send_raw(b"".join(frame(f, more=i < 2) for i, f in enumerate(stats))
                      + frame(b"bad", more=True) + frame(b"\x07")
                      + b"".join(frame(f, more=i < 2) for i, f in enumerate(stats)))
        replies = [peer.reply() for _ in range(3)]
    first, second = replies[0][2], replies[2][2]
    assert second["bad_requests"] == first["bad_requests"] + 1
