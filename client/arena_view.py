"""A client's read-only view of the daemon's arena: remap, drain and seqlock-checked copies.

Nothing here talks to the daemon: the slot table is read lock-free (acquire/release atomics in
the native extension), rows being filled are waited for, and every copy is checked against the
row versions read before it, so a row evicted and refilled meanwhile is never taken for the
expert it held (invariant 2). A device that reads rows without those checks (pull.py) reads
them inside a step's epoch, published in this client's record of the arena's epoch table
(:class:`StepEpoch`).
"""

from dataclasses import dataclass

import numpy as np

from expertd import native
from expertd.shm.layout import EPOCH_DTYPE, Arena

U64 = 2**64 - 1


@dataclass(frozen=True)
class Lookup:
    """Where ``experts`` of one layer are in the arena, as :func:`expertd.native.remap` says.

    ``slots`` is -1 for an expert with no ready row; ``filling`` the row being filled with it,
    or -1. ``versions`` are the seqlock versions the copy is checked against.
    """

    missing: int
    slots: np.ndarray
    versions: np.ndarray
    filling: np.ndarray


class ArenaView:
    """The mapping of one daemon's arena (``name`` from its hello), for reading rows.

    Args:
        name: the shared-memory name the daemon's hello gave.
        segment_tables: per layer, ``(offsets, nbytes)`` of its segments within a row.
    """

    def __init__(self, name: str, segment_tables: list):
        self.arena = Arena.attach(name)
        self.raw = self.arena.raw
        g = self.arena.geometry
        self.epoch = self.arena.epoch
        self._slot_of, self._slots = g.slot_of_offset, g.slots_offset
        self._rows, self._stride, self._n_experts = g.rows_offset, g.stride, g.n_experts
        self._n_rows = g.total_rows
        self._segments = segment_tables

    @property
    def serving(self) -> bool:
        return bool(self.arena.header["serving"][0])

    def lookup(self, layer: int, experts: np.ndarray) -> Lookup:
        """Lock-free lookup of ``experts`` (distinct int32) of ``layer`` in the slot table."""
        n = len(experts)
        slots = np.empty(n, np.int32)
        versions = np.empty(n, np.uint64)
        filling = np.empty(n, np.int32)
        missing = native.remap(self.raw, self._slot_of, self._slots, self._n_experts,
                               self._n_rows, layer, experts, slots, versions, filling)
        return Lookup(missing, slots, versions, filling)

    def drain(self, layer: int, experts: np.ndarray, found: Lookup, timeout: float) -> int:
        """Wait up to ``timeout`` s for the rows others are filling with ``experts``; those that
        became ready are written into ``found``. Returns how many did."""
        idx = np.flatnonzero(found.filling >= 0)
        slots = np.empty(len(idx), np.int32)
        versions = np.empty(len(idx), np.uint64)
        native.drain(self.raw, self._slots, layer, np.ascontiguousarray(experts[idx]),
                     np.ascontiguousarray(found.filling[idx]), slots, versions, timeout)
        ok = slots >= 0
        found.slots[idx[ok]] = slots[ok]
        found.versions[idx[ok]] = versions[ok]
        return int(ok.sum())

    def copy(self, layer: int, slots: np.ndarray, dest: np.ndarray, bases: np.ndarray,
             positions: np.ndarray) -> None:
        """Copy each segment of rows ``slots`` of ``layer`` to ``dest`` (GIL released): segment
        ``s`` of the row for position ``p`` lands at ``bases[s] + p * nbytes[s]``."""
        offsets, nbytes = self._segments[layer]
        native.copy_segments(self.raw, self._rows, self._stride, slots, offsets, nbytes, bases,
                             dest, positions)

    def rows(self, layer: int, slots: np.ndarray, versions: np.ndarray) -> "ArenaRows":
        """Rows ``slots`` of ``layer`` as a lookup or a lease found them (at ``versions``)."""
        return ArenaRows(self, layer, slots, versions)

    def segment_table(self, layer: int) -> tuple:
        """``(offsets, nbytes)`` of ``layer``'s segments within a row."""
        return self._segments[layer]

    def _unchanged(self, slots: np.ndarray, versions: np.ndarray) -> bool:
        return native.validate(self.raw, self._slots, slots, versions)

    def _count_hits(self, slots: np.ndarray) -> None:
        native.bump_hits(self.raw, self._slots, slots)

    def close(self) -> None:
        self.arena.close()


@dataclass(frozen=True)
class ArenaRows:
    """Rows of one layer of the arena, as a lookup or a lease found them: the one route by
    which the client copies arena rows on the host (demands, rows written ahead, the host
    puller), with one rule for taking a copy (:meth:`unchanged`; :meth:`intact` row by row)
    and one count of the rows used without asking the daemon (:meth:`count_hits`). It holds
    the view it reads, so the mapping outlives a reconnect while a copy of it is in flight."""

    view: ArenaView
    layer: int
    slots: np.ndarray
    versions: np.ndarray

    def copy(self, dest: np.ndarray, bases: np.ndarray, positions: np.ndarray) -> None:
        """Copy each row's segments into ``dest`` (GIL released; see ArenaView.copy)."""
        self.view.copy(self.layer, self.slots, dest, bases, positions)

    def unchanged(self) -> bool:
        """No row changed since its version was read (the seqlock check, the whole group at
        once): a copy of them all is taken only where this holds (invariant 2)."""
        return self.view._unchanged(self.slots, self.versions)

    def intact(self) -> np.ndarray:
        """Per row, True if it did not change since its version was read (:meth:`unchanged`,
        row by row only when the whole group's check fails): a copy of a row is taken only
        where this holds."""
        if self.unchanged():
            return np.ones(len(self.slots), dtype=bool)
        view, slots, versions = self.view, self.slots, self.versions
        return np.array([view._unchanged(slots[i:i + 1], versions[i:i + 1])
                         for i in range(len(slots))], dtype=bool)

    def count_hits(self, keep: np.ndarray | None = None) -> int:
        """Count the rows (those at ``keep``, default all) as used without asking the daemon:
        through the slot table, for its LFU. Returns how many."""
        slots = self.slots if keep is None else self.slots[keep]
        if len(slots):
            self.view._count_hits(slots)
        return len(slots)


class StepEpoch:
    """This client's record in the arena's epoch table: the step it is in.

    Args:
        raw: the arena mapping (uint8 array).
        offset: where the record starts (``epochs_offset + slot * EPOCH_DTYPE.itemsize``).
    """

    def __init__(self, raw: np.ndarray, offset: int):
        self._raw, self._step_at = raw, offset + EPOCH_DTYPE.fields["step"][1]
        self._lost_at = offset + EPOCH_DTYPE.fields["lost"][1]
        self._pid_at = offset + EPOCH_DTYPE.fields["pid"][1]
        # What the record holds while it is ours: the pid the daemon wrote when it gave it
        # out (before the hello's reply) and the last step published in it.
        self._pid = native.read_u64(raw, self._pid_at)
        self._published = self.step = native.read_u64(raw, self._step_at)
        if self.step & 1:  # a record given out mid-step (never by a daemon that zeroes it)
            self.step = (self.step + 1) & U64
        self.disowned = False  # the record stopped being ours (see :meth:`owned`)

    @property
    def inside(self) -> bool:
        return bool(self.step & 1)

    def owned(self) -> bool:
        """The record is still this client's. A client forgotten by the daemon (stopped longer
        than the client timeout) finds its record zeroed or given to another client: the daemon
        protects none of its reads, and it must not write the record any more."""
        return (not self.disowned and native.read_u64(self._raw, self._pid_at) == self._pid != 0
                and native.read_u64(self._raw, self._step_at) == self._published)

    def _publish(self, step: int) -> None:
        native.publish_u64(self._raw, self._step_at, step)
        self._published = step

    def begin(self) -> None:
        """Enter a step: published (and fenced) before any read of the slot table. A record
        that is no longer ours is left alone; the step's end then says it was lost."""
        if not self.step & 1:
            self.step = (self.step + 1) & U64  # a hostile 2**64 - 1 wraps, as the record does
            if self.owned():
                self._publish(self.step)
            else:
                self.disowned = True

    def end(self) -> bool:
        """Leave the step, after every read of it is done. True if the daemon revoked it or
        stopped protecting it (its record went free or to another client meanwhile): the
        step's rows may have been refilled while read, and it must be replayed."""
        return self.check(self.step, more=False)

    def check(self, launched: int, more: bool) -> bool:
        """A step launched while the record showed ``launched`` is done (every read of it).
        With ``more``, another step is still in flight (a pipelining client): the record
        advances by two and stays odd, which tells the daemon this one is done (see
        expertd.serving.epochs); else it leaves the step (even). True if that step was lost:
        the daemon gave up on a step it showed at or after ``launched`` (the loss covers
        every step then in flight), or the record is no longer ours."""
        if not self.step & 1:
            return False
        gave_up = native.read_u64(self._raw, self._lost_at)
        lost = bool(gave_up & 1) and (gave_up - launched) & U64 <= (self.step - launched) & U64
        self.step = (self.step + (2 if more else 1)) & U64
        if self.owned():
            self._publish(self.step)
        else:
            self.disowned, lost = True, True
        return lost
