"""The epoch book: pure logic, no daemon (docs/ARCHITECTURE.md, "Epochs")."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from expertd.serving.epochs import (
    PROBATION,
    PROBATION_WAIT,
    U64,
    EpochBook,
    lost_covers,
    released,
)
from expertd.serving.stats import EpochStats
from expertd.shm.layout import EPOCH_SLOTS

A, B, C, D = (bytes([i]) * 16 for i in range(4))
HOLD = 1.0


def test_records_are_given_once_each_kept_on_a_second_attach_and_reused_last():
    book = EpochBook(HOLD, slots=3)
    assert [book.attach(o) for o in (A, B, C)] == [0, 1, 2]
    assert book.attach(D) == -1 and book.record(D) == -1  # every record is taken
    assert book.attach(B) == 1 and book.attached() == [0, 1, 2]
    assert book.detach(B) == 1 and book.detach(B) == -1
    assert book.attach(D) == 1  # the only free one
    book.detach(A)
    book.detach(C)
    assert book.attach(B) == 0  # freed first, given first: a freed record waits its turn
    assert EpochBook(HOLD).slots == EPOCH_SLOTS
    with pytest.raises(ValueError):
        EpochBook(0.0)
    with pytest.raises(ValueError):
        EpochBook(HOLD, slots=0)


def test_a_row_waits_only_for_attached_records_inside_a_step():
    book = EpochBook(HOLD)
    a, b = book.attach(A), book.attach(B)
    assert not book.retire(5, {a: 2, b: 0}, now=0.0)  # both between steps
    assert not book.retire(5, {a: 2, b: 0, 7: 3}, now=0.0)  # record 7 is nobody's
    assert book.retire(5, {a: 3, b: 0}, now=0.0)
    assert book.blocked(5) and book.blocking() == [a] and book.waiting() == 1
    assert book.poll({a: 3}, now=0.5) == ([], [])  # still inside that step
    assert book.poll({}, now=0.5) == ([], [])  # a record not read counts as unchanged
    assert book.poll({a: 4}, now=0.6) == ([5], [])
    assert not book.blocked(5) and book.blocking() == [] and book.waiting() == 0
    assert book.stats() == EpochStats(deferred_fills=1, epochs_lost=0, epoch_clients=2,
                                      epoch_wait_max_s=0.6)


def test_a_row_waits_for_every_record_that_was_inside_a_step_until_it_cannot_read_it():
    book = EpochBook(HOLD)
    a, b = book.attach(A), book.attach(B)
    assert book.retire(1, {a: 1, b: 7}, now=0.0)
    assert book.retire(2, {a: 1, b: 8}, now=0.1)
    assert book.poll({a: 2, b: 7}, now=0.2) == ([2], [])  # row 1 still waits for b
    assert book.retire(3, {a: 3, b: 7}, now=0.3)  # a is in its next step now
    # b advanced by two and is still odd: a client pipelining its steps checked one, and the
    # one it launched while showing 7 may still read row 1.
    assert book.poll({a: 3, b: 9}, now=0.4) == ([], [])
    assert book.poll({a: 3, b: 11}, now=0.4) == ([1], [])  # both checked by 7 + 4
    assert book.poll({a: 5}, now=0.5) == ([], [])
    assert book.poll({a: 6}, now=0.5) == ([3], [])  # even: nothing of a's is in flight
    assert released(U64, 3) and not released(U64, 1)  # the record wraps as it counts


def test_a_pipelining_record_that_stalls_between_checks_loses_what_it_had_in_flight():
    book = EpochBook(HOLD)
    a = book.attach(A)
    assert book.retire(1, {a: 5}, now=0.0)
    assert book.poll({a: 7}, now=0.5) == ([], [])  # one check: its next step may still read
    assert book.retire(2, {a: 7}, now=0.6)
    assert book.poll({a: 7}, now=1.1) == ([1, 2], [(a, 7)])  # lost at 7 covers 5's reads too
    assert lost_covers(7, 5) and lost_covers(7, 7) and not lost_covers(7, 3)
    assert not lost_covers(0, 1) and not lost_covers(6, 5)  # never lost, or an even value
    assert not book.retire(3, {a: 7}, now=1.2)  # nothing waits for the step it lost
    assert book.retire(3, {a: 9}, now=1.2)


def test_a_record_past_the_hold_loses_its_epoch_once_and_then_blocks_nothing_in_that_step():
    book = EpochBook(HOLD)
    a, b = book.attach(A), book.attach(B)
    assert book.retire(1, {a: 5, b: 1}, now=10.0)
    assert book.retire(2, {a: 5}, now=10.8)
    assert book.poll({a: 5, b: 2}, now=11.0) == ([], [])  # b moved on; a is within the hold
    assert book.poll({a: 5}, now=11.0 + 1e-6) == ([1, 2], [(a, 5)])  # row 2 waits no longer
    assert book.stats().epochs_lost == 1
    assert not book.retire(3, {a: 5, b: 0}, now=11.5)  # a lost step 5: nothing waits for it
    assert book.retire(3, {a: 7, b: 0}, now=12.0)  # its next step (on probation: see below)
    assert book.poll({a: 7}, now=13.5) == ([3], [(a, 7)])
    assert book.stats() == EpochStats(deferred_fills=3, epochs_lost=2, epoch_clients=2,
                                      epoch_wait_max_s=1.5)


def test_a_record_that_lost_its_epoch_is_waited_for_briefly_until_its_probation_ends():
    """A client that advanced its record by two each time its epoch was lost (as a pipelining
    client does) made every eviction wait the whole hold, one after another. After a loss
    that a row waited the hold for, the record's next blocks wait PROBATION_WAIT of a hold
    (then the client replays, as after any loss), for PROBATION holds; a step that ends
    within the short wait loses nothing; losses on probation do not extend it; letting a row
    go does not end it (the next one would be held the whole hold again); a record attached
    anew starts clean."""
    short = PROBATION_WAIT * HOLD
    book = EpochBook(HOLD)
    a, b = book.attach(A), book.attach(B)
    assert book.retire(1, {a: 1, b: 1}, now=0.0)
    assert book.poll({a: 1, b: 2}, now=0.5) == ([], [])
    assert book.poll({a: 1}, now=1.5) == ([1], [(a, 1)])  # waited the hold: probation
    assert book.retire(2, {a: 3, b: 3}, now=2.0)
    assert book.poll({a: 3, b: 3}, now=2.0 + short / 2) == ([], [])  # within the short wait
    assert book.poll({a: 3, b: 3}, now=2.0 + 2 * short) == ([], [(a, 3)])  # b: waited for
    assert book.blocking() == [b]
    assert book.poll({b: 4}, now=2.1) == ([2], [])
    assert book.retire(3, {a: 5}, now=2.2)
    assert book.poll({a: 6}, now=2.2 + short / 2) == ([3], [])  # ended in time: nothing lost
    assert book.retire(4, {a: 7}, now=2.3)  # still on probation
    assert book.poll({a: 7}, now=2.3 + 2 * short) == ([4], [(a, 7)])
    end = 1.5 + PROBATION * HOLD
    assert book.retire(3, {a: 9}, now=end - 0.1)
    assert book.poll({a: 9}, now=end - 0.1 + 2 * short) == ([3], [(a, 9)])  # no extension
    assert book.retire(6, {a: 11}, now=end + 0.1)  # probation over: waited for again
    assert book.poll({a: 11}, now=end + 0.1 + HOLD / 2) == ([], [])
    assert book.poll({a: 11}, now=end + 0.2 + HOLD) == ([6], [(a, 11)])
    book.detach(B)
    b2 = book.attach(B)
    assert book.retire(5, {b2: 1}, now=end + 0.3)
    assert book.poll({b2: 1}, now=end + 0.3) == ([], [])  # a new attachment: no probation


def test_detaching_a_record_lifts_its_blocks_and_forgets_what_it_lost():
    book = EpochBook(HOLD)
    a, b = book.attach(A), book.attach(B)
    book.retire(1, {a: 1, b: 1}, now=0.0)
    book.retire(2, {a: 1}, now=0.0)
    assert book.detach(A) == a
    assert book.blocking() == [b]
    assert book.poll({b: 1}, now=0.1) == ([2], [])  # row 1 still waits for b
    assert book.poll({b: 1}, now=2.0) == ([1], [(b, 1)])
    book.detach(B)
    b2 = book.attach(B)
    assert book.retire(4, {b2: 1}, now=2.0)  # a new record has lost nothing


def test_a_row_retired_again_while_it_waits_waits_for_both():
    book = EpochBook(HOLD)
    a, b = book.attach(A), book.attach(B)
    assert book.retire(1, {a: 1, b: 0}, now=0.0)
    assert book.retire(1, {a: 1, b: 0}, now=0.0)  # still blocked: nothing new, still True
    assert book.retire(1, {a: 1, b: 3}, now=0.5)
    assert book.poll({a: 2, b: 3}, now=0.6) == ([], [])
    assert book.poll({a: 2, b: 3}, now=1.2) == ([], [])  # b's hold counts from 0.5
    assert book.poll({a: 2, b: 3}, now=1.6) == ([1], [(b, 3)])
    assert book.stats().deferred_fills == 1  # one row held back once


class EpochMachine(RuleBasedStateMachine):
    """Clients attach, step, leave; rows are retired; time passes and the book is polled.

    A plain model says which rows each poll frees and which records it marks lost; beside it,
    the safety property itself: a row is never freed while an attached, non-lost record that
    was inside a step when the row was retired still shows that step.
    """

    OWNERS = (A, B, C, D)

    def __init__(self):
        super().__init__()
        self.book = EpochBook(HOLD, slots=3)
        self.now = 0.0
        self.record = {}  # owner -> record
        self.steps = {}  # record -> its step, as the client publishes it
        self.lost = {}  # record -> the step the book said it lost
        self.rows = {}  # row -> {record: (step, since, on probation)}: what it waits for
        self.at_retire = {}  # row -> [(attachment, record, step)] that blocked it when retired
        self.attachment = {}  # record -> which attachment of it this is (1, 2, ...)
        self.attachments = 0
        self.last_even = {}  # record -> the latest even step it showed (nothing in flight)
        self.probation = {}  # record -> until when a block of it is given up on at once

    @rule(owner=st.sampled_from(OWNERS))
    def attach(self, owner):
        got = self.book.attach(owner)
        if owner in self.record:
            assert got == self.record[owner]
        elif len(self.record) == 3:
            assert got == -1
        else:
            assert got >= 0 and got not in self.record.values()
            self.record[owner] = got
            self.steps[got] = 0  # the daemon zeroes a record it gives out
            self.last_even[got] = 0
            self.attachments += 1
            self.attachment[got] = self.attachments

    @rule(owner=st.sampled_from(OWNERS))
    def detach(self, owner):
        record = self.record.pop(owner, -1)
        assert self.book.detach(owner) == record
        if record >= 0:
            del self.steps[record]
            del self.attachment[record]
            self.lost.pop(record, None)
            self.probation.pop(record, None)
            for waits in self.rows.values():
                waits.pop(record, None)

    @precondition(lambda self: self.record)
    @rule(data=st.data(), by=st.integers(1, 2))
    def step(self, data, by):
        record = self.record[data.draw(st.sampled_from(sorted(self.record)))]
        self.steps[record] += by
        if not self.steps[record] & 1:
            self.last_even[record] = self.steps[record]

    @rule(row=st.integers(0, 5), stray=st.integers(0, 3))
    def retire(self, row, stray):
        steps = dict(self.steps)
        for r in range(3):  # a record nobody holds shows anything: it is ignored
            steps.setdefault(r, 2 * stray + 1)
        waits = {r: s for r, s in self.steps.items() if s & 1 and self.lost.get(r) != s}
        entry = self.rows.get(row)
        assert self.book.retire(row, steps, self.now) == bool(waits or entry is not None)
        if waits or entry is not None:
            entry = self.rows.setdefault(row, {})
            for r, s in waits.items():
                if entry.get(r, (None,))[0] != s:
                    on_probation = self.probation.get(r, self.now) > self.now
                    since = (self.now - (1 - PROBATION_WAIT) * HOLD if on_probation
                             else self.now)
                    entry[r] = (s, since, on_probation)
            self.at_retire.setdefault(row, []).extend(
                (self.attachment[r], r, s) for r, s in waits.items())

    @rule(dt=st.sampled_from([0.0, 0.3, 0.6, 1.1]))
    def poll(self, dt):
        self.now += dt
        steps = {r: self.steps[r] for r in self.book.blocking()}
        freed, lost = self.book.poll(steps, self.now)
        want_lost, waited = {}, set()
        for waits in self.rows.values():
            for r, (s, since, on_probation) in waits.items():
                now = self.steps[r]
                if (self.now - since > HOLD and now & 1 and now - s < 4
                        and self.lost.get(r) != now):
                    want_lost[r] = now
                    if not on_probation:
                        waited.add(r)
        assert sorted(lost) == sorted(want_lost.items()) and len(lost) == len(want_lost)
        self.lost.update(want_lost)
        for r in waited:
            self.probation[r] = self.now + PROBATION * HOLD
        want_freed = []
        for row, waits in list(self.rows.items()):
            for r, (s, _, _) in list(waits.items()):
                now, gave_up = self.steps[r], self.lost.get(r, 0)
                if not now & 1 or now - s >= 4 or (gave_up & 1 and 0 <= gave_up - s < 4):
                    del waits[r]
            if not waits:
                want_freed.append(row)
                del self.rows[row]
        assert freed == want_freed
        for row in freed:
            for attachment, r, s in self.at_retire.pop(row, []):
                # A record attached since (never freed) that may still read the row: odd ever
                # since (an even step showed nothing in flight), fewer than two checks past the
                # step it showed, not given up on.
                still = self.attachment.get(r) == attachment
                if not still:
                    continue
                now, gave_up = self.steps[r], self.lost.get(r, 0)
                reading = (now & 1 and self.last_even[r] < s and now - s < 4
                           and not (gave_up & 1 and 0 <= gave_up - s < 4))
                assert not reading, (
                    f"row {row} freed while record {r} shows {now}, retired at {s}")

    @invariant()
    def the_book_agrees_with_the_model(self):
        assert self.book.waiting() == len(self.rows)
        assert self.book.blocking() == sorted({r for w in self.rows.values() for r in w})
        assert self.book.attached() == sorted(self.record.values())
        for row in range(6):
            assert self.book.blocked(row) == (row in self.rows)
        s = self.book.stats()
        assert s.epoch_clients == len(self.record) and s.epochs_lost >= len(self.lost)


TestEpochMachine = EpochMachine.TestCase
TestEpochMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
