"""Prefill: time to first token when a layer routes to more experts than its pool holds.

    python bench/prefill.py [--lengths 128 1024] [--arena 1.0] [--reps 2]

A synthetic model with 64 experts per layer and top-8, pools of this machine's default size (2 x
top-k rows a layer), so a long prompt's layers route to more experts than the pools hold. Each
such call runs whole, as resident mlx-lm's does (one call a layer, the router's own ids where
the pairs are at least the experts): on host-backed pools (a CPU's, Metal's) on a stage with a
row for every expert, on device-backed ones (a GPU's without a puller) on a stack laid out as a
pulled call's (client/layer.py). Forwards are timed side by side, interleaved, in one run:
resident mlx-lm and the streamed model on each pool backing; the logits of all are checked to
be bit-identical.

With ``--arena 1.0`` every expert is resident in the arena after a warm-up run, so the times
compare compute and copies; a smaller arena adds the fills of the misses. Not part of
``make bench``.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import daemon, ensure_model

# Small experts: MLX's CPU kernels are slow, and a 1024-token prompt must prefill in seconds.
PREFILL = dict(family="qwen3_moe", layers=4, experts=64, top_k=8, hidden=256, moe_inter=128,
               bits=4, mode="affine", seed=5)
BACKINGS = ("host", "device")


def ttft(model, ids):
    """Seconds for one prefill forward to its last position's logits, and those logits."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    start = time.perf_counter()
    logits = model(ids, cache=cache)[:, -1, :]
    mx.eval(logits)
    return time.perf_counter() - start, logits


def experts_per_layer(model_dir, ids) -> list:
    """How many distinct experts each MoE layer of this prompt routes to (resident routing)."""
    import mlx_lm
    import numpy as np
    from mlx_lm.models.switch_layers import SwitchGLU

    model = mlx_lm.load(str(model_dir))[0]
    counts = []
    for _, module in model.named_modules():
        if isinstance(module, SwitchGLU):
            def record(self, x, indices, _cls=SwitchGLU):
                counts.append(len(np.unique(np.array(indices))))
                return _cls.__call__(self, x, indices)
            module.__class__ = type("RecordingSwitchGLU", (SwitchGLU,), {"__call__": record})
    ttft(model, ids)
    return counts


def run(lengths=(128, 1024), arena: float = 1.0, reps: int = 2) -> list:
    import mlx.core as mx
    import mlx_lm

    from expertd.client import load
    from expertd.manifest import Manifest

    model_dir, blob_dir = ensure_model("prefill-h256", PREFILL)
    manifest = Manifest.load(blob_dir)
    resident = mlx_lm.load(str(model_dir))[0]
    # The arena's own overhead (slot table, side rows) is small next to this model's experts.
    cache_gb = manifest.total_expert_bytes * arena * 1.05 / 2**30 + 0.002
    results = []
    with daemon(blob_dir, cache_gb):
        models = {b: load(blob_dir, pool_backing=b, prefetch="off")[0] for b in BACKINGS}
        try:
            rows = models["host"].expertd_session.pools[0].rows
            for length in lengths:
                ids = mx.array([[(37 * i + 11) % (resident.args.vocab_size - 16) + 8
                                 for i in range(length)]])
                variants = {"resident": resident, **models}
                times = {name: [] for name in variants}
                logits = {}
                for rep in range(reps + 1):  # the first round warms the arena and MLX up
                    for name, m in variants.items():
                        seconds, logits[name] = ttft(m, ids)
                        if rep:
                            times[name].append(seconds)
                exact = all(mx.array_equal(logits["resident"], logits[b]).item()
                            for b in BACKINGS)
                # The best run: on a shared machine the others' load only ever adds time.
                results.append(dict(
                    length=length, rows=rows, experts=experts_per_layer(model_dir, ids),
                    exact=exact, times=times,
                    **{f"{n}_s": min(t) for n, t in times.items()},
                    **{f"{n}_median_s": statistics.median(t) for n, t in times.items()}))
        finally:
            for m in models.values():
                m.expertd_session.close()
    return results


def table(results: list, arena: float) -> str:
    spec = PREFILL
    title = (f"prefill TTFT: {spec['family']} synth, {spec['layers']} layers x "
             f"{spec['experts']} experts, top-{spec['top_k']}, hidden {spec['hidden']}, "
             f"moe-inter {spec['moe_inter']}, {spec['bits']}-bit; pools of "
             f"{results[0]['rows']} rows a layer; arena {arena:.0%} of experts; best of the "
             "timed runs in s (median in brackets); ratios of the best runs")
    header = ("| prompt | experts routed a layer | resident | host-backed pools | device-backed "
              "pools | host ÷ resident | device ÷ resident | logits bit-identical |")
    lines = [title, "", header, "|" + " --- |" * 8]
    for r in results:
        lines.append(
            f"| {r['length']} | {','.join(map(str, r['experts']))} | "
            + " | ".join(f"{r[n + '_s']:.2f} ({r[n + '_median_s']:.2f})"
                         for n in ("resident", *BACKINGS))
            + " | " + " | ".join(f"{r[b + '_s'] / r['resident_s']:.2f}" for b in BACKINGS)
            + f" | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--arena", type=float, default=1.0,
                        help="arena size as a fraction of every expert (default 1.0)")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    results = run(args.lengths, args.arena, args.reps)
    print(table(results, args.arena))
    if not all(r["exact"] for r in results):
        sys.exit("logits differ from resident mlx-lm")


if __name__ == "__main__":
    main()
