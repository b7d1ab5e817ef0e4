"""Hit rate of the LFU policy against Belady's optimal offline policy on a routing trace.

Run: ``python bench/belady.py [--tokens N --layers L --experts E --top-k K --skew S --seed S]``
for synthetic Zipf traces, or ``python bench/belady.py --trace A.npz [B.npz ...]`` for routing
recorded from a model (``bench/learned.py`` writes them: ``experts`` of shape (sequences, tokens,
layers, top_k)). A trace is a sequence of (layer, expert) keys, one per routed expert, token by
token and layer by layer. Every policy fills on demand: a miss always brings the key in.
"""

import argparse
import heapq
from collections import OrderedDict

import numpy as np

from expertd.serving.policy import LfuPolicy


def _flat(trace) -> tuple[np.ndarray, int, int]:
    trace = np.asarray(trace, dtype=np.int64).reshape(-1, 2)
    n_layers, n_experts = int(trace[:, 0].max()) + 1, int(trace[:, 1].max()) + 1
    return trace[:, 0] * n_experts + trace[:, 1], n_layers, n_experts


def belady_hits(trace, capacity: int, count_from: int = 0) -> int:
    """Hits of the optimal offline policy (evict the key whose next use is furthest away).

    Args:
        trace: (N, 2) array or sequence of (layer, expert).
        capacity: rows in the cache.
        count_from: requests before this index warm the cache and are not counted.
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
            hits += i >= count_from
        elif len(resident) >= capacity:
            while True:
                far, victim = heapq.heappop(heap)
                if resident.get(victim) == -far:
                    del resident[victim]
                    break
        resident[key] = int(next_use[i])
        heapq.heappush(heap, (-int(next_use[i]), key))
    return hits


def policy_hits(trace, capacity: int, group: int = 1, layered: bool = False, **options) -> int:
    """Hits of ``LfuPolicy`` with demand fills; ``options`` go to its constructor.

    ``group`` > 1 takes the requests ``group`` at a time (one token's top_k experts of one layer)
    as one demand, the way ``expertd/serving/cache.py`` starts one: the victims of all its misses are
    chosen in one call with the demand's resident rows not eligible, so one miss cannot evict a
    row another of the same demand uses. ``group`` 1 is one request after the other.
    ``layered`` passes the demand's layer and missing experts, as the daemon does (per-layer
    quotas, when the policy has them on); a demand's requests must then share one layer.
    """
    keys, n_layers, n_experts = _flat(trace)
    policy = LfuPolicy(capacity, n_layers, n_experts, **options)
    # The slot table, as the daemon keeps it: flat key per row (-1 empty) and row per key.
    row_keys = np.full(capacity, -1, dtype=np.int64)
    key_row = {}
    hits = 0
    keys = keys.tolist()
    for start in range(0, len(keys), group):
        demand = keys[start:start + group]
        missing = [flat for flat in demand if flat not in key_row]
        hits += len(demand) - len(missing)
        if missing:
            eligible = np.ones(capacity, dtype=bool)
            eligible[[key_row[flat] for flat in demand if flat in key_row]] = False
            where = ((missing[0] // n_experts, [flat % n_experts for flat in missing])
                     if layered else ())
            for flat, row in zip(missing, policy.victims(len(missing), eligible, row_keys, *where)):
                key_row.pop(int(row_keys[row]), None)
                row_keys[row] = flat
                key_row[flat] = row
        for flat in demand:  # the hit, or the fill the miss brought (one touch, as the daemon)
            policy.on_touched(divmod(flat, n_experts))
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


def npz_trace(path) -> tuple[np.ndarray, int, int]:
    """The request stream of a recorded routing file, and how many keys its model has.

    The sequences are concatenated into one stream (the cache carries over from one to the next,
    as a daemon serving successive prompts would); within a token, layers go in order, each with
    its top_k experts. The key count is layers x (largest expert id + 1): the file does not store
    the expert count, so an expert that no token ever chose would not be counted.

    Returns:
        An (N, 2) array of (layer, expert), the number of distinct possible keys, and top_k.
    """
    experts = np.load(path)["experts"].astype(np.int64)
    _, _, n_layers, top_k = experts.shape
    layer = np.broadcast_to(np.arange(n_layers)[None, None, :, None], experts.shape)
    trace = np.stack([layer.ravel(), experts.ravel()], axis=1)
    return trace, n_layers * (int(experts.max()) + 1), top_k


HEADER = (f"{'trace':<14}{'capacity':>14}{'belady':>9}{'lfu':>9}{'lfu-dem':>9}{'lru':>9}"
          f"{'lfu-q':>9}{'lfu/belady':>12}{'dem/belady':>12}{'lru/belady':>12}{'q/belady':>12}")


def _report(name: str, trace, n_keys: int, top_k: int, fractions, target: float | None) -> None:
    """One line per capacity; ``lfu-dem`` is LFU fed whole demands of top_k (``group``), and
    ``lfu-q`` the same demands with their layer, as the daemon runs them (per-layer quotas)."""
    for fraction in fractions:
        capacity = max(1, round(fraction * n_keys))
        rates = [hits(trace, capacity) / len(trace) for hits in (
            belady_hits, policy_hits, lambda t, c: policy_hits(t, c, group=top_k), lru_hits,
            lambda t, c: policy_hits(t, c, group=top_k, layered=True, min_quota=top_k))]
        line = (f"{name:<14}{f'{capacity} ({fraction:.0%})':>14}"
                + "".join(f"{rate:>9.4f}" for rate in rates)
                + "".join(f"{rate / rates[0]:>12.3f}" for rate in rates[1:]))
        if target is not None:
            line += f"{'pass' if rates[1] / rates[0] >= target else 'fail':>8}"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75])
    parser.add_argument("--trace", nargs="+", metavar="NPZ",
                        help="recorded routing files instead of the synthetic traces")
    parser.add_argument("--target", type=float, default=0.95,
                        help="LFU / Belady bar for the pass/fail column (traces only)")
    args = parser.parse_args()

    if args.trace:
        print(HEADER + f"{f'>= {args.target}':>8}")
        for path in args.trace:
            trace, n_keys, top_k = npz_trace(path)
            name = path.rsplit("/", 1)[-1].removesuffix(".npz").removeprefix("trace-")
            print(f"# {path}: {len(trace)} requests, {n_keys} keys")
            _report(name, trace, n_keys, top_k, args.fractions, args.target)
        return

    n_keys = args.layers * args.experts
    scenarios = [("stationary", 0), ("topic shifts", max(1, args.tokens // 4))]
    print(f"{args.tokens} tokens, {args.layers} layers x {args.experts} experts, "
          f"top-{args.top_k}, skew {args.skew}, seed {args.seed}")
    print(HEADER)
    for name, phase_tokens in scenarios:
        trace = routing_trace(args.tokens, args.layers, args.experts, args.top_k, args.skew,
                              args.seed, phase_tokens)
        _report(name, trace, n_keys, args.top_k, args.fractions, None)


if __name__ == "__main__":
    main()
