"""The side-row book: which arena rows are prefetch rows, who claimed them, and which may be
rewritten.

Pure logic, no I/O, like the policy and the lease book. The arena has ``cache_rows`` LFU rows and
``2 * side_rows`` side rows; a role swap (:meth:`SideBook.swap`) turns a used side row into a
cache row and the cache's LFU victim into a side row, so both counts stay fixed while the rows
themselves move. Each client numbers its PREFETCH messages (its generation); a side row filled or
merged for generation ``g`` stays untouched until that client has sent generation ``g + 2``, so a
client reads generation ``g`` while ``g + 1`` is filled (invariant 3). A claim also lapses when
its client goes away or ``hold`` seconds after the row was filled, so no client, silent or
asking again and again, keeps the rows forever.
"""

import numpy as np

SIDE_HOLD = 1.0  # seconds a claim protects its row at most


class SideBook:
    """Roles of the arena's rows and the claims on the side rows.

    Args:
        cache_rows: rows of the LFU cache (the first ones, at the start).
        side_rows: rows one PREFETCH may take; the pool holds twice as many.
        hold: seconds after which a claim no longer protects its row.
    Raises:
        ValueError: on a negative size or a hold that is not positive.
    """

    def __init__(self, cache_rows: int, side_rows: int, hold: float = SIDE_HOLD):
        if cache_rows < 1 or side_rows < 0:
            raise ValueError("cache_rows must be at least 1 and side_rows not negative")
        if not hold > 0:
            raise ValueError("hold must be a positive number of seconds")
        total = cache_rows + 2 * side_rows
        self.per_prefetch = side_rows
        self.hold = hold
        self.side = np.zeros(total, dtype=bool)  # True: a side row, False: an LFU cache row
        self.side[cache_rows:] = True
        # Filled by a prefetch and not used yet: used, it is a saved miss; rewritten, a waste.
        self.prefetched = np.zeros(total, dtype=bool)
        self.pending: set = set()  # side rows that were used and wait for a cache row to swap
        self._generation: dict = {}  # owner -> its latest prefetch generation
        self._claims: dict = {}  # row -> {owner: generation}
        self._stamp = np.zeros(total, dtype=np.float64)  # when the row was last filled

    @property
    def total_rows(self) -> int:
        return self.side.size

    def side_rows(self) -> np.ndarray:
        """Row numbers that are side rows now."""
        return np.flatnonzero(self.side)

    # ---- clients ------------------------------------------------------------------------

    def next_generation(self, owner: bytes) -> int:
        """A new PREFETCH from ``owner``: its generation number (1, 2, ...)."""
        gen = self._generation.get(owner, 0) + 1
        self._generation[owner] = gen
        return gen

    def forget(self, owner: bytes) -> None:
        """``owner`` went away: its claims protect nothing any more."""
        self._generation.pop(owner, None)

    # ---- claims -------------------------------------------------------------------------

    def claim(self, row: int, owner: bytes, gen: int, now: float) -> None:
        """``owner``'s generation ``gen`` wants ``row`` kept (a merged prefetch).

        The hold still counts from the row's fill, not from this claim: a client that keeps
        asking for what sits in the side rows, and never reads it, would otherwise keep every
        side row for ever. Claims of owners gone are dropped here, so a long-lived row does
        not collect every client that ever merged onto it.
        """
        claims = self._claims.setdefault(row, {})
        for gone in [o for o in claims if o not in self._generation]:
            del claims[gone]
        claims[owner] = max(gen, claims.get(owner, 0))

    def filled(self, row: int, owner: bytes, gen: int, now: float) -> bool:
        """``row`` is rewritten for ``owner``'s generation ``gen``.

        Returns:
            True if it held a prefetched expert nobody used (a wasted prefetch).
        """
        wasted = bool(self.prefetched[row])
        self._claims[row] = {owner: gen}
        self._stamp[row] = now
        self.prefetched[row] = True
        return wasted

    def _protected(self, row: int, now: float) -> bool:
        claims = self._claims.get(row)
        if not claims or now - self._stamp[row] > self.hold:
            return False
        return any(self._generation.get(owner, gen + 2) < gen + 2
                   for owner, gen in claims.items())

    def overwritable(self, now: float, busy: np.ndarray) -> np.ndarray:
        """Bool per row: a side row that a prefetch may rewrite now.

        Args:
            now: the monotonic time.
            busy: bool per row, True where a row is leased or filling.
        """
        mask = self.side & ~np.asarray(busy, dtype=bool)
        for row in np.flatnonzero(mask):
            if int(row) in self.pending or self._protected(int(row), now):
                mask[row] = False
        return mask

    def absorbable(self, now: float, ready: np.ndarray) -> np.ndarray:
        """Side rows that may join the cache before anyone used them (``ExpertCache._absorb``):
        ``ready`` (bool per row), and claimed by no client's two latest generations within the
        hold, or used already and waiting for a cache row. A generation its client may still
        read stays a side row: in the cache, unused, it would be the LFU's first victim.
        """
        rows = np.flatnonzero(self.side & np.asarray(ready, dtype=bool)).tolist()
        return np.array([r for r in rows if r in self.pending or not self._protected(r, now)],
                        dtype=np.intp)

    def choose(self, n: int, now: float, busy: np.ndarray, empty: np.ndarray) -> list:
        """Up to ``n`` side rows to rewrite: empty ones first, then unclaimed ones (demoted
        cache rows), then those whose claims lapsed, least recently filled first.

        Args:
            n: rows wanted; more than ``side_rows`` are never given to one PREFETCH.
            busy: bool per row, True where leased or filling.
            empty: bool per row, True where the row holds nothing.
        """
        n = min(n, self.per_prefetch)
        if n <= 0:
            return []
        rows = np.flatnonzero(self.overwritable(now, busy))
        rank = [(0 if empty[r] else 1 if not self._claims.get(int(r)) else 2,
                 self._stamp[r], int(r)) for r in rows]
        return [row for _, _, row in sorted(rank)[:n]]

    # ---- use and promotion ----------------------------------------------------------------

    def take(self, row: int) -> bool:
        """Cache row ``row`` was used or is being rewritten: True if it held a prefetched
        expert nobody had used yet (one that joined the cache unused, see :meth:`swap`)."""
        first = bool(self.prefetched[row])
        self.prefetched[row] = False
        return first

    def used(self, row: int) -> bool:
        """A demand or a client used side row ``row``: it waits for promotion.

        Returns:
            True if this is the first use of a prefetched expert (a saved miss).
        """
        first = bool(self.prefetched[row])
        self.prefetched[row] = False
        self.pending.add(row)
        return first

    def swap(self, row: int, victim: int, unused: bool = False) -> None:
        """Promote side row ``row`` into the cache and demote cache row ``victim`` to a side
        row. The victim keeps its expert (a later use promotes it back) but no claim, so it
        is among the first rows a prefetch rewrites. ``unused``: ``row`` joins the cache
        before anyone used it (it took an empty cache row's place), so it stays counted as
        prefetched until it is used (:meth:`take`) or evicted. A victim that joined the cache
        that way and was never used stays counted as prefetched too: its first use is still a
        saved miss (:meth:`used`), its rewrite a waste (:meth:`filled`)."""
        if not self.side[row] or self.side[victim]:
            raise ValueError(f"swap needs a side row and a cache row, got {row} and {victim}")
        self.side[row], self.side[victim] = False, True
        self.prefetched[row] = unused and bool(self.prefetched[row])
        self._claims.pop(row, None)
        self._claims.pop(victim, None)
        self._stamp[victim] = 0.0
        self.pending.discard(row)
