"""Where a streamed decode token's extra host time goes on CUDA (issue 24), in one process.

    PYTHONSAFEPATH=1 python bench/launch_probe.py [--tokens 48] [--rounds 3] [--out FILE.json]

The Qwen3-30B-A3B-shaped model of bench/gpu_pull.py, pools at 25% of the experts, an arena
holding every expert. Two parts:

- one layer's pull alone, repeated: host microseconds to build it (the kernel call's Python and
  binding) and to launch it (``mx.async_eval``: MLX's CUDA encoder), with the router's ids
  contiguous and strided (a slice, as the router hands them over), against the same rows
  gathered from the pool by MLX's own ``take`` and against a one-op baseline;
- one decode step at a time, resident's and the streamed one's, built, launched, waited for
  and checked apart, with no profiler;
- whole decodes, resident mlx-lm against expertd's loop, alternating round by round, for each
  variant of the loop's knobs (``--drains``: the most steps between two drained ones; 8 never
  backs off): tok/s and ratio, with tokens compared.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import daemon
from gpu_pools import decode
from gpu_pull import pull_model, read_every_expert, resident_split, streamed_split


def _per_call(make, calls: int = 200) -> dict:
    """Median host µs to build what ``make()`` returns and to launch it (async_eval)."""
    import mlx.core as mx

    mx.eval(make())  # compiled, warm
    build, launch = [], []
    kept = []
    for _ in range(calls):
        t = time.perf_counter()
        out = make()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        build.append(t1 - t)
        launch.append(t2 - t1)
        kept.append(out)
        if len(kept) >= 16:
            mx.eval(kept)
            kept = []
    mx.eval(kept)
    return dict(build_us=1e6 * statistics.median(build), launch_us=1e6 * statistics.median(launch))


def pull_alone(session) -> dict:
    import mlx.core as mx
    import numpy as np

    layer = session.manifest.layers[0].index
    pool = session.pools[0]
    puller = session.puller
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(pool.num_experts, 8, replace=False)).astype(np.uint32)
    flat = mx.array(ids.reshape(1, 1, 8))
    wide = mx.array(np.concatenate([ids, ids]).reshape(1, 1, 16))
    strided = wide[..., :8]  # a slice, as the router's top-k
    table = pool.pull_table()
    rows = mx.array(np.maximum(pool.row_of[ids], 0).astype(np.int32))
    out = {
        "pull, contiguous ids": _per_call(lambda: puller.assemble(layer, flat, pool)),
        "pull, strided ids": _per_call(lambda: puller.assemble(layer, strided, pool)),
        "take of pool rows (9 ops)": _per_call(lambda: [a[rows] for a in pool.arrays]),
        "one op": _per_call(lambda: flat + 1),
        "table lookup op": _per_call(lambda: table[flat]),
    }
    return out


def _tally(session) -> dict:
    """What a streamed session did so far: rows pulled, pool hits, promotions, steps, replays."""
    pools = session.pools
    return dict(rows_pulled=session.pull_counters()["rows_pulled"],
                hits=sum(p.counters["hits"] for p in pools),
                promoted=sum(p.counters["promoted"] for p in pools),
                steps=session.counters["steps"], replays=session.counters["replays"])


class Phases:
    """Host seconds a pipelined decode spends building steps (Steps.launch), launching them
    (mx.async_eval) and settling them (Steps.settle: the wait and the check), by thin wrappers
    (a microsecond each)."""

    def __init__(self, steps=None):
        import mlx.core as mx

        self.steps, self.mx = steps, mx  # steps None: mx.async_eval alone (a resident loop)
        self.t = dict(launch=0.0, async_eval=0.0, settle=0.0, drained=0)
        self._real = (mx.async_eval,) + ((steps.launch, steps.settle) if steps else ())

    def _wrap(self, key, real):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t
                if key == "settle" and len(a) + len(k) == 1:
                    self.t["drained"] += 1
        return timed

    def __enter__(self):
        self.mx.async_eval = self._wrap("async_eval", self._real[0])
        if self.steps is not None:
            self.steps.launch = self._wrap("launch", self._real[1])
            self.steps.settle = self._wrap("settle", self._real[2])
        return self.t

    def __exit__(self, *exc):
        self.mx.async_eval = self._real[0]
        if self.steps is not None:
            del self.steps.launch, self.steps.settle


def decodes(resident, streamed, tokenizer, args) -> list:
    from expertd.client import speculation

    rows = []
    original = speculation.MAX_DRAIN_EVERY
    steps = streamed.__dict__["_expertd_steps"]
    try:
        for drain in args.drains:
            speculation.MAX_DRAIN_EVERY = drain  # DRAIN_EVERY: drains never back off
            steps.drains = speculation.Drains()
            for model, own in ((resident, False), (streamed, True)):
                decode(model, tokenizer, args.tokens, 0.0, None, own)  # warm
            res, st = [], []
            phases = dict(launch=0.0, async_eval=0.0, settle=0.0, drained=0)
            session = streamed.expertd_session
            per_round = []
            for _ in range(args.rounds):
                a = decode(resident, tokenizer, args.tokens, 0.0)
                before = _tally(session)
                with Phases(steps) as t:
                    b = decode(streamed, tokenizer, args.tokens, 0.0, None, True)
                after = _tally(session)
                for k in phases:
                    phases[k] += t[k]
                per_round.append(dict(ratio=b["tps"] / a["tps"], resident_tps=a["tps"],
                                      **{k: round(1e3 * v / args.tokens, 3) if k != "drained"
                                         else v for k, v in t.items()},
                                      **{k: (after[k] - before[k]) / args.tokens
                                         for k in after}))
                print(per_round[-1], flush=True)
                if a["tokens"] != b["tokens"]:
                    raise AssertionError("streamed tokens differ from resident ones")
                res.append(a["tps"])
                st.append(b["tps"])
            ratios = [s / r for s, r in zip(st, res)]
            rows.append(dict(max_drain_every=drain, drain_every_now=steps.drains.every,
                             resident_tps=statistics.median(res),
                             streamed_tps=statistics.median(st),
                             ratio=statistics.median(ratios), ratios=ratios,
                             ms_per_token={k: 1e3 * v / (args.rounds * args.tokens)
                                           for k, v in phases.items() if k != "drained"},
                             drained=phases["drained"], per_round=per_round))
            print(rows[-1], flush=True)
    finally:
        speculation.MAX_DRAIN_EVERY = original
    return rows


def main() -> None:
    import mlx.core as mx
    import mlx_lm

    from expertd.client import load

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drains", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--small", action="store_true", help="a tiny model (a CPU smoke run)")
    parser.add_argument("--skip-split", action="store_true", help="no one-step split")
    parser.add_argument("--pull", default="auto", help="host: a CPU smoke run")
    args = parser.parse_args()
    model_dir, blob_dir, _, all_gb, pool_gb = pull_model(args.small)
    resident, tokenizer = mlx_lm.load(str(model_dir))
    result = dict(device=str(mx.default_device()), mlx=mx.__version__)
    with daemon(blob_dir, all_gb):
        streamed, _ = load(blob_dir, pool_gb=pool_gb, pull=args.pull, prefetch="off")
        session = streamed.expertd_session
        try:
            read_every_expert(session)
            decode(streamed, tokenizer, 8, 0.0, None, True)  # kernels compiled
            result["alone"] = pull_alone(session)
            for k, v in result["alone"].items():
                print(f"{k:28} build {v['build_us']:7.1f} us  launch {v['launch_us']:7.1f} us",
                      flush=True)
            # One step at a time, nothing else in flight, no profiler: build, launch (encode),
            # wait, check (ms), resident's and the streamed step's, twice each.
            result["split"] = [] if args.skip_split else [dict(resident=resident_split(resident, tokenizer),
                                    streamed=streamed_split(streamed, tokenizer, profile=False))
                               for _ in range(2)]
            print(json.dumps(result["split"]), flush=True)
            result["decodes"] = decodes(resident, streamed, tokenizer, args)
            result["counters"] = {k: v for k, v in session.counters.items() if v}
        finally:
            session.close()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
