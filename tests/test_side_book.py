"""The side-row book: pure logic, no daemon."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from expertd.serving.side import SIDE_HOLD, SideBook

A, B = b"a" * 16, b"b" * 16
CACHE, SIDE = 6, 2  # rows 0..5 cache, 6..9 side


def idle(book):
    return np.zeros(book.total_rows, dtype=bool)


def empty(book, rows=()):
    mask = np.zeros(book.total_rows, dtype=bool)
    mask[list(rows)] = True
    return mask


def test_roles_start_with_the_side_rows_after_the_cache_rows():
    book = SideBook(CACHE, SIDE)
    assert book.total_rows == 10 and book.side_rows().tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError):
        SideBook(0, 2)
    with pytest.raises(ValueError):
        SideBook(4, 2, hold=0)


def test_one_prefetch_takes_at_most_half_the_pool_and_empty_rows_first():
    book = SideBook(CACHE, SIDE)
    assert book.choose(4, 0.0, idle(book), empty(book, [8, 9])) == [8, 9]
    assert book.choose(0, 0.0, idle(book), empty(book)) == []


def test_a_generation_is_kept_until_its_owner_is_two_generations_further():
    book = SideBook(CACHE, SIDE)
    g1 = book.next_generation(A)
    for row in (6, 7):
        book.filled(row, A, g1, now=0.0)
    g2 = book.next_generation(A)
    # g1 may still be read while g2 fills: its rows are not offered.
    assert book.choose(2, 0.1, idle(book), empty(book, [8, 9])) == [8, 9]
    for row in (8, 9):
        book.filled(row, A, g2, now=0.1)
    assert book.choose(2, 0.2, idle(book), empty(book)) == []
    g3 = book.next_generation(A)
    assert g3 == 3
    assert book.choose(2, 0.2, idle(book), empty(book)) == [6, 7]  # g1's rows, not g2's


def test_another_client_cannot_take_rows_within_the_hold_but_can_after_it():
    book = SideBook(CACHE, SIDE)
    g = book.next_generation(A)
    for row in (6, 7, 8, 9):
        book.filled(row, A, g, now=10.0)
    book.next_generation(B)
    assert book.choose(2, 10.5, idle(book), empty(book)) == []
    assert book.choose(2, 10.0 + SIDE_HOLD + 0.01, idle(book), empty(book)) == [6, 7]


def test_a_gone_owner_protects_nothing():
    book = SideBook(CACHE, SIDE)
    book.filled(6, A, book.next_generation(A), now=0.0)
    assert book.choose(4, 0.1, idle(book), empty(book)) == [7, 8]
    book.forget(A)
    book.used(7), book.used(8)  # waiting for promotion: only 9 and the gone owner's 6 are left
    assert book.choose(4, 0.1, idle(book), empty(book)) == [9, 6]


def test_busy_and_used_rows_are_never_offered():
    book = SideBook(CACHE, SIDE)
    busy = idle(book)
    busy[6] = True
    assert book.used(7) is False  # never prefetched: not a saved miss
    assert book.choose(2, 0.0, busy, empty(book)) == [8, 9]
    assert 7 in book.pending


def test_a_merged_prefetch_renews_the_claim():
    book = SideBook(CACHE, SIDE)
    book.filled(6, A, book.next_generation(A), now=0.0)
    book.next_generation(A)
    g3 = book.next_generation(A)
    book.claim(6, A, g3, now=0.0)  # generation 3 wants it too
    assert 6 not in book.choose(2, 0.1, idle(book), empty(book))


def test_rewriting_an_unused_prefetch_is_a_waste_and_a_first_use_a_saved_miss():
    book = SideBook(CACHE, SIDE)
    g = book.next_generation(A)
    assert book.filled(6, A, g, now=0.0) is False
    assert book.filled(6, A, g, now=0.0) is True
    assert book.used(6) is True and book.used(6) is False


def test_swap_moves_the_roles_and_leaves_the_victim_first_to_go():
    book = SideBook(CACHE, SIDE)
    g = book.next_generation(A)
    for row in (6, 7, 8, 9):
        book.filled(row, A, g, now=0.0)
    book.used(6)
    book.swap(6, 2)
    assert not book.side[6] and book.side[2] and 6 not in book.pending
    assert book.side_rows().tolist() == [2, 7, 8, 9]
    # The demoted row has no claim: it goes before A's protected rows, as an unclaimed row.
    assert book.choose(4, 0.1, idle(book), empty(book)) == [2]
    with pytest.raises(ValueError):
        book.swap(3, 4)  # two cache rows


class SideMachine(RuleBasedStateMachine):
    """Random prefetches, uses and swaps: the pool keeps its size, and a client's two latest
    generations (within the hold) are never offered for rewriting."""

    def __init__(self):
        super().__init__()
        self.book = SideBook(CACHE, SIDE)
        self.now = 0.0
        self.owner_of = {}  # row -> (owner, gen, time) of its last fill

    @rule(owner=st.sampled_from([A, B]), n=st.integers(0, 3), dt=st.floats(0, 0.6))
    def prefetch(self, owner, n, dt):
        self.now += dt
        gen = self.book.next_generation(owner)
        rows = self.book.choose(n, self.now, idle(self.book), empty(self.book))
        assert len(rows) <= SIDE
        for row in rows:
            assert self.book.side[row]
            last = self.owner_of.get(row)
            if last is not None and self.now - last[2] <= SIDE_HOLD:
                o, g, _ = last
                latest = self.book._generation.get(o)
                assert latest is None or latest >= g + 2, "a protected row was offered"
            self.book.filled(row, owner, gen, self.now)
            self.owner_of[row] = (owner, gen, self.now)

    @rule(data=st.data())
    def use_and_swap(self, data):
        side = self.book.side_rows().tolist()
        cache = np.flatnonzero(~self.book.side).tolist()
        row = data.draw(st.sampled_from(side))
        self.book.used(row)
        self.book.swap(row, data.draw(st.sampled_from(cache)))
        self.owner_of.pop(row, None)

    @rule(owner=st.sampled_from([A, B]))
    def leave(self, owner):
        self.book.forget(owner)

    @invariant()
    def pool_keeps_its_size(self):
        assert self.book.side_rows().size == 2 * SIDE


TestSideMachine = SideMachine.TestCase
TestSideMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
