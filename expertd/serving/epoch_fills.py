"""The expert cache's epochs: refills of evicted rows held back until the clients that were
inside a step when the row was unmapped have finished it (docs/ARCHITECTURE.md, "Epochs").

An object the cache (cache.py) owns: the epoch book (epochs.py) decides; this reads the
records' steps from the arena, writes the ``lost`` field of a record whose step outlasted the
lease bound, and keeps the fills held back. The cache submits every read itself: it asks
:meth:`EpochFills.hold` before a read, and :meth:`EpochFills.check` names the held fills it may
now submit. A held fill's row stays FILLING for its new key, so demands wait on it as on any
fill; it is not counted ``in_flight`` (no read runs for it) until it is submitted.
"""

import logging

from expertd import native
from expertd.serving.epochs import EpochBook
from expertd.serving.stats import EpochStats
from expertd.shm.layout import EPOCH_DTYPE

log = logging.getLogger("expertd")

_SIZE = EPOCH_DTYPE.itemsize
_STEP = EPOCH_DTYPE.fields["step"][1]
_LOST = EPOCH_DTYPE.fields["lost"][1]


class EpochFills:
    """The arena's epoch records and the fills held back for them.

    Args:
        arena: the daemon's arena (its epoch table is read and written here).
        max_hold: seconds a client may stay in one step while a refill waits for it, before
            it loses its epoch (the lease bound; see EpochBook).
        clock: monotonic seconds (the cache's) that waits are timed by.
    """

    def __init__(self, arena, max_hold: float, clock):
        self.book = EpochBook(max_hold, slots=len(arena.epochs))
        self.clock = clock
        self._table = arena.epochs
        self._raw = arena.raw
        self._base = arena.geometry.epochs_offset
        self.held: dict = {}  # row -> urgent: refills waiting for steps (the row's new key
        # is in the slot table: the row is FILLING for it)

    # ---- clients ------------------------------------------------------------------------

    def attach(self, owner: bytes, pid: int) -> int:
        """A hello: ``owner``'s epoch record (the one it has, else a zeroed one with its pid),
        or -1 when every record is taken (the client then copies rows on the host)."""
        had = self.book.record(owner)
        record = self.book.attach(owner)
        if record >= 0 and had < 0:
            rec = self._table[record:record + 1]
            rec["step"], rec["lost"], rec["pid"] = 0, 0, pid
        return record

    def detach(self, owner: bytes) -> None:
        """``owner`` is forgotten: its record is free, its step and pid zeroed; the refills it
        held back are freed by the next :meth:`check`. A step it was inside is revoked first
        (written into ``lost``): a client forgotten while stopped (a heartbeat timeout shorter
        than the lease bound) learns at that step's end that the rows it read may have been
        refilled, and replays it."""
        record = self.book.detach(owner)
        if record < 0:
            return
        step = native.read_u64(self._raw, self._field(record, _STEP))
        native.publish_u64(self._raw, self._field(record, _LOST), step if step & 1 else 0)
        rec = self._table[record:record + 1]
        rec["step"], rec["pid"] = 0, 0

    # ---- rows ---------------------------------------------------------------------------

    def _field(self, record: int, offset: int) -> int:
        return self._base + record * _SIZE + offset

    def _steps(self, records) -> dict:
        """record -> its step, each read after a full fence: what the daemon wrote before
        (the row's unmapping) is visible to every client before a step is read."""
        return {r: native.read_u64(self._raw, self._field(r, _STEP)) for r in records}

    def _must_wait(self, row: int, evicted: bool) -> bool:
        """Whether the fill of ``row`` (begun: its old key is unmapped) must wait for steps:
        an expert was evicted from it while a client was inside a step, or it was emptied
        that way before (a withdrawn row) and is still blocked."""
        attached = self.book.attached() if evicted else None
        if attached:
            return self.book.retire(row, self._steps(attached), self.clock())
        return self.book.blocked(row)

    def hold(self, row: int, urgent: bool, evicted: bool) -> bool:
        """Hold the begun fill of ``row`` back if it must wait for steps (``evicted``: its
        fill unmapped an expert). True: held, the caller submits no read until :meth:`check`
        frees it; False: the caller submits it now."""
        if self._must_wait(row, evicted):
            self.held[row] = urgent
            return True
        return False

    def block(self, row: int) -> None:
        """``row`` was emptied (its expert unmapped, not refilled): its next fill, whenever it
        comes, waits for the steps begun before."""
        self._must_wait(row, True)

    def expedite(self, row: int) -> bool:
        """A demand waits on the fill of ``row`` now: True if that fill is held (it is
        submitted urgent once freed); False: its read is queued, the caller moves it forward."""
        if row in self.held:
            self.held[row] = True
            return True
        return False

    def check(self, now: float) -> list:
        """The held fills whose blockers moved on, as ``(row, urgent)``, no longer held; the
        records that stayed in one step past the bound are marked lost first (their ``lost``
        is written before the refill starts)."""
        if not self.book.waiting():
            return []
        freed, lost = self.book.poll(self._steps(self.book.blocking()), now)
        for record, step in lost:
            native.publish_u64(self._raw, self._field(record, _LOST), step)
            log.warning("client pid %d stayed in step %d longer than %g s: its epoch is lost "
                        "(it replays that step)", int(self._table[record]["pid"]), step,
                        self.book.max_hold)
        return [(row, self.held.pop(row)) for row in freed if row in self.held]

    def drop(self) -> list:
        """At shutdown: the rows of every held fill, no longer held (no read was started)."""
        rows = list(self.held)
        self.held.clear()
        return rows

    def stats(self) -> EpochStats:
        """The epoch book's STATS record (:class:`~expertd.serving.stats.EpochStats`)."""
        return self.book.stats()
