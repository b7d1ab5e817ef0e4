"""The expert cache: the arena's rows, what fills them and who holds them.

Demands are leased what is resident and filled what is not, or queued while rows are short;
fills run on the pread pool; background fills (warm-up, prefetch, pins) use workers the demands
leave free. The serving loop hands requests in and gets answers out through ``send``; the
decisions are the slot table's, the policy's and the lease book's.
"""

import logging
import time
from collections import deque

from .leases import Demand, LeaseBook
from .policy import LfuPolicy
from .protocol import Op, reply_error, reply_ok
from .shm.layout import SlotState
from .slots import SlotTable

log = logging.getLogger("expertd")


class ExpertCache:
    """Rows of the arena and the fills, leases and demands around them.

    Args:
        arena: the daemon's arena.
        pool: the :class:`~expertd.io.FillPool` that reads rows.
        book: the :class:`~expertd.leases.LeaseBook` (caps and time bounds set).
        workers: most background fills in flight at once.
        send: ``send(identity, frames)``, how answers go out.
    """

    def __init__(self, arena, pool, book: LeaseBook, workers: int, send):
        g = arena.geometry
        self.table = SlotTable(arena)
        self.policy = LfuPolicy(g.cache_rows, g.n_layers, g.n_experts)
        self.book = book
        self.pool = pool
        self.stride = g.stride
        self.workers = workers
        self.send = send
        self.background: deque = deque()  # (layer, expert) to fill when workers are free
        self.background_rows: set = set()  # rows being filled for warm-up, prefetch or pins
        self.warm_total = self.warm_done = 0
        self.room_changed = False  # rows were freed: queued demands may fit now
        self.counters = dict(demand_hits=0, misses=0, bytes_read=0, fills=0, fill_errors=0)
        self.in_flight = 0
        self._busy_since = 0.0
        self._fill_seconds = 0.0

    # ---- demands ---------------------------------------------------------------------------

    def start(self, d: Demand) -> bool:
        """Lease what is resident, fill the rest; False (nothing held) if rows are short."""
        if not self.book.fits(d.owner, len(d.experts)):
            return False
        rows, need, waiting = [], [], set()
        for i, e in enumerate(d.experts):
            row, state = self.table.lookup(d.layer, e)
            if state == SlotState.READY or state == SlotState.FILLING:
                rows.append(row)
                if state == SlotState.FILLING:
                    waiting.add(row)
            else:
                rows.append(-1)
                need.append(i)
        if need:
            eligible = (self.book.leased == 0) & ~self.table.filling()
            eligible[[r for r in rows if r >= 0]] = False  # never evict what this demand uses
            victims = self.policy.victims(len(need), eligible, self.table.row_keys())
            if len(victims) < len(need):
                return False
            for i, row in zip(need, victims):
                self._fill(int(row), d.layer, d.experts[i])
                rows[i] = int(row)
                waiting.add(int(row))
        filled = set(need)
        for i, e in enumerate(d.experts):
            if i not in filled:  # a fill counts its own use
                self.policy.on_touched((d.layer, e))
        self.counters["demand_hits"] += len(d.experts) - len(need)
        self.counters["misses"] += len(need)
        self.book.grant(d, rows, waiting, time.monotonic())
        if not waiting:
            self._answer(d)
        return True

    def _answer(self, d: Demand) -> None:
        if d.error is not None:
            self.book.release(d.lease)
            self.room_changed = True
            self.send(d.owner, reply_error(d.rid, bytes([Op.DEMAND]), *d.error))
            return
        self.book.answered(d, time.monotonic())
        self.send(d.owner, reply_ok(d.rid, Op.DEMAND, rows=d.rows,
                                    versions=self.table.versions(d.rows), lease=d.lease))

    def retry_queued(self, alive) -> None:
        """Start the queued demands that fit now, oldest first; ``alive(owner)`` filters."""
        self.room_changed = False
        still = [d for d in self.book.take_queue() if alive(d.owner) and not self.start(d)]
        self.book.requeue_front(still)

    def release(self, lease: int, owner: bytes) -> None:
        if self.book.release(lease, owner=owner):  # only its owner may release a lease
            self.room_changed = True

    def forget(self, client) -> None:
        """A client left or died: its leases, queued demands and pins go with it."""
        self.book.drop_owner(client.identity)
        for key in client.pins:
            self.policy.drop(key)
        client.pins.clear()
        self.room_changed = True

    def expire(self, now: float) -> None:
        if self.book.expire(now):
            self.room_changed = True

    # ---- fills -----------------------------------------------------------------------------

    def _fill(self, row: int, layer: int, expert: int) -> None:
        evicted = self.table.begin_fill(row, layer, expert)
        if evicted is not None and evicted[1]:
            self.policy.on_touched(*evicted)  # uses not harvested yet belong to the old key
        self.policy.on_touched((layer, expert))
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        self.in_flight += 1
        self.pool.submit(row, layer, expert)

    def completions(self, stopping: bool = False) -> None:
        """Take in every fill the pool finished: answer the demands they complete."""
        done = self.pool.completions()
        for row, _, _, error in done:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._fill_seconds += time.monotonic() - self._busy_since
            self.table.end_fill(row, error is None)
            if error is None:
                self.counters["bytes_read"] += self.stride
                self.counters["fills"] += 1
            else:
                log.error("fill failed: %s", error[1])
                self.counters["fill_errors"] += 1
            if row in self.background_rows:
                self.background_rows.discard(row)
                self._warm_progress()
            for d in self.book.filled(row, error):
                self._answer(d)
        if done and not stopping:
            # Rows that were filling are eligible again: demands queued behind them may fit.
            self.room_changed = True
            self.top_up_background()

    def fill_seconds(self) -> float:
        """Seconds during which at least one fill was in flight."""
        running = time.monotonic() - self._busy_since if self.in_flight else 0.0
        return self._fill_seconds + running

    def add_background(self, keys, first: bool = False) -> None:
        """Fill ``keys`` when workers are free (``first``: before what already waits)."""
        if first:
            self.background.extendleft(keys)
        else:
            self.background.extend(keys)
        self.top_up_background()

    def top_up_background(self) -> None:
        """Start queued background fills (warm-up, prefetch, pins) while workers are free."""
        while self.background and len(self.background_rows) < self.workers:
            layer, expert = self.background.popleft()
            if self.table.lookup(layer, expert)[1] != SlotState.EMPTY:
                continue
            eligible = (self.book.leased == 0) & ~self.table.filling()
            victims = self.policy.victims(1, eligible, self.table.row_keys())
            if not victims:
                self.background.clear()
                return
            row = int(victims[0])
            self._fill(row, layer, expert)
            self.background_rows.add(row)

    def _warm_progress(self) -> None:
        if self.warm_done >= self.warm_total:
            return
        self.warm_done += 1
        step = max(1, self.warm_total // 10)
        if self.warm_done % step == 0 or self.warm_done == self.warm_total:
            log.info("warm-up: %d/%d experts read", self.warm_done, self.warm_total)

    def harvest_hits(self) -> int:
        """Credit the uses clients counted in the table since the last call; how many."""
        rows, counts = self.table.harvest()
        for row, count in zip(rows.tolist(), counts.tolist()):
            self.policy.on_touched(self.table.key(row), count)
        return int(counts.sum())
