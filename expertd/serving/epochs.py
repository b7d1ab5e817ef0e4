"""The epoch book: which client holds which record of the arena's epoch table, and which evicted
rows wait for a step to end before they may be refilled.

Pure logic, no I/O, like the lease and side-row books: the serving loop reads the records'
steps from shared memory (after a full fence, see ``EpochFills._steps``) and writes the
``lost`` field of the records this book gives up on. docs/ARCHITECTURE.md, "Epochs": a client publishes in
its record the step it is in, odd while its device may read arena rows; a row unmapped while a
client showed step ``s`` (odd) is refilled only once that client can no longer read it: its
record shows an even step (nothing in flight), or an odd one at least ``PIPELINE_ADVANCE`` past
``s``. A client that pipelines its steps (the next one launched before the last is checked,
never more than two in flight) advances its record by two at each check and stays odd; any
step it had in flight when it showed ``s`` is checked by ``s + 4``. A serial client goes odd,
even, odd, so nothing changes for it. A client whose record has not moved that far within
``max_hold`` seconds (the lease bound) loses its epoch: the daemon stops waiting for it and
writes the step it shows into ``lost``; the client replays every step it launched at or
before that one. A record that lost its epoch after a row waited the whole bound for it is
then on probation for ``PROBATION`` holds: a row it blocks waits for it ``PROBATION_WAIT`` of
a hold at most, then its step is written into ``lost`` (the client replays as after any
loss). Without probation, a client that advanced its record by two each time its epoch was
lost (as a pipelining client does) made every eviction wait the whole bound, one after
another. An honest client's steps end well within the short wait (and one that does not is
told, as after any loss); probation ends with its time only, since a record that could end it
by letting one row go would then hold the next for the whole bound again. A client that goes
away frees its record, and its blocks with it.
"""

from collections import deque
from dataclasses import dataclass, field

from expertd.serving.stats import EpochStats
from expertd.shm.layout import EPOCH_SLOTS

U64 = 2**64 - 1
PIPELINE_ADVANCE = 4  # two checks of a client with two steps in flight
PROBATION = 10  # holds (max_hold each) for which a record that lost its epoch is waited less
PROBATION_WAIT = 0.01  # of a hold: how long a row waits for a record on probation


def released(step: int, now: int) -> bool:
    """Whether a record that showed odd ``step`` when a row was retired can no longer read the
    row, now that it shows ``now`` (modulo 2**64, as the record wraps)."""
    return not now & 1 or (now - step) & U64 >= PIPELINE_ADVANCE


def lost_covers(lost: int, step: int) -> bool:
    """Whether a loss at ``lost`` gives up on reads made while the record showed ``step``:
    the steps in flight at ``step`` are checked by ``step + 4``."""
    return lost & 1 == 1 and (lost - step) & U64 < PIPELINE_ADVANCE


@dataclass(eq=False)
class Retired:
    """A row unmapped while records were inside a step: its refill waits for them."""

    since: float  # when it was first retired (for the longest wait)
    # record -> (the odd step it showed, since when, whether it was on probation then)
    waits: dict = field(default_factory=dict)


class EpochBook:
    """Records given out, and rows whose refill waits for steps to end.

    Args:
        max_hold: seconds a record may stay in one odd step, seen from a row it blocks, before
            it loses its epoch.
        slots: records in the table (``EPOCH_SLOTS`` in the arena).
    Raises:
        ValueError: on a hold that is not positive or fewer than one record.
    """

    def __init__(self, max_hold: float, slots: int = EPOCH_SLOTS):
        if not max_hold > 0:
            raise ValueError("max_hold must be a positive number of seconds")
        if slots < 1:
            raise ValueError("slots must be at least 1")
        self.max_hold = max_hold
        self.slots = slots
        self._owner_of: dict = {}  # record -> owner
        self._record: dict = {}  # owner -> record
        # Freed records go to the back: a record is given out again as late as possible, so
        # that a client forgotten while stopped, which may still write its old record once
        # resumed, most likely writes one nobody holds.
        self._free: deque = deque(range(slots))
        self._rows: dict = {}  # row -> Retired, in retire order
        self._lost: dict = {}  # record -> the step it lost (no row waits for that step again)
        self._probation: dict = {}  # record -> until when it is waited for less (PROBATION)
        self.deferred = 0
        self.lost = 0
        self.longest_wait = 0.0

    # ---- records ------------------------------------------------------------------------

    def attach(self, owner: bytes) -> int:
        """``owner``'s record: the one it has, else a free one; -1 when every record is taken."""
        record = self._record.get(owner)
        if record is not None:
            return record
        if not self._free:
            return -1
        record = self._free.popleft()
        self._record[owner] = record
        self._owner_of[record] = owner
        return record

    def record(self, owner: bytes) -> int:
        """``owner``'s record, or -1 if it has none."""
        return self._record.get(owner, -1)

    def attached(self) -> list:
        """Records given out now, in order."""
        return sorted(self._owner_of)

    def detach(self, owner: bytes) -> int:
        """``owner`` went away: its record is free again and blocks nothing (the rows it was the
        last to block come out of the next :meth:`poll`). Returns the record, or -1 if it had
        none."""
        record = self._record.pop(owner, None)
        if record is None:
            return -1
        del self._owner_of[record]
        self._free.append(record)
        self._lost.pop(record, None)
        self._probation.pop(record, None)
        for entry in self._rows.values():
            entry.waits.pop(record, None)
        return record

    # ---- rows -----------------------------------------------------------------------------

    def retire(self, row: int, steps: dict, now: float) -> bool:
        """``row`` was just unmapped (its expert evicted) while clients may be inside a step.

        Args:
            steps: record -> its step, read after the unmapping was made visible; records not
                given out are ignored.
        Returns:
            True if the row's refill must wait (see :meth:`poll`): an attached record showed
            an odd step it has not lost.
        """
        waits = {r: int(s) for r, s in steps.items()
                 if int(s) & 1 and r in self._owner_of and self._lost.get(r) != int(s)}
        if not waits:
            return row in self._rows
        entry = self._rows.get(row)
        if entry is None:
            entry = self._rows[row] = Retired(now)
            self.deferred += 1
        for record, step in waits.items():
            if entry.waits.get(record, (None,))[0] != step:
                # On probation: as if all of the bound but PROBATION_WAIT had passed.
                short = self._probation.get(record, now) > now
                since = now - (1 - PROBATION_WAIT) * self.max_hold if short else now
                entry.waits[record] = (step, since, short)
        return True

    def waiting(self) -> int:
        """Rows whose refill waits now (or that a detach freed since the last poll)."""
        return len(self._rows)

    def blocked(self, row: int) -> bool:
        """Whether ``row``'s refill waits for a step to end."""
        return row in self._rows

    def blocking(self) -> list:
        """Records that some row waits for: the only steps :meth:`poll` needs."""
        return sorted({r for entry in self._rows.values() for r in entry.waits})

    def poll(self, steps: dict, now: float) -> tuple:
        """What changed since the rows were retired.

        Args:
            steps: record -> its step now, for the records of :meth:`blocking` (one missing is
                taken as unchanged).
        Returns:
            ``(freed rows, lost)``: the rows no record blocks any more, in retire order, and
            ``[(record, step)]`` of the records that lost their epoch now (a row waited for
            them longer than ``max_hold`` seconds, and they show the step written): the
            caller writes each step into its record's ``lost``.
        """
        if not self._rows:
            return [], []
        due: dict = {}  # record -> (the step it loses, whether a row waited the bound for it)
        for entry in self._rows.values():
            for record, (step, since, short) in entry.waits.items():
                current = int(steps.get(record, step))
                if (now - since > self.max_hold and not released(step, current)
                        and self._lost.get(record) != current):
                    due[record] = (current, not short or due.get(record, (0, False))[1])
        lost = []
        for record, (current, waited) in due.items():
            self._lost[record] = current
            if waited:  # given up on after a wait (not on probation): probation starts
                self._probation[record] = now + PROBATION * self.max_hold
            lost.append((record, current))
        self.lost += len(lost)
        freed = []
        for row, entry in list(self._rows.items()):
            for record, (step, _, _) in list(entry.waits.items()):
                if (released(step, int(steps.get(record, step)))
                        or lost_covers(self._lost.get(record, 0), step)):
                    del entry.waits[record]
            if not entry.waits:
                del self._rows[row]
                freed.append(row)
                self.longest_wait = max(self.longest_wait, now - entry.since)
        return freed, lost

    def stats(self) -> EpochStats:
        return EpochStats(deferred_fills=self.deferred, epochs_lost=self.lost,
                          epoch_clients=len(self._owner_of),
                          epoch_wait_max_s=round(self.longest_wait, 6))
