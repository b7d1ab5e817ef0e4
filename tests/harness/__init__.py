"""The one test harness, by job (everything is importable from ``harness`` itself):

- ``core``: limits, ``wait_until`` (the one poll-until helper), shared-memory probes, STATS, the
  exact bytes of a blob directory, ``SEEN_ARENAS`` (checked by conftest at the session's end);
- ``raw``: ``RawClient``, a protocol-level client with the arena mapped;
- ``zmtp``: ``ZmtpPeer``, a peer speaking ZMTP by hand (frames past the limit, silence, garbage);
- ``inprocess``: ``InProcessDaemon``, the real serving loop on a thread of the test process, and
  ``FakeClock``, a clock the test moves by hand: for protocol tests that need no process;
- ``daemon``: ``Daemon``, a real ``expertd start --foreground`` process, for what needs one
  (kills, SIGSTOP, permissions, restarts, the command line, the daemon's memory);
- ``processes``: the command line, client processes (``daemon_helpers.py``), ``stop_process``
  (the one SIGTERM-then-SIGKILL stopper) and a pseudo-terminal;
- ``policy``: the cache-policy tests' helpers (``test_policy_*``): a policy filled row by row,
  its frequencies, auto-pins as the cache asks for them, the victim order by a full sort;
- ``prefetching``: the PREFETCH attack tests' helpers (``test_prefetch_attack_*``): a PREFETCH
  answered in order, STATS once quiet, the invariants of a quiet daemon's arena.
"""

from .core import (
    SEEN_ARENAS,
    SMALL_CACHE_GB,
    START_TIMEOUT,
    STOP_TIMEOUT,
    TINY_CACHE_GB,
    arena_owner,
    expected_bytes,
    query_stats,
    shm_exists,
    shm_mode,
    try_stats,
    validate,
    wait_until,
)
from .daemon import Daemon, kill_serving_daemon, running_daemon
from .inprocess import FakeClock, InProcessDaemon, server_config
from .policy import A, B, all_rows, auto_pin, filled, frequencies, frequency, n_explicit, reference_order
from .prefetching import check_arena, prefetch, quiet
from .processes import (
    CLIENT_SCRIPT,
    EXPERTD,
    drawn,
    expertd_cli,
    finish_client,
    read_json_line,
    sigint_as_usual,
    spawn_client,
    stop_process,
    terminal,
)
from .raw import RawClient
from .zmtp import ZmtpPeer

__all__ = [
    "A", "B", "CLIENT_SCRIPT", "EXPERTD", "SEEN_ARENAS", "SMALL_CACHE_GB", "START_TIMEOUT",
    "STOP_TIMEOUT", "TINY_CACHE_GB", "Daemon", "FakeClock", "InProcessDaemon", "RawClient",
    "all_rows", "arena_owner", "auto_pin", "check_arena", "drawn", "expected_bytes", "expertd_cli",
    "filled", "finish_client", "frequencies", "frequency", "kill_serving_daemon", "n_explicit",
    "prefetch", "query_stats", "quiet", "read_json_line", "reference_order",
    "running_daemon", "server_config", "shm_exists", "shm_mode", "sigint_as_usual", "spawn_client",
    "stop_process", "terminal", "try_stats", "validate", "wait_until", "ZmtpPeer",
]
