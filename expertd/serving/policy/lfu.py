"""LFU with decay: the daemon's policy.

Frequencies are kept per key, not per row, so an expert that was evicted and comes back keeps
its history. Every ``decay_interval`` touches they are all multiplied by ``decay_factor``, so a
key that was hot long ago goes before one that is warm now. Ties go to the least recent use.
"""

import numpy as np

from expertd.serving.policy.base import CachePolicy
from expertd.serving.policy.keys import non_negative_int

# Decayed frequencies below this are flushed to zero: such keys are cold, and subnormal floats
# would slow every later pass over the array.
FREQUENCY_FLOOR = 1e-12


class LfuPolicy(CachePolicy):
    """Evicts the least frequently used keys (decayed), the least recently used among equals.

    Args:
        decay_interval: touches (sum of counts) after which every frequency is multiplied by
            ``decay_factor``; 0 means ``8 * n_rows``.
        decay_factor: in (0, 1]; 1 disables decay.
        options: as for :class:`CachePolicy`.
    Raises:
        ValueError: on any argument out of range.
    """

    name = "lfu"

    def __init__(self, n_rows: int, n_layers: int, n_experts: int, *, decay_interval: int = 0,
                 decay_factor: float = 0.5, **options):
        super().__init__(n_rows, n_layers, n_experts, **options)
        decay_interval = non_negative_int("decay_interval", decay_interval)
        if isinstance(decay_factor, bool) or not isinstance(decay_factor, (int, float, np.floating)):
            raise ValueError(f"decay_factor must be a number, got {decay_factor!r}")
        if not 0.0 < decay_factor <= 1.0:
            raise ValueError(f"decay_factor must be in (0, 1], got {decay_factor}")
        self.decay_interval = decay_interval or 8 * self.n_rows
        self.decay_factor = float(decay_factor)
        self._freq = np.zeros(self.keys.size, dtype=np.float64)
        self._last_used = np.zeros(self.keys.size, dtype=np.int64)  # logical clock, for ties
        self._clock = 0
        self._since_decay = 0

    def on_touched(self, key, count: int = 1) -> None:
        flat = self.keys.flat(key)
        count = non_negative_int("count", count)
        if not count:
            return
        self._freq[flat] += count
        self._clock += 1
        self._last_used[flat] = self._clock
        self._since_decay += count
        if self._since_decay >= self.decay_interval:
            steps, self._since_decay = divmod(self._since_decay, self.decay_interval)
            self._freq *= self.decay_factor ** steps
            self._freq[self._freq < FREQUENCY_FLOOR] = 0.0

    def strength(self, flats: np.ndarray) -> np.ndarray:
        return self._freq[flats]

    def coldest(self, flats: np.ndarray, need: int) -> np.ndarray:
        chosen = np.arange(flats.size)
        if flats.size > need:
            # Only the ``need`` lowest are sorted: those below the need-th frequency, and as
            # many of those tied with it as are least recent.
            freq = self._freq[flats]
            kth = np.partition(freq, need - 1)[need - 1]
            below = np.flatnonzero(freq < kth)
            tied = np.flatnonzero(freq == kth)
            n_tied = need - below.size
            if tied.size > n_tied:
                tied = tied[np.argpartition(self._last_used[flats[tied]], n_tied - 1)[:n_tied]]
            chosen = np.concatenate((below, tied))
        keys = flats[chosen]
        return chosen[np.lexsort((self._last_used[keys], self._freq[keys]))]

    def hottest(self, flats: np.ndarray, limit: int) -> np.ndarray:
        flats = flats[self._freq[flats] > 0]
        if limit == 0:
            return flats[:0]
        if limit < flats.size:
            freq = self._freq[flats]
            # Keep every key tied with the limit-th one, then let the sort break the tie.
            kth = np.partition(freq, flats.size - limit)[flats.size - limit]
            flats = flats[freq >= kth]
        order = np.lexsort((-self._last_used[flats], -self._freq[flats]))
        return flats[order[:limit]]

    def load_strength(self, flats: np.ndarray, values: np.ndarray) -> None:
        self._freq[:] = 0.0
        self._freq[flats] = values
        # state() lists ties most recent first; negative ticks keep that order, older than any event.
        self._last_used[flats] = -1 - np.arange(flats.size)
