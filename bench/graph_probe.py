"""What a decode step costs the host on a GPU, resident and streamed, and the CUDA graphs it makes.

    PYTHONSAFEPATH=1 python bench/graph_probe.py [--small] [--steps 32] [--out probe.json]

On the bench's model (gpu_pull.py's: pools 25%, the arena holding every expert, expertd's
speculative step as its pipelined loop makes it): per decode step, the Python build, MLX's encode
(``mx.async_eval``), the wait and the check, for resident mlx-lm and for the streamed model, each
step evaluated before the next (gpu_pull.py's split, without the profiler). On MLX's CUDA backend
the encode is where a host-bound step goes (bench/RESULTS.md); with MLX_SAVE_CUDA_GRAPHS_DOT_FILE
set (MLX writes one file per committed CUDA graph), each phase's graphs and kernel nodes are
counted too. Run it under MLX's CUDA environment switches (MLX_USE_CUDA_GRAPHS,
MLX_MAX_OPS_PER_BUFFER, MLX_CUDA_GRAPH_CACHE_SIZE) to see what each does to both. With the CUDA
puller, the streamed steps run once more with the step's statuses joined by mx.concatenate (a
copy node a layer) instead of CudaPuller.join's one kernel, between the first pass and the last.
"""

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import daemon
from gpu_pools import PROMPT
from gpu_pull import pull_model, read_every_expert


def graphs_so_far() -> tuple:
    """``(files, nodes)`` MLX has written so far under MLX_SAVE_CUDA_GRAPHS_DOT_FILE."""
    prefix = os.environ.get("MLX_SAVE_CUDA_GRAPHS_DOT_FILE")
    if not prefix:
        return 0, 0
    files = glob.glob(prefix + "_*.dot")
    nodes = 0
    for f in files:  # a node is a line with a label; its edges have none
        with open(f) as fh:
            nodes += sum(1 for line in fh if "label" in line and "->" not in line)
    return len(files), nodes


def resident_steps(model, tokenizer, steps: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = model(mx.array([tokenizer.encode(PROMPT)]), cache=cache)[:, -1].argmax(-1)
    mx.eval(y)
    for _ in range(4):  # warm: every shape seen
        y = model(y[:, None], cache=cache)[:, -1].argmax(-1)
        mx.eval(y)
    files, nodes = graphs_so_far()
    build = encode = wait = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        y = model(y[:, None], cache=cache)[:, -1].argmax(-1)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        build, encode, wait = build + t1 - t, encode + t2 - t1, wait + t3 - t2
    f2, n2 = graphs_so_far()
    return dict(build_ms=1e3 * build / steps, encode_ms=1e3 * encode / steps,
                wait_ms=1e3 * wait / steps, graphs=(f2 - files) / steps,
                nodes=(n2 - nodes) / steps)


def streamed_steps(model, tokenizer, steps: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from expertd.client.step import StepGuard

    guard = model.__dict__["_expertd_steps"]
    forward = super(StepGuard, model).__call__
    cache = make_prompt_cache(model)
    y = model(mx.array([tokenizer.encode(PROMPT)]), cache=cache)[:, -1].argmax(-1)
    mx.eval(y)
    out = dict(build_ms=0.0, encode_ms=0.0, wait_ms=0.0, check_ms=0.0, replays=0)
    counted = 0
    files = nodes = 0
    for i in range(steps + 4):
        if i == 4:  # warm: every shape seen
            files, nodes = graphs_so_far()
        t = time.perf_counter()
        launched = guard.launch(forward, y[:, None], (), {"cache": cache})
        y = launched.logits[:, -1].argmax(-1)
        t1 = time.perf_counter()
        mx.async_eval(y, *launched.flat)
        t2 = time.perf_counter()
        mx.eval(y, *launched.flat)
        t3 = time.perf_counter()
        if guard.settle(launched) is not None:
            out["replays"] += 1
            break
        t4 = time.perf_counter()
        if i >= 4:
            counted += 1
            for k, v in (("build_ms", t1 - t), ("encode_ms", t2 - t1), ("wait_ms", t3 - t2),
                         ("check_ms", t4 - t3)):
                out[k] += 1e3 * v
    guard.quiesce()
    f2, n2 = graphs_so_far()
    counted = max(1, counted)
    out = {k: (v / counted if k.endswith("_ms") else v) for k, v in out.items()}
    out.update(steps=counted, graphs=(f2 - files) / counted, nodes=(n2 - nodes) / counted)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent
                        / "graph_probe.json")
    args = parser.parse_args()

    import mlx.core as mx
    import mlx_lm

    from expertd.client import load
    from expertd.client.pull import Puller

    model_dir, blob_dir, m, all_gb, pool_gb = pull_model(args.small)
    resident, tokenizer = mlx_lm.load(str(model_dir))
    env = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    result = dict(device=str(mx.default_device()), mlx=mx.__version__, env=env)
    result["resident"] = resident_steps(resident, tokenizer, args.steps)
    with daemon(blob_dir, all_gb):
        streamed, _ = load(blob_dir, pool_gb=pool_gb, prefetch="off")
        session = streamed.expertd_session
        try:
            read_every_expert(session)
            result["puller"] = session.puller.name if session.puller is not None else "none"
            result["streamed"] = streamed_steps(streamed, tokenizer, args.steps)
            puller = session.puller
            if puller is not None and type(puller).join is not Puller.join:
                # The statuses joined as before CudaPuller.join: mx.concatenate, a copy node
                # a layer in the step's CUDA graph. Between two passes with the join, so
                # that the pools' drift between passes is on both sides of it.
                puller.join = lambda parts: Puller.join(puller, parts)
                try:
                    result["streamed_concatenate"] = streamed_steps(streamed, tokenizer,
                                                                    args.steps)
                finally:
                    del puller.join
                if session.puller is not puller:
                    result["streamed_concatenate"]["puller_replaced"] = True
            result["streamed_again"] = streamed_steps(streamed, tokenizer, args.steps)
        finally:
            session.close()
    result["resident_again"] = resident_steps(resident, tokenizer, args.steps)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
