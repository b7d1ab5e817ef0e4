"""The STATS reply's keys are a contract (clients, ``expertd status`` and ``/metrics`` read them
by name): pinned here, with the records of the daemon's parts that fill them."""

import dataclasses
import os

import pytest
from harness import TINY_CACHE_GB, InProcessDaemon

from expertd.serving import stats
from expertd.serving.stats import STATS_KEYS, assemble

EXPECTED = [
    "endpoint", "arena", "pid", "blob_dir", "epoch", "log", "uptime_s", "arena_bytes",
    "arena_rows", "stride", "cache_capped", "rows_used", "hits", "demand_hits", "client_hits",
    "misses", "hit_rate", "prefetch", "side_rows", "side_rows_used", "prefetch_requested",
    "prefetch_ignored", "prefetch_merged", "prefetch_fills", "prefetch_dropped", "prefetch_shed",
    "prefetch_hits", "prefetch_wasted", "bytes_read", "fills", "fill_errors", "failed_experts",
    "failed_count", "background_pending", "fill_seconds", "fill_gbps", "pinned", "clients", "client_pools",
    "leases", "leased_rows", "queued",
    "lease_expiries", "max_demand", "client_cap", "deferred_fills", "epochs_lost",
    "epoch_clients", "epoch_wait_max_s", "bad_requests", "internal_errors", "busy",
    "clients_timed_out", "clients_disconnected", "demands", "in_flight", "io", "io_reason",
    "workers", "verify", "implementation", "peers", "peers_accepted", "peers_closed",
    "handshakes_failed", "accepts_failed", "replies_dropped",
]
RECORDS = (stats.DaemonInfo, stats.ServerCounters, stats.CacheCounters, stats.CacheStats,
           stats.LeaseStats, stats.EpochStats, stats.ClientStats, stats.PeerCounters)


def blank(record):
    """An instance of ``record`` with a zero (or None) in every field."""
    return record(**{f.name: 0 for f in dataclasses.fields(record)})


def test_the_keys_are_those_clients_read_in_their_order():
    assert list(STATS_KEYS) == EXPECTED


def test_each_key_comes_from_exactly_one_record():
    names = [f.name for record in RECORDS for f in dataclasses.fields(record)]
    assert sorted(names) == sorted(EXPECTED) and len(names) == len(set(names))
    assert list(assemble(*map(blank, RECORDS))) == EXPECTED


@dataclasses.dataclass
class Extra:
    surprise: int = 0


@pytest.mark.parametrize("records", [RECORDS[1:], RECORDS + (Extra,)], ids=["missing", "extra"])
def test_records_that_do_not_give_exactly_the_keys_are_a_bug(records):
    with pytest.raises(RuntimeError, match="differ from STATS_KEYS"):
        assemble(*map(blank, records))


def test_a_daemon_reports_exactly_these_keys(blobs, isolated_env):
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB) as d:
        reply = d.stats()
        own = d.server.stats()
    assert list(reply) == ["ok", *EXPECTED] and list(own) == EXPECTED
    assert reply["pid"] == os.getpid() and reply["arena"] == d.arena
    assert reply["arena_rows"] == d.server.geometry.cache_rows
    assert reply["hits"] == reply["demand_hits"] + reply["client_hits"] == 0
    assert reply["clients"] == 0 and reply["client_pools"] == [] and reply["leases"] == 0
