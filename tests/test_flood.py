"""Floods must not grow the daemon's memory (DESIGN.md: daemon RSS - arena < 100 MB under any
flood) nor keep STATS from being answered: rejected messages from many peers, one message of a
gigabyte, a thousand connections each holding a message open.

Memory is read from /proc (Linux): VmHWM is the peak resident size, so a growth that came and
went during the flood counts too; the arena is populated before the flood, so none of it is
the arena's.
"""

import os
import resource
import socket
import sys

import pytest
from harness import TINY_CACHE_GB, Daemon, query_stats, read_replies, wait_until

from expertd.connection import Connection
from expertd.paths import daemon_paths
from expertd.protocol import CLIENT_ID_BYTES, PROTOCOL_VERSION, Op
from expertd.serving.peers import MAX_CLIENTS, MAX_PEERS, MAX_REQUEST
from expertd.wire import MAGIC, ConnectionLost, encode

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
    """32 peers send 300 messages of 60 KB each without waiting (576 MB in all; under ZeroMQ
    the daemon grew by ~370 MB and kept most of it): the daemon grows by less than 100 MB,
    answers STATS in the middle of the flood, and rejects every message."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        before = _memory_mb(d.pid)
        peers = [Connection(blobs) for _ in range(32)]
        try:
            for _ in range(300):
                for peer in peers:
                    peer.send_frames(HOSTILE, wait=False)  # queued when the daemon is slower
            sent = 300 * len(peers)
            during = query_stats(blobs)  # answers within the client's usual timeout
            assert during["bad_requests"] < sent, "the flood was over before STATS was asked"

            def rejected():
                for peer in peers:
                    while peer.poll(0):  # writes what is queued, reads the error replies
                        peer.recv()
                return query_stats(blobs)["bad_requests"] >= sent

            wait_until(rejected, 60, f"the daemon to reject all {sent} messages")
            after = _memory_mb(d.pid)
        finally:
            for peer in peers:
                peer.close()
        _grew(before, after)
        assert query_stats(blobs)["internal_errors"] == 0


def test_a_message_of_a_gigabyte_is_refused_at_its_length(blobs, isolated_env):
    """One message of 20,000 frames of 60 KB (1.2 GB, which ZeroMQ held whole: the daemon grew
    past 1,166 MiB): the daemon drops the peer at the message's length, before it keeps any of
    it. A message of many small frames within the limit gets its error reply."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        before = _memory_mb(d.pid)
        with Connection(blobs) as conn:
            conn.send_frames([b"7", b"\x07"] + [b"\x91" * 60000] * 20000)
            with pytest.raises(ConnectionLost):
                conn.poll(30.0)
        with Connection(blobs) as conn:
            frames = [b"8", b"\x07"] + [b"\x91"] * (MAX_REQUEST // 8)
            conn.send_frames(frames)
            assert conn.poll(10.0), "no reply to a message of many frames"
            rid, _, body = conn.recv()
        assert rid == b"8" and "expected 3 frames, got more than 3" in body["error"]
        _grew(before, _memory_mb(d.pid))
        stats = query_stats(blobs)
        assert stats["bad_requests"] == 1 and stats["peers_dropped"] == 1


def _open_holding_a_message(path: str) -> socket.socket:
    """A connection that greets, then sends all but the last byte of a message at the
    largest length allowed, and holds it open."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(path)
        sock.send(MAGIC + os.urandom(CLIENT_ID_BYTES) + MAX_REQUEST.to_bytes(4, "little")
                  + b"\0" * (MAX_REQUEST - 1))
    except (BlockingIOError, ConnectionError, FileNotFoundError):
        pass  # the daemon's backlog is full, or it closed us: a flooder does not care
    return sock


def test_a_thousand_connections_holding_messages_open(blobs, isolated_env):
    """1,000 connections each hold a message of the largest size all but one byte (under
    ZeroMQ, 1,000 peers took the daemon to 303 MiB, and STATS up to 250 ms): the daemon keeps
    at most MAX_PEERS of them, grows by less than 100 MB, answers STATS from new connections
    throughout, and a client that said hello before the flood is served all along."""
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
            path = str(daemon_paths(blobs).socket)
            for wave in range(10):
                floods += [_open_holding_a_message(path) for _ in range(100)]
                stats = query_stats(blobs)
                assert stats["peers"] <= MAX_PEERS, stats["peers"]
                lease = client.request(Op.DEMAND, {"layer": 0, "experts": [wave]})["lease"]
                client.send(Op.RELEASE, {"lease": lease})
            assert stats["peers_replaced"] > 0  # the cap was reached, and STATS still came
            after = _memory_mb(d.pid)
        finally:
            for sock in floods:
                sock.close()
            client.close()
        _grew(before, after)
        assert query_stats(blobs)["internal_errors"] == 0


def _hello(conn: Connection) -> dict:
    conn.send(Op.HELLO, {"version": PROTOCOL_VERSION, "client": conn.client_id,
                         "pid": os.getpid()})
    assert conn.poll(10.0), "no reply to a hello"
    return conn.recv()[2]


def test_hellos_cannot_take_every_connection(blobs, isolated_env):
    """Peers that say hello are kept, but at most MAX_CLIENTS of them: past that a hello is
    refused as busy, and STATS is answered on new connections. A client is forgotten when its
    connection closes, so connecting, saying hello and leaving in a loop fills nothing."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        held = [Connection(blobs) for _ in range(MAX_CLIENTS + 20)]
        try:
            replies = [_hello(conn) for conn in held]
            assert [r["ok"] for r in replies] == [True] * MAX_CLIENTS + [False] * 20
            assert "clients are connected already" in replies[-1]["error"]
            for _ in range(3 * MAX_PEERS):  # new connections replace the refused ones
                stats = query_stats(blobs)
            assert stats["clients"] == MAX_CLIENTS and stats["peers"] <= MAX_PEERS
        finally:
            for conn in held:
                conn.close()
        wait_until(lambda: query_stats(blobs)["clients"] == 0, 10.0,
                   "the clients to go with their connections")
        for _ in range(2 * MAX_CLIENTS):
            with Connection(blobs) as conn:
                assert _hello(conn)["ok"]
        assert d.stats()["clients_disconnected"] >= 3 * MAX_CLIENTS - 1


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


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="sets the daemon's limits")
def test_out_of_descriptors_a_new_connection_replaces_an_idle_one(blobs, isolated_env):
    """The daemon's descriptors run out on silent connections: a new one still gets its
    STATS answered, an idle peer closed to make room (before, everyone was locked out)."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        limit = len(os.listdir(f"/proc/{d.pid}/fd")) + 16
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (limit, limit))
        silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(40)]
        try:
            for sock in silent:
                sock.connect(str(daemon_paths(blobs).socket))
            stats = query_stats(blobs)
            assert stats["peers"] < 40 and stats["peers_replaced"] > 0, stats
        finally:
            for sock in silent:
                sock.close()


def test_a_client_keeps_two_trusted_connections_at_most(blobs, isolated_env):
    """Its own, and one heartbeat connection (the newest): a client's token sent from many
    connections does not make them all a client's, and one that said goodbye is a peer like
    any other. Either way new connections still get their STATS (before, both filled every
    slot for good)."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB):
        owner = Connection(blobs)
        beats, gone = [], []
        try:
            token = _hello(owner)["token"]
            for _ in range(MAX_PEERS):
                beats.append(Connection(blobs))
                assert beats[-1].request(Op.HEARTBEAT, {"client": owner.client_id,
                                                        "token": token})["known"]
            for _ in range(MAX_PEERS):
                gone.append(Connection(blobs))
                assert _hello(gone[-1])["ok"]
                gone[-1].send(Op.GOODBYE, {})
            for _ in range(2 * MAX_PEERS):  # each new one replaces an idle peer
                stats = query_stats(blobs)
            assert stats["clients"] == 1 and stats["peers"] <= MAX_PEERS, stats
            lost = 0
            for beat in beats[:-1]:
                with pytest.raises(ConnectionLost):
                    beat.poll(10.0)
                lost += 1
            assert lost == MAX_PEERS - 1
            assert owner.request(Op.HEARTBEAT, {"client": owner.client_id, "token": token})
        finally:
            for conn in [owner, *beats, *gone]:
                conn.close()


def test_a_stats_after_a_bad_request_counts_it(blobs, isolated_env):
    """STATS asked in one run share a reply only while nothing happened between them: a bad
    request between two is counted in the second."""
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(daemon_paths(blobs).socket))
            stats = [b"s", bytes([Op.STATS]), b"\x80"]
            sock.sendall(MAGIC + os.urandom(CLIENT_ID_BYTES) + encode(stats)
                         + encode([b"bad", b"\x07"]) + encode(stats))
            sock.settimeout(10.0)
            replies = read_replies(sock, 3)
        first, second = replies[0][2], replies[2][2]
        assert second["bad_requests"] == first["bad_requests"] + 1
