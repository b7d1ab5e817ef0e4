"""PREFETCH against faults and odd input: a read-ahead whose read fails under a waiting demand
(the daemon a process, stopped with SIGSTOP to line the two up), ``core`` of every shape, and
no side rows at all; checked against the arena's own invariants."""

import pytest
from harness import (
    TINY_CACHE_GB,
    InProcessDaemon,
    RawClient,
    check_arena,
    expected_bytes,
    prefetch,
    quiet,
    running_daemon,
    wait_until,
)

from expertd.protocol import Op


def failed_read_ahead_waited_on(d, c: RawClient) -> dict:
    """Cut the last layer's blob short, then send a PREFETCH of an expert past the new end and
    a DEMAND for it while the daemon is stopped (so one batch takes both and the demand waits
    on the read-ahead in flight). Check the demand fails by I/O; STATS once quiet.

    The two reach the daemon's queue through the ZeroMQ threads of both processes, so now and
    then the daemon resumes with only the first read (two batches: two failed reads, and the
    demand waited on nothing). The pair is then sent again for another cut-off expert, until
    one batch took both."""
    import os
    import signal

    from test_side_rows import stopped

    from expertd.errors import DaemonError
    from expertd.protocol import ErrorCode

    last = c.manifest.layers[-1]
    os.truncate(c.blob_dir / last.file, 2 * c.manifest.stride + 5)  # experts 2.. cut off
    before = quiet(c)
    for expert in range(last.num_experts - 1, 1, -1):
        os.kill(d.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: stopped(d.pid), 10.0, "the daemon to stop")
            c.conn.send(Op.PREFETCH, {"layer": last.index, "experts": [expert]})
            rid = c.conn.send(Op.DEMAND, {"layer": last.index, "experts": [expert]})
        finally:
            os.kill(d.pid, signal.SIGCONT)
        with pytest.raises(DaemonError) as err:
            c.conn.wait(rid, 20.0)
        assert err.value.code == ErrorCode.IO
        stats = quiet(c)
        assert stats["prefetch_fills"] == 0, stats
        failed = stats["fill_errors"] - before["fill_errors"]
        assert failed in (1, 2), stats
        if failed == 1:  # one read for both: the demand waited on the read-ahead
            return stats
        before = stats
    pytest.fail("the daemon never took the read-ahead and the demand in one batch")


def test_a_failed_read_ahead_leaves_an_empty_row_the_next_prefetches_take(blob_dir,
                                                                          isolated_env):
    """After a read-ahead's read failed under a waiting demand (the row it was promoted to,
    a cache row, is empty again), prefetches take that row, and the arena stays consistent."""
    with running_daemon(blob_dir, isolated_env, "--cache-gb", TINY_CACHE_GB,
                        "--workers", "1") as d:
        with RawClient(blob_dir) as c:
            failed_read_ahead_waited_on(d, c)
            for gen in range(4):
                prefetch(c, 0, range(4 * gen, 4 * gen + 4))
                quiet(c)
            assert c.fetch(0, [0, 1]) and c.fetch(1, [0, 1])
            stats = quiet(c)
            assert stats["prefetch_fills"] == 16 and stats["prefetch_dropped"] == 0, stats
            assert stats["internal_errors"] == 0, stats
            check_arena(c, stats)


def test_a_failed_read_ahead_that_a_demand_waited_on_saved_nothing(blob_dir, isolated_env):
    """No saved miss is counted for a read-ahead whose read brought nothing."""
    with running_daemon(blob_dir, isolated_env, "--cache-gb", TINY_CACHE_GB,
                        "--workers", "1") as d:
        with RawClient(blob_dir) as c:
            stats = failed_read_ahead_waited_on(d, c)
            assert stats["prefetch_hits"] <= stats["prefetch_fills"], stats


def test_prefetch_cores_of_every_shape(models, isolated_env):
    """``core`` 0 (all of it a wider guess), equal to the list, past it, negative, a bool, a
    float, a string, nil: the good ones are read (a core of 0 still reads with workers idle),
    each bad one gets one error reply naming ``core``, and the daemon keeps serving."""
    from expertd.errors import DaemonError

    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--workers", "4"):
        with RawClient(blobs) as c:
            c.fill_cache(2)
            c.conn.send(Op.PREFETCH, {"layer": 0, "experts": [0, 1, 2, 3], "core": 0})
            quiet(c)
            c.conn.send(Op.PREFETCH, {"layer": 1, "experts": [0, 1, 2, 3], "core": 4})
            stats = quiet(c)
            assert stats["prefetch_fills"] == 8 and stats["prefetch_shed"] == 0, stats
            for core in (5, -1, True, 1.5, "1", None, 2**40):
                with pytest.raises(DaemonError, match="core"):
                    c.request(Op.PREFETCH, {"layer": 0, "experts": [4, 5, 6, 7], "core": core})
            stats = quiet(c)
            assert stats["prefetch_fills"] == 8 and stats["bad_requests"] == 7, stats
            assert stats["internal_errors"] == 0, stats
            check_arena(c, stats)


def test_no_side_rows(models, isolated_env):
    """``--side-rows 0``: every PREFETCH is dropped, nothing is read ahead or moved, and
    demands are served from the cache alone."""
    blobs = models.blobs()
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--side-rows", "0"):
        with RawClient(blobs) as c:
            assert c.hello["side_rows"] == 0
            for gen in range(3):
                prefetch(c, gen, [0, 1, 2, 3])
            assert c.fetch(0, [0, 1]) == [want[(0, 0)], want[(0, 1)]]
            stats = quiet(c)
            assert stats["prefetch_fills"] == 0 and stats["prefetch_dropped"] == 12, stats
            assert stats["side_rows"] == 0 and stats["side_rows_used"] == 0, stats
            assert stats["internal_errors"] == 0 and stats["fills"] == 2, stats
            check_arena(c, stats)
