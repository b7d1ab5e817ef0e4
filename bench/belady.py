"""Hit rate of the LFU policy against Belady's optimal offline policy on a routing trace.

Run: ``python bench/belady.py [--tokens N --layers L --experts E --top-k K --skew S --seed S]``.
A trace is a sequence of (layer, expert) keys, one per routed expert, token by token and layer by
layer. Both policies fill on demand: a miss always brings the key in.
"""

import argparse
import heapq
from collections import OrderedDict

import numpy as np

from expertd.policy import LfuPolicy


def _flat(trace) -> tuple[np.ndarray, int, int]:
    trace = np.asarray(trace, dtype=np.int64).reshape(-1, 2)
    n_layers, n_experts = int(trace[:, 0].max()) + 1, int(trace[:, 1].max()) + 1
    return trace[:, 0] * n_experts + trace[:, 1], n_layers, n_experts


def belady_hits(trace, capacity: int) -> int:
    """Hits of the optimal offline policy (evict the key whose next use is furthest away).

    Args:
        trace: (N, 2) array or sequence of (layer, expert).
        capacity: rows in the cache.
    """
    keys, _, _ = _flat(trace)
    n = len(keys)
    next_use = np.empty(n, dtype=np.int64)
    seen = {}
    for i in range(n - 1, -1, -1):
        key = int(keys[i])
        next_use[i] = seen.get(key, n)
        seen[key] = i
    resident = {}  # key -> its next use
    heap = []  # (-next use, key), stale entries skipped on pop
    hits = 0
    for i in range(n):
        key = int(keys[i])
        if key in resident:
            hits += 1
        elif len(resident) >= capacity:
            while True:
                far, victim = heapq.heappop(heap)
                if resident.get(victim) == -far:
                    del resident[victim]
                    break
        resident[key] = int(next_use[i])
        heapq.heappush(heap, (-int(next_use[i]), key))
    return hits


def policy_hits(trace, capacity: int, **options) -> int:
    """Hits of ``LfuPolicy`` with demand fills; ``options`` go to its constructor."""
    keys, n_layers, n_experts = _flat(trace)
    policy = LfuPolicy(capacity, n_layers, n_experts, **options)
    eligible = np.ones(capacity, dtype=bool)
    # The slot table, as the daemon keeps it: flat key per row (-1 empty) and row per key.
    row_keys = np.full(capacity, -1, dtype=np.int64)
    key_row = {}
    hits = 0
    for flat in keys.tolist():
        key = divmod(flat, n_experts)
        if flat in key_row:
            hits += 1
        else:
            row = policy.victims(1, eligible, row_keys)[0]
            key_row.pop(int(row_keys[row]), None)
            row_keys[row] = flat
            key_row[flat] = row
        policy.on_touched(key)  # the hit, or the fill the miss brought (one touch, as the daemon)
    return hits


def lru_hits(trace, capacity: int) -> int:
    """Hits of plain LRU, as a baseline."""
    keys, _, _ = _flat(trace)
    cache = OrderedDict()
    hits = 0
    for key in keys.tolist():
        if key in cache:
            hits += 1
            cache.move_to_end(key)
            continue
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[key] = None
    return hits


def routing_trace(tokens: int, layers: int, experts: int, top_k: int, skew: float, seed: int,
                  phase_tokens: int = 0) -> np.ndarray:
    """A Zipf-like routing trace: per layer, expert of popularity rank r is chosen with weight
    1 / (r + 1) ** skew, top_k distinct experts per token and layer.

    ``phase_tokens`` > 0 reshuffles every layer's ranking that often (a change of topic).
    Returns an (tokens * layers * top_k, 2) array of (layer, expert).
    """
    rng = np.random.default_rng(seed)
    log_weight = -skew * np.log(np.arange(1, experts + 1))
    phases = 1 if phase_tokens <= 0 else -(-tokens // phase_tokens)
    span = tokens if phase_tokens <= 0 else phase_tokens
    chunks = []
    for _ in range(phases):
        ranks = np.argsort(rng.random((layers, experts)), axis=1)  # a permutation per layer
        logits = np.broadcast_to(log_weight[ranks], (span, layers, experts))
        # Gumbel top-k draws top_k distinct experts in proportion to their weights.
        noisy = logits + rng.gumbel(size=logits.shape)
        chosen = np.argpartition(-noisy, top_k - 1, axis=2)[:, :, :top_k]
        chunks.append(chosen)
    chosen = np.concatenate(chunks)[:tokens]
    layer = np.broadcast_to(np.arange(layers)[None, :, None], chosen.shape)
    return np.stack([layer.ravel(), chosen.ravel()], axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75])
    args = parser.parse_args()

    n_keys = args.layers * args.experts
    scenarios = [("stationary", 0), ("topic shifts", max(1, args.tokens // 4))]
    print(f"{args.tokens} tokens, {args.layers} layers x {args.experts} experts, "
          f"top-{args.top_k}, skew {args.skew}, seed {args.seed}")
    print(f"{'trace':<14}{'capacity':>14}{'belady':>9}{'lfu':>9}{'lru':>9}"
          f"{'lfu/belady':>12}{'lru/belady':>12}")
    for name, phase_tokens in scenarios:
        trace = routing_trace(args.tokens, args.layers, args.experts, args.top_k, args.skew,
                              args.seed, phase_tokens)
        for fraction in args.fractions:
            capacity = max(1, round(fraction * n_keys))
            rates = [hits(trace, capacity) / len(trace)
                     for hits in (belady_hits, policy_hits, lru_hits)]
            print(f"{name:<14}{f'{capacity} ({fraction:.0%})':>14}{rates[0]:>9.4f}"
                  f"{rates[1]:>9.4f}{rates[2]:>9.4f}{rates[1] / rates[0]:>12.3f}"
                  f"{rates[2] / rates[0]:>12.3f}")


if __name__ == "__main__":
    main()
