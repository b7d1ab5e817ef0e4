"""No client can starve another, clean-up never stalls the loop, hostile frames cost no memory.

The serving loop in this process, with a clock the test moves where a test waits out a bound;
a daemon process where the test measures the process itself (its loop's responsiveness under a
reclaim, its memory); real client processes killed for real (issue: fairness and bounded work).
"""

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from harness import (
    TINY_CACHE_GB,
    Daemon,
    FakeClock,
    InProcessDaemon,
    RawClient,
    expected_bytes,
    query_stats,
    read_json_line,
    spawn_client,
    stop_process,
    wait_until,
)

from expertd.connection import Connection
from expertd.errors import DaemonError
from expertd.protocol import ErrorCode, Op


def spawn_holder(blob_dir, n_leases: int, pins=()):
    """A client process holding ``n_leases`` one-expert leases and ``pins``, until killed."""
    return spawn_client("hoard", blob_dir, n_leases, json.dumps(list(pins)))


def test_a_hoarding_client_cannot_time_out_another(blobs, isolated_env):
    """One client asks for far more rows than its share and never releases; another still gets
    every expert of the model, exactly, while the hoarder stays alive."""
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB) as d, \
            RawClient(blobs) as hoarder, RawClient(blobs) as other:
        cap, group = hoarder.hello["client_cap"], hoarder.hello["max_demand"]
        m = hoarder.manifest
        keys = [(layer.index, e) for layer in m.layers for e in range(layer.num_experts)]
        for layer, e in keys:  # fire and forget: it never releases anything
            hoarder.conn.send(Op.DEMAND, {"layer": layer, "experts": [e]})
        wait_until(lambda: d.stats()["leases"] == cap, 10, f"the hoarder to hold {cap} leases")
        for layer in m.layers:
            experts = list(range(layer.num_experts))
            for start in range(0, len(experts), group):
                chunk = experts[start:start + group]
                rid = other.conn.send(Op.DEMAND, {"layer": layer.index, "experts": chunk})
                reply = other.conn.wait(rid, 5.0)  # would time out if the hoarder starved it
                got = [other.row_bytes(row, layer.index) for row in reply["rows"]]
                other.release(reply["lease"])
                assert got == [want[(layer.index, e)] for e in chunk]
                assert hoarder.heartbeat()["known"]
        stats = d.stats()
        assert stats["leased_rows"] <= cap
        # Past its cap and a bounded queue, its demands were refused at once (BUSY), not kept.
        refused = len(keys) - cap - stats["queued"]
        assert stats["queued"] > 0 and refused > 0
        assert stats["busy"] == refused and hoarder.conn.stray_errors == refused


def test_leases_are_revoked_past_their_bound_even_while_the_holder_heartbeats(blobs, isolated_env):
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--lease-timeout", "0.5",
                         clock=FakeClock()) as d, RawClient(blobs) as c:
        reply = c.demand(0, [1, 2])
        assert d.stats()["leases"] == 1

        def revoked():
            assert c.heartbeat()["known"]  # the holder is alive throughout
            d.advance(0.1)
            return d.stats()["lease_expiries"] == 1

        wait_until(revoked, 10, "the lease to be revoked")
        assert d.stats()["leases"] == 0
        c.release(reply["lease"])  # a late release of a revoked lease is harmless
        want = expected_bytes(blobs)
        assert c.fetch(0, [1, 2]) == [want[(0, 1)], want[(0, 2)]]
        assert d.stats()["leases"] == 0


def test_reclaiming_500_leases_keeps_the_daemon_answering(models, isolated_env):
    """A client holding 500 leases dies; while they are reclaimed, a live client's heartbeats
    are answered and it is never timed out: the daemon, on its own clock, finds no live client
    silent past the client timeout (a loop stalled that long by the reclaim would time it out
    in the same turn, before reading its next heartbeat). The reclaim's work is its own
    leases' (test_leases); how fast it is, bench/reclaim.py measures."""
    blob_dir = models.blobs(layers=6, experts=256, top_k=4, seed=3)
    with Daemon(blob_dir, isolated_env, "--cache-gb", "0.03", "--client-timeout", "1.5",
                "--heartbeat", "0.5") as d:
        assert d.ready["client_cap"] >= 500, d.ready
        holder = spawn_holder(blob_dir, 500)
        try:
            assert read_json_line(holder, 60)["leases"] == 500
            with RawClient(blob_dir) as live:
                assert d.stats()["leases"] == 500
                holder.kill()
                holder.wait(10)

                def reclaimed():
                    assert live.heartbeat()["known"]  # never forgotten meanwhile
                    return (s := live.request(Op.STATS))["leases"] == 0 and s

                stats = wait_until(reclaimed, 20, "the dead client's leases to be reclaimed")
                assert live.heartbeat()["known"]  # and still known after
                after = live.request(Op.STATS)
        finally:
            stop_process(holder)
        # The kernel closed its connection: it was forgotten then, not at its timeout.
        assert stats["clients_disconnected"] == 1 and stats["leased_rows"] == 0
        # The live client is the one client left, and no one was ever timed out.
        assert (after["clients"], after["clients_timed_out"]) == (1, 0), after


def test_pins_die_with_their_client(blobs, isolated_env, tmp_path):
    state = tmp_path / "hot.json"
    with InProcessDaemon(blobs, "--cache-gb", "0.0015", "--client-timeout", "1",
                         "--heartbeat", "0.25", "--state-file", state) as d:
        holder = spawn_holder(blobs, 0, pins=[(0, [3, 7]), (1, [2])])
        try:
            read_json_line(holder, 30)
            wait_until(lambda: d.stats()["pinned"] == 3, 10, "the three pins to be filled")
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
            wait_until(lambda: d.stats()["clients"] == 0, 10, "the killed client to time out")
            assert d.stats()["pinned"] == 0
        finally:
            stop_process(holder)
        with RawClient(blobs) as c:  # a client that says goodbye drops its pins at once
            assert c.request(Op.PIN, {"layer": 2, "experts": [5]})["pinned"] == 1
            c.conn.send(Op.GOODBYE, {})
            wait_until(lambda: d.stats()["clients"] == 0, 5, "goodbye to be heard")
            assert d.stats()["pinned"] == 0
    saved = json.loads(state.read_text())
    assert saved["policy"]["pins"] == []  # nothing a client pinned outlives it in the hot set


def _rss_minus_arena(pid: int, arena_bytes: int) -> int:
    """Resident memory that is not the arena (Linux: the anonymous and file-backed part)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if ":" in line)
    kb = lambda k: int(fields[k].split()[0]) * 1024  # noqa: E731
    return kb("VmRSS") - min(kb("RssShmem"), arena_bytes)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_100000_hostile_frames_leave_memory_under_the_bar(blobs, isolated_env):
    """100 000 hostile messages, three of them a frame of 100 MB: RSS minus the arena stays
    under 100 MB, and libzmq closes the connection of each 100 MB frame at its length
    (MAXMSGSIZE), before reading it."""
    rng = __import__("random").Random(7)
    big = b"\xff" * (100 << 20)
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        arena = d.ready["arena_bytes"]
        before = _rss_minus_arena(d.pid, arena)
        with Connection(blobs) as conn:
            for i in range(100_000):
                if i in (10_000, 50_000, 90_000):
                    closed = query_stats(blobs)["peers_closed"]
                    with Connection(blobs) as one:
                        one.send_frames([b"r", bytes([Op.DEMAND]), big])
                        wait_until(lambda: query_stats(blobs)["peers_closed"] > closed, 30,
                                   "libzmq to close the connection of a 100 MB frame")
                    continue
                kind = rng.randrange(4)
                if kind == 0:
                    frames = [os.urandom(rng.randrange(1, 64))]
                elif kind == 1:
                    frames = [b"r" * rng.randrange(0, 40), bytes([rng.randrange(256)]),
                              os.urandom(rng.randrange(0, 2048))]
                elif kind == 2:
                    frames = [os.urandom(8)] * rng.randrange(2, 9)
                else:
                    frames = [b"rid", bytes([Op.DEMAND]), b"\xdf" + os.urandom(60_000)]
                conn.send_frames(frames)
                while conn.poll(0):
                    conn.recv()
                if i % 1000 == 999:
                    query_stats(blobs)  # keeps the sender from running far ahead
        stats = query_stats(blobs)
        assert d.proc.poll() is None and stats["bad_requests"] > 50_000
        after = _rss_minus_arena(d.pid, arena)
        print(f"daemon RSS - arena: {before / 2**20:.1f} MiB before, {after / 2**20:.1f} MiB "
              f"after 100 000 hostile frames")
        assert after < 100 << 20, f"{after / 2**20:.1f} MiB"


def test_a_bug_in_a_handler_is_logged_answered_and_survived(blobs, isolated_env, caplog):
    """The serving loop, with one handler broken on purpose: the request gets an INTERNAL
    error, the log has the traceback, and every other request is still served."""
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB) as d:
        def broken(*_):
            raise KeyError("a bug")

        d.server._pin = broken
        with RawClient(blobs) as c:
            with pytest.raises(DaemonError) as err:
                c.request(Op.PIN, {"layer": 0, "experts": [1]})
            assert err.value.code == ErrorCode.INTERNAL
            want = expected_bytes(blobs)
            assert c.fetch(0, [1, 2]) == [want[(0, 1)], want[(0, 2)]]
            assert c.request(Op.STATS)["internal_errors"] == 1
        assert "KeyError: 'a bug'" in caplog.text
    assert d.poll() is not None  # its loop stopped


def test_a_client_cannot_take_the_rows_freed_for_a_queued_demand(blobs, isolated_env):
    """Every cache row is leased; a demand for two rows waits in the queue. A client that
    frees one row and demands one new expert each time took that row every time (a new
    demand was started before the queue was looked at), so the queued demand never found two
    rows and waited past every bound. Now the rows that come free are owed to the queued
    demand: the newcomer waits behind it, and the second row freed completes it."""
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, clock=FakeClock()) as d, \
            RawClient(blobs) as honest:
        rows, cap = honest.hello["cache_rows"], honest.hello["client_cap"]
        m = honest.manifest
        keys = iter([(layer.index, e) for layer in m.layers[:-1]
                     for e in range(layer.num_experts)])
        holders, leases = [], []
        try:
            while d.stats()["leased_rows"] < rows:  # every cache row leased, one a lease
                if not holders or len(leases[-1]) == cap:
                    holders.append(RawClient(blobs))
                    leases.append([])
                layer, e = next(keys)
                leases[-1].append(holders[-1].demand(layer, [e])["lease"])
            last = m.layers[-1].index
            rid = honest.conn.send(Op.DEMAND, {"layer": last, "experts": [0, 1]})
            wait_until(lambda: d.stats()["queued"] == 1, 10, "the demand to be queued")
            jumper = holders[0]
            jumper.release(leases[0].pop())  # one row free: the queued demand needs two
            jumper.heartbeat()  # (its connection's messages are handled in order)
            layer, e = next(keys)
            jumper.conn.send(Op.DEMAND, {"layer": layer, "experts": [e]})
            jumper.heartbeat()
            jumper.release(leases[0].pop())  # a second row free
            jumper.heartbeat()
            reply = honest.conn.wait(rid, 10.0)  # never came: the jumper held the first row
            got = [honest.row_bytes(row, last) for row in reply["rows"]]
            assert got == [want[(last, 0)], want[(last, 1)]]
            assert d.stats()["queued"] == 1  # the newcomer, behind it
        finally:
            for holder in holders:
                holder.close()
