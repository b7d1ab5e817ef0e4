"""A client's attachment to the daemon: hello, arena view, requests, heartbeat, reconnection.

The session composes three parts that each own their state: an :class:`ArenaView` (the mapped
arena: lookups, drains, seqlock-checked copies), a :class:`Requester` (the one request engine on
the socket, hello included: request ids, demands and their leases) and a :class:`Heartbeat` (a
thread with a socket of its own that tells the daemon the client lives). What it adds is the
reading of rows that combines them (``read_rows``: the source every pool reads through), and
reconnection, written once (``_across_restarts``): a daemon that dies or restarts is waited for
and attached again, and the read starts over on the new arena. The layers' expert pools
(pool.py) live in the client's memory and survive a reconnection; the model's parts are held
together by runtime.py, not by the session.
"""

import logging
import os
import sys
import threading
import time
import weakref

import numpy as np

from expertd import native
from expertd.choices import check_choice
from expertd.client.arena_view import ArenaView
from expertd.client.backing import Stage, buffer_bytes, segment_bases
from expertd.client.copier import Copier
from expertd.client.counters import BATCH_COUNTERS, REPLAY_COUNTERS
from expertd.client.dtypes import MLX_DTYPES
from expertd.client.heartbeat import Heartbeat
from expertd.client.interrupts import HeldInterrupts
from expertd.client.links import Links, weak_method
from expertd.client.pull import PULL_MODES, StepEpoch, make_puller
from expertd.client.requester import DaemonDied, Requester
from expertd.connection import Connection
from expertd.errors import BlobStoreError, DaemonError, DaemonNotRunning
from expertd.manifest import Manifest, blob_dir_problem
from expertd.paths import daemon_paths
from expertd.protocol import PROTOCOL_VERSION, Op
from expertd.runfile import elsewhere, serving_epoch
from expertd.shm.layout import EPOCH_DTYPE

# How long a read waits for rows someone else is filling before it demands them itself. The
# demand merges onto the same fill, and moves a prefetch's low-priority read to the front.
DRAIN_TIMEOUT = 0.05
HELLO_TIMEOUT = 10.0  # a daemon that holds its lock but does not answer a hello (stopped)

__all__ = ["DaemonDied", "Session"]

log = logging.getLogger("expertd")


def check_served(paths) -> None:
    """Raise DaemonNotRunning unless a daemon holds the lock of ``paths``' blob directory (one
    killed with SIGKILL leaves its socket and run files: nothing should wait on them)."""
    if serving_epoch(paths) is None:
        blob = paths.blob_dir
        problem = blob_dir_problem(blob)
        if problem is not None:  # not a daemon to start: a directory to make first
            raise BlobStoreError(problem)
        raise DaemonNotRunning(elsewhere(paths) or f"no expertd serves {blob} (its lock is "
                               f"free): start one with: expertd start --blobs {blob}")


def notice(line: str) -> None:
    """Say ``line`` on stderr, on a line of its own: on a terminal, a reply being streamed to
    it may have left the cursor mid-line, so the line starts on the next one."""
    sys.stderr.write(("\n" if sys.stderr.isatty() else "") + line + "\n")
    sys.stderr.flush()


class Session:
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
        # The socket and the threads, held apart from the session: a model dropped without
        # close() (or left at exit) still has them shut, in order, by the finalizer.
        self._links = Links()
        weakref.finalize(self, self._links.close)
        self.paths = daemon_paths(blob_dir)
        self.manifest = Manifest.load(self.paths.blob_dir)
        self.reconnect_timeout = reconnect_timeout
        self.requested_group = max_group or max(64, 4 * self.manifest.top_k)
        self.counters = dict(fast_hits=0, demanded=0, drained=0, retries=0, reconnects=0,
                             late_leases=0, prefetch_asked=0, misses=0, prefetch_saved=0,
                             hits_reported=0, steps=0, host_waits=0, speculative_steps=0,
                             unchecked_steps=0, replays=0, pulled_steps=0,
                             **dict.fromkeys(BATCH_COUNTERS, 0),
                             **dict.fromkeys(REPLAY_COUNTERS, 0))
        # Where the main thread's time goes per MoE layer call (see layer.py).
        self.timing = dict(sync_s=0.0, exposed_s=0.0, copy_s=0.0, fill_wait_s=0.0,
                           copier_wait_s=0.0, prestage_s=0.0, layers=0,
                           # a speculative step's building, its one wait, its bookkeeping
                           step_build_s=0.0, step_wait_s=0.0, step_book_s=0.0)
        self.pool_bytes = 0  # the client's expert memory: its pools (see announce_pools)
        self._links.copier = Copier()  # the model's layers' (its thread starts when used)
        self.timeline = None  # a list to record (layer, t0, t_sync, t_fetched, t_done) per call
        self.conn = self.view = self.requester = self._heartbeat = None
        self.epoch = None  # the attached daemon's (kept across a detach: see unanswered)
        self.pull_mode = check_choice("pull", pull, PULL_MODES)
        self.puller = self.step_epoch = None  # made at each attach (see pull.py)
        self._stages: dict = {}  # (rows, segment sizes) -> backing.Stage
        self._pull_layers = {
            layer.index: [(MLX_DTYPES[seg.dtype], tuple(seg.shape), seg.nbytes)
                          for seg in layer.segments] for layer in self.manifest.layers}
        self._pulled_before = dict(rows_pulled=0, bytes_pulled=0, pull_s=0.0, timed_bytes=0)
        self._pull_lock = threading.Lock()  # the puller's swap against pull_counters' reads
        self.max_group = None
        self.closed = False
        self._segment_tables = [
            (np.array([seg.offset for seg in layer.segments], dtype=np.intp),
             np.array([seg.nbytes for seg in layer.segments], dtype=np.intp))
            for layer in self.manifest.layers]
        self._attach()
        log.debug("attached to expertd pid %d serving %s: puller %s, pools %d bytes",
                  self.daemon_pid, self.paths.blob_dir,
                  self.puller.name if self.puller is not None else "none", self.pool_bytes)

    # ---- attachment ------------------------------------------------------------------------

    def _attach(self, hello_timeout: float = HELLO_TIMEOUT) -> None:
        """Say hello and map the arena. Nothing of a failed or interrupted attach stays
        open, and the session changes only once every part is ready."""
        check_served(self.paths)
        conn = Connection(self.paths.blob_dir, at_exit=False)  # the session's finalizer shuts it
        view = heartbeat = None
        attached = False
        # The session's one request engine on this socket, hello included. Until the session
        # is attached, the daemon counts as alive while it holds the directory's lock.
        requester = Requester(conn, self.paths.blob_dir, self._requester_alive, self.counters)
        try:
            hello = requester.hello(self._hello_body(conn.client_id), timeout=hello_timeout)
            if hello["blob_dir"] != str(self.paths.blob_dir):
                raise DaemonError(f"the daemon serves {hello['blob_dir']}, not "
                                  f"{self.paths.blob_dir}")
            if hello["manifest"] != self.manifest.digest:
                raise DaemonError(f"the daemon serves another version of {self.paths.blob_dir} "
                                  "(converted again since it started?); restart it with: expertd "
                                  f"stop --blobs {self.paths.blob_dir} && expertd start --blobs "
                                  f"{self.paths.blob_dir}")
            view = ArenaView(hello["arena"], self._segment_tables)
            if view.epoch != hello["epoch"]:
                raise DaemonError("the daemon's arena changed during attach; try again")
            interval = hello["heartbeat_interval"]
            # The daemon forgets a client silent for client_timeout; the client gives the daemon
            # as long (and at least three heartbeats) before calling it stuck. The thread holds
            # the session weakly, so that dropping the model drops the session. Its first look
            # at the daemon's liveness comes an interval later, once the session below is set.
            heartbeat = Heartbeat(str(self.paths.socket), conn.client_id, hello["token"], interval,
                                  max(hello["client_timeout"], 3 * interval),
                                  weak_method(self, "_daemon_alive", False),
                                  weak_method(self, "_reap", False),
                                  weak_method(self, "_heartbeat_report", {}))
            requester.heartbeat = heartbeat
            with HeldInterrupts():  # attached all at once: a SIGINT comes after
                self._links.conn, self._links.heartbeat = conn, heartbeat
                self.conn, self.view, self.hello = conn, view, hello
                self.daemon_pid, self.epoch = hello["pid"], hello["epoch"]
                self.requester, self._heartbeat = requester, heartbeat
                # Fixed at the first attach: the read buffers are sized for it. A daemon
                # restarted with a smaller cache is read from in chunks of what it leases at
                # once. No layer needs more rows at once than it has experts.
                if self.max_group is None:
                    self.max_group = min(hello["max_demand"], self.requested_group,
                                         self.manifest.max_experts)
                self.demand_limit = hello["max_demand"]
                self._attach_puller(view, hello.get("epoch_slot", -1))
                attached = True
        except BaseException:
            if not attached:
                if heartbeat is not None:
                    heartbeat.stop()
                if view is not None:
                    view.close()
                conn.close()
            raise

    def _attach_puller(self, view, slot: int) -> None:
        """The puller and the step's epoch record of this attach: none without a record (the
        daemon gives out EPOCH_SLOTS), the per-layer host path then."""
        if self.pull_mode == "off" or slot is None or slot < 0:
            return
        if not native.STEP_RECORDS_FENCED:  # the pure twin, on a CPU that reorders (arm64)
            return
        puller = make_puller(self.pull_mode, view, self._pull_layers)
        if puller is None:
            return
        g = view.arena.geometry
        self.step_epoch = StepEpoch(view.raw, g.epochs_offset + slot * EPOCH_DTYPE.itemsize)
        self.puller = puller

    def drop_puller(self, layer: int) -> None:
        """Stop pulling for the rest of this process: the device's pull of ``layer`` differed
        from the host copy (pull.verify_pull). Says so in one line."""
        name = self.puller.name if self.puller is not None else "device"
        notice(f"expertd: the {name} pull of layer {layer} differs from the host copy; this "
               "process copies rows on the host from now on")
        self.pull_mode = "off"
        self._close_puller()

    def _close_puller(self) -> None:
        with self._pull_lock:  # a /metrics scrape (another thread) sees the counts whole
            puller, self.puller, self.step_epoch = self.puller, None, None
            if puller is not None:
                for key in self._pulled_before:
                    self._pulled_before[key] += puller.counters[key]
        if puller is not None:
            puller.close()

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

    def count_pulled(self, layer: int, rows: int) -> None:
        """``rows`` of ``layer`` were pulled in a step (known from its statuses)."""
        if self.puller is not None:
            self.puller.count(layer, rows)

    def pull_counters(self) -> dict:
        """Rows and bytes pulled from the arena (every attach so far), and the seconds the
        timed pulls (a prompt's) took."""
        with self._pull_lock:
            now = self.puller.counters if self.puller is not None else {}
            return {k: v + now.get(k, 0) for k, v in self._pulled_before.items()}

    def announce_pools(self, pool_bytes: int) -> None:
        """Tell the daemon this client's expert memory (its pools' ``pool_bytes``), for
        status: a second hello, which keeps the client's token, leases and pins."""
        self.pool_bytes = pool_bytes
        self.check_alive()
        self._across_restarts(lambda: self.requester.hello(
            self._hello_body(self.conn.client_id), HELLO_TIMEOUT))

    def _hello_body(self, client_id: bytes) -> dict:
        return {"version": PROTOCOL_VERSION, "client": client_id, "pid": os.getpid(),
                "pool_bytes": self.pool_bytes}

    def _detach(self) -> None:
        # Detached first: should an interrupt cut what follows short, the next call still
        # attaches again (closing twice is harmless). The old mapping stays valid until nothing
        # references it: a copy ahead in flight may still read it.
        self._close_puller()
        self.conn = self.view = self._heartbeat = None
        self._links.detach(goodbye=False)
        if self.requester is not None:
            self.requester.forget()

    @property
    def copier(self):
        """The copier.Copier of the model's layers, closed with the session."""
        return self._links.copier

    def close(self) -> None:
        """Say goodbye (the daemon drops this client's leases and pins at once) and detach."""
        self.closed = True
        self._links.close()
        self._detach()

    def _reconnect(self, why: str) -> None:
        """Detach, then wait up to reconnect_timeout for a daemon to attach to (saying ``why``
        once it has to wait). A wait that fails or is interrupted leaves the session detached:
        the next call waits again."""
        blob = self.paths.blob_dir
        self._detach()
        deadline = time.monotonic() + self.reconnect_timeout
        waiting = False
        while True:
            try:
                # A daemon that holds its lock but does not answer (stopped) is asked no longer
                # than the wait has left.
                self._attach(min(HELLO_TIMEOUT, max(0.1, deadline - time.monotonic())))
                self.counters["reconnects"] += 1
                notice(f"expertd: re-attached to the daemon serving {blob} "
                       f"(pid {self.daemon_pid})")
                return
            except (DaemonNotRunning, DaemonError, OSError, ValueError) as exc:
                held = serving_epoch(self.paths) is not None  # alive, not answering
                if time.monotonic() > deadline:
                    if held:
                        raise DaemonNotRunning(
                            f"{why}, and it did not answer within {self.reconnect_timeout:g} s "
                            f"(stopped, or stuck?); restart it with: expertd restart --blobs "
                            f"{blob}") from None
                    gone = (f"expertd serving {blob} is gone and did not come back within "
                            f"{self.reconnect_timeout:g} s")
                    if isinstance(exc, DaemonNotRunning):
                        raise DaemonNotRunning(f"{gone}; start it with: expertd start --blobs "
                                               f"{blob}") from None
                    raise DaemonNotRunning(f"{gone}: {exc}") from None
                if not waiting:
                    hint = (f"expertd restart --blobs {blob} if it is stuck" if held else
                            f"expertd start --blobs {blob}")
                    notice(f"expertd: {why}; waiting up to {self.reconnect_timeout:g} s for it "
                           f"to answer again ({hint})")
                    waiting = True
                time.sleep(0.1)

    def _requester_alive(self) -> bool:
        """The daemon a request waits on lives: the attached one (see _daemon_alive), or,
        during a hello, whichever holds the directory's lock."""
        if self.view is None:
            return serving_epoch(self.paths) is not None
        return self._daemon_alive()

    def _daemon_alive(self) -> bool:
        """The daemon we said hello to still holds the directory's lock (a pid reused by
        another process, or a new daemon, does not count) and still serves."""
        view = self.view
        return serving_epoch(self.paths) == self.epoch and view is not None and view.serving

    def _heartbeat_report(self) -> dict:
        pulled = self.pull_counters()
        return {"steps": self.counters["steps"], "host_waits": self.counters["host_waits"],
                "replays": self.counters["replays"], "pulled_rows": pulled["rows_pulled"],
                "pulled_bytes": pulled["bytes_pulled"],
                **{key: self.counters[key] for key in REPLAY_COUNTERS},
                "pull_us": round(1e6 * pulled["pull_s"]),
                "pull_timed_bytes": pulled["timed_bytes"],
                **{key: self.counters[key] for key in BATCH_COUNTERS}}

    def _reap(self) -> bool:
        requester = self.requester
        return requester.reap() if requester is not None else False

    def unanswered(self) -> bool:
        """The daemon this session attached to still holds its lock but does not answer: no
        heartbeat answered for the time-to-dead, or the session detached to wait for it
        (a new daemon holding the lock is not this one: it answers the next attach)."""
        heartbeat = self._heartbeat
        if heartbeat is not None:
            return heartbeat.stuck
        return (self.conn is None and self.epoch is not None
                and serving_epoch(self.paths) == self.epoch)

    def check_alive(self) -> None:
        """Attach again now if detached (an earlier wait for the daemon failed or was
        interrupted) or if the heartbeat saw the daemon die (while every expert was in the
        pools, nothing else would notice, and this process would keep its arena mapped).
        Every use of the view, connection or requester comes after this.

        Raises:
            DaemonNotRunning: no daemon came back within reconnect_timeout.
            DaemonError: the session was closed.
        """
        if self.view is None:
            if self.closed:
                raise DaemonError("this model's expertd session is closed; load the model again")
            self._reconnect(f"expertd serving {self.paths.blob_dir} is gone")
        elif self._heartbeat is not None and self._heartbeat.lost:
            self._reconnect(f"expertd (pid {self.daemon_pid}) serving {self.paths.blob_dir} died")
        elif (self.step_epoch is not None and not self.step_epoch.inside
              and not self.step_epoch.owned()):
            # Forgotten (stopped longer than the client timeout): the epoch record is free or
            # another client's, so no step would be protected. A pulling step sends no request
            # that would tell us; say hello again before the next one.
            self._reconnect(f"expertd (pid {self.daemon_pid}) forgot this client")

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

    def _across_restarts(self, call):
        """``call()``, run again on a new attachment after each daemon death (see
        :meth:`_reconnect`, which raises when none comes back in time), until it returns."""
        while True:
            try:
                return call()
            except DaemonDied as exc:
                self._reconnect(str(exc))

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
                while True:
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
        self.check_alive()
        log.debug("layer %d: %d experts absent from the arena, demanded", layer, len(experts))

        def demand() -> None:
            requester = self.requester
            with requester.lock, HeldInterrupts() as held:
                try:
                    for start in range(0, len(experts), self.demand_limit):
                        requester.demand(layer, experts[start:start + self.demand_limit], held)
                        requester.release_all()
                finally:
                    requester.release_all()

        self._across_restarts(demand)

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

    # ---- requests ---------------------------------------------------------------------------

    def request(self, op: Op, body: dict) -> dict:
        """A request that survives a daemon restart: re-attaches and retries once it is back."""
        self.check_alive()
        return self._across_restarts(lambda: self.requester.ask(op, body))

    @property
    def _leases(self) -> set:
        return self.requester.leases

    # ---- reports ---------------------------------------------------------------------------

    def stats(self) -> dict:
        return self.request(Op.STATS, {})
