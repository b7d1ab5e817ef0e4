"""Where the host's time goes in a decode token: resident mlx-lm against expertd's loop.

    PYTHONSAFEPATH=1 python bench/host_profile.py [--tokens 48] [--top 30] [--out DIR]

On MLX's CUDA backend a decode token is bound by the host (bench/RESULTS.md, "Where a token's
time goes on CUDA"), so what a streamed token adds is host time. This runs the Qwen3-30B-A3B
-shaped model of bench/gpu_pull.py with pools at 25% of the experts and an arena holding every
expert, decodes the same prompt with resident mlx-lm (mlx_lm.stream_generate) and with the
streamed model (expertd's loop), first plainly (tok/s, tokens compared), then under cProfile,
and prints each run's functions by own time, with the host time per token of the calls that
matter: building (the model's forward), launching (``mx.async_eval``: encoding the graph), the
waits (``mx.eval``, ``.item()``) and the streamed step's check and bookkeeping.
"""

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import daemon
from gpu_pools import decode
from gpu_pull import pull_model, read_every_expert

# (label, function name as pstats spells it): host time per token of each
KEYS = (("mx.async_eval", "async_eval host_profile.py"),
        ("mx.eval", "eval host_profile.py"),
        ("model forward", "__call__ qwen3_moe.py:247"),
        ("Steps.launch", "launch step.py"),
        ("Steps.settle", "settle step.py"),
        ("StepCheck.check", "check step_check.py"),
        ("StepCheck.flush", "flush step_check.py"),
        ("StreamedLayer.forward", "forward layer.py"),
        ("puller.assemble", "assemble pull.py"),
        ("switch compute", "compute switch.py"))


def _timed(real):
    """``real`` (an mlx.core function) behind a Python function of its name, which cProfile
    sees (it does not see nanobind's functions: their time lands in their callers')."""
    def async_eval(*args, **kwargs):
        return real(*args, **kwargs)

    def eval(*args, **kwargs):
        return real(*args, **kwargs)

    return {"async_eval": async_eval, "eval": eval}[real.__name__]


def _find(stats: pstats.Stats, key: str) -> float:
    """Cumulative seconds of the function ``key`` names (a built-in's repr, or "name file")."""
    total = 0.0
    for (file, line, name), (_, _, _, ct, _) in stats.stats.items():
        if key.startswith("<"):
            hit = name == key
        else:
            want = key.split()
            hit = name == want[0] and file.endswith(want[1].split(":")[0]) and (
                ":" not in want[1] or str(line) == want[1].split(":")[1])
        if hit:
            total += ct
    return total


def profiled(model, tokenizer, tokens: int, own_loop: bool, top: int) -> tuple:
    import mlx.core as mx

    prof = cProfile.Profile()
    real = mx.async_eval, mx.eval
    mx.async_eval, mx.eval = _timed(real[0]), _timed(real[1])
    try:
        prof.enable()
        run = decode(model, tokenizer, tokens, 0.0, None, own_loop)
        prof.disable()
    finally:
        mx.async_eval, mx.eval = real
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    per = {label: 1e3 * _find(stats, key) / tokens for label, key in KEYS}
    return run, per, text.getvalue()


def main() -> None:
    import mlx.core as mx
    import mlx_lm

    from expertd.client import load

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, help="a folder for the profiles' text")
    args = parser.parse_args()
    model_dir, blob_dir, _, all_gb, pool_gb = pull_model(args.small)
    resident, tokenizer = mlx_lm.load(str(model_dir))
    with daemon(blob_dir, all_gb):
        streamed, _ = load(blob_dir, pool_gb=pool_gb, pull="auto", prefetch="off")
        session = streamed.expertd_session
        try:
            read_every_expert(session)
            for _ in range(2):  # warm-up: kernels compiled, pools settled
                decode(resident, tokenizer, args.tokens, 0.0)
                decode(streamed, tokenizer, args.tokens, 0.0, None, True)
            plain = {}
            for label, model, own in (("resident", resident, False),
                                      ("streamed", streamed, True)):
                runs = [decode(model, tokenizer, args.tokens, 0.0, None, own) for _ in range(3)]
                plain[label] = sorted(r["tps"] for r in runs)[1]
                plain[label + "_tokens"] = runs[0]["tokens"]
            if plain["resident_tokens"] != plain["streamed_tokens"]:
                raise AssertionError("streamed tokens differ from resident ones")
            print(f"device {mx.default_device()}, mlx {mx.__version__}; decode tok/s: "
                  f"resident {plain['resident']:.1f}, streamed {plain['streamed']:.1f}, "
                  f"ratio {plain['streamed'] / plain['resident']:.3f}")
            rows = {}
            for label, model, own in (("resident", resident, False),
                                      ("streamed", streamed, True)):
                run, per, text = profiled(model, tokenizer, args.tokens, own, args.top)
                rows[label] = per
                print(f"\n== {label} under cProfile: {run['tps']:.1f} tok/s\n{text}")
                if args.out:
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / f"{label}.txt").write_text(text)
            print("\nhost ms per token (cumulative, under cProfile)")
            print(f"{'call':24} {'resident':>9} {'streamed':>9}")
            for label, _ in KEYS:
                print(f"{label:24} {rows['resident'][label]:9.3f} {rows['streamed'][label]:9.3f}")
            print({k: v for k, v in session.counters.items() if v})
        finally:
            session.close()


if __name__ == "__main__":
    main()
