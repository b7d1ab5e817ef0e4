"""Speculative decoding with a draft model on a streamed model (issue 26, item 13).

    PYTHONSAFEPATH=1 python bench/draft.py [--rounds 2] [--tokens 48] [--results]

Resident mlx-lm and the streamed model (pools 25% of the experts, the arena holding every
expert), each with and without a resident draft, alternating round by round in one process;
greedy tokens must be equal with the draft and without it, or it raises. The draft is the
model's 8-bit twin (same vocabulary, close predictions): no small trained draft exists
offline, so the draft costs about what the model does, and what this measures is the mechanism:
drafted tokens accepted, model calls and host waits per token, tok/s side by side.
"""

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MEDIUM, ROOT, daemon, ensure_model, write_section
from gpu_pools import PROMPT, QWEN3_30B_SHAPES

SECTION = "## Draft models (issue 26)"
DRAFTS = 3


def run_once(model, tokenizer, draft, tokens: int) -> dict:
    import mlx_lm

    extra = dict(draft_model=draft, num_draft_tokens=DRAFTS) if draft is not None else {}
    out, drafted, last = [], 0, None
    for last in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=tokens, **extra):
        out.append(last.token)
        drafted += last.from_draft
    return dict(tps=last.generation_tps, tokens=out, drafted=drafted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--results", action="store_true", help="write into bench/RESULTS.md")
    args = parser.parse_args()
    import mlx.core as mx
    import mlx_lm

    from expertd.client import load
    from expertd.manifest import Manifest

    gpu = mx.default_device() == mx.gpu
    spec = QWEN3_30B_SHAPES if gpu else dict(MEDIUM, experts=64)  # 25%: 2 x top-k rows
    name = "gpu-pools-qwen3-30b-shapes" if gpu else "draft-medium-64"
    model_dir, blob_dir = ensure_model(name, spec)
    draft_dir, _ = ensure_model(name + "-8bit", dict(spec, bits=8))
    m = Manifest.load(blob_dir)
    all_gb = m.total_expert_bytes * 1.3 / 2**30 + 0.01
    pool_gb = 0.25 * sum(la.num_experts * la.expert_bytes for la in m.layers) / 2**30
    resident, tokenizer = mlx_lm.load(str(model_dir))
    draft = mlx_lm.load(str(draft_dir))[0]
    runs = {k: [] for k in ("resident", "resident+draft", "streamed", "streamed+draft")}
    counts = {}
    with daemon(blob_dir, all_gb):
        streamed, _ = load(blob_dir, pool_gb=pool_gb, prefetch="off")
        session = streamed.expertd_session
        try:
            import numpy as np

            for layer in session.manifest.layers:  # the arena holds every expert
                session.demand_absent(layer.index, np.arange(layer.num_experts, dtype=np.int32))
            for model in (resident, streamed):  # warm-up
                run_once(model, tokenizer, None, 8)
                run_once(model, tokenizer, draft, 8)
            for _ in range(args.rounds):
                for key, model, d in (("resident", resident, None),
                                      ("resident+draft", resident, draft),
                                      ("streamed", streamed, None),
                                      ("streamed+draft", streamed, draft)):
                    c0 = dict(session.counters)
                    t = time.perf_counter()
                    r = run_once(model, tokenizer, d, args.tokens)
                    r["seconds"] = time.perf_counter() - t
                    if model is streamed:
                        c = session.counters
                        r.update(steps=c["steps"] - c0["steps"],
                                 host_waits=c["host_waits"] - c0["host_waits"],
                                 replays=c["replays"] - c0["replays"])
                    runs[key].append(r)
                for with_draft in ("", "+draft"):
                    if runs["resident" + with_draft][-1]["tokens"] != \
                            runs["streamed" + with_draft][-1]["tokens"]:
                        raise AssertionError(f"streamed{with_draft} tokens differ from resident")
        finally:
            session.close()
        del streamed
        gc.collect()
    for key, rs in runs.items():
        n = sum(len(r["tokens"]) for r in rs)
        counts[key] = dict(tps=statistics.median(r["tps"] for r in rs),
                           drafted=sum(r["drafted"] for r in rs) / n,
                           **({k: sum(r[k] for r in rs) / n for k in
                               ("steps", "host_waits", "replays")} if "steps" in rs[0] else {}))
    lines = [SECTION, "",
             f"`PYTHONSAFEPATH=1 python bench/draft.py --rounds {args.rounds} --tokens "
             f"{args.tokens}` on {mx.default_device()} (MLX {mx.__version__}), "
             f"{time.strftime('%Y-%m-%d')}: {spec['layers']} layers, {spec['experts']} experts, "
             f"top-{spec['top_k']}, hidden {spec['hidden']}; streamed with pools of 25% of the "
             f"experts and the arena holding every expert; the draft is the model's 8-bit twin "
             f"drafting {DRAFTS} tokens at a time (see the script's docstring). Greedy tokens "
             f"equal resident's, with the draft and without it, in every round.", "",
             "| run | tok/s | ÷ resident (same draft) | tokens drafted and accepted | "
             "model calls / token | host waits / token |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key, c in counts.items():
        base = counts["resident+draft" if "draft" in key else "resident"]["tps"]
        lines.append(f"| {key} | {c['tps']:.1f} | {c['tps'] / base:.2f} | {c['drafted']:.0%} | "
                     f"{c.get('steps', float('nan')):.2f} | {c.get('host_waits', float('nan')):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results:
        write_section(ROOT / "RESULTS.md", SECTION, text)


if __name__ == "__main__":
    main()
