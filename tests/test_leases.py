"""The lease book and the client registry: pure logic, no daemon."""

import sys

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from expertd.serving import leases
from expertd.serving.clients import ClientRegistry
from expertd.serving.config import cache_limits
from expertd.serving.leases import Demand, LeaseBook
from expertd.serving.stats import LeaseStats

A, B = b"a" * 16, b"b" * 16


def demand(owner=A, experts=(0, 1)):
    return Demand(owner, b"r", 0, tuple(experts))


def book_steps(call) -> tuple:
    """``(lines of expertd/serving/leases.py that call() ran, what it returned)``: the book's work,
    counted the same on an idle machine and a busy one (a loop over every lease or demand
    counts each pass)."""
    steps = 0

    def count(frame, event, arg):
        nonlocal steps
        steps += event == "line"
        return count

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg:
                 count if frame.f_code.co_filename == leases.__file__ else None)
    try:
        result = call()
    finally:
        sys.settrace(previous)
    return steps, result


def test_grant_counts_rows_per_lease_and_per_client():
    book = LeaseBook(8, client_cap=4, max_queued=2, max_hold=10.0)
    d1, d2 = demand(), demand(B, (1, 2))
    l1 = book.grant(d1, [0, 1], set(), now=0.0)
    l2 = book.grant(d2, [1, 2], set(), now=0.0)
    assert book.leased.tolist() == [1, 2, 1, 0, 0, 0, 0, 0]
    assert (book.held(A), book.held(B), len(book)) == (2, 2, 2)
    assert book.fits(A, 2) and not book.fits(A, 3)
    assert not book.release(l1, owner=B)  # only the owner may release
    assert book.release(l1, owner=A) and not book.release(l1)
    assert book.leased.tolist() == [0, 1, 1, 0, 0, 0, 0, 0] and book.held(A) == 0
    assert not book.release(l2, owner=A) and book.held(B) == 2  # l2 is B's
    assert book.stats() == LeaseStats(leases=1, leased_rows=2, queued=0, lease_expiries=0,
                                      client_cap=4)


def test_waiting_demand_completes_when_its_last_fill_ends_and_keeps_the_first_error():
    book = LeaseBook(8, 8, 2, 10.0)
    d = demand(experts=(0, 1, 2))
    book.grant(d, [3, 4, 5], {4, 5}, now=0.0)
    assert book.filled(4, ("CHECKSUM", "bad")) == []
    assert book.filled(5, None) == [d]
    assert d.error == ("CHECKSUM", "bad") and d.waiting == set()
    assert book.filled(5, None) == []  # nobody waits any more


def test_expiry_revokes_answered_leases_only_and_in_time_order():
    book = LeaseBook(8, 8, 2, max_hold=5.0)
    waiting = demand(experts=(0,))
    book.grant(waiting, [0], {0}, now=0.0)  # waits on a fill: never expires
    old = demand(B, (1,))
    book.grant(old, [1], set(), now=1.0)
    book.answered(old, now=1.0)
    young = demand(B, (2,))
    book.grant(young, [2], set(), now=4.0)
    book.answered(young, now=4.0)
    assert book.expire(now=5.5) == []
    assert book.expire(now=6.5) == [B]
    assert book.leased.tolist()[:3] == [1, 0, 1] and book.expired == 1
    assert book.filled(0, None) == [waiting]
    book.answered(waiting, now=7.0)  # answered late: its bound starts at the answer
    assert book.expire(now=9.5) == [B]
    assert book.expire(now=12.5) == [A] and len(book) == 0


def test_queue_is_bounded_per_client_and_keeps_order():
    book = LeaseBook(8, 8, max_queued=2, max_hold=10.0)
    d1, d2, d3, other = demand(), demand(), demand(), demand(B)
    assert book.enqueue(d1) and book.enqueue(d2) and not book.enqueue(d3)
    assert book.enqueue(other) and book.queued() == 3
    taken = book.take_queue()
    assert taken == [d1, d2, other] and book.queued() == 0
    book.requeue_front([d2, other])
    assert book.queued() == 2 and book.enqueue(d3) and not book.enqueue(demand())


def test_drop_owner_releases_only_its_leases_and_demands():
    book = LeaseBook(8, 8, 4, 10.0)
    mine = [demand(experts=(i,)) for i in range(3)]
    for i, d in enumerate(mine):
        book.grant(d, [i], {i} if i == 0 else set(), now=0.0)
    theirs = demand(B, (5,))
    book.grant(theirs, [5], set(), now=0.0)
    book.enqueue(demand())
    book.enqueue(demand(B))
    assert book.drop_owner(A) == (3, 2)
    assert book.leased.tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
    assert book.filled(0, None) == []  # the dropped demand no longer waits
    assert [d.owner for d in book.take_queue()] == [B]
    assert book.drop_owner(A) == (0, 0)


def test_dropping_a_client_with_many_leases_is_linear():
    """500 leases of one client among 20 000 of others: reclaiming costs its own leases only,
    the same work as among none, and twice the work for twice the leases."""
    def book_with(mine: int, others: int) -> LeaseBook:
        book = LeaseBook(64, client_cap=10**6, max_queued=4, max_hold=10.0)
        for i in range(others):
            book.grant(demand(B, (i % 64,)), [i % 64], set(), now=0.0)
        for i in range(mine):
            book.grant(demand(A, (i % 64,)), [i % 64], set(), now=0.0)
        return book

    crowded = book_with(500, 20_000)
    steps, dropped = book_steps(lambda: crowded.drop_owner(A))
    assert dropped == (500, 0)
    assert len(crowded) == 20_000 and int(crowded.leased.sum()) == 20_000
    alone = book_with(500, 0)
    assert book_steps(lambda: alone.drop_owner(A)) == (steps, (500, 0))
    double = book_with(1000, 0)
    assert book_steps(lambda: double.drop_owner(A))[0] <= 2 * steps


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 16, 64, 1000])
def test_cache_limits_leave_room_for_another_clients_largest_group(rows):
    max_pins, max_demand, cap = cache_limits(rows)
    assert max_demand >= 1 and cap >= max_demand
    if rows >= 2:
        assert max_pins + cap + max_demand <= rows


def test_registry_heartbeat_needs_the_clients_token():
    reg = ClientRegistry(time_to_dead=2.0)
    a = reg.hello(A, pid=10, now=0.0)
    b = reg.hello(B, pid=11, now=0.0)
    assert a.token != b.token
    assert not reg.heartbeat(A, b.token, now=1.5)  # another client's token refreshes nothing
    assert reg.heartbeat(B, b.token, now=1.5)
    assert reg.hello(A, pid=10, now=1.0).token == a.token  # a second hello keeps the token
    assert [c.identity for c in reg.dead(now=3.2)] == [A]
    assert A not in reg and B in reg and len(reg) == 1
    assert reg.seen(A, now=3.3) is None and reg.seen(B, now=3.3) is b


class BookMachine(RuleBasedStateMachine):
    """Random grants, fills, releases, expiries and drops against a plain model."""

    def __init__(self):
        super().__init__()
        self.book = LeaseBook(6, client_cap=4, max_queued=3, max_hold=2.0)
        self.model = {}  # lease -> (owner, rows, waiting, answered_at)
        self.now = 0.0

    @rule(owner=st.sampled_from([A, B]), rows=st.lists(st.integers(0, 5), min_size=1, max_size=3,
                                                         unique=True),
          wait=st.integers(0, 3))
    def grant(self, owner, rows, wait):
        if not self.book.fits(owner, len(rows)):
            return
        d = demand(owner, tuple(range(len(rows))))
        waiting = set(rows[:wait])
        lease = self.book.grant(d, rows, waiting, self.now)
        self.model[lease] = [owner, rows, d, None if waiting else self.now]
        if not waiting:
            self.book.answered(d, self.now)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fill(self, data):
        lease = data.draw(st.sampled_from(sorted(self.model)))
        d = self.model[lease][2]
        if d.waiting:
            row = sorted(d.waiting)[0]
            for done in self.book.filled(row, None):
                self.book.answered(done, self.now)
                for entry in self.model.values():
                    if entry[2] is done:
                        entry[3] = self.now

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        lease = data.draw(st.sampled_from(sorted(self.model)))
        assert self.book.release(lease, owner=self.model[lease][0])
        del self.model[lease]

    @rule(dt=st.floats(0.0, 1.5))
    def advance_and_expire(self, dt):
        self.now += dt
        self.book.expire(self.now)
        for lease in [k for k, v in self.model.items()
                      if v[3] is not None and self.now - v[3] > 2.0]:
            del self.model[lease]

    @rule(owner=st.sampled_from([A, B]))
    def drop(self, owner):
        self.book.drop_owner(owner)
        for lease in [k for k, v in self.model.items() if v[0] == owner]:
            del self.model[lease]

    @invariant()
    def counts_match_the_model(self):
        expected = np.zeros(6, np.int32)
        held = {A: 0, B: 0}
        for owner, rows, _, _ in self.model.values():
            expected[rows] += 1
            held[owner] += len(rows)
        assert self.book.leased.tolist() == expected.tolist()
        assert len(self.book) == len(self.model)
        assert (self.book.held(A), self.book.held(B)) == (held[A], held[B])
        assert max(held.values()) <= self.book.client_cap


TestBookMachine = BookMachine.TestCase
TestBookMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_freed_rows_go_first_to_the_clients_holding_least():
    """Two identities of one hoarder hold rows and queue more; a newcomer's demand queued after
    theirs still comes out first, so the hoarder cannot take every freed row."""
    book = LeaseBook(16, client_cap=8, max_queued=4, max_hold=10.0)
    C = b"c" * 16
    for owner in (A, B):
        book.grant(demand(owner, (0,)), [0, 1, 2], set(), now=0.0)
        book.enqueue(demand(owner))
    newcomer = demand(C)
    book.enqueue(newcomer)
    book.enqueue(demand(A))
    taken = book.take_queue()
    assert taken[0] is newcomer and [d.owner for d in taken[1:]] == [A, B, A]


def test_a_demand_over_its_own_cap_is_owed_nothing():
    """A queued demand that its owner's cap does not let start (it waits for that owner's
    own releases) holds no one back, even a client holding more; one that fits holds back
    the clients holding as much or more."""
    book = LeaseBook(16, client_cap=4, max_queued=4, max_hold=10.0)
    C = b"c" * 16
    book.grant(demand(A, (0,)), [0, 1, 2], set(), now=0.0)
    book.grant(demand(C, (9,)), [9, 10, 11, 12], set(), now=0.0)
    book.enqueue(demand(A, (3, 4)))  # 3 held + 2 > the cap of 4
    assert not book.owed(C) and not book.owed(B)
    book.grant(demand(B, (5,)), [5, 6, 7], set(), now=0.0)
    book.enqueue(demand(B, (8,)))  # 3 held + 1 fits
    assert book.owed(C) and book.owed(A) and book.owed(B)
    assert not book.owed(b"d" * 16)  # holds nothing: less than B


def test_the_queue_is_bounded_for_all_clients_together():
    book = LeaseBook(8, 8, max_queued=4, max_hold=10.0, max_queued_total=6)
    owners = [bytes([i]) * 16 for i in range(4)]
    accepted = [book.enqueue(demand(o)) for o in owners for _ in range(2)]
    assert accepted == [True] * 6 + [False] * 2 and book.queued() == 6
    book.drop_owner(owners[0])  # its two demands go: room for two more
    assert book.queued() == 4 and book.enqueue(demand(owners[3]))
    assert all(d.owner != owners[0] for d in book.take_queue())


def test_dropping_many_queued_clients_costs_their_own_demands_only():
    """Each of 999 clients with 32 queued demands is dropped for the work of dropping one
    client beside one other, however many others still queue."""
    def queued_book(n_owners: int) -> tuple:
        book = LeaseBook(8, 8, max_queued=32, max_hold=10.0, max_queued_total=10**6)
        owners = [i.to_bytes(16, "little") for i in range(n_owners)]
        for o in owners:
            for _ in range(32):
                book.enqueue(demand(o))
        return book, owners

    small, pair = queued_book(2)
    one, _ = book_steps(lambda: small.drop_owner(pair[0]))
    book, owners = queued_book(1000)
    for o in owners[:-1]:
        assert book_steps(lambda: book.drop_owner(o)) == (one, (0, 32))
    assert book.queued() == 32 and {d.owner for d in book.take_queue()} == {owners[-1]}


def test_registry_refuses_clients_past_its_bound():
    reg = ClientRegistry(time_to_dead=2.0, max_clients=2)
    assert reg.hello(A, 1, 0.0) and reg.hello(B, 2, 0.0)
    assert reg.hello(b"c" * 16, 3, 0.0) is None
    assert reg.hello(A, 1, 0.5) is not None  # a known client may say hello again
