"""A batch of sequences decoded together (issue 42), next to resident mlx-lm, in one process.

    PYTHONSAFEPATH=1 python bench/batch_cpu.py [--rounds 3] [--tokens 32] [--batch 8]
                                               [--out FILE.json] [--results]
    (on the lent GPU)           python bench/batch_cpu.py --gpu [--batch 8]

The issue's model (Qwen3-style, 4 MoE layers of 64 experts, top-8, hidden 512), a daemon whose
arena holds every expert, the streamed model loaded for ``--batch`` sequences decoded together
(``load(decode_concurrency=)``: its default pools on unified memory). With ``--gpu``: the
Qwen3-30B-A3B-shaped model of gpu_pull.py (12 MoE layers × 128 experts, 4-bit) with pools of a
quarter of the experts, and expertd's batch also run with its layers' compiled calls off
("plain"), which shows what compiling a batch's step is worth where the host is the bound.
Each round runs, in one process and alternating with the resident model (mlx_lm.load of the
same checkpoint):

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

from common import daemon, ensure_model, run_and_report

ISSUE_MODEL = dict(family="qwen3_moe", layers=4, experts=64, top_k=8, hidden=512, moe_inter=384,
                   bits=4, mode="affine", seed=5)
SECTION = "## CPU: a batch decoded together (issue 42)"
GPU_SECTION = "## GPU: a batch decoded together (issue 42)"
BAR = 0.8


def prompts(vocab: int, n: int) -> list:
    return [[(37 * i + 13 * s) % (vocab - 16) + 8 for i in range(12 + 3 * s)] for s in range(n)]


def one_round(resident, streamed, tokenizer, ids, tokens: int, plain: bool = False) -> dict:
    import mlx_lm

    from expertd.client.batch import batch_generate
    from expertd.client.decode import stream_generate

    out = {}
    runs = [("mlx-lm batch, resident", resident, mlx_lm.batch_generate),
            ("mlx-lm batch, streamed", streamed, mlx_lm.batch_generate),
            ("expertd batch, streamed", streamed, batch_generate)]
    if plain:
        runs.append(("expertd batch, plain", streamed, batch_generate))
    for name, model, run in runs:
        layers = model.__dict__["_expertd_steps"].layers if model is streamed else []
        for layer in layers:  # "plain": no layer's call compiled
            layer.compiled = name != "expertd batch, plain"
        r = run(model, tokenizer, ids, max_tokens=tokens, **(
            {"return_token_ids": True} if run is mlx_lm.batch_generate else {}))
        out[name] = dict(tps=r.stats.generation_tps, ids=r.token_ids)
    for layer in streamed.__dict__["_expertd_steps"].layers:
        layer.compiled = True
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

    if args.gpu:
        from gpu_pools import QWEN3_30B_SHAPES, TINY
        from gpu_pull import pull_model, read_every_expert

        spec = TINY if args.small else QWEN3_30B_SHAPES
        model_dir, blob_dir, m, all_gb, pool_gb = pull_model(args.small)
        options = dict(pool_gb=pool_gb)
    else:
        spec, read_every_expert = ISSUE_MODEL, None
        model_dir, blob_dir = ensure_model("batch-cpu-issue42", ISSUE_MODEL)
        m = Manifest.load(blob_dir)
        all_gb, options = m.total_expert_bytes * 1.3 / 2**30 + 0.01, {}
    resident, tokenizer = mlx_lm.load(str(model_dir))
    ids = prompts(resident.args.vocab_size, args.batch)
    rounds = []
    with daemon(blob_dir, all_gb):
        streamed, _ = load(blob_dir, decode_concurrency=args.batch, **options)
        session = streamed.expertd_session
        try:
            pools = [p.rows for p in session.pools]
            if read_every_expert is not None:
                read_every_expert(session)
            one_round(resident, streamed, tokenizer, ids, 4, args.gpu)  # warm: read, traced
            for _ in range(args.rounds):
                r = one_round(resident, streamed, tokenizer, ids, args.tokens, args.gpu)
                for name in [n for n in r if n.startswith(("mlx-lm batch, s", "expertd batch"))]:
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
        ("expertd batch, plain", "mlx-lm batch, resident"),
        ("one sequence, streamed", "one sequence, resident")) if name in rounds[0]}
    return dict(model=spec, device=str(mx.default_device()), mlx=mx.__version__,
                batch=args.batch, tokens=args.tokens, pool_rows=pools, rounds=rounds,
                ratio=ratio, counters={k: counters[k] for k in (
                    "steps", "unchecked_steps", "speculative_steps", "replays", "host_waits",
                    "decode_tokens", "batch_steps", "routed_pairs", "union_experts",
                    "pulled_rows", "pulled_bytes")})


def section(r: dict) -> str:
    return SECTION if r["model"] == ISSUE_MODEL else GPU_SECTION


def table(r: dict) -> str:
    spec = r["model"]
    what = ("the issue's model (4 MoE layers × 64 experts, top-8, hidden 512)"
            if spec == ISSUE_MODEL else
            f"a model of {spec['family']} shapes ({spec['layers']} MoE layers × {spec['experts']} "
            f"experts, top-{spec['top_k']}, {spec['bits']}-bit), pools of a quarter of the "
            "experts")
    lines = [f"{section(r)}\n",
             f"{r['device']}, MLX {r['mlx']}; {what}, the arena holding every expert, the "
             f"streamed model loaded for {r['batch']} sequences ({r['pool_rows'][0]} pool rows "
             f"a layer); {len(r['rounds'])} rounds of {r['tokens']} tokens a sequence, "
             "resident alternating in the same process; token ids equal to resident's in every "
             f"round. `python bench/batch_cpu.py{' --gpu' if spec != ISSUE_MODEL else ''}`.\n",
             "| path | streamed ÷ resident (median) | rounds | target | verdict |",
             "| --- | --- | --- | --- | --- |"]
    bases = {"mlx-lm batch, streamed": "mlx-lm batch, resident",
             "expertd batch, streamed": "mlx-lm batch, resident",
             "expertd batch, plain": "mlx-lm batch, resident",
             "one sequence, streamed": "one sequence, resident"}
    for name, label, bar in (
            ("mlx-lm batch, streamed", f"mlx-lm's batch_generate, {r['batch']} sequences", BAR),
            ("expertd batch, streamed", f"expertd's batch_generate, {r['batch']} sequences "
             "(÷ mlx-lm's on resident)", None),
            ("expertd batch, plain", "the same, no call compiled", None),
            ("one sequence, streamed", "one sequence (expertd's loop ÷ mlx-lm's)", None)):
        if name not in r["ratio"]:
            continue
        per = [f"{x[name] / x[bases[name]]:.2f}" for x in r["rounds"]]
        ratio = r["ratio"][name]
        verdict = "" if bar is None else "pass" if ratio >= bar else "FAIL"
        lines.append(f"| {label} | {ratio:.2f} | {', '.join(per)} | "
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
    p.add_argument("--gpu", action="store_true", help="the Qwen3-30B-A3B-shaped model, pools "
                   "25%%, expertd's batch also with no call compiled (a run on the lent GPU)")
    p.add_argument("--small", action="store_true", help="with --gpu: a tiny model (a smoke run)")
    run_and_report(p, run, table, section)


if __name__ == "__main__":
    main()
