"""LRU: evict the key whose last use is oldest. The baseline the LFU is measured against
(bench/policies.py); quotas and pins apply to it as to any policy."""

import numpy as np

from expertd.serving.policy.base import CachePolicy
from expertd.serving.policy.keys import non_negative_int


class LruPolicy(CachePolicy):
    """Evicts the least recently used keys.

    Args:
        options: as for :class:`CachePolicy`.
    """

    name = "lru"

    def __init__(self, n_rows: int, n_layers: int, n_experts: int, **options):
        super().__init__(n_rows, n_layers, n_experts, **options)
        self._last_used = np.zeros(self.keys.size, dtype=np.int64)  # 0: never used
        self._clock = 0

    def on_touched(self, key, count: int = 1) -> None:
        flat = self.keys.flat(key)
        if non_negative_int("count", count):
            self._clock += 1
            self._last_used[flat] = self._clock

    def strength(self, flats: np.ndarray) -> np.ndarray:
        return self._last_used[flats].astype(np.float64)

    def coldest(self, flats: np.ndarray, need: int) -> np.ndarray:
        last = self._last_used[flats]
        chosen = np.arange(flats.size)
        if flats.size > need:
            # Keys never used tie: the first of them in ``flats`` (the lowest rows) go first.
            kth = np.partition(last, need - 1)[need - 1]
            below = np.flatnonzero(last < kth)
            chosen = np.concatenate((below, np.flatnonzero(last == kth)[:need - below.size]))
        return chosen[np.argsort(last[chosen], kind="stable")]

    def hottest(self, flats: np.ndarray, limit: int) -> np.ndarray:
        flats = flats[self._last_used[flats] > 0]
        return flats[np.argsort(-self._last_used[flats], kind="stable")[:limit]]

    def load_strength(self, flats: np.ndarray, values: np.ndarray) -> None:
        # Only the order is kept: the saved keys are older than any use from now on.
        self._last_used[:] = 0
        self._last_used[flats[::-1]] = np.arange(1, flats.size + 1)
        self._clock = max(self._clock, flats.size)
