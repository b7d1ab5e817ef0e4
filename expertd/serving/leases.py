"""The demand and lease book: which client holds which rows, and which demands wait.

Pure logic, no I/O: the serving loop decides which rows a demand gets (slot table and policy)
and tells the book; the book keeps the lease counts per row, the leases per client, the demands
waiting on fills and the queue of demands waiting for room. It enforces the fairness rules:
a client holds at most ``client_cap`` rows at once, queues at most ``max_queued`` demands, and
a lease held longer than ``max_hold`` seconds is revoked even if its holder heartbeats.
Every clean-up costs O(the leases concerned), never O(all leases).
"""

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from expertd.serving.stats import LeaseStats


@dataclass(eq=False)
class Demand:
    """One client's request for the rows of some experts of one layer."""

    owner: bytes  # the client's routing id
    rid: bytes
    layer: int
    experts: tuple
    rows: list = field(default_factory=list)
    waiting: set = field(default_factory=set)  # rows whose fill is still in flight
    lease: int = 0
    error: tuple | None = None  # (code, message) of the first failed fill
    dropped: bool = False  # its owner went away while it was queued
    misses: int = 0  # experts it had read from the disk
    saved: int = 0  # experts it found read ahead by a prefetch (first use of a side row)


@dataclass(eq=False)
class Lease:
    owner: bytes
    rows: np.ndarray
    granted: float
    demand: Demand | None  # set while the demand waits on fills


class LeaseBook:
    """Leases and waiting demands.

    Args:
        n_rows: rows that can be leased.
        client_cap: most rows one client may hold leased at once.
        max_queued: most demands one client may have queued for room.
        max_hold: seconds after which an answered lease is revoked.
        max_queued_total: most demands queued for room, all clients together.
    Raises:
        ValueError: on arguments out of range.
    """

    def __init__(self, n_rows: int, client_cap: int, max_queued: int, max_hold: float,
                 max_queued_total: int = 256):
        if n_rows < 1 or client_cap < 1 or max_queued < 1:
            raise ValueError("n_rows, client_cap and max_queued must be at least 1")
        if not max_hold > 0:
            raise ValueError("max_hold must be positive")
        self.client_cap = client_cap
        self.max_queued = max_queued
        self.max_hold = max_hold
        self.max_queued_total = max_queued_total
        self.leased = np.zeros(n_rows, dtype=np.int32)  # leases holding each row
        self._leases: dict = {}  # id -> Lease, in grant order (dicts keep insertion order)
        self._by_owner: dict = {}  # owner -> set of lease ids
        self._held: dict = {}  # owner -> rows held across its leases
        self._waiters: dict = {}  # row -> [Demand] waiting for its fill
        self._queue: deque = deque()
        self._queued: dict = {}  # owner -> demands it has in the queue
        self._dropped = 0  # demands in the queue whose owner went away (skipped when taken)
        self._next = 1
        self.expired = 0

    # ---- questions ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._leases)

    def held(self, owner: bytes) -> int:
        """Rows ``owner`` holds leased now."""
        return self._held.get(owner, 0)

    def fits(self, owner: bytes, n: int) -> bool:
        """Whether ``owner`` may lease ``n`` more rows under its cap."""
        return self._held.get(owner, 0) + n <= self.client_cap

    def stats(self) -> LeaseStats:
        return LeaseStats(leases=len(self._leases), leased_rows=int(self.leased.sum()),
                          queued=self.queued(), lease_expiries=self.expired,
                          client_cap=self.client_cap)

    # ---- leases -------------------------------------------------------------------------

    def grant(self, demand: Demand, rows: list, waiting: set, now: float) -> int:
        """Lease ``rows`` (-1 entries are skipped) to the demand's owner; returns the lease id.

        The demand waits for the fills of ``waiting`` (see :meth:`filled`).
        """
        held = np.array([r for r in rows if r >= 0], dtype=np.intp)
        np.add.at(self.leased, held, 1)
        lease = self._next
        self._next += 1
        demand.rows, demand.waiting, demand.lease = rows, set(waiting), lease
        self._leases[lease] = Lease(demand.owner, held, now, demand if waiting else None)
        self._by_owner.setdefault(demand.owner, set()).add(lease)
        self._held[demand.owner] = self._held.get(demand.owner, 0) + len(held)
        for row in demand.waiting:
            self._waiters.setdefault(row, []).append(demand)
        return lease

    def release(self, lease: int, owner: bytes | None = None) -> bool:
        """Drop a lease; with ``owner``, only if it is the owner's. True if one was dropped."""
        entry = self._leases.get(lease)
        if entry is None or (owner is not None and entry.owner != owner):
            return False
        del self._leases[lease]
        np.subtract.at(self.leased, entry.rows, 1)
        self._held[entry.owner] -= len(entry.rows)
        ids = self._by_owner[entry.owner]
        ids.discard(lease)
        if not ids:
            del self._by_owner[entry.owner]
            del self._held[entry.owner]
        if entry.demand is not None:
            self._forget_waiting(entry.demand)
        return True

    def _forget_waiting(self, demand: Demand) -> None:
        for row in demand.waiting:
            waiters = self._waiters.get(row)
            if waiters is not None:
                waiters[:] = [d for d in waiters if d is not demand]
                if not waiters:
                    del self._waiters[row]
        demand.waiting = set()

    def answered(self, demand: Demand, now: float) -> None:
        """The demand's reply went out: its lease's time bound starts now."""
        entry = self._leases.pop(demand.lease, None)
        if entry is not None:
            entry.demand = None
            entry.granted = now
            self._leases[demand.lease] = entry  # to the end: the dict stays in ``granted`` order

    def filled(self, row: int, error: tuple | None) -> list:
        """A fill ended; the demands it completes (nothing left to wait for), in order."""
        done = []
        for demand in self._waiters.pop(row, ()):
            demand.waiting.discard(row)
            if error is not None and demand.error is None:
                demand.error = error
            if not demand.waiting:
                done.append(demand)
        return done

    def expire(self, now: float) -> list:
        """Revoke answered leases held longer than ``max_hold``; their owners."""
        stale = []
        for lease, entry in self._leases.items():
            if now - entry.granted <= self.max_hold:
                break  # the dict is in ``granted`` order: every later lease is younger
            if entry.demand is None:  # a demand still waiting on its fills keeps its rows
                stale.append((lease, entry.owner))
        for lease, _ in stale:
            self.release(lease)
        self.expired += len(stale)
        return [owner for _, owner in stale]

    # ---- the queue of demands waiting for room ------------------------------------------

    def enqueue(self, demand: Demand) -> bool:
        """Queue a demand that found no room; False if its owner, or everyone together, has
        too many queued."""
        mine = self._queued.setdefault(demand.owner, [])
        if len(mine) >= self.max_queued or self.queued() >= self.max_queued_total:
            if not mine:
                del self._queued[demand.owner]
            return False
        mine.append(demand)
        self._queue.append(demand)
        return True

    def queued(self) -> int:
        return len(self._queue) - self._dropped

    def owed(self, owner: bytes) -> bool:
        """A queued demand goes before a new one of ``owner`` that needs rows filled: one
        whose owner holds no more rows (take_queue's order) and that its owner's cap lets
        start. Else a client that releases a lease and demands again in one batch takes the
        freed row each time, and a demand queued for room waits past every bound. A demand
        over its own owner's cap waits for that owner's releases, not for room: it is owed
        nothing (as the cache's retry_queued decides), and holds nobody else back."""
        mine = self._held.get(owner, 0)
        return any(not d.dropped and self._held.get(d.owner, 0) <= mine
                   and self.fits(d.owner, len(d.experts)) for d in self._queue)

    def take_queue(self) -> list:
        """Every queued demand, removed from the queue (re-enqueue what waits with
        :meth:`requeue_front`): those of clients holding the fewest rows first, then the
        oldest, so a client that holds much cannot take every freed row before the others."""
        demands = sorted((d for d in self._queue if not d.dropped),
                         key=lambda d: self._held.get(d.owner, 0))
        self._queue.clear()
        self._queued.clear()
        self._dropped = 0
        return demands

    def requeue_front(self, demands: list) -> None:
        """Put back demands taken with :meth:`take_queue` that still find no room, in order."""
        for demand in reversed(demands):
            self._queue.appendleft(demand)
        for demand in demands:
            self._queued.setdefault(demand.owner, []).append(demand)

    # ---- clients that go away -----------------------------------------------------------

    def drop_owner(self, owner: bytes) -> tuple:
        """Forget a client: release its leases, unqueue its demands.

        Returns:
            ``(leases released, demands dropped that waited on fills or in the queue)``.
        """
        ids = self._by_owner.get(owner, ())
        n = len(ids)
        waiting = [self._leases[i].demand for i in ids if self._leases[i].demand is not None]
        for lease in list(ids):
            self.release(lease)
        queued = self._queued.pop(owner, [])
        for demand in queued:  # skipped when the queue is next taken: O(its own demands)
            demand.dropped = True
        self._dropped += len(queued)
        return n, len(waiting) + len(queued)

    def pending(self) -> list:
        """Every demand that waits (on fills or in the queue), e.g. to fail them at shutdown."""
        seen = {}
        for waiters in self._waiters.values():
            for demand in waiters:
                seen[id(demand)] = demand
        for demand in self._queue:
            if not demand.dropped:
                seen[id(demand)] = demand
        return list(seen.values())
