"""Host microseconds to build one MoE block's decode call (issue 24): resident against streamed.

    PYTHONSAFEPATH=1 python bench/build_probe.py [--small] [--calls 2000] [--rounds 3]

On a GPU the host is a decode's bound (bench/RESULTS.md, issue 24), so what a streamed layer
costs the host to build counts beside the device's work. For one MoE block of bench/gpu_pull.py's
model (``--small``: the tiny one), pools at 25% of the experts and an arena holding every
expert, the median host µs to build (not evaluate) a decode call of:

- resident mlx-lm's block;
- the streamed block in a speculative step, compiled (StreamedLayer.block_call) and plainly
  (``StreamedLayer.compiled = False``), with the per-layer host path (pull off: the ids are
  remapped on the device, as without a device puller).

Every 50th call is evaluated, so the graphs do not grow. Outputs are compared first: the
compiled block's equal the plain one's, bit for bit.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_seconds, daemon
from gpu_pull import pull_model, read_every_expert


def main() -> None:
    import mlx.core as mx
    import mlx_lm

    from expertd.client import load

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the tiny model (a CPU run)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_dir, blob_dir, _, all_gb, pool_gb = pull_model(args.small)
    resident, _ = mlx_lm.load(str(model_dir))
    with daemon(blob_dir, all_gb):
        streamed, _ = load(blob_dir, pool_gb=pool_gb, pull="off", prefetch="off",
                           speculate="on", fill_pools=True)
        try:
            read_every_expert(streamed.expertd_session)
            ours, theirs = streamed.model.layers[1].mlp, resident.model.layers[1].mlp
            layer = ours.__dict__["_expertd_layer"]
            x = mx.random.normal((1, 1, resident.args.hidden_size)).astype(mx.bfloat16)
            mode = layer.mode
            mode.speculative, mode.records = True, []
            try:
                for _ in range(3):  # the first call of the shape plain, then traced
                    got = ours(x)
                layer.compiled = False
                plain = ours(x)
                layer.compiled = True
                # (not resident's: an expert missing from the pool computes with a
                # placeholder row in a speculative call, which the step's check replays)
                if not mx.array_equal(got, plain).item():
                    raise AssertionError("the compiled block's output differs from the plain one")
                print(f"{mx.default_device()}, MLX {mx.__version__}, block "
                      f"{type(theirs).__name__}, µs to build a decode call (median of "
                      f"{args.calls}):", flush=True)
                for _ in range(args.rounds):
                    mode.records = []
                    a = 1e6 * build_seconds(lambda: theirs(x), args.calls, 50)
                    b = 1e6 * build_seconds(lambda: ours(x), args.calls, 50)
                    layer.compiled = False
                    mode.records = []
                    c = 1e6 * build_seconds(lambda: ours(x), args.calls, 50)
                    layer.compiled = True
                    print(f"  resident {a:.1f}, streamed compiled {b:.1f}, streamed plain "
                          f"{c:.1f}", flush=True)
            finally:
                mode.speculative, mode.records = False, None
        finally:
            streamed.expertd_session.close()


if __name__ == "__main__":
    main()
