"""Prefill: time to first token when a layer's routed experts need several groups.

    python bench/prefill.py [--lengths 128 1024] [--max-group 16] [--arena 1.0] [--reps 2]
                            [--with-rerun]

A synthetic model with 64 experts per layer and top-8 is loaded with a small ``max_group``, so
a long prompt's layers run in groups. Forwards are timed side by side, interleaved, in one run:
resident mlx-lm; the streamed model with the grouped path of client/switch.py ("pairs": each
group computes only the pairs routed into it, and its compute starts while the next group's rows
are filled and copied); the same path with that overlap turned off ("sync": every group computed
at the next layer's sync); and with ``--with-rerun`` the path before pairs ("rerun": each group
reruns the layer over every token and keeps its own slots), reproduced below. The logits of all
are checked to be bit-identical.

With ``--arena 1.0`` every expert is resident in the arena after a warm-up run, so the times
compare compute; a smaller arena adds the fills of the misses. Not part of ``make bench``.
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


def rerun_call(self, x, indices):
    """The grouped path before it computed pairs (client/switch.py as of e5b0aa9)."""
    import mlx.core as mx
    import numpy as np

    st = self.layer
    idx = np.array(indices)
    unique = np.unique(idx).astype(np.int32)
    size = st.session.max_group
    if len(unique) <= size:
        return self._run(st, x, unique, np.searchsorted(unique, idx).astype(idx.dtype))
    out = None
    for start in range(0, len(unique), size):
        group = unique[start:start + size]
        member = np.isin(idx, group)
        local = np.where(member, np.searchsorted(group, idx).clip(max=len(group) - 1), 0)
        y = self._run(st, x, group, local.astype(idx.dtype))
        out = y if out is None else mx.where(mx.array(member)[..., None], y, out)
    return out


def ttft(model, ids):
    """Seconds for one prefill forward to its last position's logits, and those logits."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    start = time.perf_counter()
    logits = model(ids, cache=cache)[:, -1, :]
    mx.eval(logits)
    return time.perf_counter() - start, logits


def groups_per_layer(model_dir, ids, max_group: int) -> list:
    """How many groups each MoE layer of this prompt needs (resident routing)."""
    import mlx_lm
    import numpy as np
    from mlx_lm.models.switch_layers import SwitchGLU

    model = mlx_lm.load(str(model_dir))[0]
    counts = []
    for _, module in model.named_modules():
        if isinstance(module, SwitchGLU):
            def record(self, x, indices, _cls=SwitchGLU):
                counts.append(-(-len(np.unique(np.array(indices))) // max_group))
                return _cls.__call__(self, x, indices)
            module.__class__ = type("RecordingSwitchGLU", (SwitchGLU,), {"__call__": record})
    ttft(model, ids)
    return counts


def sync_call(self, x, indices):
    """The grouped path with each group computed only when the next layer syncs (no overlap of
    a group's compute with the next group's fills and copy)."""
    import expertd.client.switch as switch

    real = switch.mx
    switch.mx = _NoAsyncEval(real)
    try:
        return _PAIRS_CALL[0](self, x, indices)
    finally:
        switch.mx = real


_PAIRS_CALL = []  # the product's StreamedSwitch.__call__, saved by run()


class _NoAsyncEval:
    """mlx.core with ``async_eval`` a no-op."""

    def __init__(self, mx):
        self._mx = mx

    def __getattr__(self, name):
        return getattr(self._mx, name)

    @staticmethod
    def async_eval(*_):
        pass


def run(lengths=(128, 1024), max_group: int = 16, arena: float = 1.0, reps: int = 2,
        with_rerun: bool = False) -> list:
    import mlx.core as mx
    import mlx_lm

    from expertd.client import load
    from expertd.client.switch import StreamedSwitch
    from expertd.manifest import Manifest

    model_dir, blob_dir = ensure_model("prefill-h256", PREFILL)
    manifest = Manifest.load(blob_dir)
    resident = mlx_lm.load(str(model_dir))[0]
    pairs_call = StreamedSwitch.__call__
    _PAIRS_CALL[:] = [pairs_call]
    # The arena's own overhead (slot table, side rows) is small next to this model's experts.
    cache_gb = manifest.total_expert_bytes * arena * 1.05 / 2**30 + 0.002
    results = []
    with daemon(blob_dir, cache_gb):
        model, _ = load(blob_dir, max_group=max_group)
        try:
            for length in lengths:
                ids = mx.array([[(37 * i + 11) % (resident.args.vocab_size - 16) + 8
                                 for i in range(length)]])
                variants = {"resident": (resident, None), "pairs": (model, pairs_call),
                            "sync": (model, sync_call)}
                if with_rerun:
                    variants["rerun"] = (model, rerun_call)
                times = {name: [] for name in variants}
                logits = {}
                for rep in range(reps + 1):  # the first round warms the arena and MLX up
                    for name, (m, call) in variants.items():
                        if call is not None:
                            StreamedSwitch.__call__ = call
                        seconds, logits[name] = ttft(m, ids)
                        if rep:
                            times[name].append(seconds)
                StreamedSwitch.__call__ = pairs_call
                exact = all(mx.array_equal(logits["resident"], logits[n]).item()
                            for n in variants if n != "resident")
                # The best run: on a shared machine the others' load only ever adds time.
                best = {name: min(t) for name, t in times.items()}
                med = {name: statistics.median(t) for name, t in times.items()}
                groups = groups_per_layer(model_dir, ids, max_group)
                results.append(dict(length=length, groups=groups, exact=exact, times=times,
                                    **{f"{n}_s": v for n, v in best.items()},
                                    **{f"{n}_median_s": v for n, v in med.items()}))
        finally:
            StreamedSwitch.__call__ = pairs_call
            model.expertd_session.close()
    return results


def table(results: list, max_group: int, arena: float) -> str:
    spec = PREFILL
    title = (f"prefill TTFT: {spec['family']} synth, {spec['layers']} layers x "
             f"{spec['experts']} experts, top-{spec['top_k']}, hidden {spec['hidden']}, "
             f"moe-inter {spec['moe_inter']}, {spec['bits']}-bit; max_group {max_group}; arena "
             f"{arena:.0%} of experts; best of the timed runs in s (median in brackets); "
             "ratios of the best runs")
    names = [n for n in ("pairs", "sync", "rerun") if f"{n}_s" in results[0]]
    label = {"pairs": "groups overlapped (now)", "sync": "groups not overlapped",
             "rerun": "layer per group (old)"}
    header = ("| prompt | groups per layer | resident | " + " | ".join(label[n] for n in names)
              + " | " + " | ".join(f"{label[n]} ÷ resident" for n in names)
              + " | logits bit-identical |")
    lines = [title, "", header, "|" + " --- |" * (3 + 2 * len(names) + 1)]
    for r in results:
        lines.append(
            f"| {r['length']} | {','.join(map(str, r['groups']))} | "
            + " | ".join(f"{r[n + '_s']:.2f} ({r[n + '_median_s']:.2f})"
                         for n in ["resident"] + names)
            + " | " + " | ".join(f"{r[n + '_s'] / r['resident_s']:.2f}" for n in names)
            + f" | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--max-group", type=int, default=16)
    parser.add_argument("--arena", type=float, default=1.0,
                        help="arena size as a fraction of every expert (default 1.0)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--with-rerun", action="store_true",
                        help="also time the path before groups computed only their own pairs")
    args = parser.parse_args()
    results = run(args.lengths, args.max_group, args.arena, args.reps, args.with_rerun)
    print(table(results, args.max_group, args.arena))
    if not all(r["exact"] for r in results):
        sys.exit("logits differ from resident mlx-lm")


if __name__ == "__main__":
    main()
