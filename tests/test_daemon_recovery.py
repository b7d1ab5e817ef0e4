"""Daemon paths that only show when things go wrong: demands queued behind fills, clients that
vanish with a demand queued, a state file that cannot be written. The serving loop runs in this
process, with a clock the test moves where a client's timeout is waited out."""

import shutil

import pytest
from daemon_helpers import FAST_TIMEOUTS
from harness import (
    STOP_TIMEOUT,
    TINY_CACHE_GB,
    FakeClock,
    InProcessDaemon,
    RawClient,
    expected_bytes,
    shm_exists,
    wait_until,
)

from expertd.errors import DaemonError
from expertd.manifest import Manifest
from expertd.paths import daemon_paths
from expertd.protocol import Op


def test_demand_queued_behind_fills_is_answered(models, isolated_env):
    """A demand that finds every cache row busy filling must start once those fills complete,
    even if no lease is ever released. (Prefetches fill side rows and no longer take cache
    rows: clients that demand and leave at once hold none, and their fills run on.)"""
    blobs = models.blobs()
    # As many workers as rows: every row is FILLING when the demand arrives.
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--workers", "16"):
        with RawClient(blobs) as c:
            rows = c.hello["cache_rows"]
            step = c.hello["client_cap"]
            for start in range(0, rows, step):
                with RawClient(blobs) as gone:
                    gone.conn.send(Op.DEMAND, {"layer": 0, "experts": list(
                        range(start, min(rows, start + step)))})
                    gone.conn.send(Op.GOODBYE, {})
            reply = c.demand(1, [0, 1, 2, 3], timeout=20.0)
            got = [c.row_bytes(r, 1) for r in reply["rows"]]
            c.release(reply["lease"])
            want = expected_bytes(blobs)
            assert got == [want[(1, e)] for e in range(4)]
            wait_until(lambda: c.request(Op.STATS)["leases"] == 0, 10.0, "the lease to go")


def test_vanished_client_with_a_queued_demand_leaks_no_lease(models, isolated_env):
    blobs = models.blobs()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, *FAST_TIMEOUTS,
                         clock=FakeClock()) as d:
        with RawClient(blobs) as watcher, RawClient(blobs) as gone:
            group = watcher.hello["max_demand"]
            assert group == watcher.hello["client_cap"]
            gone.demand(0, list(range(group)))  # a lease never released: all it may hold
            # Queued: one more row would take it past its cap.
            gone.conn.send(Op.DEMAND, {"layer": 1, "experts": [0]})
            wait_until(lambda: watcher.request(Op.STATS)["queued"] == 1, 10.0,
                       "the second demand to be queued")
            assert watcher.request(Op.STATS)["leases"] == 1
            # `gone` sends nothing more: its heartbeat times out; `watcher` keeps its own alive.
            def forgotten():
                beat = watcher.heartbeat()
                d.advance(0.1)  # the time between two of its heartbeats
                return beat and watcher.request(Op.STATS)["clients"] == 1

            wait_until(forgotten, 15.0, "the silent client to be forgotten")
            stats = watcher.request(Op.STATS)
            assert (stats["leases"], stats["queued"], stats["leased_rows"]) == (0, 0, 0), stats
            assert len(watcher.fetch(1, list(range(group)))) == group


def test_unwritable_state_file_does_not_leave_shared_memory_behind(models, isolated_env,
                                                                   tmp_path):
    blobs = models.blobs()
    state_dir = tmp_path / "state-here"
    state_dir.mkdir()
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--state-file",
                         state_dir / "hot.json") as d:
        with RawClient(blobs) as c:
            c.fetch(0, [1, 2])
        shutil.rmtree(state_dir)  # the state file can no longer be written
        d.stop()  # as SIGTERM stops a daemon process
        assert d.wait(timeout=STOP_TIMEOUT) == 0, d.log_text()
        assert "could not save the hot set" in d.log_text()
    assert not shm_exists(d.arena)
    assert not daemon_paths(blobs).socket.exists()


def _flip_byte(blobs, layer: int, expert: int) -> None:
    manifest = Manifest.load(blobs)
    with open(blobs / manifest.layers[layer].file, "r+b") as f:
        f.seek(expert * manifest.stride + 100)
        byte = f.read(1)[0]
        f.seek(expert * manifest.stride + 100)
        f.write(bytes([byte ^ 0xFF]))


def test_verify_always_catches_corruption_after_a_good_first_read(models, blob_dir,
                                                                  isolated_env):
    blobs = blob_dir
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--verify", "always"):
        with RawClient(blobs) as c:
            assert c.fetch(1, [5]) == [expected_bytes(models.blobs())[(1, 5)]]
            _flip_byte(blobs, 1, 5)
            c.evict(1, 5)
            with pytest.raises(DaemonError, match="layer 1 expert 5"):
                c.demand(1, [5])


def test_verify_first_checks_each_expert_once(blob_dir, isolated_env):
    """With --verify first (the default is always): the first fill of an expert is checked,
    its refills are not."""
    blobs = blob_dir
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--verify", "first"):
        with RawClient(blobs) as c:
            c.fetch(1, [5])
            _flip_byte(blobs, 1, 5)
            c.evict(1, 5, untouched=[(1, 6)])
            assert c.request(Op.STATS)["fill_errors"] == 0
            c.fetch(1, [5])  # refilled without a check: served
            assert c.request(Op.STATS)["fill_errors"] == 0
            _flip_byte(blobs, 1, 6)  # never read yet: its first fill is checked
            with pytest.raises(DaemonError, match="layer 1 expert 6"):
                c.demand(1, [6])
