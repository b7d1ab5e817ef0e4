"""The per-layer hot path of a client session: remap, drain, demand, copy, and the staged guess.

``fetch(layer, experts, dest)`` is a lock-free remap through the shared slot table, one demand for
whatever is missing, a drain of rows other clients are filling and a copy of each segment into
``dest`` (GIL released, seqlock-checked). ``prestage`` starts the background copy of the next
layer's guessed rows; ``fetch`` keeps those of them the router chose and that still validate.
:class:`~expertd.client.session.Session` supplies the attachment and the requests.
"""

import functools
import time
from dataclasses import dataclass

import numpy as np

from expertd import native
from expertd.client.interrupts import HeldInterrupts
from expertd.errors import DaemonError
from expertd.protocol import Op

# How long a fetch waits for rows someone else is filling before it demands them itself. The
# demand merges onto the same fill, and moves a prefetch's low-priority read to the front.
DRAIN_TIMEOUT = 0.05
# Below this many bytes, a layer's guessed rows are cheaper to copy on the critical path than to
# hand to the copier thread: handing a job over and waiting for it cost about 50 µs here
# (bench/RESULTS.md, overlap notes), the time memcpy takes for about 250 KB at this machine's
# 5 GB/s. Qwen3-30B-A3B's guessed rows are 2.5 MB each.
COPY_AHEAD_MIN_BYTES = 512 * 1024


class DaemonDied(DaemonError):
    """The daemon this client was attached to is gone."""


@dataclass
class Prestage:
    """Rows of a guessed expert set being copied ahead of their layer (see :meth:`Session.prestage`)."""

    layer: int
    epoch: int
    guessed: np.ndarray  # every expert guessed, best first (the read-ahead)
    n_core: int  # the first n_core of them are the core, the next layer's likely top-k
    experts: np.ndarray  # those of the core resident when guessed, copied to positions 0, 1, ...
    slots: np.ndarray
    versions: np.ndarray
    job: object = None  # the copier's CopyJob
    where: dict = None  # expert -> its position, for the staged experts


class RowReader:
    """The hot path, mixed into the session (which attaches, requests and reconnects)."""

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

    def _remap(self, layer: int, experts: np.ndarray) -> tuple:
        """Lock-free lookup of ``experts`` in the shared slot table: ``(missing, slots,
        versions, filling)`` as :func:`expertd.native.remap` fills them."""
        n = len(experts)
        slots = np.empty(n, np.int32)
        versions = np.empty(n, np.uint64)
        filling = np.empty(n, np.int32)
        missing = native.remap(self.raw, self._slot_of_offset, self._slots_offset,
                               self._n_experts, layer, experts, slots, versions, filling)
        return missing, slots, versions, filling

    def _fetch_chunk(self, layer, experts, positions, dest, bases, offsets, nbytes) -> None:
        n = len(experts)
        raw = self.raw
        timing = self.timing
        missing, slots, versions, filling = self._remap(layer, experts)
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

    def prestage(self, layer: int, guessed: np.ndarray, n_core: int, dest: np.ndarray,
                 copier) -> Prestage:
        """Start copying the resident rows of the guess's core (``guessed[:n_core]``) into
        ``dest`` on ``copier``'s thread, and ask the daemon to read the absent experts of the
        whole guess (distinct, best first) into its side rows."""
        _, slots, versions, filling = self._remap(layer, guessed)
        ready = slots >= 0
        absent = int((~ready & (filling < 0)).sum())
        ready[n_core:] = False
        if absent and self._socket_lock.acquire(blocking=False):
            # All of the guess, not only what is absent: a resident guess may sit in a side row,
            # and naming it claims that row for this generation, so the daemon does not reuse
            # it for the absent ones while the copier reads it.
            try:  # fire and forget; skipped if the heartbeat thread has the socket right now
                self._send_quietly(Op.PREFETCH, {"layer": layer, "experts": guessed.tolist(),
                                                 "core": n_core})
                self.counters["prefetch_asked"] += absent
            finally:
                self._socket_lock.release()
        staged = Prestage(layer, self.epoch, guessed, n_core, guessed[ready], slots[ready],
                          versions[ready])
        # Rows are copied ahead only when they fit the staging buffer as one group, and when
        # the copy is worth a thread hand-off (see COPY_AHEAD_MIN_BYTES).
        fits = (len(staged.experts) <= self.max_group and len(staged.experts)
                * self.manifest.layers[layer].expert_bytes >= self.copy_ahead_bytes)
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
            if not native.validate(self.raw, self._slots_offset, slots, versions):
                # Some row changed since the copier read it: keep the others.
                self.counters["retries"] += 1
                good = [j for j in range(len(at))
                        if native.validate(self.raw, self._slots_offset, slots[j:j + 1],
                                           versions[j:j + 1])]
                keep, at = [keep[j] for j in good], [at[j] for j in good]
                slots = slots[good]
            if keep:
                native.bump_hits(self.raw, self._slots_offset, slots)
                self.counters["staged_used"] += len(at)
        self.counters["staged_unused"] += len(staged.where) - len(keep)  # copied, not used
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
        self.counters["misses"] += reply.get("misses", 0)
        self.counters["prefetch_saved"] += reply.get("saved", 0)

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

