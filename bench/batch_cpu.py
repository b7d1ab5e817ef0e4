"""A batch of sequences decoded together on this CPU (issue 42), next to resident mlx-lm.

    PYTHONSAFEPATH=1 python bench/batch_cpu.py [--rounds 3] [--tokens 32] [--batch 8]
                                               [--out FILE.json] [--results]

The issue's model (Qwen3-style, 4 MoE layers of 64 experts, top-8, hidden 512), a daemon whose
arena holds every expert, the streamed model loaded for ``--batch`` sequences decoded together
(``load(decode_concurrency=)``: its default pools on unified memory). Each round runs, in one
process and alternating with the resident model (mlx_lm.load of the same checkpoint):

- mlx-lm's own ``batch_generate`` of the batch, on the streamed model and on the resident one;
- expertd's ``batch_generate`` (client/batch.py: each step launched before the last is
  checked) on the streamed model;
- one sequence, expertd's pipelined loop (``stream_generate``) and mlx-lm's, for scale.

Token ids must be equal to resident's in every round, or it raises. The ratios are of
generated tokens per second (decode: each run's ``generation_tps``).
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import daemon, ensure_model, report

ISSUE_MODEL = dict(family="qwen3_moe", layers=4, experts=64, top_k=8, hidden=512, moe_inter=384,
                   bits=4, mode="affine", seed=5)
SECTION = "## CPU: a batch decoded together (issue 42)"
BAR = 0.8


def prompts(vocab: int, n: int) -> list:
    return [[(37 * i + 13 * s) % (vocab - 16) + 8 for i in range(12 + 3 * s)] for s in range(n)]


def one_round(resident, streamed, tokenizer, ids, tokens: int) -> dict:
    import mlx_lm

    from expertd.client.batch import batch_generate
    from expertd.client.decode import stream_generate

    out = {}
    for name, model, run in (("mlx-lm batch, resident", resident, mlx_lm.batch_generate),
                             ("mlx-lm batch, streamed", streamed, mlx_lm.batch_generate),
                             ("expertd batch, streamed", streamed, batch_generate)):
        r = run(model, tokenizer, ids, max_tokens=tokens, **(
            {"return_token_ids": True} if run is mlx_lm.batch_generate else {}))
        out[name] = dict(tps=r.stats.generation_tps, ids=r.token_ids)
    for name, model, run in (("one sequence, resident", resident, mlx_lm.stream_generate),
                             ("one sequence, streamed", streamed, stream_generate)):
        last = None
        toks = []
        for last in run(model, tokenizer, ids[0], max_tokens=tokens):
            toks.append(last.token)
        out[name] = dict(tps=last.generation_tps, ids=[toks])
    return out


def run(args) -> dict:
    import mlx.core as mx
    import mlx_lm

    from expertd.client import load
    from expertd.manifest import Manifest

    model_dir, blob_dir = ensure_model("batch-cpu-issue42", ISSUE_MODEL)
    m = Manifest.load(blob_dir)
    resident, tokenizer = mlx_lm.load(str(model_dir))
    ids = prompts(resident.args.vocab_size, args.batch)
    rounds = []
    with daemon(blob_dir, m.total_expert_bytes * 1.3 / 2**30 + 0.01):
        streamed, _ = load(blob_dir, decode_concurrency=args.batch)
        session = streamed.expertd_session
        try:
            pools = [p.rows for p in session.pools]
            one_round(resident, streamed, tokenizer, ids, 4)  # warm: every expert read once
            for _ in range(args.rounds):
                r = one_round(resident, streamed, tokenizer, ids, args.tokens)
                for name in ("mlx-lm batch, streamed", "expertd batch, streamed"):
                    if r[name]["ids"] != r["mlx-lm batch, resident"]["ids"]:
                        raise AssertionError(f"{name}: tokens differ from resident's")
                if r["one sequence, streamed"]["ids"] != r["one sequence, resident"]["ids"]:
                    raise AssertionError("one sequence: tokens differ from resident's")
                rounds.append({k: v["tps"] for k, v in r.items()})
            counters = session.all_counters()
        finally:
            session.close()
    ratio = {name: statistics.median(r[name] / r[base] for r in rounds) for name, base in (
        ("mlx-lm batch, streamed", "mlx-lm batch, resident"),
        ("expertd batch, streamed", "mlx-lm batch, resident"),
        ("one sequence, streamed", "one sequence, resident"))}
    return dict(model=ISSUE_MODEL, device=str(mx.default_device()), mlx=mx.__version__,
                batch=args.batch, tokens=args.tokens, pool_rows=pools, rounds=rounds,
                ratio=ratio, counters={k: counters[k] for k in (
                    "steps", "unchecked_steps", "speculative_steps", "replays", "host_waits",
                    "decode_tokens", "batch_steps", "routed_pairs", "union_experts")})


def table(r: dict) -> str:
    lines = [f"{SECTION}\n",
             f"{r['device']}, MLX {r['mlx']}; the issue's model (4 MoE layers × 64 experts, "
             f"top-8, hidden 512), the arena holding every expert, the streamed model loaded "
             f"for {r['batch']} sequences (default pools: {r['pool_rows'][0]} rows a layer); "
             f"{len(r['rounds'])} rounds of {r['tokens']} tokens a sequence, resident "
             "alternating in the same process; token ids equal to resident's in every round. "
             "`python bench/batch_cpu.py`.\n",
             "| path | streamed ÷ resident (median) | rounds | target | verdict |",
             "| --- | --- | --- | --- | --- |"]
    per = {name: [f"{x[name] / x[base]:.2f}" for x in r["rounds"]] for name, base in (
        ("mlx-lm batch, streamed", "mlx-lm batch, resident"),
        ("expertd batch, streamed", "mlx-lm batch, resident"),
        ("one sequence, streamed", "one sequence, resident"))}
    for name, label, bar in (
            ("mlx-lm batch, streamed", f"mlx-lm's batch_generate, {r['batch']} sequences", BAR),
            ("expertd batch, streamed", f"expertd's batch_generate, {r['batch']} sequences "
             "(÷ mlx-lm's on resident)", None),
            ("one sequence, streamed", "one sequence (expertd's loop ÷ mlx-lm's)", None)):
        ratio = r["ratio"][name]
        verdict = "" if bar is None else "pass" if ratio >= bar else "FAIL"
        lines.append(f"| {label} | {ratio:.2f} | {', '.join(per[name])} | "
                     f"{f'≥ {bar}' if bar else ''} | {verdict} |")
    c = r["counters"]
    lines.append(f"\nThe streamed model's steps: {c['steps']}, {c['unchecked_steps']} of them "
                 f"unchecked (every pool holding every expert), {c['replays']} replayed (an "
                 f"expert not yet in its pool), {c['host_waits']} host waits; "
                 f"{c['batch_steps']} batch steps.\n")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", type=Path)
    p.add_argument("--results", action="store_true", help="write bench/RESULTS.md's section")
    args = p.parse_args()
    r = run(args)
    report(args, r, table(r), SECTION)


if __name__ == "__main__":
    main()
