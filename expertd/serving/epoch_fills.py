"""The expert cache's epochs: refills of evicted rows held back until the clients that were
inside a step when the row was unmapped have finished it (docs/ARCHITECTURE.md, "Epochs").

Half of :class:`~expertd.serving.cache.ExpertCache`, kept in a module of its own: the epoch book
(epochs.py) decides; this reads the records' steps from the arena, writes the ``lost`` field
of a record whose step outlasted the lease bound, and submits the fills the book frees. A held
fill's row stays FILLING for its new key, so demands wait on it as on any fill; it is not
counted ``in_flight`` (no read runs for it) until it is submitted.
"""

import logging

from expertd import native
from expertd.serving.epochs import EpochBook
from expertd.shm.layout import EPOCH_DTYPE

log = logging.getLogger("expertd")

_SIZE = EPOCH_DTYPE.itemsize
_STEP = EPOCH_DTYPE.fields["step"][1]
_LOST = EPOCH_DTYPE.fields["lost"][1]


class EpochFills:
    """The epoch half of ExpertCache (a mixin: its state is set up by :meth:`_init_epochs`)."""

    def _init_epochs(self, arena, max_hold: float) -> None:
        self.epochs = EpochBook(max_hold, slots=len(arena.epochs))
        self._epoch_table = arena.epochs
        self._epoch_raw = arena.raw
        self._epoch_base = arena.geometry.epochs_offset
        self.held: dict = {}  # row -> urgent: refills waiting for steps (the row's new key
        # is in the slot table: the row is FILLING for it)

    # ---- clients ------------------------------------------------------------------------

    def attach_client(self, owner: bytes, pid: int) -> int:
        """A hello: ``owner``'s epoch record (the one it has, else a zeroed one with its pid),
        or -1 when every record is taken (the client then copies rows on the host)."""
        had = self.epochs.record(owner)
        record = self.epochs.attach(owner)
        if record >= 0 and had < 0:
            rec = self._epoch_table[record:record + 1]
            rec["step"], rec["lost"], rec["pid"] = 0, 0, pid
        return record

    def detach_client(self, owner: bytes) -> None:
        """``owner`` is forgotten: its record is free, its step and pid zeroed; the refills it
        held back are submitted by the next :meth:`check_epochs`. A step it was inside is
        revoked first (written into ``lost``): a client forgotten while stopped (a heartbeat
        timeout shorter than the lease bound) learns at that step's end that the rows it
        read may have been refilled, and replays it."""
        record = self.epochs.detach(owner)
        if record < 0:
            return
        step = native.read_u64(self._epoch_raw, self._field(record, _STEP))
        native.publish_u64(self._epoch_raw, self._field(record, _LOST), step if step & 1 else 0)
        rec = self._epoch_table[record:record + 1]
        rec["step"], rec["pid"] = 0, 0

    # ---- rows ---------------------------------------------------------------------------

    def _field(self, record: int, offset: int) -> int:
        return self._epoch_base + record * _SIZE + offset

    def _steps(self, records) -> dict:
        """record -> its step, each read after a full fence: what the daemon wrote before
        (the row's unmapping) is visible to every client before a step is read."""
        return {r: native.read_u64(self._epoch_raw, self._field(r, _STEP)) for r in records}

    def _must_wait(self, row: int, evicted: bool) -> bool:
        """Whether the fill of ``row`` (begun: its old key is unmapped) must wait for steps:
        an expert was evicted from it while a client was inside a step, or it was emptied
        that way before (a withdrawn row) and is still blocked."""
        attached = self.epochs.attached() if evicted else None
        if attached:
            return self.epochs.retire(row, self._steps(attached), self.clock())
        return self.epochs.blocked(row)

    def _hold_or_submit(self, row: int, layer: int, expert: int, urgent: bool,
                        evicted: bool) -> None:
        if self._must_wait(row, evicted):
            self.held[row] = urgent
        else:
            self._submit(row, layer, expert, urgent)

    def _expedite(self, row: int) -> None:
        """A demand waits on the prefetch fill of ``row`` now: it goes first."""
        if row in self.held:
            self.held[row] = True
        else:
            self.pool.expedite(row)

    def check_epochs(self, now: float) -> None:
        """Submit the held fills whose blockers moved on; mark lost the records that stayed
        in one step past the bound (their ``lost`` is written before the refill starts)."""
        if not self.epochs.waiting():
            return
        freed, lost = self.epochs.poll(self._steps(self.epochs.blocking()), now)
        for record, step in lost:
            native.publish_u64(self._epoch_raw, self._field(record, _LOST), step)
            log.warning("client pid %d stayed in step %d longer than %g s: its epoch is lost "
                        "(it replays that step)", int(self._epoch_table[record]["pid"]), step,
                        self.epochs.max_hold)
        for row in freed:
            if row in self.held:
                self._submit(row, *self.table.key(row), self.held.pop(row))

    def drop_held(self) -> None:
        """At shutdown: end every held fill as failed (its row empty), without a read. The
        demands that waited on them were answered already."""
        for row in list(self.held):
            del self.held[row]
            self.table.end_fill(row, False)
            self.prefetch_rows.discard(row)
            self._saved_unread.discard(row)
            self.background_rows.discard(row)
