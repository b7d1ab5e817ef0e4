"""What steps replayed on rows absent from the arena read from the disk (issue 42), on this CPU.

    PYTHONSAFEPATH=1 python bench/absent_reads.py [--batch 1,8] [--tokens 32] [--out FILE.json]
                                                  [--results]

An arena of a quarter of the experts (a model larger than its cache) and pools of a quarter:
a speculative step that met a row absent from the arena ran the layers after it without that
expert's share (zeros), and what they routed to is only a guess at what its replay needs.
Each way below gets a fresh daemon and the same requests, decoded by mlx-lm's
``batch_generate`` on the streamed model (what serve's ``BatchGenerator`` runs), ``--batch``
sequences at a time:

- **speculative, demanding what the replay routes to** (``step_check.needed_absent``: each
  sequence's absent rows up to its first layer that lacked any; since 2026-12-08);
- **speculative, demanding every layer's absent rows** (the policy before, a prompt's first
  layer's only: restored here by replacing ``needed_absent``);
- **waiting per layer** (``speculate="off"``): each layer reads what it routes to, and the
  next layer's guessed experts are read ahead.

The host copy pulls (a CPU has no device pull) and the speculative ways speculate "on" (``auto``
on a CPU mostly waits per layer, which would hide the difference). Per way: the bytes the
daemon read per generated token, replays per model call, host waits per model call. Token ids
must equal resident mlx-lm's (it raises otherwise). A CPU's seconds are not the bars' measure
(bench/RESULTS.md, issue 42's GPU runs); the bytes are counts that do not depend on the
machine's speed.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch_cpu import prompts
from common import daemon, ensure_model, run_and_report, stats
from overlap import arena_gb

MODEL = dict(family="qwen3_moe", layers=8, experts=64, top_k=8, hidden=256, moe_inter=256,
             bits=4, mode="affine", seed=7)
QUARTER = 0.25  # of the experts: the arena's rows, and the pools'
SECTION = "## CPU: what replays on absent rows read (issue 42)"
WAYS = ("speculative, demanding what the replay routes to",
        "speculative, demanding every layer's absent rows (before)",
        "waiting per layer")


def every_layer(pulled, kinds, experts, sequences: int = 1) -> list:
    """The demand policy before 2026-12-08: every layer's absent experts of a decode step, the
    first layer's that lacked any of a prompt (a call of more than one token a sequence)."""
    import numpy as np

    from expertd.client.pull import ABSENT

    out = []
    for record, part in pulled:
        lacked = experts[part][kinds[part] == ABSENT]
        if lacked.size:
            out.append((record.layer, np.unique(lacked).astype(np.int32)))
    prompt = bool(pulled) and pulled[0][0].ids.ndim >= 2 and pulled[0][0].ids.shape[-2] > 1
    return out[:1] if prompt else out


def one_way(way: str, blob_dir, arena: float, pool_gb: float, resident_ids: list, tokenizer,
            ids: list, tokens: int) -> dict:
    import mlx_lm

    from expertd.client import load, step_check

    kept = step_check.needed_absent
    if way == WAYS[1]:
        step_check.needed_absent = every_layer
    try:
        with daemon(blob_dir, arena):
            streamed, _ = load(blob_dir, pool_gb=pool_gb, pull="host", decode_concurrency=len(ids),
                               speculate="off" if way == WAYS[2] else "on")
            session = streamed.expertd_session
            try:
                before = stats(blob_dir)["bytes_read"]
                r = mlx_lm.batch_generate(streamed, tokenizer, ids, max_tokens=tokens,
                                          return_token_ids=True)
                read = stats(blob_dir)["bytes_read"] - before
                c = dict(session.counters)
            finally:
                session.close()
    finally:
        step_check.needed_absent = kept
    if r.token_ids != resident_ids:
        raise AssertionError(f"{way}: tokens differ from resident's")
    generated = sum(len(t) for t in r.token_ids)
    calls = max(1, c["steps"])
    return dict(way=way, generated=generated, bytes_read=read, bytes_per_token=read / generated,
                replays_per_call=c["replays"] / calls, host_waits_per_call=c["host_waits"] / calls,
                replays_absent=c["replays_absent"], steps=c["steps"])


def run(args) -> dict:
    import mlx.core as mx
    import mlx_lm

    from expertd.manifest import Manifest

    model_dir, blob_dir = ensure_model("absent-reads", MODEL)
    m = Manifest.load(blob_dir)
    arena = arena_gb(blob_dir, round(QUARTER * len(m.layers) * m.max_experts))
    pool_gb = QUARTER * sum(la.num_experts * la.expert_bytes for la in m.layers) / 2**30
    resident, tokenizer = mlx_lm.load(str(model_dir))
    out = dict(model=MODEL, device=str(mx.default_device()), mlx=mx.__version__,
               tokens=args.tokens, batches={})
    for batch in (int(b) for b in args.batch.split(",")):
        ids = prompts(resident.args.vocab_size, batch)
        want = mlx_lm.batch_generate(resident, tokenizer, ids, max_tokens=args.tokens,
                                     return_token_ids=True).token_ids
        out["batches"][batch] = [one_way(way, blob_dir, arena, pool_gb, want, tokenizer, ids,
                                         args.tokens) for way in WAYS]
        for w in out["batches"][batch]:
            print(f"{batch} sequences, {w['way']}: {w['bytes_per_token'] / 2**20:.2f} MiB a "
                  f"token, {w['replays_per_call']:.2f} replays a call", flush=True)
    return out


def table(r: dict) -> str:
    spec = r["model"]
    lines = [f"{SECTION}\n",
             f"{r['device']}, MLX {r['mlx']}; {spec['layers']} MoE layers × {spec['experts']} "
             f"experts, top-{spec['top_k']}, hidden {spec['hidden']}, {spec['bits']}-bit; arena "
             f"and pools a quarter of the experts each; mlx-lm's batch_generate of "
             f"{r['tokens']} tokens a sequence, a fresh daemon for each way; token ids equal to "
             "resident's. `python bench/absent_reads.py`.\n",
             "| sequences | way | MiB read a generated token | ÷ waiting per layer | "
             "replays a model call | host waits a model call |",
             "| --- | --- | --- | --- | --- | --- |"]
    for batch, ways in r["batches"].items():
        base = ways[-1]["bytes_per_token"]
        for w in ways:
            lines.append(f"| {batch} | {w['way']} | {w['bytes_per_token'] / 2**20:.2f} | "
                         f"{w['bytes_per_token'] / base if base else float('nan'):.1f} | "
                         f"{w['replays_per_call']:.2f} | {w['host_waits_per_call']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,8", help="sequences decoded together, a run each")
    p.add_argument("--tokens", type=int, default=32)
    run_and_report(p, run, table, lambda r: SECTION)


if __name__ == "__main__":
    main()
