"""The expert cache's side rows: where prefetches are read, and how a side row joins the cache.

A prefetch is read into a side row that the side-row book (side.py) chooses. A side row becomes
a cache row by swapping roles with the policy's victim when a real hit or demand uses it, or
while a cache row is still empty (its bytes never move, so a client may go on reading them).
:class:`SideRows` holds the book and those swaps; the cache (cache.py) owns one and asks it
about rows (:meth:`~SideRows.is_side`, :meth:`~SideRows.is_prefetched`) and claims, never
the book itself, and keeps the fills.
"""

import numpy as np

from expertd.serving.side import SideBook
from expertd.shm.layout import SlotState


class SideRows:
    """The side rows of the cache and the role swaps between them and the cache rows.

    Args:
        table: the cache's :class:`~expertd.serving.slots.SlotTable`.
        policy: the cache's policy (it names the cache row a side row swaps with).
        leases: the cache's :class:`~expertd.serving.leases.LeaseBook` (a leased row is never
            given to a prefetch).
        cache_rows, side_rows, hold: the :class:`~expertd.serving.side.SideBook`'s.
    """

    def __init__(self, table, policy, leases, cache_rows: int, side_rows: int, hold: float):
        self.table, self.policy, self.leases = table, policy, leases
        self.book = SideBook(cache_rows, side_rows, hold=hold)
        # False while the LFU cache may still have rows that never held anything (see absorb).
        self.cache_full = False

    # ---- rows and claims -----------------------------------------------------------------

    def is_side(self, row: int) -> bool:
        """Whether ``row`` is a side row now (else a cache row)."""
        return bool(self.book.side[row])

    def is_prefetched(self, row: int) -> bool:
        """Whether ``row`` holds a prefetched expert nobody has used yet."""
        return bool(self.book.prefetched[row])

    def side_mask(self) -> np.ndarray:
        """Bool per row, True where a side row is now (the book's own array: read it only)."""
        return self.book.side

    def side_rows(self) -> np.ndarray:
        """Row numbers that are side rows now."""
        return self.book.side_rows()

    def count(self) -> int:
        """Side rows in all: twice what one PREFETCH may take."""
        return 2 * self.book.per_prefetch

    def pending(self) -> list:
        """Side rows used already that wait for a cache row to swap with, in row order."""
        return sorted(self.book.pending)

    def next_generation(self, owner: bytes) -> int:
        """A new PREFETCH from ``owner``: its generation number (see SideBook)."""
        return self.book.next_generation(owner)

    def forget(self, owner: bytes) -> None:
        """``owner`` went away: its claims protect nothing any more."""
        self.book.forget(owner)

    def claim(self, row: int, owner: bytes, gen: int, now: float) -> None:
        """A prefetch merged onto resident ``row``: a side row is claimed for ``owner``'s
        generation ``gen``; a cache row needs no claim."""
        if self.book.side[row]:
            self.book.claim(row, owner, gen, now)

    def filled(self, row: int, owner: bytes, gen: int, now: float) -> bool:
        """Side row ``row`` is rewritten for ``owner``'s generation ``gen``: True if it held a
        prefetched expert nobody used (a wasted prefetch)."""
        return self.book.filled(row, owner, gen, now)

    def take(self, row: int) -> bool:
        """Cache row ``row`` was used or is being rewritten: True if it held a prefetched
        expert nobody had used yet (one that joined the cache unused)."""
        return self.book.take(row)

    def cache_row_keys(self) -> np.ndarray:
        """The slot table's flat key per row, -1 for side rows as for empty ones."""
        keys = self.table.row_keys()
        keys[self.book.side] = -1
        return keys

    def use(self, row: int, evictable: np.ndarray) -> int:
        """A demand or a client used side row ``row``: promoted (see :meth:`promote`); 1 if
        that use was the first of a prefetched expert (a saved miss), else 0."""
        first = self.book.used(row)
        self.promote(row, evictable)
        return int(first)

    def promote(self, row: int, evictable: np.ndarray) -> bool:
        """Swap side row ``row`` with the policy's victim among the ``evictable`` cache rows;
        False (it stays a side row, waiting) if none may be given up now."""
        victims = self.policy.victims(1, evictable, self.table.row_keys())
        if not victims:
            self.book.pending.add(row)
            return False
        self.book.swap(row, int(victims[0]))
        return True

    def absorb(self, now: float) -> None:
        """While the LFU cache still has rows that never held an expert, side rows holding one
        swap roles with them: the side row's expert stays resident as a cache row, and the
        empty row becomes a side row for the next prefetch. A wrong guess evicts nothing this
        way either, and a cache large enough for every expert never reads one twice. Once no
        cache row is empty this is skipped, so the full arena is scanned only while the cache
        warms up. A generation a client may still read is left in the side rows (invariant 3,
        see SideBook)."""
        if self.cache_full:
            return
        states = self.table.states()
        empty = np.flatnonzero(~self.book.side & (states == SlotState.EMPTY)
                               & (self.leases.leased == 0))
        if not len(empty):
            self.cache_full = True
            return
        held = self.book.absorbable(now, states == SlotState.READY)
        for row, victim in zip(held.tolist(), empty.tolist()):
            self.book.swap(row, victim, unused=True)

    def emptied(self, row: int) -> None:
        """``row`` holds nothing any more (a failed fill, a withdrawal): it may be a cache row
        that is empty again, and nothing was read into it to waste."""
        self.cache_full = False
        self.book.prefetched[row] = False

    def choose(self, n: int, now: float) -> list:
        """Up to ``n`` side rows to read prefetches into: neither leased nor filling, as the
        book picks them (fewer, or none, when every one is held)."""
        side = self.book.side_rows()
        states = self.table.states(side)
        busy = np.zeros(self.book.total_rows, dtype=bool)
        busy[side] = (self.leases.leased[side] > 0) | (states == SlotState.FILLING)
        empty = np.zeros_like(busy)
        empty[side] = states == SlotState.EMPTY
        return self.book.choose(n, now, busy, empty)
