"""The cache's background fills: warm-up and pins, read while the demands leave workers free.

The keys waiting and the rows being filled for them; the cache (cache.py) picks each key's row
and starts its fill (``ExpertCache.top_up_background``).
"""

import logging
from collections import deque

log = logging.getLogger("expertd")


class BackgroundFills:
    """Keys to fill when workers are free, the rows filling for them, the warm-up's progress.

    Args:
        workers: most background fills in flight at once.
    """

    def __init__(self, workers: int):
        self.workers = workers
        self.queue: deque = deque()  # (layer, expert) to fill when workers are free
        self.rows: set = set()  # rows being filled for warm-up or pins
        self.warm_total = self.warm_done = 0

    def add(self, keys, first: bool = False) -> None:
        """Queue ``keys`` (``first``: before what already waits)."""
        if first:
            self.queue.extendleft(keys)
        else:
            self.queue.extend(keys)

    def warm(self, keys) -> None:
        """Queue the warm-up's ``keys``; their completions are counted in the log."""
        self.warm_total = len(keys)
        self.add(keys)

    def next_key(self):
        """The next key to fill, or None while every worker it may use is taken or nothing
        waits."""
        if self.queue and len(self.rows) < self.workers:
            return self.queue.popleft()
        return None

    def clear(self) -> None:
        """Drop every key that waits (no row is free for them, or the daemon stops)."""
        self.queue.clear()

    def pending(self) -> int:
        """Keys waiting or being filled."""
        return len(self.queue) + len(self.rows)

    def started(self, row: int) -> None:
        self.rows.add(row)

    def finished(self, row: int) -> None:
        """A fill of ``row`` ended: if it was a background fill, its worker is free again."""
        if row in self.rows:
            self.rows.discard(row)
            self._progress()

    def dropped(self, row: int) -> None:
        """The fill of ``row`` ended without a read (at shutdown)."""
        self.rows.discard(row)

    def _progress(self) -> None:
        if self.warm_done >= self.warm_total:
            return
        self.warm_done += 1
        step = max(1, self.warm_total // 10)
        if self.warm_done % step == 0 or self.warm_done == self.warm_total:
            log.info("warm-up: %d/%d experts read", self.warm_done, self.warm_total)
