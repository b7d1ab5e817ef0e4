"""Why rounds of the same decode spread so widely on the device (issue 24): every token's time.

    PYTHONSAFEPATH=1 python bench/token_times.py [--small] [--rounds 6] [--tokens 48]
                                                 [--out FILE.json]

The model of bench/gpu_pull.py (Qwen3-30B-A3B expert shapes), pools at 25% of the experts, an
arena holding every expert. Resident mlx-lm (its own loop) and the streamed model (expertd's
loop) alternate round by round, as in gpu_pull.py, and each round records:

- the host seconds between consecutive tokens (the first token's prompt excluded);
- Python's garbage collections during the round, by generation, with their seconds
  (``gc.callbacks``);
- for the streamed model, what each token's interval held: a drained step (settled before the
  next was launched), a step that waited per layer (auto's probe, or a pause), a replay.

``--variants`` picks what the streamed rounds run under, alternating by round when several are
given: ``default`` (Python's collector as it is), ``freeze`` (``gc.freeze()`` before the round,
as ``expertd.client.load`` could do once the model is built), ``prompt`` (both models compute a
512-token prompt's first token before the round, as gpu_pull.py's rounds do: the streamed
model's pools then hold what that prompt promoted), ``plain`` (a decode's speculative calls
run plainly, not as compiled graphs: ``StreamedLayer.compiled``). Tokens are compared in every
round.
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import daemon
from gpu_pools import PROMPT, TTFT_TOKENS, first_token
from gpu_pull import pull_model, read_every_expert
from launch_probe import Phases


class GcClock:
    """Seconds and counts of the collections by generation while entered."""

    def __init__(self):
        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._start = None

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            g = info["generation"]
            self.seconds[g] += time.perf_counter() - self._start
            self.count[g] += 1
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


COUNTED = ("host_waits", "replays", "steps", "speculative_steps")


def one_round(model, tokenizer, tokens: int, own: bool, session=None) -> dict:
    """One decode: the tokens, the host interval between consecutive ones, the collections,
    and per token the phases' milliseconds (Phases; resident: its mx.async_eval alone) and,
    with ``session``, what its steps did (COUNTED, drains, promotions)."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    if own:
        from expertd.client.decode import stream_generate
    mx.random.seed(0)

    def marks() -> dict:
        now = {k: 1e3 * v if k != "drained" else v for k, v in t.items()}
        if session is not None:
            now.update({k: session.counters[k] for k in COUNTED},
                       promoted=sum(p.counters["promoted"] for p in session.pools))
        return now

    stamps, out, events = [], [], []
    with GcClock() as clock, Phases(model.__dict__.get("_expertd_steps")) as t:
        last = marks()
        for r in stream_generate(model, tokenizer, PROMPT, max_tokens=tokens):
            stamps.append(time.perf_counter())
            out.append(r.token)
            now = marks()
            events.append({k: round(now[k] - last[k], 3) for k in now})
            last = now
    gaps = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]
    return dict(tokens=out, gaps_ms=gaps, tps=len(gaps) / (stamps[-1] - stamps[0]),
                gc_ms=[1e3 * s for s in clock.seconds], gc_count=clock.count, events=events)


def main() -> None:
    import mlx.core as mx
    import mlx_lm

    from expertd.client import load

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (a CPU smoke run)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--variants", nargs="+", default=["default", "freeze", "prompt"],
                        choices=["default", "freeze", "prompt", "plain"])
    parser.add_argument("--pull", default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model_dir, blob_dir, _, all_gb, pool_gb = pull_model(args.small)
    resident, tokenizer = mlx_lm.load(str(model_dir))
    result = dict(device=str(mx.default_device()), mlx=mx.__version__, python=sys.version,
                  gc_threshold=gc.get_threshold(), rounds=[])
    with daemon(blob_dir, all_gb):
        streamed, _ = load(blob_dir, pool_gb=pool_gb, pull=args.pull, prefetch="off")
        session = streamed.expertd_session
        try:
            read_every_expert(session)
            for model, own in ((streamed, True), (resident, False), (streamed, True)):
                one_round(model, tokenizer, args.tokens, own)  # compiled, warm
            result["objects"] = len(gc.get_objects())
            ids = mx.array([[(37 * i + 11) % (resident.args.vocab_size - 16) + 8
                             for i in range(TTFT_TOKENS)]])
            for i in range(args.rounds):
                mode = args.variants[i % len(args.variants)]
                if mode == "prompt":
                    for model in (resident, streamed):
                        first_token(model, ids)
                a = one_round(resident, tokenizer, args.tokens, False)
                if mode == "freeze":
                    gc.collect()
                    gc.freeze()
                layers = streamed.__dict__["_expertd_steps"].layers
                for layer in layers:
                    layer.compiled = mode != "plain"
                try:
                    b = one_round(streamed, tokenizer, args.tokens, True, session)
                finally:
                    gc.unfreeze()
                    for layer in layers:
                        layer.compiled = True
                if a["tokens"] != b["tokens"]:
                    raise AssertionError("streamed tokens differ from resident ones")
                row = dict(variant=mode, ratio=b["tps"] / a["tps"], resident=a, streamed=b)
                result["rounds"].append(row)
                sa, sb = sorted(a["gaps_ms"]), sorted(b["gaps_ms"])
                print(f"round {i} {mode}: ratio {row['ratio']:.3f}  resident "
                      f"{a['tps']:.1f} tok/s (gap p50 {statistics.median(sa):.2f} max "
                      f"{sa[-1]:.2f} ms, gc {a['gc_count']} {sum(a['gc_ms']):.1f} ms)  "
                      f"streamed {b['tps']:.1f} (p50 {statistics.median(sb):.2f} max "
                      f"{sb[-1]:.2f}, gc {b['gc_count']} {sum(b['gc_ms']):.1f} ms)",
                      flush=True)
                for who, run in (("resident", a), ("streamed", b)):
                    per = {k: statistics.median(e.get(k, 0.0) for e in run["events"][1:])
                           for k in ("launch", "async_eval", "settle")}
                    print(f"   {who} median ms a token: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in per.items()), flush=True)
                slow = sorted(range(len(b["gaps_ms"])), key=lambda j: -b["gaps_ms"][j])[:4]
                print("   slowest streamed gaps:",
                      [(j, round(b["gaps_ms"][j], 2), b["events"][j + 1]) for j in slow],
                      flush=True)
        finally:
            session.close()
    for mode in args.variants:
        rs = [r["ratio"] for r in result["rounds"] if r["variant"] == mode]
        if rs:
            print(f"{mode}: median ratio {statistics.median(rs):.3f} of {len(rs)} "
                  f"{[round(r, 3) for r in rs]}")
    if args.out:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
