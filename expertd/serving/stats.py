"""The STATS reply: its keys, and the records the parts of the daemon fill for it.

Clients, ``expertd status`` and ``/metrics`` read these keys by name: none is renamed or
dropped. Each part fills its own record (the cache its counters and figures, the lease book, the
client registry and the peers theirs); the server adds who it is and counts its requests, and
:func:`assemble` puts them together in the order of ``STATS_KEYS``.
"""

from dataclasses import dataclass, fields

STATS_KEYS = (
    # who and where (DaemonInfo)
    "endpoint", "arena", "pid", "blob_dir", "epoch", "log", "uptime_s", "arena_bytes",
    "arena_rows", "stride", "cache_capped",
    # the cache (CacheStats, CacheCounters)
    "rows_used", "hits", "demand_hits", "client_hits", "misses", "hit_rate", "prefetch",
    "side_rows", "side_rows_used", "prefetch_requested", "prefetch_ignored", "prefetch_merged",
    "prefetch_fills", "prefetch_dropped", "prefetch_shed", "prefetch_hits", "prefetch_wasted",
    "bytes_read", "fills", "fill_errors", "failed_experts", "failed_count",
    "background_pending", "fill_seconds",
    "fill_gbps", "pinned",
    # clients and their leases (ClientStats, LeaseStats)
    "clients", "client_pools", "leases", "leased_rows", "queued", "lease_expiries",
    "max_demand", "client_cap",
    # reclamation by epochs (EpochStats)
    "deferred_fills", "epochs_lost", "epoch_clients", "epoch_wait_max_s",
    # requests (ServerCounters)
    "bad_requests", "internal_errors", "busy", "clients_timed_out", "clients_disconnected",
    "demands",
    # reads and connections (DaemonInfo, CacheStats, PeerCounters)
    "in_flight", "io", "io_reason", "workers", "verify", "implementation", "peers",
    "peers_accepted", "peers_closed", "handshakes_failed", "accepts_failed", "replies_dropped",
)


@dataclass(frozen=True)
class DaemonInfo:
    """Who the daemon is, where it serves, and how it was started."""

    endpoint: str
    arena: str
    pid: int
    blob_dir: str
    epoch: int
    log: str
    uptime_s: float
    arena_bytes: int
    arena_rows: int
    stride: int
    cache_capped: bool
    max_demand: int
    io: str
    io_reason: str | None
    workers: int
    verify: str
    implementation: str
    peers: int  # connections open now


@dataclass
class ServerCounters:
    """Requests the serving loop counted."""

    bad_requests: int = 0
    demands: int = 0
    internal_errors: int = 0
    busy: int = 0  # demands refused: their client had too many queued
    clients_timed_out: int = 0
    clients_disconnected: int = 0


@dataclass
class CacheCounters:
    """What the cache counted: uses, reads and prefetches."""

    demand_hits: int = 0
    client_hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    fills: int = 0
    fill_errors: int = 0
    prefetch_requested: int = 0
    prefetch_ignored: int = 0
    prefetch_merged: int = 0
    prefetch_fills: int = 0
    prefetch_dropped: int = 0
    prefetch_shed: int = 0
    prefetch_hits: int = 0  # saved misses: first uses of prefetched rows
    prefetch_wasted: int = 0


@dataclass(frozen=True)
class CacheStats:
    """The cache's figures now, derived from its rows and counters."""

    rows_used: int
    side_rows: int
    side_rows_used: int
    prefetch: str
    hits: int
    hit_rate: float
    fill_seconds: float
    fill_gbps: float
    pinned: int  # resident rows of pinned keys
    in_flight: int
    # [layer, expert, message] of experts whose latest fill failed (a damaged blob), at most
    # FAILED_SHOWN, pinned ones first, and how many there are; warm-up and pin fills not done yet
    failed_experts: list
    failed_count: int
    background_pending: int


@dataclass(frozen=True)
class LeaseStats:
    """The lease book now."""

    leases: int
    leased_rows: int  # leases summed over rows: a row two clients hold counts twice
    queued: int  # demands waiting for room
    lease_expiries: int  # leases revoked for being held too long, so far
    client_cap: int


@dataclass(frozen=True)
class EpochStats:
    """The epoch book: refills that waited for clients' steps to end (docs/ARCHITECTURE.md, "Epochs")."""

    deferred_fills: int  # refills of evicted rows held back for a step, so far
    epochs_lost: int  # records whose step outlasted the lease bound while a row waited
    epoch_clients: int  # clients holding an epoch record now
    epoch_wait_max_s: float  # the longest a held refill waited, in seconds


@dataclass(frozen=True)
class ClientStats:
    """The clients known now."""

    clients: int
    client_pools: list  # per client: pid, pool_bytes, steps, host_waits


@dataclass
class PeerCounters:
    """Connections accepted and closed (by their peer, or by libzmq: a frame over MAXMSGSIZE,
    a silence past the ZMTP heartbeat), handshakes refused (not ZMTP, another user), accepts
    that failed (out of descriptors), and replies dropped (their peer gone, or reading none)."""

    peers_accepted: int = 0
    peers_closed: int = 0
    handshakes_failed: int = 0
    accepts_failed: int = 0
    replies_dropped: int = 0


def assemble(*records) -> dict:
    """The STATS dict of the parts' records (dataclass instances), in ``STATS_KEYS`` order.

    Raises:
        RuntimeError: if the records do not give exactly ``STATS_KEYS`` (a daemon bug).
    """
    merged = {}
    for record in records:
        merged.update((f.name, getattr(record, f.name)) for f in fields(record))
    if len(merged) != len(STATS_KEYS) or not merged.keys() >= set(STATS_KEYS):
        raise RuntimeError(f"STATS records differ from STATS_KEYS: "
                           f"{sorted(set(merged) ^ set(STATS_KEYS))}")
    return {key: merged[key] for key in STATS_KEYS}
