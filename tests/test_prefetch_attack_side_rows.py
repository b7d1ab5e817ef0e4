"""Attacks on the side rows through PREFETCH: hogs, floods, a client that dies, pins, prefetches
racing demands, shutdown, the absorb's accounting and another client's generation, checked
against the arena's own invariants. The daemon is the serving loop in this process.

Run as a script (``python test_prefetch_attack_side_rows.py burst BLOBS``) this file is also
the client process a test kills.
"""

import json
import sys
import time

import numpy as np
from harness import (
    TINY_CACHE_GB,
    FakeClock,
    InProcessDaemon,
    RawClient,
    check_arena,
    expected_bytes,
    prefetch,
    quiet,
    read_json_line,
    spawn_client,
    stop_process,
    validate,
    wait_until,
)
from test_side_rows import LONG_HOLD

from expertd.protocol import Op
from expertd.shm.layout import SlotState

SCRIPT = __file__


def test_a_client_that_never_reads_cannot_keep_the_side_rows(models, isolated_env):
    """A re-prefetch of what sits in the side rows (merged, nothing read) must not extend its
    claims past the hold after the fill: otherwise one client that prefetches and never reads
    keeps every side row and every other client's prefetch is dropped for ever."""
    blobs = models.blobs()
    hold = 0.25
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--side-hold", str(hold),
                         clock=FakeClock()) as d:
        with RawClient(blobs) as hog, RawClient(blobs) as other:
            hog.fill_cache(2)
            prefetch(hog, 0, [0, 1, 2, 3])
            prefetch(hog, 0, [4, 5, 6, 7])
            filled = d.clock()
            stats = quiet(hog)
            assert stats["prefetch_fills"] == 8 and stats["side_rows_used"] == 8
            # The hog keeps asking for the same two sets, past the hold of their fill.
            n = 0
            while d.clock() < filled + 1.5 * hold:
                prefetch(hog, 0, [0, 1, 2, 3] if n % 2 else [4, 5, 6, 7])
                n += 1
                d.clock.advance(hold / 8)  # the time between two of the hog's requests
            stats = prefetch(other, 1, [0, 1, 2, 3])
            assert stats["prefetch_dropped"] == 0, (n, stats)
            stats = quiet(other)
            assert stats["prefetch_fills"] == 12
            check_arena(other, stats)


def test_a_flood_of_prefetches_keeps_leases_rows_and_demands_intact(models, isolated_env):
    """Thousands of max-size PREFETCHes over every layer from one client while another holds a
    lease: the leased rows are never rewritten, the other's demands are answered, the cache
    keeps its size and the side rows never exceed theirs."""
    blobs = models.blobs()
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--workers", "2"):
        with RawClient(blobs) as flood, RawClient(blobs) as victim:
            m = flood.manifest
            held = victim.demand(1, [0, 1])  # half its cap: the fetches below need the rest
            rows, versions = held["rows"], held["versions"]
            everything = [(layer.index, list(range(layer.num_experts))) for layer in m.layers]
            for i in range(3000):
                layer, experts = everything[i % len(everything)]
                flood.conn.send(Op.PREFETCH, {"layer": layer, "experts": experts[i % 5:]})
                if i % 500 == 0:
                    got = victim.fetch(2, [i % 16, (i + 1) % 16])
                    assert got == [want[(2, i % 16)], want[(2, (i + 1) % 16)]]
            stats = quiet(flood)
            assert stats["prefetch_requested"] > 3000 * 10
            assert validate(victim.raw, victim.slots_offset, rows, versions), \
                "a leased row was rewritten by a prefetch"
            assert [victim.row_bytes(r, 1) for r in rows] == [want[(1, e)] for e in range(2)]
            victim.release(held["lease"])
            stats = quiet(victim)
            assert stats["internal_errors"] == 0 and stats["fill_errors"] == 0, stats
            check_arena(victim, stats)


def test_a_killed_prefetcher_leaves_nothing(models, isolated_env):
    """A client SIGKILLed right after a burst of PREFETCHes (fills queued behind one worker):
    the fills finish, its claims go with its connection, and another client gets every side
    row at once: within the hold, here longer than any test, so only the client's death can
    free them."""
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--workers", "1",
                         "--client-timeout", "0.2", "--heartbeat", "0.1", *LONG_HOLD) as d:
        proc = spawn_client("burst", blobs, script=SCRIPT)
        try:
            assert read_json_line(proc, 30.0)["sent"] == 2
            proc.kill()
            proc.wait(10)
        finally:
            stop_process(proc)
        wait_until(lambda: d.stats()["clients_disconnected"] == 1, 10.0, "its connection closed")
        # Its fills finish (one worker: on a loaded machine some are still queued when its
        # connection closes, and a side row being filled is not handed out).
        wait_until(lambda: d.stats()["in_flight"] == 0, 10.0, "its fills to finish")
        with RawClient(blobs) as other:
            # Two generations of the next client take all eight rows.
            prefetch(other, 2, [0, 1, 2, 3])
            stats = prefetch(other, 2, [4, 5, 6, 7])
            assert stats["prefetch_dropped"] == 0, stats
            stats = quiet(other)
            assert stats["clients"] == 1 and stats["leased_rows"] == 0 and stats["queued"] == 0
            assert stats["prefetch_fills"] == 16
            check_arena(other, stats)


def test_pinning_an_expert_in_a_side_row_keeps_it(models, isolated_env):
    """An expert prefetched into a side row and then pinned joins the cache: no later
    prefetch overwrites it, and the cache keeps its size."""
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB):
        with RawClient(blobs) as c:
            prefetch(c, 0, [0, 1, 2, 3])
            quiet(c)
            c.request(Op.PIN, {"layer": 0, "experts": [2]})
            kept = c.slot(0, 2)
            for gen in range(6):
                prefetch(c, 1 + gen % 2, range(4 * (gen // 2), 4 * (gen // 2) + 4))
                quiet(c)
            assert c.slot(0, 2) == kept
            stats = quiet(c)
            assert stats["pinned"] == 1 and stats["prefetch_dropped"] == 0, stats
            check_arena(c, stats)


def test_demands_and_prefetches_of_the_same_experts_race(models, isolated_env):
    """Two clients: one prefetches what the other demands and evicts, in every order; every
    demanded row holds the right bytes and the daemon stays consistent."""
    blobs = models.blobs()
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--workers", "1"):
        with RawClient(blobs) as a, RawClient(blobs) as b:
            rng = np.random.default_rng(7)
            for i in range(300):
                layer = int(rng.integers(3))
                experts = sorted(rng.choice(16, 4, replace=False).tolist())
                a.conn.send(Op.PREFETCH, {"layer": layer, "experts": experts})
                if i % 3:
                    b.conn.send(Op.PREFETCH, {"layer": (layer + 1) % 3, "experts": experts})
                got = b.fetch(layer, experts[i % 2:])
                assert got == [want[(layer, e)] for e in experts[i % 2:]]
            stats = quiet(a)
            assert stats["prefetch_hits"] > 0 and stats["internal_errors"] == 0, stats
            check_arena(a, stats)


def test_shutdown_with_prefetch_fills_queued(models, isolated_env):
    """SHUTDOWN while prefetches keep coming and their fills wait behind one worker: the
    daemon stops at once and cleanly (the harness checks the arena is gone)."""
    blobs = models.blobs(layers=1, experts=32, top_k=8, hidden=512, moe_inter=512)
    with InProcessDaemon(blobs, "--cache-gb", "0.05", "--workers", "1") as d:
        with RawClient(blobs) as c:
            c.conn.send(Op.PREFETCH, {"layer": 0, "experts": list(range(8))})
            c.conn.send(Op.PREFETCH, {"layer": 0, "experts": list(range(8, 16))})
            c.request(Op.SHUTDOWN)
            for _ in range(50):
                c.conn.send(Op.PREFETCH, {"layer": 0, "experts": list(range(16, 24))})
        assert d.wait(10) == 0
        assert "Traceback" not in d.log_text()


def test_an_absorbed_prefetch_demoted_unused_still_counts(models, isolated_env):
    """A read-ahead row taken into an empty cache row, then demoted to a side row before
    anyone used it (a promotion's LFU victim: it was never counted as used): its first use is
    still a saved miss, and its rewrite still a waste. Every expert prefetched is accounted
    for once: prefetch_fills == prefetch_hits + prefetch_wasted."""
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB):
        with RawClient(blobs) as c:
            assert c.hello["cache_rows"] == 10 and c.hello["side_rows"] == 4
            for gen in range(3):  # the third: 0..3 (no longer claimed) take empty cache rows
                prefetch(c, 0, range(4 * gen, 4 * gen + 4))
                quiet(c)
            for start in range(0, 6, 2):  # the six other cache rows, used once each
                c.fetch(1, [start, start + 1])
            # 4 sits in a side row: its use promotes it, and the victim is one of 0..3 (never
            # used, the lowest frequency), demoted to a side row with its expert.
            reply = c.demand(0, [4])
            c.release(reply["lease"])
            assert reply["saved"] == 1
            for lease in [c.demand(0, [e])["lease"] for e in (0, 1, 2, 3)]:
                c.release(lease)
            stats = quiet(c)
            assert stats["prefetch_hits"] == 5 and stats["prefetch_wasted"] == 0, stats
            # Three more generations: the side rows' unused experts (5..11 and the demoted
            # one) are rewritten, the client's own generations letting them go.
            for gen in range(3):
                prefetch(c, 2, range(4 * gen, 4 * gen + 4))
                quiet(c)
            stats = quiet(c)
            assert stats["prefetch_fills"] == 24, stats
            for layer, e in [(layer, e) for layer in (0, 2) for e in range(12)]:
                if c.slot(layer, e)[1] == SlotState.READY:  # the rest: each used once
                    c.release(c.demand(layer, [e])["lease"])
            stats = quiet(c)
            assert stats["prefetch_hits"] + stats["prefetch_wasted"] == stats["prefetch_fills"], \
                stats
            check_arena(c, stats)


def test_another_clients_prefetch_does_not_expose_a_generation_to_demands(models, isolated_env):
    """Invariant 3 with the absorb: A's latest read-ahead sits in side rows, B's PREFETCH finds
    empty cache rows and moves read-ahead rows into them, B's demands then need rows. A's
    generation must stay put until A itself moves on (or the hold lapses, here not within the
    test): taken into the cache unused, its rows would be the LFU's first victims (never
    counted as used) and B's demands would rewrite them before A read them."""
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, *LONG_HOLD):
        with RawClient(blobs) as a, RawClient(blobs) as b:
            for start in range(0, 6, 2):  # six of the ten cache rows, four left empty
                b.fetch(1, [start, start + 1])
            prefetch(a, 0, [0, 1, 2, 3])
            quiet(a)
            kept = [a.slot(0, e) for e in range(4)]
            assert all(state == SlotState.READY for _, state, _ in kept)
            prefetch(b, 2, [0, 1, 2, 3])
            quiet(b)
            b.fetch(2, [8, 9])
            b.fetch(2, [10, 11])
            assert [a.slot(0, e) for e in range(4)] == kept, "A's read-ahead was rewritten"
            stats = quiet(b)
            assert stats["prefetch_dropped"] == 0 and stats["prefetch_wasted"] == 0, stats
            check_arena(b, stats)


# ---- the client process a test kills ----------------------------------------------------------

def burst(blobs) -> None:
    """Two PREFETCHes of four experts each (eight fills, one worker), then wait to be killed."""
    c = RawClient(blobs)
    c.conn.send(Op.PREFETCH, {"layer": 0, "experts": [0, 1, 2, 3]})
    c.conn.send(Op.PREFETCH, {"layer": 1, "experts": [0, 1, 2, 3]})
    c.request(Op.STATS)  # both were handled when this comes back
    print(json.dumps({"sent": 2}), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    if sys.argv[1] == "burst":
        burst(sys.argv[2])
