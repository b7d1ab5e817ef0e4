"""What the cache-policy tests share (``test_policy_*``): two clients' routing ids, a policy
filled row by row, its frequencies and explicit pins as the saved state holds them, auto-pins
as the cache asks for them, and the victim order by a full sort."""

import numpy as np

from expertd.serving.policy import CachePolicy, LfuPolicy

A, B = b"a" * 16, b"b" * 16  # two clients' routing ids, for their holds


def all_rows(policy: CachePolicy) -> np.ndarray:
    return np.ones(policy.n_rows, dtype=bool)


def frequencies(policy: LfuPolicy) -> dict:
    """Every key's decayed frequency, as the saved state holds it (keys absent are at 0)."""
    return {(layer, expert): value for layer, expert, value in policy.state()["frequencies"]}


def frequency(policy: LfuPolicy, key) -> float:
    return frequencies(policy).get(key, 0.0)


def n_explicit(policy: CachePolicy) -> int:
    """Keys pinned for good: those the saved state keeps."""
    return len(policy.state()["pins"])


def auto_pin(policy: CachePolicy, n: int, rows) -> list:
    """Auto-pins by the policy's ranking, as the cache asks for them."""
    return policy.pins.auto_pin(n, rows, policy.hottest)


def filled(n_rows: int, n_layers: int = 2, n_experts: int = 8,
           **options) -> tuple[LfuPolicy, np.ndarray]:
    """A policy and its slot table (flat key per row) whose rows hold keys (0, 0), (0, 1), ...
    in row order; each fill counts one touch, as the daemon's fills do."""
    policy = LfuPolicy(n_rows, n_layers, n_experts, **options)
    for row in range(n_rows):
        policy.on_touched(divmod(row, n_experts))
    return policy, np.arange(n_rows, dtype=np.int64)


def reference_order(policy: LfuPolicy, eligible: np.ndarray, row_keys: np.ndarray) -> list[int]:
    """Every qualifying row by a full sort: empty rows, then (frequency, recency)."""
    empty, resident = [], []
    freq = frequencies(policy)
    for row in range(policy.n_rows):
        flat = int(row_keys[row])
        if not eligible[row]:
            continue
        key = divmod(flat, policy.n_experts)
        if flat < 0:
            empty.append(row)
        elif not policy.pins.is_pinned(key):
            # Recency is internal; the clock value of the key's last fill or touch.
            resident.append((freq.get(key, 0.0), int(policy._last_used[flat]), row))
    return empty + [row for _, _, row in sorted(resident)]
