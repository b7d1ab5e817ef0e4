"""The expert cache: the arena's rows, what fills them and who holds them.

Demands are leased what is resident and filled what is not, or queued while rows are short;
fills run on the pread pool; background fills (warm-up, pins) use workers the demands leave
free; prefetches fill the side rows (side_rows.py), behind every demand in the pool; the refill
of a row evicted while a client was inside a step waits for that step to end (epoch_fills.py).
The serving loop hands requests in through verbs (demands, pins, prefetches, releases) and gets
answers out through ``send``; it never reaches the books themselves. The decisions are the slot
table's, the policy's, the pin book's, the lease book's, the side-row book's and the epoch
book's.

One job, over 400 lines: the cache's decisions in order (its books are elsewhere).
"""

import logging
import time

import numpy as np

from expertd.protocol import Op, reply_error, reply_ok
from expertd.serving.background import BackgroundFills
from expertd.serving.epoch_fills import EpochFills
from expertd.serving.leases import Demand, LeaseBook
from expertd.serving.policy import DEFAULT_POLICY, KeySpace, PinBook, make_policy
from expertd.serving.side import SIDE_HOLD
from expertd.serving.side_rows import SideRows
from expertd.serving.slots import SlotTable
from expertd.serving.stats import CacheCounters, CacheStats
from expertd.shm.layout import SlotState

log = logging.getLogger("expertd")
# Experts whose latest fill failed are remembered until one of theirs succeeds (at most every
# expert of the model: a whole corrupt blob is counted whole); STATS names this many of them.
FAILED_SHOWN = 16


class ExpertCache:
    """Rows of the arena and the fills, leases and demands around them.

    Args:
        arena: the daemon's arena.
        pool: the :class:`~expertd.serving.preads.FillPool` that reads rows.
        book: the :class:`~expertd.serving.leases.LeaseBook` (caps and time bounds set).
        workers: most background fills in flight at once.
        send: ``send(identity, frames)``, how answers go out.
        prefetch: "on", "auto" (the daemon fills what clients ask for; clients decide per
            layer whether to ask) or "off" (PREFETCH is counted and ignored).
        top_k: experts each token routes to per layer: no layer's quota of rows goes below it.
        side_hold: seconds a prefetch claim protects its side row at most (see SideBook).
        clock: monotonic seconds (the server's) that leases and side-row holds are timed by;
            fill throughput is timed in real seconds.
        max_pins: most keys pinned by the pin file and clients together (None: no cap).
        policy: the name of the cache policy (``expertd.serving.policy.POLICIES``).
        epoch_hold: seconds a client may stay in one step while a refill waits for it, before
            it loses its epoch (the lease bound; see EpochBook).
    """

    def __init__(self, arena, pool, book: LeaseBook, workers: int, send, prefetch: str = "auto",
                 top_k: int = 1, side_hold: float = SIDE_HOLD, clock=time.monotonic,
                 max_pins: int | None = None, policy: str = DEFAULT_POLICY,
                 epoch_hold: float = 30.0):
        g = arena.geometry
        self.clock = clock
        # The slot table, the policy, the pins and the lease book span every row: a side row
        # becomes a cache row by a role swap, never by a copy.
        self.table = SlotTable(arena)
        self.pins = PinBook(KeySpace(g.n_layers, g.n_experts), g.total_rows, cap=max_pins)
        self.policy = make_policy(policy, g.total_rows, g.n_layers, g.n_experts, pins=self.pins,
                                  min_quota=top_k)
        self.book = book
        self.side = SideRows(self.table, self.policy, book, g.cache_rows, g.side_rows,
                             side_hold)
        self.prefetch_mode = prefetch
        self.prefetch_rows: set = set()  # rows being filled for a prefetch
        self._saved_unread: set = set()  # of those, rows a demand counted as saved misses
        self.pool = pool
        self.stride = g.stride
        self.workers = workers
        self.send = send
        self.background = BackgroundFills(workers)
        self.room_changed = False  # rows were freed: queued demands may fit now
        self.counters = CacheCounters()
        self.failed: dict = {}  # (layer, expert) -> why its latest fill failed
        self.in_flight = 0
        self._withdrawing: set = set()  # keys to empty once neither leased nor filling
        self._busy_since = 0.0
        self._fill_seconds = 0.0
        self.epochs = EpochFills(arena, epoch_hold, clock)

    # ---- demands ---------------------------------------------------------------------------

    def start(self, d: Demand, owed: bool | None = None) -> bool:
        """Lease what is resident, fill the rest; False (nothing held) if rows are short, or if
        rows must be filled and ``owed`` (the rows free now are owed to a demand that waits
        before this one; None: LeaseBook.owed asked, only when a row must be filled)."""
        if not self.book.fits(d.owner, len(d.experts)):
            return False
        rows, need, waiting, side_used, absorbed = [], [], set(), [], []
        for i, e in enumerate(d.experts):
            row, state = self.table.lookup(d.layer, e)
            if state == SlotState.READY or state == SlotState.FILLING:
                rows.append(row)
                if state == SlotState.FILLING:
                    waiting.add(row)
                if self.side.is_side(row):
                    side_used.append(row)
                elif self.side.is_prefetched(row):  # read ahead, then taken into the cache
                    absorbed.append(row)
            else:
                rows.append(-1)
                need.append(i)
        if need:
            if self.book.owed(d.owner) if owed is None else owed:
                return False
            eligible = self._evictable()
            eligible[[r for r in rows if r >= 0]] = False  # never evict what this demand uses
            victims = self.policy.victims(len(need), eligible, self.table.row_keys(), d.layer,
                                          [d.experts[i] for i in need])
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
        self.book.grant(d, rows, waiting, self.clock())
        # Leased now, so no promotion below picks another of this demand's rows as its victim.
        saved = 0
        for row in side_used:
            first = self.side.use(row, self._evictable())
            if row in self.prefetch_rows:
                if not self.epochs.expedite(row):  # a demand waits on it now: it goes first
                    self.pool.expedite(row)
                if first:  # counted now, taken back should the read fail
                    self._saved_unread.add(row)
            saved += first
        for row in absorbed:
            saved += self.side.take(row)
        self.counters.demand_hits += len(d.experts) - len(need) - saved
        self.counters.prefetch_hits += saved
        self.counters.misses += len(need)
        d.misses, d.saved = len(need), saved
        if log.isEnabledFor(logging.DEBUG):
            log.debug("demand of layer %d for %d experts: %d resident, %d to read, %d read "
                      "ahead", d.layer, len(d.experts), len(d.experts) - len(need), len(need),
                      saved)
        if not waiting:
            self._answer(d)
        return True

    def enqueue(self, d: Demand) -> bool:
        """Queue a demand :meth:`start` could not serve now; False if its client's queue is
        full."""
        return self.book.enqueue(d)

    def held_by(self, owner: bytes) -> int:
        """Rows ``owner``'s leases hold now."""
        return self.book.held(owner)

    def fail_pending(self, code, message: str) -> None:
        """At shutdown: queued background fills dropped, every demand that waits answered with
        error ``code``, and every held fill ended failed (its row empty) without a read."""
        self.background.clear()
        for d in self.book.pending():
            self.send(d.owner, reply_error(d.rid, bytes([Op.DEMAND]), code, message))
        for row in self.epochs.drop():
            self.table.end_fill(row, False)
            self.prefetch_rows.discard(row)
            self._saved_unread.discard(row)
            self.background.dropped(row)

    def _evictable(self) -> np.ndarray:
        """Bool per row: a cache row a demand may take (not leased, not filling)."""
        return ~self.side.side_mask() & (self.book.leased == 0) & ~self.table.filling()

    def _answer(self, d: Demand) -> None:
        if d.error is not None:
            self.book.release(d.lease)
            self.room_changed = True
            self.send(d.owner, reply_error(d.rid, bytes([Op.DEMAND]), *d.error))
            return
        self.book.answered(d, self.clock())
        self.send(d.owner, reply_ok(d.rid, Op.DEMAND, rows=d.rows,
                                    versions=self.table.versions(d.rows), lease=d.lease,
                                    misses=d.misses, saved=d.saved))

    def retry_queued(self, alive) -> None:
        """Start the queued demands that fit now, in the queue's order (those of clients
        holding the fewest rows first, then the oldest); ``alive(owner)`` filters. Once one
        does not fit, those after it start only if they need no row filled: the rows that
        come free are owed to it, or a stream of smaller demands would starve it."""
        self.room_changed = False
        still, owed = [], False
        for d in self.book.take_queue():
            if not alive(d.owner):
                continue
            if not self.book.fits(d.owner, len(d.experts)):
                still.append(d)  # its own cap: it waits for its own releases, owed nothing
            elif not self.start(d, owed=owed):
                still.append(d)
                owed = True
        self.book.requeue_front(still)

    def release(self, lease: int, owner: bytes) -> None:
        if self.book.release(lease, owner=owner):  # only its owner may release a lease
            self.room_changed = True

    def forget(self, client) -> None:
        """A client left or died: its leases, queued demands and pins go with it."""
        self.book.drop_owner(client.identity)
        self.side.forget(client.identity)
        self.pins.forget(client.identity)
        self.epochs.detach(client.identity)
        self.room_changed = True

    def expire(self, now: float) -> None:
        if self.book.expire(now):
            self.room_changed = True

    # ---- step epochs -----------------------------------------------------------------------

    def attach_client(self, owner: bytes, pid: int) -> int:
        """A hello: ``owner``'s epoch record, or -1 when every record is taken."""
        return self.epochs.attach(owner, pid)

    def holds_fills(self) -> bool:
        """Whether a refill waits for a client's step to end (nothing wakes the loop then)."""
        return bool(self.epochs.held)

    def check_epochs(self, now: float) -> None:
        """Submit the held fills whose blockers moved on (EpochFills.check)."""
        for row, urgent in self.epochs.check(now):
            self._submit(row, *self.table.key(row), urgent)

    # ---- prefetches ------------------------------------------------------------------------

    def prefetch(self, owner: bytes, layer: int, experts, core: int | None = None,
                 claim=()) -> int:
        """Fill the experts of ``layer`` that ``owner`` predicts it will need into side rows.

        Experts resident or filling anywhere are merged (and their side rows claimed for this
        generation); the others take overwritable side rows, at most ``side_rows`` of them, and
        are read after every queued demand. None free: dropped. ``experts`` come best guess
        first; those past the first ``core`` are a wider guess, about half of it wrong, read only
        while workers are spare (shed otherwise): when reads back up, as on a daemon the SSD
        bounds, wrong guesses would take bandwidth the demands need.

        The experts of ``claim`` only have their side rows claimed: one gone since the client
        saw it resident is not read.

        Returns:
            How many experts it started reading.
        """
        c = self.counters
        c.prefetch_requested += len(experts) + len(claim)
        if self.prefetch_mode == "off":
            c.prefetch_ignored += len(experts) + len(claim)
            return 0
        now = self.clock()
        gen = self.side.next_generation(owner)
        for e in claim:
            self._merge(layer, e, owner, gen, now)
        core = len(experts) if core is None else core
        want, n_core = [], 0
        for i, e in enumerate(experts):
            if not self._merge(layer, e, owner, gen, now):
                want.append(e)
                n_core += i < core
        tail = len(want) - n_core
        if tail:
            keep = min(tail, max(0, self.workers - self.in_flight - n_core))
            c.prefetch_shed += tail - keep
            want = want[:n_core + keep]
        if not want:
            return 0
        self.side.absorb(now)
        # Only the side rows are looked at: clients send a PREFETCH per layer, and work over
        # the whole arena on each would take the serving thread from the demands.
        self.harvest_hits(self.side.side_rows())  # a used prefetch is promoted first
        rows = self.side.choose(len(want), now)
        c.prefetch_dropped += len(want) - len(rows)
        for e, row in zip(want, rows):
            c.prefetch_wasted += self.side.filled(row, owner, gen, now)
            self._fill(row, layer, e, urgent=False)
            self.prefetch_rows.add(row)
        return len(rows)

    def _merge(self, layer: int, expert: int, owner: bytes, gen: int, now: float) -> bool:
        """A prefetch of ``expert`` resident or filling: merged (counted), its side row, if it
        sits in one, claimed for ``owner``'s generation ``gen``; False if it is absent."""
        row, state = self.table.lookup(layer, expert)
        if state == SlotState.EMPTY:
            return False
        self.counters.prefetch_merged += 1
        self.side.claim(row, owner, gen, now)
        return True

    # ---- fills -----------------------------------------------------------------------------

    def _fill(self, row: int, layer: int, expert: int, urgent: bool = True) -> None:
        if not self.side.is_side(row) and self.side.take(row):
            self.counters.prefetch_wasted += 1  # read ahead, taken into the cache, never used
        evicted = self.table.begin_fill(row, layer, expert)
        if evicted is not None:
            self.policy.on_evicted(*evicted)
        if log.isEnabledFor(logging.DEBUG):  # -v: a line per fill (never on by default)
            log.debug("fill row %d with layer %d expert %d (%s)%s", row, layer, expert,
                      "demanded" if urgent else "read ahead",
                      f", evicting layer {evicted[0][0]} expert {evicted[0][1]}" if evicted else "")
        self.policy.on_filled((layer, expert), used=urgent)  # a prefetch's is a guess
        # Held back while a client that may read the evicted expert is inside a step.
        if not self.epochs.hold(row, urgent, evicted is not None):
            self._submit(row, layer, expert, urgent)

    def _submit(self, row: int, layer: int, expert: int, urgent: bool) -> None:
        """Start the read of a begun fill: from here it counts ``in_flight``."""
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        self.in_flight += 1
        self.pool.submit(row, layer, expert, urgent=urgent)

    def completions(self, stopping: bool = False) -> None:
        """Take in every fill the pool finished: answer the demands they complete."""
        done = self.pool.completions()
        for row, layer, expert, error in done:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._fill_seconds += time.monotonic() - self._busy_since
            self.table.end_fill(row, error is None)
            if error is None and log.isEnabledFor(logging.DEBUG):
                log.debug("filled row %d", row)
            if error is None:
                self.failed.pop((layer, expert), None)
                self.counters.bytes_read += self.stride
                self.counters.fills += 1
                if row in self.prefetch_rows:
                    self.counters.prefetch_fills += 1
            else:
                log.error("fill failed: %s", error[1])
                self.counters.fill_errors += 1
                self.failed[(layer, expert)] = error[1]
                self.side.emptied(row)  # maybe an empty cache row again; nothing to waste
                if row in self._saved_unread:
                    self.counters.prefetch_hits -= 1  # nothing was read: nothing saved
            self._saved_unread.discard(row)
            self.prefetch_rows.discard(row)
            self.background.finished(row)
            for d in self.book.filled(row, error):
                self._answer(d)
        if done and not stopping:
            # Rows that were filling are eligible again: demands queued behind them may fit.
            self.room_changed = True
            self.top_up_background()

    def withdraw(self, keys) -> None:
        """Stop serving ``keys``, rows of a lazy directory marked absent again (their shard
        failed its sha256, see FillPool.withdrawn): a resident copy is emptied (a seqlock
        write, so a client's copy of the slot table sees it go), and the next demand fetches
        the row anew. A row leased or filling now is emptied at a later call, once it is
        neither."""
        for layer, expert in list(self._withdrawing) + list(keys):
            self._withdrawing.discard((layer, expert))
            row, state = self.table.lookup(layer, expert)
            if state == SlotState.EMPTY:
                continue
            if state == SlotState.FILLING or self.book.leased[row]:
                self._withdrawing.add((layer, expert))
                continue
            evicted = self.table.begin_fill(row, layer, expert)
            if evicted is not None:
                self.policy.on_evicted(*evicted)
            self.epochs.block(row)  # its refill, whenever, waits for steps begun before
            self.table.end_fill(row, False)
            self.side.emptied(row)
            self.room_changed = True

    def fill_seconds(self) -> float:
        """Seconds during which at least one fill was in flight."""
        running = time.monotonic() - self._busy_since if self.in_flight else 0.0
        return self._fill_seconds + running

    def stats(self) -> CacheStats:
        c, busy = self.counters, self.fill_seconds()
        hits = c.demand_hits + c.client_hits
        # A prefetched row used is a saved miss: it counts beside hits and misses, in neither.
        looked_up = hits + c.misses + c.prefetch_hits
        return CacheStats(
            rows_used=self.table.rows_used(~self.side.side_mask()), side_rows=self.side.count(),
            side_rows_used=self.table.rows_used(self.side.side_mask()), prefetch=self.prefetch_mode,
            hits=hits, hit_rate=round(hits / max(1, looked_up), 4), fill_seconds=round(busy, 6),
            fill_gbps=round(c.bytes_read / busy / 1e9, 3) if busy else 0.0,
            pinned=self.pins.n_pinned_rows(self.side.cache_row_keys()), in_flight=self.in_flight,
            failed_experts=self._failed_shown(), failed_count=len(self.failed),
            background_pending=self.background.pending())

    def _failed_shown(self) -> list:
        # Pinned experts first: start names the pins it cannot serve from these.
        pinned = self.pins.pinned_keys
        failed = sorted(self.failed.items(), key=lambda item: (item[0] not in pinned, item[0]))
        return [[la, ex, why] for (la, ex), why in failed[:FAILED_SHOWN]]

    def stats_records(self) -> tuple:
        """The cache's STATS records: its counters, :meth:`stats`, the lease book's and the
        epoch book's."""
        return self.counters, self.stats(), self.book.stats(), self.epochs.stats()

    # ---- pins, warm-up and the hot set -----------------------------------------------------

    def pin(self, owner: bytes, keys) -> int | None:
        """Hold ``keys`` pinned for ``owner`` while it lives and fill them first; how many
        keys are pinned now, or None (nothing pinned) past the pins' cap."""
        held = self.pins.hold(owner, keys)
        if held is None:
            return None
        self.background.add(held, first=True)
        self.top_up_background()
        return len(self.pins.pinned_keys)

    def unpin(self, owner: bytes, keys) -> int:
        """Let go of ``owner``'s pins of ``keys``; how many keys are pinned now."""
        self.pins.release(owner, keys)
        return len(self.pins.pinned_keys)

    def policy_state(self, limit: int) -> dict:
        """What the hot set saves: the policy's state and its ``limit`` hottest keys."""
        return {"policy": self.policy.state(),
                "hot": [list(k) for k in self.policy.hot_keys(limit)]}

    def restore_policy(self, hot_set) -> list:
        """Read the policy back from ``hot_set`` (HotSet.load); the keys to warm with."""
        return hot_set.load(self.policy)

    def warm(self, keys) -> None:
        """Fill ``keys`` in the background, counting the warm-up's progress in the log."""
        self.background.warm(keys)
        self.top_up_background()

    def auto_pin(self, n: int) -> None:
        """Pin the ``n`` hottest resident cache rows' keys (as the pins' cap leaves room)."""
        self.pins.auto_pin(n, self.side.cache_row_keys(), self.policy.hottest)

    def top_up_background(self) -> None:
        """Start queued background fills (warm-up, pins) while workers are free."""
        while (key := self.background.next_key()) is not None:
            layer, expert = key
            row, state = self.table.lookup(layer, expert)
            if state != SlotState.EMPTY:
                if self.side.is_side(row):  # a pin (or warm key) in a side row joins the cache
                    self.side.promote(row, self._evictable())
                continue
            victims = self.policy.victims(1, self._evictable(), self.table.row_keys())
            if not victims:
                self.background.clear()
                return
            row = int(victims[0])
            self._fill(row, layer, expert)
            self.background.started(row)

    def harvest_hits(self, rows: np.ndarray | None = None) -> None:
        """Credit the uses clients counted in the table since the last call, and promote the
        side rows they used. A prefetched row's first use is a saved miss (prefetch_hits);
        its later uses, and uses of other rows, are client hits.

        Args:
            rows: only these rows (the side rows, before a prefetch chooses among them).
        """
        rows, counts = self.table.harvest(rows)
        for row, count in zip(rows.tolist(), counts.tolist()):
            self.policy.on_touched(self.table.key(row), count)
            side = self.side.is_side(row)
            if side or self.side.is_prefetched(row):
                saved = self.side.use(row, self._evictable()) if side else self.side.take(row)
                self.counters.prefetch_hits += saved
                count -= saved
            self.counters.client_hits += count
        for row in self.side.pending():  # used before, no cache row was free then
            self.side.promote(row, self._evictable())
