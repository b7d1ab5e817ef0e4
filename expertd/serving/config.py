"""The daemon's configuration, validated once at start-up, and the limits derived from it."""

import math
from dataclasses import dataclass
from pathlib import Path

from expertd.choices import PREFETCH_MODES, SPECULATE_MODES  # noqa: F401 (its users' names)
from expertd.protocol import GUESS_WIDTH
from expertd.serving.preads import VERIFY_MODES
from expertd.serving.side import SIDE_HOLD
from expertd.shm.layout import Geometry

IO_MODES = ("direct", "buffered")  # O_DIRECT / F_NOCACHE reads, or through the page cache


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``expertd start`` decides, validated once.

    The defaults here are the daemon's: ``expertd start``'s flags take theirs from these fields
    (expertd.cli.options), so a daemon built in Python and one started from the shell agree.
    """

    blob_dir: Path
    cache_bytes: int
    workers: int = 8
    io: str = "direct"
    verify: str = "always"
    client_timeout: float = 10.0
    heartbeat_interval: float = 1.0
    lease_timeout: float = 30.0
    pin_file: Path | None = None
    auto_pin: int = 0
    save_interval: float = 60.0
    prefetch: str = "auto"
    side_rows: int | None = None  # prefetch rows per generation; None: Geometry.default_side_rows
    side_hold: float = SIDE_HOLD  # seconds a prefetch claim protects its side row at most
    # Clients one process may have attached at once (the kernel names the process: a flood of
    # hellos from one filled every client slot); a process runs one session a model.
    clients_per_process: int = 16

    def __post_init__(self):
        if self.cache_bytes <= 0:
            raise ValueError("cache size must be positive")
        if self.workers < 1:
            raise ValueError("workers must be at least 1")
        if self.io not in IO_MODES:
            raise ValueError(f"io must be {' or '.join(map(repr, IO_MODES))}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}")
        for name in ("client_timeout", "heartbeat_interval", "lease_timeout", "side_hold"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name.replace('_', ' ')} must be a positive number of seconds")
        if self.client_timeout <= self.heartbeat_interval:
            raise ValueError("client timeout must exceed the heartbeat interval")
        if self.auto_pin < 0:
            raise ValueError("auto-pin must not be negative")
        if self.clients_per_process < 1:
            raise ValueError("clients per process must be at least 1")
        if self.side_rows is not None and self.side_rows < 0:
            raise ValueError("side rows must not be negative")
        if self.prefetch not in PREFETCH_MODES:
            raise ValueError(f"prefetch must be one of {', '.join(PREFETCH_MODES)}")


def arena_geometry(manifest, cache_bytes: int, side_rows: int | None) -> Geometry:
    """The arena a daemon lays out for ``manifest`` in ``cache_bytes``: ``side_rows`` prefetch
    rows a generation, or when None the default for that budget (Geometry.default_side_rows).
    ``expertd start`` checks its flags against this same layout.

    Raises:
        ValueError: if the budget cannot hold one cache row beside the side rows.
    """
    shape = len(manifest.layers), manifest.max_experts, manifest.stride
    if side_rows is None:
        side_rows = Geometry.default_side_rows(*shape, cache_bytes, manifest.top_k, GUESS_WIDTH)
    return Geometry.for_budget(*shape, cache_bytes, side_rows=side_rows)


def cache_limits(cache_rows: int) -> tuple:
    """``(max_pins, max_demand, client_cap)`` for a cache of ``cache_rows`` rows.

    Pins take at most a quarter of the rows. A demand (one client's group) takes at most half of
    the rest, and one client holds at most what leaves room for another client's largest group
    beside every pin: no client, however greedy, can starve the others.
    """
    max_pins = cache_rows // 4
    max_demand = max(1, (cache_rows - max_pins) // 2)
    client_cap = max(max_demand, cache_rows - max_pins - max_demand)
    return max_pins, max_demand, client_cap
