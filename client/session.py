"""A client's attachment to the daemon: socket, mapped arena, heartbeat, reconnection.

``fetch(layer, experts, dest)`` is the per-layer hot path: a lock-free remap through the shared
slot table, one demand for whatever is missing, a drain of rows other clients are filling, a copy
of each segment into ``dest`` (GIL released, seqlock-checked); ``switch.py`` views it as MLX arrays.

No lease outlives its use, whatever interrupts the client: every lease the daemon grants is
recorded the moment its reply is read (with SIGINT held back for those few steps) and released
in a ``finally``; a demand whose waiter was interrupted keeps its request id, and its late reply
is released by whichever thread reads it next (the heartbeat thread when the client is idle).
"""

import functools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import zmq

from expertd import native
from expertd.client.heartbeat import Heartbeat
from expertd.client.interrupts import HeldInterrupts
from expertd.connection import Connection
from expertd.errors import DaemonError, DaemonNotRunning, ProtocolError
from expertd.manifest import Manifest
from expertd.paths import daemon_paths
from expertd.protocol import PROTOCOL_VERSION, ErrorCode, Op, parse_reply, request
from expertd.runfile import serving_epoch
from expertd.shm.layout import Arena

log = logging.getLogger("expertd.client")

DRAIN_TIMEOUT = 5.0
POLL_SLICE = 0.05  # how often a wait looks at the daemon's liveness and a held-back SIGINT
REQUEST_TIMEOUT = 300.0  # a daemon that heartbeats but never answers one request
GOODBYE_LINGER_MS = 200  # how long close() lets the goodbye reach the daemon


@dataclass
class Prestage:
    """Rows of a guessed expert set being copied ahead of their layer (see :meth:`Session.prestage`)."""

    layer: int
    epoch: int
    guessed: np.ndarray  # every expert guessed (sorted)
    experts: np.ndarray  # those resident when guessed, copied to positions 0, 1, ...
    slots: np.ndarray
    versions: np.ndarray
    job: object = None  # the copier's CopyJob
    where: dict = None  # expert -> its position, for the staged experts


class DaemonDied(DaemonError):
    """The daemon this client was attached to is gone."""


class Session:
    """One client's connection to the expertd serving ``blob_dir``.

    Args:
        blob_dir: the blob directory; the daemon is found from it.
        reconnect_timeout: how long to wait for a restarted daemon after the old one died.
        max_group: most experts fetched at once (bounds the client's own expert memory).
    Raises:
        DaemonNotRunning: no daemon serves the directory (the message says how to start one).
        DaemonError: the daemon serves another blob directory or speaks another protocol.
    """

    def __init__(self, blob_dir, reconnect_timeout: float = 60.0, max_group: int | None = None):
        self.paths = daemon_paths(blob_dir)
        self.manifest = Manifest.load(self.paths.blob_dir)
        self.reconnect_timeout = reconnect_timeout
        self.requested_group = max_group or max(64, 4 * self.manifest.top_k)
        self.counters = dict(fast_hits=0, demanded=0, drained=0, retries=0, reconnects=0,
                             late_leases=0, prefetch_asked=0, staged_used=0, staged_unused=0)
        # Where the main thread's time goes after each router sync (see switch.py).
        self.timing = dict(sync_s=0.0, exposed_s=0.0, copy_s=0.0, fill_wait_s=0.0,
                           copier_wait_s=0.0, layers=0)
        self.guessers: list = []  # predict.Guesser per MoE layer (set by the loader)
        self.copier = None  # copier.Copier (set by the loader)
        self.timeline = None  # a list to record (layer, t0, t_sync, t_fetched, t_done) per call
        self.conn = self.arena = self._heartbeat = None
        self.max_group = None
        self._bases: dict = {}
        self._segment_tables = [
            (np.array([seg.offset for seg in layer.segments], dtype=np.intp),
             np.array([seg.nbytes for seg in layer.segments], dtype=np.intp))
            for layer in self.manifest.layers]
        # The socket is used by the calling thread, and by the heartbeat thread only while no
        # request is in progress (to release late leases); the lock hands it over between them.
        self._socket_lock = threading.RLock()
        self._demands: set = set()  # ids of demands sent whose reply has not been read
        self._leases: set = set()  # leases granted and not yet released
        self._next_rid = 0
        self._attach()

    # ---- attachment ------------------------------------------------------------------------

    def _attach(self) -> None:
        self._check_not_dead()
        conn = Connection(self.paths.blob_dir)
        try:
            hello = conn.request(Op.HELLO, {"version": PROTOCOL_VERSION, "client": conn.client_id,
                                            "pid": os.getpid()}, timeout=10.0)
        except DaemonError:
            conn.close()
            raise
        if hello["blob_dir"] != str(self.paths.blob_dir):
            conn.close()
            raise DaemonError(f"the daemon serves {hello['blob_dir']}, not {self.paths.blob_dir}")
        if hello["manifest"] != self.manifest.digest:
            conn.close()
            raise DaemonError(f"the daemon serves another version of {self.paths.blob_dir} "
                              "(converted again since it started?); restart it with: expertd stop "
                              f"--blobs {self.paths.blob_dir} && expertd start --blobs "
                              f"{self.paths.blob_dir}")
        arena = Arena.attach(hello["arena"])
        if arena.epoch != hello["epoch"]:
            arena.close()
            conn.close()
            raise DaemonError("the daemon's arena changed during attach; try again")
        self.conn, self.arena, self.hello = conn, arena, hello
        self.daemon_pid, self.epoch = hello["pid"], hello["epoch"]
        self.raw = arena.raw
        g = arena.geometry
        self._slot_of_offset, self._slots_offset = g.slot_of_offset, g.slots_offset
        self._rows_offset, self._stride, self._n_experts = g.rows_offset, g.stride, g.n_experts
        # Fixed at the first attach: the staging buffers are sized for it. A daemon restarted
        # with a smaller cache is served in chunks of what it leases at once.
        if self.max_group is None:
            # No layer needs more rows at once than it has experts.
            self.max_group = min(hello["max_demand"], self.requested_group,
                                 self.manifest.max_experts)
        self.demand_limit = hello["max_demand"]
        interval = hello["heartbeat_interval"]
        # The daemon forgets a client silent for client_timeout; the client gives the daemon as
        # long (and at least three heartbeats) before calling it stuck.
        self._heartbeat = Heartbeat(self.paths.endpoint, conn.client_id, hello["token"], interval,
                                    max(hello["client_timeout"], 3 * interval),
                                    self._daemon_alive, self._reap)

    def _check_not_dead(self) -> None:
        """A daemon killed with SIGKILL leaves its socket and run files: do not wait on them."""
        if serving_epoch(self.paths) is None:
            blob = self.paths.blob_dir
            raise DaemonNotRunning(f"no expertd serves {blob} (its lock is free): start one "
                                   f"with: expertd start --blobs {blob}")

    def _detach(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.conn is not None:
            self.conn.close()
        # Leases and demands belong to the daemon they were made with.
        self._demands.clear()
        self._leases.clear()
        # The old mapping stays valid until nothing references it; numpy views may outlive us.
        self.conn = self.arena = self._heartbeat = None

    def close(self) -> None:
        """Say goodbye (the daemon drops this client's leases and pins at once) and detach."""
        if self.copier is not None:
            self.copier.close()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.conn is not None:
            self._send_quietly(Op.GOODBYE, {})
            self.conn.sock.close(linger=GOODBYE_LINGER_MS)  # bounded: the daemon may be gone
        self._detach()

    def _reconnect(self, why: str) -> None:
        blob = self.paths.blob_dir
        print(f"expertd: {why}; waiting up to {self.reconnect_timeout:g} s for it to come back "
              f"(expertd start --blobs {blob})", file=sys.stderr, flush=True)
        self._detach()
        deadline = time.monotonic() + self.reconnect_timeout
        while True:
            try:
                self._attach()
                self.counters["reconnects"] += 1
                print(f"expertd: re-attached to the daemon serving {blob} (pid {self.daemon_pid})",
                      file=sys.stderr, flush=True)
                return
            except (DaemonNotRunning, DaemonError, OSError, ValueError) as exc:
                if time.monotonic() > deadline:
                    raise DaemonNotRunning(f"expertd serving {blob} is gone and did not come back "
                                           f"within {self.reconnect_timeout:g} s ({exc}); start "
                                           f"it with: expertd start --blobs {blob}") from None
                time.sleep(0.1)

    def _daemon_alive(self) -> bool:
        """The daemon we said hello to still holds the directory's lock (a pid reused by
        another process, or a new daemon, does not count) and still serves."""
        return serving_epoch(self.paths) == self.epoch and bool(self.arena.header["serving"][0])

    # ---- requests --------------------------------------------------------------------------

    def request(self, op: Op, body: dict) -> dict:
        """A request that survives a daemon restart: re-attaches and retries once it is back."""
        while True:
            try:
                return self._ask(op, body)
            except DaemonDied as exc:
                self._reconnect(str(exc))

    def _ask(self, op: Op, body: dict, held: HeldInterrupts | None = None) -> dict:
        """One request to the daemon attached now; DaemonDied if it is gone.

        SIGINT is held back (by ``held``, or here) except while waiting, where one that came is
        delivered every POLL_SLICE. A demand's lease is in ``self._leases`` when this returns.
        """
        if held is None:
            with HeldInterrupts() as held:
                return self._ask(op, body, held)
        with self._socket_lock:
            rid = self._new_rid()
            if op is Op.DEMAND:
                self._demands.add(rid)  # before the send: its reply is never unaccounted for
            self.conn.sock.send_multipart(request(rid, op, body))
            try:
                return self._wait(rid, held)
            except BaseException:
                if self._demands:
                    self._heartbeat.wake()  # to release the late lease as soon as it comes
                raise

    def _new_rid(self) -> bytes:
        self._next_rid += 1
        return b"s" + self._next_rid.to_bytes(8, "little")

    def _send_quietly(self, op: Op, body: dict) -> None:
        """Fire and forget (release, goodbye); never blocks on a daemon that is gone."""
        try:
            self.conn.sock.send_multipart(request(self._new_rid(), op, body), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the daemon is gone or flooded; its leases die with it or with our heartbeat

    def _release_leases(self) -> None:
        with self._socket_lock:
            while self._leases:
                lease = next(iter(self._leases))
                # Sent before it is forgotten: an interrupt in between means one more release
                # (which the daemon ignores), never one less.
                self._send_quietly(Op.RELEASE, {"lease": lease})
                self._leases.discard(lease)

    def _read_reply(self, rid: bytes | None):
        """Read one waiting reply; the body if it answers ``rid``, else None.

        Replies to interrupted demands have their lease released here. Call with the socket
        lock held and, in the main thread, SIGINT held back.
        """
        got, _, body = parse_reply(self.conn.sock.recv_multipart(zmq.NOBLOCK))
        if got in self._demands:
            self._demands.discard(got)
            if body.get("ok") and "lease" in body:
                if got == rid:
                    self._leases.add(body["lease"])
                else:
                    self.counters["late_leases"] += 1
                    self._send_quietly(Op.RELEASE, {"lease": body["lease"]})
        return body if got == rid else None

    def _reap(self) -> bool:
        """Heartbeat thread: while no request or fetch runs, release the leases of late replies
        to interrupted demands (and any lease an interrupted release left behind).

        Returns True while something is left to release.
        """
        if not (self._demands or self._leases) or not self._socket_lock.acquire(blocking=False):
            return bool(self._demands or self._leases)
        try:
            while self.conn.sock.poll(0):
                self._read_reply(None)
            self._release_leases()
            return bool(self._demands)
        except (zmq.ZMQError, ProtocolError):
            return False
        finally:
            self._socket_lock.release()

    def _wait(self, rid: bytes, held: HeldInterrupts) -> dict:
        deadline = time.monotonic() + REQUEST_TIMEOUT
        sock = self.conn.sock
        while True:
            if held.pending:
                held.deliver()  # KeyboardInterrupt: the demand, if any, stays recorded
            if sock.poll(int(POLL_SLICE * 1000)):
                while sock.poll(0):
                    body = self._read_reply(rid)
                    if body is not None:
                        return self._checked(body)
                continue
            if not self._daemon_alive():
                raise DaemonDied(f"expertd (pid {self.daemon_pid}) serving "
                                 f"{self.paths.blob_dir} died")
            if self._heartbeat.stuck:
                raise DaemonError(f"expertd (pid {self.daemon_pid}) serving "
                                  f"{self.paths.blob_dir} has answered no heartbeat for "
                                  f"{self._heartbeat.time_to_dead:g} s; restart it with: "
                                  f"expertd restart --blobs {self.paths.blob_dir}")
            if time.monotonic() > deadline:
                raise DaemonError(f"expertd (pid {self.daemon_pid}) is alive but has not "
                                  f"answered for {REQUEST_TIMEOUT:g} s")

    def _checked(self, body: dict) -> dict:
        if body.get("ok"):
            return body
        code = body.get("code")
        if code == ErrorCode.SHUTTING_DOWN:
            raise DaemonDied(f"expertd (pid {self.daemon_pid}) is shutting down")
        if code == ErrorCode.NOT_HELLO:
            # A daemon restarted before we noticed got this request on the old socket path
            # (or ours timed out our heartbeat): attach again.
            raise DaemonDied(f"expertd serving {self.paths.blob_dir} no longer knows this "
                             "client (restarted?)")
        raise DaemonError(str(body.get("error", "unknown error")), code)

    # ---- the hot path ----------------------------------------------------------------------

    def fetch(self, layer: int, experts: np.ndarray, dest: np.ndarray,
              staged: Prestage | None = None) -> np.ndarray:
        """Copy the rows of ``experts`` (distinct int32) of ``layer`` into ``dest``.

        ``dest`` is a uint8 array of at least :meth:`staging_bytes` bytes. Segment ``s`` of the
        expert at position ``p`` lands at ``bases(layer)[s] + p * nbytes[s]``. Rows ``staged``
        copied already (the background copier's guess for this layer) are kept where they are
        if the router chose them and they still validate; the others are copied into the
        positions left free.

        Returns:
            The position of each expert in ``dest`` (int32, one per expert).
        """
        offsets, nbytes = self._segment_tables[layer]
        bases = self.bases(layer)
        if self._heartbeat.lost:
            # The daemon died while every expert was a hit: leave its arena now, or this process
            # would keep a dead daemon's whole cache mapped.
            self._reconnect(f"expertd (pid {self.daemon_pid}) serving {self.paths.blob_dir} died")
        if staged is None:
            positions, todo = np.arange(len(experts), dtype=np.int32), None
        else:
            positions, todo = self._claim(staged, experts)
            if todo is not None and not len(todo):
                return positions
        rest, at = (experts, positions) if todo is None else (experts[todo], positions[todo])
        while True:
            try:
                # A daemon restarted with a smaller cache may lease fewer rows at once.
                limit = self.demand_limit
                for start in range(0, len(rest), limit):
                    self._fetch_chunk(layer, rest[start:start + limit], at[start:start + limit],
                                      dest, bases, offsets, nbytes)
                return positions
            except DaemonDied as exc:
                self._reconnect(str(exc))

    def bases(self, layer: int) -> np.ndarray:
        """Where each segment of ``layer`` starts in a destination: room for ``max_group``
        experts each, 64-byte aligned."""
        bases = self._bases.get(layer)
        if bases is None:
            sizes = (self.max_group * self._segment_tables[layer][1] + 63) // 64 * 64
            bases = np.zeros_like(sizes)
            np.cumsum(sizes[:-1], out=bases[1:])
            self._bases[layer] = bases
        return bases

    def _fetch_chunk(self, layer, experts, positions, dest, bases, offsets, nbytes) -> None:
        n = len(experts)
        slots = np.empty(n, np.int32)
        versions = np.empty(n, np.uint64)
        filling = np.empty(n, np.int32)
        raw = self.raw
        timing = self.timing
        missing = native.remap(raw, self._slot_of_offset, self._slots_offset, self._n_experts,
                               layer, experts, slots, versions, filling)
        if missing and (filling >= 0).any():
            started = time.perf_counter()
            self._drain(layer, experts, slots, versions, filling)
            timing["fill_wait_s"] += time.perf_counter() - started
        if not (slots < 0).any():
            started = time.perf_counter()
            native.copy_segments(raw, self._rows_offset, self._stride, slots, offsets, nbytes,
                                 bases, dest, positions)
            timing["copy_s"] += time.perf_counter() - started
            if native.validate(raw, self._slots_offset, slots, versions):
                # Rows found without the daemon are counted through the table for its LFU.
                native.bump_hits(raw, self._slots_offset, slots)
                self.counters["fast_hits"] += n
                return
            # A row was evicted and refilled while we copied it: lease the group instead.
            self.counters["retries"] += 1
        # The lock keeps the heartbeat thread off leases in use. SIGINT is held back until the
        # leases are released (a copy takes a millisecond or so), except while the demand waits.
        with self._socket_lock, HeldInterrupts() as held:
            try:
                while True:
                    started = time.perf_counter()
                    self._demand(layer, experts, slots, versions, held)
                    copying = time.perf_counter()
                    native.copy_segments(raw, self._rows_offset, self._stride, slots, offsets,
                                         nbytes, bases, dest, positions)
                    timing["fill_wait_s"] += copying - started
                    timing["copy_s"] += time.perf_counter() - copying
                    if native.validate(raw, self._slots_offset, slots, versions):
                        return
                    # Our lease lapsed (held past the daemon's bound): lease them again.
                    self.counters["retries"] += 1
                    self._release_leases()
            finally:
                # Whatever happened (KeyboardInterrupt while waiting included), nothing stays
                # leased. A second SIGINT is held back too; should one fall just before, the
                # heartbeat thread releases what is left.
                if self._leases:
                    try:
                        with HeldInterrupts():
                            self._release_leases()
                    finally:
                        if self._leases:
                            self._heartbeat.wake()

    # ---- the guessed rows of the next layer ------------------------------------------------

    def prestage(self, layer: int, guessed: np.ndarray, dest: np.ndarray, copier) -> Prestage:
        """Start copying the resident rows of ``guessed`` (distinct, sorted) into ``dest`` on
        ``copier``'s thread, and ask the daemon to prefetch the others into its side rows."""
        n = len(guessed)
        slots = np.empty(n, np.int32)
        versions = np.empty(n, np.uint64)
        filling = np.empty(n, np.int32)
        native.remap(self.raw, self._slot_of_offset, self._slots_offset, self._n_experts, layer,
                     guessed, slots, versions, filling)
        ready = slots >= 0
        absent = guessed[~ready & (filling < 0)]
        if len(absent) and self._socket_lock.acquire(blocking=False):
            try:  # fire and forget; skipped if the heartbeat thread has the socket right now
                self._send_quietly(Op.PREFETCH, {"layer": layer, "experts": absent.tolist()})
                self.counters["prefetch_asked"] += len(absent)
            finally:
                self._socket_lock.release()
        staged = Prestage(layer, self.epoch, guessed, guessed[ready], slots[ready],
                          versions[ready])
        # Rows are copied only when they fit the staging buffer as one group.
        fits = len(staged.experts) <= self.max_group
        staged.where = {e: p for p, e in enumerate(staged.experts.tolist())} if fits else {}
        if staged.where:
            offsets, nbytes = self._segment_tables[layer]
            staged.job = copier.submit(functools.partial(
                native.copy_segments, self.raw, self._rows_offset, self._stride, staged.slots,
                offsets, nbytes, self.bases(layer), dest,
                np.arange(len(staged.experts), dtype=np.int32)))
        return staged

    def _claim(self, staged: Prestage, experts: np.ndarray) -> tuple:
        """Keep the staged rows the router chose and that still validate.

        Returns:
            ``(positions, todo)``: every expert's position in the destination, and the indices
            of the experts still to be fetched (they get the positions no kept row uses).
        """
        # Decode routes a handful of experts: plain Python beats numpy's per-call overhead.
        wanted = experts.tolist()
        keep, at = [], []
        if staged.job is not None:
            started = time.perf_counter()
            copied = staged.job.wait()
            self.timing["copier_wait_s"] += time.perf_counter() - started
            if copied and staged.epoch == self.epoch:
                where = staged.where
                for i, e in enumerate(wanted):
                    p = where.get(e)
                    if p is not None:
                        keep.append(i)
                        at.append(p)
        if keep:
            slots, versions = staged.slots[at], staged.versions[at]
            # Copied before this check: an unchanged even version means the bytes were never
            # rewritten while (or since) the copier read them.
            if native.validate(self.raw, self._slots_offset, slots, versions):
                native.bump_hits(self.raw, self._slots_offset, slots)
                self.counters["staged_used"] += len(at)
            else:
                keep, at = [], []
                self.counters["retries"] += 1
        self.counters["staged_unused"] += len(staged.experts) - len(keep)
        if not keep:
            return np.arange(len(wanted), dtype=np.int32), None
        positions = [-1] * len(wanted)
        for i, p in zip(keep, at):
            positions[i] = p
        taken = set(at)
        free = (p for p in range(self.max_group) if p not in taken)
        todo = [i for i, p in enumerate(positions) if p < 0]
        for i in todo:
            positions[i] = next(free)
        return np.array(positions, dtype=np.int32), np.array(todo, dtype=np.intp)

    def _demand(self, layer, experts, slots, versions, held: HeldInterrupts) -> None:
        """One round trip for the whole group: the daemon leases what is resident (so filling
        the rest cannot evict it under us) and fills the rest in parallel. The lease is in
        ``self._leases`` on return."""
        # Not self.request: rows named by a restarted daemon belong to its new arena, so a
        # restart must unwind to fetch(), which starts over on the new arena.
        reply = self._ask(Op.DEMAND, {"layer": layer, "experts": experts.tolist()}, held)
        slots[:] = reply["rows"]
        versions[:] = reply["versions"]
        self.counters["demanded"] += len(experts)

    def _drain(self, layer, experts, slots, versions, filling) -> None:
        idx = np.flatnonzero(filling >= 0)
        out_slots = np.empty(len(idx), np.int32)
        out_versions = np.empty(len(idx), np.uint64)
        native.drain(self.raw, self._slots_offset, layer, np.ascontiguousarray(experts[idx]),
                     np.ascontiguousarray(filling[idx]), out_slots, out_versions, DRAIN_TIMEOUT)
        ok = out_slots >= 0
        slots[idx[ok]] = out_slots[ok]
        versions[idx[ok]] = out_versions[ok]
        self.counters["drained"] += int(ok.sum())

    def staging_bytes(self) -> int:
        """Bytes a destination needs for ``max_group`` experts of any layer."""
        return max(self.max_group * layer.expert_bytes + 64 * len(layer.segments)
                   for layer in self.manifest.layers)

    def prediction(self) -> list:
        """Per MoE layer, how the guesses made for it went (None for a layer nobody guesses)."""
        return [None] + [g.guesses.summary() if g is not None else None
                         for g in self.guessers[:-1]]

    def stats(self) -> dict:
        return self.request(Op.STATS, {})
