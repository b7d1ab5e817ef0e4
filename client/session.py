"""A client's session with the daemon: reading rows through its attachment (attach.py).

``read_rows`` is the source every pool reads through: rows found in the arena are copied
without the daemon and seqlock-checked, the rest are demanded, copied while leased and
released, and a read that a daemon's death cuts short starts over on the new arena
(``_across_restarts``). The session is a floor below the step: it knows rows and requests, not
steps; the counters the step writes are named in counters.py. The layers' expert pools
(pool.py) live in the client's memory and survive a reconnection; the model's parts are held
together by runtime.py, not by the session.
"""

import time

import numpy as np

from expertd.errors import DaemonDied, DaemonError
from expertd.protocol import ErrorCode
from expertd.retry import RetryPolicy

from .attach import Attachment, check_served, notice
from .backing import Stage, buffer_bytes, segment_bases
from .copier import Copier
from .counters import new_counters, new_timing
from .interrupts import HeldInterrupts
from .requester import REQUEST_TIMEOUT

# How long a read waits for rows someone else is filling before it demands them itself. The
# demand merges onto the same fill, and moves a prefetch's low-priority read to the front.
DRAIN_TIMEOUT = 0.05
# A leased row's copy that changed under it (the lease lapsed, held past the daemon's bound)
# is leased again, until one holds.
LEASE_AGAIN = RetryPolicy()
# Demands sent together (demand_absent_all): the daemon queues up to 32 of a client's demands
# (serving/server.py MAX_QUEUED_PER_CLIENT) and refuses more as busy; half of that leaves room
# for the late ones of a wave that ended on an error.
DEMANDS_AT_ONCE = 16
BUSY_PAUSE = 0.05  # between a demand the daemon refused as busy and the same sent again
BUSY_RETRY = RetryPolicy(pause=BUSY_PAUSE)

__all__ = ["DaemonDied", "Session", "check_served", "notice"]


class Session(Attachment):
    """One client's connection to the expertd serving ``blob_dir``.

    Args:
        blob_dir: the blob directory; the daemon is found from it.
        reconnect_timeout: how long to wait for a restarted daemon after the old one died.
        max_group: most experts moved from the arena at once (default: 64 or 4 x top-k,
            within what the daemon leases at once).
        pull: who reads a layer's missing rows from the arena during a step (one of
            ``pull.PULL_MODES``): "auto", the device where it can (CUDA, Metal), else the
            per-layer host path; "device" (an error where it cannot); "host", the host copy
            behind the same interface (the CPU twin the tests run); "off", the per-layer path.
    Raises:
        DaemonNotRunning: no daemon serves the directory (the message says how to start one).
        DaemonError: the daemon serves another blob directory or speaks another protocol.
    """

    def __init__(self, blob_dir, reconnect_timeout: float = 60.0, max_group: int | None = None,
                 pull: str = "off"):
        self.timing = new_timing()  # where the main thread's time goes per MoE layer call
        self.timeline = None  # a list to record (layer, t0, t_sync, t_fetched, t_done) per call
        self._stages: dict = {}  # (rows, segment sizes) -> backing.Stage
        super().__init__(blob_dir, reconnect_timeout, max_group, pull, new_counters())
        self._links.copier = Copier()  # the model's layers' (its thread starts when used)

    # ---- the puller of the attach now (attach.py makes it) ---------------------------------

    @property
    def puller(self):
        """The pull.py puller of this attach, or None (rows are copied on the host)."""
        return self.pulling.puller

    @puller.setter
    def puller(self, puller) -> None:
        self.pulling.puller = puller  # tests put a checking puller in its place

    @property
    def step_epoch(self):
        """The arena_view.StepEpoch record of this attach, or None without a puller."""
        return self.pulling.step_epoch

    @property
    def pull_mode(self) -> str:
        return self.pulling.mode

    def count_pulled(self, layer: int, rows: int) -> None:
        """``rows`` of ``layer`` were pulled in a step (known from its statuses)."""
        self.pulling.count(layer, rows)

    def pull_counters(self) -> dict:
        """Rows and bytes pulled from the arena (every attach so far), and the seconds the
        timed pulls (a prompt's) took."""
        return self.pulling.counters()

    def stage(self, rows: int, like):
        """The model's stage for layers of ``rows`` experts shaped as the pool backing ``like``
        (see backing.Stage), made on first use; claimed for a write."""
        # Keyed by the segments' shapes and types, not their sizes alone: a stage's arrays
        # are shaped for one layer shape.
        key = (rows, tuple((str(d), tuple(shape), nb) for d, shape, nb in like.segment_specs))
        stage = self._stages.get(key)
        if stage is None:
            stage = self._stages[key] = Stage(rows, like.segment_specs)
        stage.claim()
        return stage

    @property
    def copier(self):
        """The copier.Copier of the model's layers, closed with the session."""
        return self._links.copier

    # ---- reading rows ----------------------------------------------------------------------

    def read_rows(self, layer: int, experts: np.ndarray, dest: np.ndarray, bases: np.ndarray,
                  positions: np.ndarray) -> None:
        """Copy the bytes of ``experts`` (distinct int32) of ``layer`` into ``dest``: segment
        ``s`` of ``experts[i]`` at ``bases[s] + positions[i] * nbytes[s]``.

        Rows found in the arena are copied without the daemon (and seqlock-checked); the rest
        are demanded, leased while copied and released. Survives a daemon restart.
        """
        self.check_alive()

        def read() -> None:
            limit = self.demand_limit  # a daemon restarted with a smaller cache leases fewer
            for start in range(0, len(experts), limit):
                self._read_chunk(layer, experts[start:start + limit], dest, bases,
                                 positions[start:start + limit])

        self._across_restarts(read)

    def _read_chunk(self, layer, experts, dest, bases, positions) -> None:
        view, timing = self.view, self.timing
        found = view.lookup(layer, experts)
        if found.missing and (found.filling >= 0).any():
            started = time.perf_counter()
            self.counters["drained"] += view.drain(layer, experts, found, DRAIN_TIMEOUT)
            timing["fill_wait_s"] += time.perf_counter() - started
        if not (found.slots < 0).any():
            rows = view.rows(layer, found.slots, found.versions)
            started = time.perf_counter()
            rows.copy(dest, bases, positions)
            timing["copy_s"] += time.perf_counter() - started
            if rows.unchanged():
                rows.count_hits()  # found without the daemon: counted for its LFU
                self.counters["fast_hits"] += len(experts)
                return
            # A row was evicted and refilled while we copied it: lease the group instead.
            self.counters["retries"] += 1
        requester = self.requester
        # The lock keeps the heartbeat thread off leases in use. SIGINT is held back until the
        # leases are released (a copy takes a millisecond or so), except while the demand waits.
        with requester.lock, HeldInterrupts() as held:
            try:
                for _ in LEASE_AGAIN.tries():
                    started = time.perf_counter()
                    leased = view.rows(layer, *requester.demand(layer, experts, held))
                    copying = time.perf_counter()
                    leased.copy(dest, bases, positions)
                    timing["fill_wait_s"] += copying - started
                    timing["copy_s"] += time.perf_counter() - copying
                    if leased.unchanged():
                        return
                    # Our lease lapsed (held past the daemon's bound): lease them again.
                    self.counters["retries"] += 1
                    requester.release_leases()
            finally:
                # Whatever happened (KeyboardInterrupt while waiting included), nothing stays
                # leased.
                requester.release_all()

    def demand_absent(self, layer: int, experts: np.ndarray) -> None:
        """Have the daemon read ``experts`` of ``layer`` into its arena (a step found them
        absent), waiting for the reads; nothing stays leased."""
        self.demand_absent_all([(layer, experts)])

    def demand_absent_all(self, groups: list) -> None:
        """:meth:`demand_absent` of every ``(layer, experts)`` of ``groups`` at once (of what a
        step found absent, what its replay will route to: step_check.needed_absent): the
        daemon reads them all in parallel, and this waits for the lot. Each group is split by
        the daemon's demand limit, and at most DEMANDS_AT_ONCE demands wait at a time (half
        the daemon's queue for one client).

        A daemon whose queues are full answers BUSY: its queue for all clients together
        (256 demands) fills when many clients wait for rows at once. The rest then go one
        demand at a time, each sent again BUSY_PAUSE s after a BUSY, until the daemon has room
        or REQUEST_TIMEOUT s have passed (then the BUSY error is raised)."""
        self.check_alive()

        def demand() -> None:
            requester, limit = self.requester, self.demand_limit  # this attach's limit
            chunks = [(layer, experts[start:start + limit]) for layer, experts in groups
                      for start in range(0, len(experts), limit)]
            with requester.lock, HeldInterrupts() as held:
                try:
                    try:
                        for start in range(0, len(chunks), DEMANDS_AT_ONCE):
                            requester.demand_all(chunks[start:start + DEMANDS_AT_ONCE], held)
                    except DaemonError as exc:
                        if exc.code != ErrorCode.BUSY:
                            raise
                        for chunk in chunks:  # what was read already is found at once
                            self._demand_when_room(chunk, held)
                finally:
                    requester.release_all()

        self._across_restarts(demand)

    def _demand_when_room(self, chunk: tuple, held: HeldInterrupts) -> None:
        """One demand of ``chunk`` (``(layer, experts)``), sent again while the daemon answers
        BUSY (see :meth:`demand_absent_all`); its lease released. A SIGINT is delivered
        between tries."""
        requester = self.requester
        deadline = time.monotonic() + REQUEST_TIMEOUT
        for _ in BUSY_RETRY.tries():
            try:
                requester.demand(*chunk, held)
                requester.release_all()
                return
            except DaemonError as exc:
                if exc.code != ErrorCode.BUSY or time.monotonic() > deadline:
                    raise
                self.counters["retries"] += 1
                if held.pending:
                    held.deliver()

    def fetch(self, layer: int, experts, dest: np.ndarray | None = None) -> np.ndarray:
        """Read ``experts`` of ``layer`` into ``dest`` (a buffer of :meth:`staging_bytes`,
        laid out by :meth:`bases`), positions 0, 1, ... Returns ``dest``. For tools and tests:
        the model reads rows into its pools with :meth:`read_rows`."""
        experts = np.asarray(experts, dtype=np.int32)
        if dest is None:
            dest = np.empty(self.staging_bytes(), np.uint8)
        self.read_rows(layer, experts, dest, self.bases(layer),
                       np.arange(len(experts), dtype=np.int32))
        return dest

    def bases(self, layer: int) -> np.ndarray:
        """Where each segment of ``layer`` starts in a :meth:`fetch` buffer."""
        return segment_bases(self.max_group, self._segment_tables[layer][1])

    def staging_bytes(self) -> int:
        """Bytes a :meth:`fetch` buffer needs for ``max_group`` experts of any layer."""
        return max(buffer_bytes(self.max_group, nbytes) for _, nbytes in self._segment_tables)

    def prefetch(self, layer: int, experts: np.ndarray, n_core: int, claim: np.ndarray) -> None:
        """Ask the daemon to read ``experts`` (distinct, absent when looked up, best first; the
        first ``n_core`` from the guess's core) of ``layer`` into its side rows. The guesses of
        ``claim`` were resident: one may sit in a side row, which claiming keeps the daemon from
        reusing."""
        self.requester.prefetch(layer, experts, n_core, claim)

    def report_hits(self, layer: int, experts: np.ndarray) -> None:
        """Tell the daemon's LFU that ``experts`` were used from a pool (through the slot
        table, no message): pooled experts stay warm in the shared cache for other clients."""
        found = self.lookup(layer, experts)
        ok = found.slots >= 0
        self.counters["hits_reported"] += self.arena_rows(
            layer, found.slots[ok], found.versions[ok]).count_hits()

    def lookup(self, layer: int, experts: np.ndarray):
        """Where ``experts`` (distinct int32) of ``layer`` are in the arena (a lock-free read
        of its slot table: arena_view.Lookup)."""
        return self.view.lookup(layer, experts)

    def arena_rows(self, layer: int, slots: np.ndarray, versions: np.ndarray):
        """Rows a :meth:`lookup` found, to copy (arena_view.ArenaRows, on the arena attached
        now)."""
        return self.view.rows(layer, slots, versions)

    @property
    def _leases(self) -> set:
        return self.requester.leases
