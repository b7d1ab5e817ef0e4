"""PREFETCH into the arena's side rows: never evicting the cache, two generations per client
(invariant 3), promotion by a role swap when a demand or a client uses a row, demands ahead of
prefetches in the pread pool, and three client processes racing it all under eviction.

The daemon is the serving loop in this process, but where a test stops it with SIGSTOP so
that requests wait together in its socket: there it is a process."""

import os
import signal

import numpy as np
import pytest
from harness import (
    TINY_CACHE_GB,
    InProcessDaemon,
    RawClient,
    expected_bytes,
    finish_client,
    running_daemon,
    spawn_client,
    validate,
    wait_until,
)

from expertd import native
from expertd.protocol import Op
from expertd.shm.layout import SlotState

SIDE = 4  # the tiny model's top_k: one PREFETCH takes at most 4 of the 8 side rows
# A claim's hold no test outlasts: what frees a claimed side row is then what the test does
# (a newer generation, the client going away), never the clock of a busy machine.
LONG_HOLD = ("--side-hold", "600")


def prefetch(c: RawClient, layer: int, experts) -> dict:
    """Send a PREFETCH and return the STATS that follow it (the daemon serves a peer in order,
    so the prefetch was handled when they come)."""
    c.conn.send(Op.PREFETCH, {"layer": layer, "experts": [int(e) for e in experts]})
    return c.request(Op.STATS)


def wait_fills(c: RawClient, n: int) -> dict:
    """STATS once ``n`` prefetch fills are done and no fill is in flight."""
    last = {}

    def done():
        last.update(c.request(Op.STATS))
        return last["prefetch_fills"] >= n and last["in_flight"] == 0 and dict(last)
    try:
        return wait_until(done, 10.0, f"{n} prefetch fills")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last STATS: {last}") from None


def stopped(pid: int) -> bool:
    """Is process ``pid`` stopped by a signal (state T in /proc)?"""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"


def slots(c: RawClient, layer: int, experts) -> dict:
    return {e: c.slot(layer, e) for e in experts}


def side_row_bytes(c: RawClient, layer: int, expert: int) -> bytes:
    """The expert's bytes from its row, read lock-free and checked with its seqlock version."""
    row, state, version = c.slot(layer, expert)
    assert row >= 0 and state == SlotState.READY and version % 2 == 0, (layer, expert)
    data = c.row_bytes(row, layer)
    assert validate(c.raw, c.slots_offset, [row], [version])
    return data


def test_prefetch_fills_side_rows_and_evicts_nothing(models, isolated_env):
    blobs = models.blobs()
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB):
        with RawClient(blobs) as c:
            cache_rows = c.hello["cache_rows"]
            resident = [(0, e) for e in range(8)] + [(1, 0), (1, 1)]
            for start in range(0, len(resident), 2):
                layer = resident[start][0]
                c.fetch(layer, [e for _, e in resident[start:start + 2]])
            before = {key: c.slot(*key) for key in resident}
            assert len({row for row, _, _ in before.values()}) == cache_rows
            stats = wait_fills(c, 0)
            assert stats["rows_used"] == cache_rows and stats["side_rows"] == 2 * SIDE
            prefetch(c, 2, [0, 1, 2, 3])
            stats = wait_fills(c, 4)
            assert stats["rows_used"] == cache_rows and stats["side_rows_used"] == 4
            assert stats["prefetch_requested"] == 4 and stats["prefetch_dropped"] == 0
            assert {key: c.slot(*key) for key in resident} == before  # nothing evicted
            for e in range(4):
                row = c.slot(2, e)[0]
                assert row not in {r for r, _, _ in before.values()}
                assert side_row_bytes(c, 2, e) == want[(2, e)]
            # Already resident (cache or side row): merged, nothing read again.
            stats = prefetch(c, 2, [0, 1])
            stats = prefetch(c, 0, [0])
            assert stats["prefetch_merged"] == 3 and stats["prefetch_fills"] == 4


def test_claimed_experts_are_merged_and_never_read(models, isolated_env):
    """A PREFETCH's claim names guesses that were resident when the client looked: those still
    resident are merged (their side rows claimed), and one gone since is not read, since the
    client's read-ahead budget did not pay for it."""
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB):
        with RawClient(blobs) as c:
            prefetch(c, 2, [0, 1])
            before = wait_fills(c, 2)
            c.conn.send(Op.PREFETCH, {"layer": 2, "experts": [5], "claim": [0, 1, 9]})
            stats = wait_fills(c, 3)
            assert stats["prefetch_fills"] == 3, stats  # expert 5 only
            assert c.slot(2, 9)[1] == SlotState.EMPTY
            assert stats["prefetch_merged"] == before["prefetch_merged"] + 2
            for bad in ([5], [16], [5, 5]):  # to be read too, out of range, twice
                c.conn.send(Op.PREFETCH, {"layer": 2, "experts": [5], "claim": bad})
            assert c.request(Op.STATS)["bad_requests"] == before["bad_requests"] + 3


def test_a_prefetch_longer_than_the_side_rows_reads_its_first_experts(models, isolated_env):
    """Clients list a guess best first: with fewer free side rows than absent experts, the
    daemon reads the head of the list and drops the tail (counted), whatever the expert ids."""
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB):
        with RawClient(blobs) as c:
            ranked = [13, 2, 9, 0, 15, 4, 7]
            prefetch(c, 1, ranked)
            stats = wait_fills(c, SIDE)
            assert stats["prefetch_fills"] == SIDE
            assert stats["prefetch_dropped"] == len(ranked) - SIDE
            for e in ranked[:SIDE]:
                assert c.slot(1, e)[1] == SlotState.READY, e
            for e in ranked[SIDE:]:
                assert c.slot(1, e)[1] == SlotState.EMPTY, e


def test_a_cache_with_empty_rows_keeps_every_prefetched_expert(models, isolated_env):
    """While LFU cache rows are empty, read-ahead rows take their place instead of being
    rewritten: four generations (twice what the side rows hold) all stay resident, nothing is
    read twice, and using one later still counts as a saved miss."""
    blobs = models.blobs()
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", "200%"):
        with RawClient(blobs) as c:
            gens = [(0, [0, 1, 2, 3]), (0, [4, 5, 6, 7]), (0, [8, 9, 10, 11]), (1, [0, 1, 2, 3])]
            for n, (layer, experts) in enumerate(gens, 1):
                prefetch(c, layer, experts)
                wait_fills(c, 4 * n)
            for layer, experts in gens:
                for e in experts:
                    assert c.slot(layer, e)[1] == SlotState.READY, (layer, e)
            assert c.fetch(0, [0, 9]) == [want[(0, 0)], want[(0, 9)]]
            stats = c.request(Op.STATS)
            assert stats["fills"] == 16 and stats["bytes_read"] == 16 * c.hello["stride"]
            assert stats["misses"] == 0 and stats["prefetch_hits"] == 2
            assert stats["prefetch_wasted"] == 0 and stats["prefetch_dropped"] == 0
            assert stats["side_rows_used"] <= stats["side_rows"]


def test_a_guess_past_its_core_is_read_only_with_workers_to_spare(models, isolated_env):
    """A PREFETCH's experts past its ``core`` are a wider guess: read while workers are idle,
    shed (and counted) while reads are backed up, the core read either way. The busy case
    sends a demand of four misses and the prefetch while the daemon is stopped, so both are
    handled in one batch with the four reads in flight on the four workers."""
    blobs = models.blobs(layers=1, experts=32, top_k=8, hidden=512, moe_inter=512)
    with running_daemon(blobs, isolated_env, "--cache-gb", "0.05", "--workers", "4") as d:
        with RawClient(blobs) as c:
            c.conn.send(Op.PREFETCH, {"layer": 0, "experts": [3, 1, 2], "core": 1})
            stats = wait_fills(c, 3)
            assert stats["prefetch_shed"] == 0
            assert all(c.slot(0, e)[1] == SlotState.READY for e in (1, 2, 3))
            os.kill(d.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: stopped(d.pid), 10.0, "the daemon to stop")
                rid = c.conn.send(Op.DEMAND, {"layer": 0, "experts": [20, 21, 22, 23]})
                c.conn.send(Op.PREFETCH, {"layer": 0, "experts": [5, 6, 7, 8], "core": 2})
            finally:
                os.kill(d.pid, signal.SIGCONT)
            c.release(c.conn.wait(rid, 20.0)["lease"])
            stats = wait_fills(c, 5)
            assert stats["prefetch_shed"] == 2 and stats["fills"] == 9
            assert [c.slot(0, e)[1] for e in (5, 6, 7, 8)] == [SlotState.READY] * 2 + [
                SlotState.EMPTY] * 2


def test_a_generation_is_kept_while_the_next_fills(models, isolated_env):
    """Invariant 3: client A's generation g stays put while g + 1 fills; g + 2 may reuse g's
    rows; another client cannot take A's two latest generations within the hold (how a claim
    lapses past it: test_a_client_that_never_reads_cannot_keep_the_side_rows)."""
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, *LONG_HOLD):
        with RawClient(blobs) as a, RawClient(blobs) as b:
            a.fill_cache(2)
            s1, s2, s3 = [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]
            prefetch(a, 0, s1)
            wait_fills(a, 4)
            first = slots(a, 0, s1)
            prefetch(a, 0, s2)  # takes the 4 other side rows
            wait_fills(a, 8)
            assert slots(a, 0, s1) == first
            second = slots(a, 0, s2)
            # Generation 3 of A needs rows: only generation 1's may go.
            prefetch(a, 0, s3)
            stats = wait_fills(a, 12)
            assert {a.slot(0, e)[0] for e in s3} == {row for row, _, _ in first.values()}
            assert all(a.slot(0, e)[0] < 0 for e in s1)
            assert slots(a, 0, s2) == second
            assert stats["prefetch_wasted"] == 4  # generation 1 was never used
            third = slots(a, 0, s3)
            stats = prefetch(b, 1, [0, 1, 2, 3])  # A's generations 2 and 3 are all there is
            assert stats["prefetch_dropped"] == 4
            assert slots(a, 0, s2) == second and slots(a, 0, s3) == third


@pytest.mark.parametrize("workers", ["8", "1"])
def test_a_demand_is_answered_from_the_side_row_and_promotes_it(models, isolated_env, workers):
    blobs = models.blobs()
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--workers", workers):
        with RawClient(blobs) as c:
            stride = c.hello["stride"]
            if workers == "8":
                prefetch(c, 1, [0, 1, 2, 3])
                wait_fills(c, 4)  # READY when demanded
            else:
                # One worker: the demand for expert 3 arrives while its prefetch fill is queued
                # behind three others (FILLING); the demand merges onto it.
                c.conn.send(Op.PREFETCH, {"layer": 1, "experts": [0, 1, 2, 3]})
            side = {e: c.slot(1, e)[0] for e in (0, 3)}
            got = c.fetch(1, [0, 3])
            assert got == [want[(1, 0)], want[(1, 3)]]
            stats = wait_fills(c, 4)
            assert stats["bytes_read"] == 4 * stride  # no second read for the demanded experts
            assert stats["prefetch_hits"] == 2 and stats["demand_hits"] == 0
            assert stats["misses"] == 0 and stats["rows_used"] == 2  # promoted into the cache
            if workers == "8":
                assert {e: c.slot(1, e)[0] for e in (0, 3)} == side  # a swap, no copy
            kept = slots(c, 1, [0, 3])
            for gen in range(4):  # later prefetches cycle through every side row
                prefetch(c, 2, range(4 * (gen % 2), 4 * (gen % 2) + 4))
                prefetch(c, 0, range(4 * gen, 4 * gen + 4))
            wait_until(lambda: c.request(Op.STATS)["in_flight"] == 0, 10.0, "the fills to end")
            assert slots(c, 1, [0, 3]) == kept


def test_a_row_used_lock_free_is_promoted_before_the_next_prefetch(models, isolated_env):
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB):
        with RawClient(blobs) as c:
            c.fill_cache(1)
            prefetch(c, 2, [0, 1, 2, 3])
            wait_fills(c, 4)
            used = [c.slot(2, e)[0] for e in (1, 2)]
            native.bump_hits(c.raw, c.slots_offset, np.array(used, np.int32))  # as clients do
            kept = slots(c, 2, [1, 2])
            for gen in range(4):  # each one fills 4 side rows, cycling through all of them
                prefetch(c, 0, range(4 * gen, 4 * gen + 4))
                stats = wait_fills(c, 4 + 4 * (gen + 1))
            assert slots(c, 2, [1, 2]) == kept
            assert stats["prefetch_hits"] == 2 and stats["client_hits"] == 0
            assert stats["rows_used"] == c.hello["cache_rows"] and stats["prefetch_dropped"] == 0
            assert stats["prefetch_wasted"] == 2 + 4 + 4  # the 2 unused, generations 2 and 3


def test_off_ignores_prefetches(models, isolated_env):
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--prefetch", "off"):
        with RawClient(blobs) as c:
            assert c.hello["prefetch"] == "off"
            stats = prefetch(c, 0, [0, 1, 2, 3])
            assert (stats["prefetch"], stats["prefetch_requested"],
                    stats["prefetch_ignored"]) == ("off", 4, 4)
            assert (stats["fills"], stats["in_flight"], stats["side_rows_used"]) == (0, 0, 0)
            assert all(c.slot(0, e)[0] < 0 for e in range(4))


def test_demands_go_before_queued_prefetch_fills(models, isolated_env):
    """One worker, sixteen prefetch fills queued (two generations of top_k = 8 on rows of
    ~1 MiB): a demand sent behind them is answered while most of them still wait.

    The three requests are sent while the daemon is stopped (SIGSTOP), so they wait together
    in its socket: otherwise a loaded machine may let the worker read most prefetches before
    the daemon has even received the demand, which says nothing about the queue's order."""
    blobs = models.blobs(layers=1, experts=32, top_k=8, hidden=512, moe_inter=512)
    with running_daemon(blobs, isolated_env, "--cache-gb", "0.05", "--workers", "1") as d:
        with RawClient(blobs) as c:
            g = c.arena.geometry
            predicted = list(range(16))
            os.kill(d.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: stopped(d.pid), 10.0, "the daemon to stop")
                c.conn.send(Op.PREFETCH, {"layer": 0, "experts": predicted[:8]})
                c.conn.send(Op.PREFETCH, {"layer": 0, "experts": predicted[8:]})
                rid = c.conn.send(Op.DEMAND, {"layer": 0, "experts": [31]})
            finally:
                os.kill(d.pid, signal.SIGCONT)
            reply = c.conn.wait(rid, 20.0)
            states = [int(c.arena.slots[c.slot(0, e)[0]]["state"]) if c.slot(0, e)[0] >= 0
                      else -1 for e in predicted]
            c.release(reply["lease"])
            done = sum(s == SlotState.READY for s in states)
            stats = wait_fills(c, 16)
            assert stats["prefetch_fills"] == 16 and stats["fills"] == 17
            # First in first out would have read all sixteen before the demand's row.
            assert done < 8, f"{done} of 16 prefetch fills were done when the demand's reply came"
            assert g.side_rows == 8


def test_three_clients_race_prefetches_reads_and_demands(models, isolated_env, tmp_path):
    """Prefetches, lock-free reads and demands of three processes under eviction on a tiny
    cache: every consumed row is verified (seqlock and checksum)."""
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB) as d:
        outs = [tmp_path / f"client{i}.json" for i in range(3)]
        procs = [spawn_client("prefetch", blobs, 3.0, seed, "--out", out)
                 for seed, out in enumerate(outs)]
        results = [finish_client(p, out, 60.0) for p, out in zip(procs, outs)]
        stats = d.stats()
    for r in results:
        assert r["errors"] == [], r
        assert r["verified"] > 100, r
    assert stats["prefetch_hits"] > 0 and stats["prefetch_wasted"] > 0, stats
    assert stats["internal_errors"] == 0 and stats["fill_errors"] == 0, stats
