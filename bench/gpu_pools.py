"""GPU expert pools: streamed decode, capped decode and TTFT next to resident mlx-lm, one process.

    python -P bench/gpu_pools.py [--small] [--rounds 3] [--tokens 48] [--temp 0]
                                 [--out FILE.json] [--md FILE.md] [--results]

Where the package is installed apart from the source tree (the GPU machine), run it with
PYTHONSAFEPATH=1 rather than -P: the daemon's own process, started from the project's root,
inherits it, and the source tree's expertd/ does not shadow the installed package there.

Made for an H200 with MLX's CUDA backend (every expert fits in a pool there); ``--small`` is a
tiny model for the CPU. The Qwen3-30B-A3B-shaped model (128 experts, top-8, 4-bit, 12 layers) is
synthesized and converted into bench/out, a daemon is started per arena, and the resident model
(mlx_lm.load of the same checkpoint) alternates with the streamed one, round by round, so that
the machine's noise hits both alike. Decoding is greedy (or seeded, ``--temp``); tokens
differing from resident raise.

- warm: an arena holding every expert, the default pool, for each of MODES (prefetch, and
  speculate: off is one host wait per MoE layer, auto one per decode step): tok/s, ratio, host
  waits per token, and per MoE layer of each decoded token µs in the per-layer router syncs
  (each waits for the GPU's work so far), moving rows into the pool, and the rest (wall ÷ layer
  calls − both; a speculative step's one wait at its end is in the rest);
- capped: arena and pool 25% of all experts: also bytes moved into pools and read by the daemon
  per token, and the transfer bound (bytes each token must move ÷ the move bandwidth measured);
- TTFT of a 500-token prompt (one forward to its last logits), and the pool bytes and RSS.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QWEN3_30B_LIKE, ROOT, daemon, ensure_model, rss_breakdown, write_section
from overlap import arena_gb
from prefill import ttft

QWEN3_30B_SHAPES = dict(QWEN3_30B_LIKE, experts=128)
TINY = dict(family="qwen3_moe", layers=4, experts=32, top_k=4, hidden=256, moe_inter=128,
            bits=4, mode="affine", seed=7)
PROMPT = "The shared cache serves every client from one copy of the experts"
TTFT_TOKENS = 500
CAPPED = 0.25  # of all experts, for the capped arena and pool
MODES = (("off", "off"), ("auto", "off"), ("auto", "auto"))  # (prefetch, speculate)
BARS = dict(warm=0.35, stretch=0.95, capped=0.8, ttft=1.5)
SECTION = "## GPU: expert pools"


def snapshot(session) -> dict:
    """What ``session`` has done so far: its timing, model calls (steps), host waits and
    replays, rows and bytes pulled from the arena, bytes moved into its pools (when routed, and
    written ahead then used), the daemon's bytes read, and a clock."""
    eb = [layer.expert_bytes for layer in session.manifest.layers]
    t, c, p = session.timing, session.counters, session.pull_counters()
    return dict(t=time.perf_counter(), sync_s=t["sync_s"], exposed_s=t["exposed_s"],
                rows_pulled=p["rows_pulled"], bytes_pulled=p["bytes_pulled"],
                steps=c["steps"], host_waits=c["host_waits"], replays=c["replays"],
                speculative_steps=c["speculative_steps"],
                moved_bytes=sum(p.counters["moved"] * eb[p.layer] for p in session.pools),
                ahead_bytes=sum(p.counters["ahead_used"] * eb[p.layer] for p in session.pools),
                bytes_read=session.stats()["bytes_read"])


def decode(model, tokenizer, tokens: int, temp: float, session=None, own_loop=False) -> dict:
    """Decode PROMPT (greedy at ``temp`` 0, else sampled from a fixed seed): mlx-lm's generation
    tok/s, the tokens, and for a streamed model what its session did between the first and the
    last token (the decode window)."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    if own_loop:  # expertd generate's loop: the next step built before this one is checked
        from expertd.client.decode import stream_generate

    mx.random.seed(0)  # the same samples for both models (their logits are the same)
    out, start, last = [], None, None
    for last in stream_generate(model, tokenizer, PROMPT, max_tokens=tokens,
                                sampler=make_sampler(temp)):
        if not out and session is not None:
            start = snapshot(session)
        out.append(last.token)
    run = dict(tps=last.generation_tps, tokens=out)
    if session is not None:
        end = snapshot(session)
        run["window"] = {k: end[k] - start[k] for k in end}
        # Its decode steps: the tokens after the first. Not the steps launched: expertd's loop
        # launched the second token's step before the first token left (the window's first
        # check) and counts each step at its launch, which made 8 tokens 7 checks of 6 steps.
        run["window"]["tokens"] = len(out) - 1
    return run


def first_token(model, ids) -> tuple:
    """Seconds to the first token of ``ids`` (one prefill forward) and that greedy token."""
    seconds, logits = ttft(model, ids)
    return seconds, int(logits.argmax().item())


def waiting_first_token(streamed, ids) -> tuple:
    """:func:`first_token` of a prompt that waits in each MoE layer (client/step.py)."""
    steps = streamed.expertd_session.steps
    kept, steps.speculate_prompts = steps.speculate_prompts, False
    try:
        return first_token(streamed, ids)
    finally:
        steps.speculate_prompts = kept


def side_by_side(resident, streamed, tokenizer, ids, args) -> dict:
    """A warm-up of each model, then ``rounds`` alternating rounds of decode and TTFT."""
    session = streamed.expertd_session
    for model in (streamed, resident):  # the long prompt first: it routes to every expert
        first_token(model, ids)
        decode(model, tokenizer, args.tokens, args.temp)
    runs = dict(res_tps=[], st_tps=[], res_ttft=[], st_ttft=[], windows=[], st_ttft_plain=[])
    # The prompt speculative (one wait) and waiting in each layer (client/step.py), in
    # alternating rounds: where a puller pulls a prompt's rows.
    compare_prompts = session.puller is not None
    for i in range(args.rounds):
        a = decode(resident, tokenizer, args.tokens, args.temp)
        b = decode(streamed, tokenizer, args.tokens, args.temp, session,
                   getattr(args, "own_loop", False))
        ta, ka = first_token(resident, ids)
        if compare_prompts and i % 2:  # first in odd rounds: an arena too small for the
            tc, kc = waiting_first_token(streamed, ids)  # prompt's rows favours the second
        tb, kb = first_token(streamed, ids)
        if compare_prompts and not i % 2:
            tc, kc = waiting_first_token(streamed, ids)
        if compare_prompts:
            runs["st_ttft_plain"].append(tc)
        if a["tokens"] != b["tokens"] or ka != kb or (compare_prompts and kc != ka):
            raise AssertionError("streamed tokens differ from resident ones")
        runs["res_tps"].append(a["tps"])
        runs["st_tps"].append(b["tps"])
        runs["res_ttft"].append(ta)
        runs["st_ttft"].append(tb)
        runs["windows"].append(b["window"])
    return runs


def summarize(runs: dict, moe_layers: int) -> dict:
    """Medians, the per-layer split and the per-token counts of the decode windows."""
    w = {k: sum(win[k] for win in runs["windows"]) for k in runs["windows"][0]}
    steps = w["tokens"]  # decode steps inside the windows: a token each, a check each
    calls = steps * moe_layers  # every MoE layer: a speculative step's layers record no timing
    res_tps, st_tps = statistics.median(runs["res_tps"]), statistics.median(runs["st_tps"])
    sync, moves = 1e6 * w["sync_s"] / calls, 1e6 * w["exposed_s"] / calls
    must = (w["moved_bytes"] + w["ahead_bytes"]) / steps
    gbps = w["moved_bytes"] / w["exposed_s"] / 1e9 if w["moved_bytes"] and w["exposed_s"] else None
    bound = gbps * 1e9 / must if gbps and must else None
    per_token = {f"{k}_per_token": w[k] / steps
                 for k in ("host_waits", "replays", "moved_bytes", "ahead_bytes", "bytes_read",
                           "speculative_steps", "rows_pulled", "bytes_pulled")}
    # A speculative step counts its one wait and itself when checked; a step waiting per layer
    # counts a wait per MoE layer and no speculative step. So the waits beyond the speculative
    # steps are the per-layer steps'.
    per_token["per_layer_steps"] = (w["host_waits"] - w["speculative_steps"]) / moe_layers
    return dict(resident_tps=res_tps, streamed_tps=st_tps, ratio=st_tps / res_tps,
                ratios=[s / r for s, r in zip(runs["st_tps"], runs["res_tps"])],
                sync_us=sync, moves_us=moves, compute_us=1e6 * w["t"] / calls - sync - moves,
                move_gbps=gbps, bound_tps=bound,
                bound_ratio=st_tps / min(res_tps, bound or res_tps),
                resident_ttft_s=statistics.median(runs["res_ttft"]),
                streamed_ttft_s=statistics.median(runs["st_ttft"]),
                ttft_ratio=statistics.median(s / r for s, r in zip(runs["st_ttft"],
                                                                   runs["res_ttft"])),
                **per_token)


def measure(blob_dir, resident, tokenizer, arena: str, cache_gb: float, pool_gb, args) -> list:
    """Each of MODES against one daemon: a streamed model each, side by side."""
    import mlx.core as mx

    from expertd.client import load

    ids = mx.array([[(37 * i + 11) % (resident.args.vocab_size - 16) + 8
                     for i in range(TTFT_TOKENS)]])
    results = []
    with daemon(blob_dir, cache_gb):
        for prefetch, speculate in MODES:
            rss_before = rss_breakdown(os.getpid())["VmRSS"]
            streamed, _ = load(blob_dir, pool_gb=pool_gb, prefetch=prefetch, speculate=speculate)
            session = streamed.expertd_session
            try:
                runs = side_by_side(resident, streamed, tokenizer, ids, args)
                results.append(dict(
                    kind="capped" if pool_gb else "warm", arena=arena, prefetch=prefetch,
                    speculate=speculate, cache_gb=cache_gb, pool_gb=pool_gb,
                    pool_rows=[p.rows for p in session.pools],
                    pools_complete=all(p.complete for p in session.pools),
                    pool_bytes=session.pool_bytes, rss=rss_breakdown(os.getpid())["VmRSS"],
                    rss_before_load=rss_before, counters=session.all_counters(),
                    **summarize(runs, len(session.pools))))
            finally:
                session.close()
            del streamed, session
            gc.collect()
            mx.clear_cache()
    return results


def run(args) -> dict:
    import mlx.core as mx
    import mlx_lm

    from expertd.manifest import Manifest

    spec = TINY if args.small else QWEN3_30B_SHAPES
    name = "gpu-pools-tiny" if args.small else "gpu-pools-qwen3-30b-shapes"
    model_dir, blob_dir = ensure_model(name, spec)
    manifest = Manifest.load(blob_dir)
    total = manifest.total_expert_bytes  # rows of the arena's stride
    # A pool row is an expert's bytes, not a stride: 25% of the experts, not of their strides.
    pool_bytes = CAPPED * sum(layer.num_experts * layer.expert_bytes for layer in manifest.layers)
    resident, tokenizer = mlx_lm.load(str(model_dir))
    arena_rows = round(CAPPED * len(manifest.layers) * manifest.max_experts)
    results = measure(blob_dir, resident, tokenizer, "every expert", total * 1.3 / 2**30 + 0.01,
                      None, args)
    results += measure(blob_dir, resident, tokenizer, f"{CAPPED:.0%}",
                       arena_gb(blob_dir, arena_rows), pool_bytes / 2**30, args)
    return dict(model=spec, device=str(mx.default_device()), mlx=mx.__version__,
                total_expert_bytes=total, rounds=args.rounds, tokens=args.tokens, temp=args.temp,
                ttft_tokens=TTFT_TOKENS, results=results)


def row(measure: str, value: str, target: str = "", ok=None) -> str:
    verdict = "" if ok is None else "pass" if ok else "FAIL"
    return f"| {measure} | {value} | {target} | {verdict} |"


def ttft_row(r: dict, tag: str, prompt: int, *bar) -> str:
    return row(f"TTFT {prompt} tokens ÷ resident, {tag}", f"{r['ttft_ratio']:.2f} "
               f"({r['streamed_ttft_s']:.3f} vs {r['resident_ttft_s']:.3f} s)", *bar)


def warm_rows(r: dict, tag: str, tps: str, prompt: int) -> list:
    return [row(f"warm decode ÷ resident, {tag}", f"{r['ratio']:.3f} {tps}",
                f"≥ {BARS['warm']} (stretch {BARS['stretch']})", r["ratio"] >= BARS["warm"]),
            row(f"per layer: sync / moves / rest; host waits, replays per token, {tag}",
                f"{r['sync_us']:.0f} / {r['moves_us']:.0f} / {r['compute_us']:.0f} µs; "
                f"{r['host_waits_per_token']:.1f}, {r['replays_per_token']:.2f}"),
            ttft_row(r, tag, prompt, f"≤ {BARS['ttft']}", r["ttft_ratio"] <= BARS["ttft"])]


def capped_rows(r: dict, tag: str, tps: str, prompt: int) -> list:
    bound = f"{r['bound_tps']:.1f} tok/s" if r["bound_tps"] else "none (no moves)"
    gbps = f"{r['move_gbps']:.2f} GB/s" if r["move_gbps"] else "no moves"
    mib = lambda key: f"{r[key] / 2**20:.2f}"  # noqa: E731
    return [row(f"capped decode ÷ min(resident, transfer bound), {tag}",
                f"{r['bound_ratio']:.3f} {tps}; bound {bound}", f"≥ {BARS['capped']}",
                r["bound_ratio"] >= BARS["capped"]),
            row(f"per token: moved into pools (+ written ahead) / daemon read; host waits, "
                f"replays, {tag}", f"{mib('moved_bytes_per_token')} (+ "
                f"{mib('ahead_bytes_per_token')}) / {mib('bytes_read_per_token')} MiB, moves "
                f"{gbps}; {r['host_waits_per_token']:.1f}, {r['replays_per_token']:.2f}"),
            ttft_row(r, tag, prompt)]


def table(summary: dict) -> str:
    """Markdown: one row per measure, with its value, its target and whether it passes."""
    s = summary["model"]
    lines = [f"{s['layers']} layers x {s['experts']} experts, top-{s['top_k']}, hidden "
             f"{s['hidden']}, moe-inter {s['moe_inter']}, {s['bits']}-bit on "
             f"{summary['device']} (MLX {summary['mlx']}); {summary['tokens']} tokens at temp "
             f"{summary['temp']:g}, medians of {summary['rounds']} alternating rounds; tokens "
             "equal resident's in every round.",
             "", "| measure | value | target | pass/fail |", "| --- | --- | --- | --- |"]
    for r in summary["results"]:
        tag = (f"arena {r['arena']}, pool {r['pool_rows'][0]} rows/layer, prefetch "
               f"{r['prefetch']}, speculate {r['speculate']}")
        tps = f"({r['streamed_tps']:.1f} vs {r['resident_tps']:.1f} tok/s)"
        rows = warm_rows if r["kind"] == "warm" else capped_rows
        lines += rows(r, tag, tps, summary["ttft_tokens"])
        lines.append(row(f"client expert memory / process RSS, {tag}",
                         f"{r['pool_bytes'] / 2**20:.1f} / {r['rss'] / 2**20:.0f} MiB "
                         f"({r['rss_before_load'] / 2**20:.0f} before its load)"))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (for the CPU)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--temp", type=float, default=0.0,
                        help="sampling temperature (default 0: greedy); a random-weight model's "
                        "greedy text repeats a token, and its routing repeats too")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_pools.json")
    parser.add_argument("--md", type=Path, help="default: gpu_pools.md next to --out")
    parser.add_argument("--results", action="store_true",
                        help=f"also put the table into bench/RESULTS.md as '{SECTION}'")
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens: at least 2 (the decode window starts at the first token)")
    summary = run(args)
    text = json.dumps(summary, indent=1)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    md = table(summary)
    (args.md or args.out.with_name("gpu_pools.md")).write_text(md)
    print(md)
    if args.results:
        write_section(ROOT / "RESULTS.md", SECTION, f"{SECTION}\n\n{md}")


if __name__ == "__main__":
    main()
