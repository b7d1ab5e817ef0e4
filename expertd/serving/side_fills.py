"""The expert cache's side rows: prefetches filled into them, and how one joins the cache.

Half of :class:`~expertd.serving.cache.ExpertCache`, kept in a module of its own: a prefetch
is merged onto a fill in flight, claimed if resident, or read into a side row that the side-row
book (side.py) chooses; a side row becomes a cache row by swapping roles with the LFU victim
when a real hit or demand uses it, or while a cache row is still empty. It works on the cache's
own state (its slot table, policy, side-row book, pread pool and counters).
"""

import numpy as np

from expertd.shm.layout import SlotState


class SideRowFills:
    """The side-row half of ExpertCache (a mixin: it has no state of its own)."""

    def cache_row_keys(self) -> np.ndarray:
        """The slot table's flat key per row, -1 for side rows as for empty ones."""
        keys = self.table.row_keys()
        keys[self.side.side] = -1
        return keys

    def _use_side(self, row: int) -> int:
        """A demand or a client used side row ``row``: promote it; 1 if that use was the first
        of a prefetched expert (a saved miss), else 0."""
        first = self.side.used(row)
        self._promote(row)
        return int(first)

    def _promote(self, row: int) -> bool:
        """Swap side row ``row`` with the policy's victim among the cache rows; False (it stays
        a side row, waiting) if no cache row may be given up now."""
        victims = self.policy.victims(1, self._evictable(), self.table.row_keys())
        if not victims:
            self.side.pending.add(row)
            return False
        self.side.swap(row, int(victims[0]))
        return True

    def _absorb(self, now: float) -> None:
        """While the LFU cache still has rows that never held an expert, side rows holding one
        swap roles with them: the side row's expert stays resident as a cache row (its bytes
        are not moved, so a client may go on reading them), and the empty row becomes a side
        row for the next prefetch. A wrong guess evicts nothing this way either, and a cache
        large enough for every expert never reads one twice. Once no cache row is empty this
        is skipped, so the full arena is scanned only while the cache warms up. A generation
        a client may still read is left in the side rows (invariant 3, see SideBook)."""
        states = self.table.records["state"]
        empty = np.flatnonzero(~self.side.side & (states == SlotState.EMPTY)
                               & (self.book.leased == 0))
        if not len(empty):
            self._cache_full = True
            return
        held = self.side.absorbable(now, states == SlotState.READY)
        for row, victim in zip(held.tolist(), empty.tolist()):
            self.side.swap(row, victim, unused=True)

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
            row, state = self.table.lookup(layer, e)
            if state == SlotState.EMPTY:
                continue
            c.prefetch_merged += 1
            if self.side.side[row]:
                self.side.claim(row, owner, gen, now)
        core = len(experts) if core is None else core
        want, n_core = [], 0
        for i, e in enumerate(experts):
            row, state = self.table.lookup(layer, e)
            if state == SlotState.EMPTY:
                want.append(e)
                n_core += i < core
                continue
            c.prefetch_merged += 1
            if self.side.side[row]:
                self.side.claim(row, owner, gen, now)
        tail = len(want) - n_core
        if tail:
            keep = min(tail, max(0, self.workers - self.in_flight - n_core))
            c.prefetch_shed += tail - keep
            want = want[:n_core + keep]
        if not want:
            return 0
        if not self._cache_full:
            self._absorb(now)
        # Only the side rows are looked at: clients send a PREFETCH per layer, and work over
        # the whole arena on each would take the serving thread from the demands.
        side = self.side.side_rows()
        self.harvest_hits(side)  # a used prefetch is promoted before rows are chosen
        side = self.side.side_rows()
        states = self.table.records["state"][side]
        busy = np.zeros(self.side.total_rows, dtype=bool)
        busy[side] = (self.book.leased[side] > 0) | (states == SlotState.FILLING)
        empty = np.zeros_like(busy)
        empty[side] = states == SlotState.EMPTY
        rows = self.side.choose(len(want), now, busy, empty)
        c.prefetch_dropped += len(want) - len(rows)
        for e, row in zip(want, rows):
            c.prefetch_wasted += self.side.filled(row, owner, gen, now)
            self._fill(row, layer, e, urgent=False)
            self.prefetch_rows.add(row)
        return len(rows)
