"""A client under a hard memory cap on this CPU (issue 27): TTFT and decode next to resident.

    sudo python bench/capped_cpu.py [--large] [--tokens 32] [--prompt 205] [--rounds 3] [--speculate auto off]

--large: issue 44's model (16 layers of 256 experts, top-8, hidden 768: 3.8 GiB of experts, about
1 MB an expert; a 16-token prompt by default, as MLX's CPU takes about 2 s a token on it here).

The client runs in a cgroup (v1 memory controller, as root) whose limit is a quarter of the
experts' bytes plus what the same client needs when loaded and run once uncapped (its RSS
peak), so the experts are several times the room it has; resident mlx-lm runs outside the cap,
in this process, before and after each capped run: each capped run is weighed against the two
resident runs around it, and the median over --rounds decides (this machine's speed drifts by tens
of percent between minutes, so a best resident run against one capped run measured the drift).
The daemon's arena holds every expert (the bar: each expert read from the disk at most once per
prompt). Tokens and the prompt's first token must be equal to resident's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, daemon, ensure_model, write_section

SPEC = dict(family="qwen3_moe", layers=16, experts=128, top_k=8, hidden=256, moe_inter=128,
            bits=4, mode="affine", seed=11)
LARGE = dict(SPEC, experts=256, hidden=768, moe_inter=768)
CGROUP = Path("/sys/fs/cgroup/memory/expertd-capped-bench")
SECTION = "## CPU: a client under a hard memory cap (issue 27)"
LARGE_SECTION = "## CPU: a client under a hard memory cap, 1 MB experts (issue 44)"
BARS = dict(ttft=1.2, decode=0.9)


def prompt_ids(n: int, vocab: int) -> list:
    return [(37 * i + 11) % (vocab - 16) + 8 for i in range(n)]


def measure(model, ids, tokens: int) -> dict:
    """The first token's seconds (one forward of the prompt), greedy decode tok/s and each
    decode token's seconds."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    start = time.perf_counter()
    logits = model(mx.array([ids]), cache=cache)[:, -1, :]
    y = mx.argmax(logits, axis=-1)
    mx.eval(y)
    ttft = time.perf_counter() - start
    out = [int(y.item())]
    times = []
    start = time.perf_counter()
    for _ in range(tokens):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        out.append(int(y.item()))
        times.append(time.perf_counter() - start - sum(times))
    return dict(ttft_s=ttft, tps=tokens / (time.perf_counter() - start), tokens=out,
                token_s=times)


def paired(capped: dict, around: list) -> dict:
    """One capped run against the mean of the resident runs around it: TTFT, tok/s and the
    per-token median as ratios (above 1: faster than resident for decode, slower for TTFT)."""
    mean = statistics.fmean
    return dict(capped=capped,
                ttft_ratio=capped["ttft_s"] / mean(r["ttft_s"] for r in around),
                decode_ratio=capped["tps"] / mean(r["tps"] for r in around),
                median_ratio=mean(statistics.median(r["token_s"]) for r in around)
                / statistics.median(capped["token_s"]))


def child(args) -> None:
    """The streamed client: load, a warm-up run, then the measured run; JSON on stdout."""
    from expertd.client import load

    model, _ = load(args.blobs, speculate=args.speculate)
    session = model.expertd_session
    try:
        ids = prompt_ids(args.prompt, model.args.vocab_size)
        before = session.stats()["bytes_read"]
        warm = measure(model, ids, 2)  # the prompt's experts are read from the disk here
        read = session.stats()["bytes_read"] - before
        run = measure(model, ids, args.tokens)
        c = session.counters
        peak = int(next(line.split()[1] for line in open("/proc/self/status")
                        if line.startswith("VmHWM"))) * 1024
        print(json.dumps(dict(run, warm_ttft_s=warm["ttft_s"], bytes_read=read,
                              peak_rss=peak, host_waits=c["host_waits"], steps=c["steps"],
                              replays=c["replays"],
                              speculative_steps=c["speculative_steps"],
                              pool_bytes=session.pool_bytes)))
    finally:
        session.close()


def spawn(args, speculate: str, limit: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--blobs", str(args.blobs), "--speculate",
           speculate, "--tokens", str(args.tokens), "--prompt", str(args.prompt)]
    env = dict(os.environ, PYTHONSAFEPATH="1")

    def enter():
        if limit is not None:
            (CGROUP / "cgroup.procs").write_text(str(os.getpid()))

    if limit is not None:
        if CGROUP.exists():  # a fresh group: limits are refused out of order otherwise
            CGROUP.rmdir()
        CGROUP.mkdir()
        (CGROUP / "memory.limit_in_bytes").write_text(str(limit))
        try:
            (CGROUP / "memory.memsw.limit_in_bytes").write_text(str(limit))
        except OSError:
            pass  # no swap accounting: the limit alone holds
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, preexec_fn=enter)
    finally:
        if limit is not None and CGROUP.exists():
            try:
                CGROUP.rmdir()  # nothing of the bench stays behind
            except OSError:
                pass
    if done.returncode:
        raise RuntimeError(f"the streamed client failed ({done.returncode}): "
                           f"{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blobs", type=Path)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, help="prompt tokens (default: 205, --large 16)")
    parser.add_argument("--large", action="store_true", help="issue 44's 3.8 GiB model")
    parser.add_argument("--speculate", nargs="+", default=["auto", "off"])
    parser.add_argument("--rounds", type=int, default=3,
                        help="capped runs a mode, each weighed against the resident runs just "
                             "before and after it; the medians decide (default 3)")
    parser.add_argument("--results", action="store_true")
    args = parser.parse_args()
    if args.child:
        args.speculate = args.speculate[0]
        child(args)
        return
    import mlx_lm

    from expertd.manifest import Manifest

    spec = LARGE if args.large else SPEC
    if args.prompt is None:
        args.prompt = 16 if args.large else 205
    model_dir, args.blobs = ensure_model("capped-cpu-large" if args.large else "capped-cpu-h256",
                                         spec)
    m = Manifest.load(args.blobs)
    experts = sum(la.num_experts * la.expert_bytes for la in m.layers)
    resident = mlx_lm.load(str(model_dir))[0]
    ids = prompt_ids(args.prompt, resident.args.vocab_size)
    measure(resident, ids, 2)
    refs = [measure(resident, ids, args.tokens)]
    rows = []
    for speculate in args.speculate:
        with daemon(args.blobs, m.total_expert_bytes * 1.3 / 2**30 + 0.01):  # cold each time
            free = spawn(args, speculate, None)
            # The cap: its needs (the uncapped peak, less its own expert pools) and a quarter
            # of the experts.
            limit = free["peak_rss"] - free["pool_bytes"] + experts // 4
            rounds = []
            for _ in range(args.rounds):
                capped = spawn(args, speculate, limit)
                if capped["tokens"] != refs[0]["tokens"]:
                    raise AssertionError("streamed tokens differ from resident ones")
                # Each capped run is weighed against the resident runs just before and just
                # after it: this machine's speed drifts by tens of percent between minutes,
                # and the pair saw the same drift.
                refs.append(measure(resident, ids, args.tokens))
                rounds.append(paired(capped, refs[-2:]))
            rows.append(dict(speculate=speculate, limit=limit, free=free, rounds=rounds,
                             **{key: statistics.median(r[key] for r in rounds)
                                for key in ("ttft_ratio", "decode_ratio", "median_ratio")}))
    ref = dict(ttft_s=statistics.median(r["ttft_s"] for r in refs),
               tps=statistics.median(r["tps"] for r in refs),
               token_s=statistics.median(statistics.median(r["token_s"]) for r in refs))
    section = LARGE_SECTION if args.large else SECTION
    text = [f"{section}\n",
            f"`sudo python bench/capped_cpu.py{' --large' if args.large else ''}`: "
            f"{spec['layers']} layers, {spec['experts']} experts, top-{spec['top_k']}, hidden "
            f"{spec['hidden']}, {experts / 2**20:.0f} MiB of experts, a "
            f"{args.prompt}-token prompt and {args.tokens} greedy tokens; resident mlx-lm "
            f"outside the cap, run between the capped runs ({len(refs)} runs, median TTFT "
            f"{ref['ttft_s']:.2f} s, {ref['tps']:.1f} tok/s); each mode's {args.rounds} capped "
            "runs weighed against the two resident runs around each, the medians of the "
            "rounds deciding; the arena holds every expert and starts cold for each mode; "
            "tokens equal.\n",
            "| speculate | cap (MiB) | peak RSS capped (MiB) | TTFT ÷ resident (rounds) | "
            "decode ÷ resident, tok/s (rounds); per-token median | replays (speculative "
            "steps), all rounds | MiB read, first prompt of a cold arena | target | verdict |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ok = r["ttft_ratio"] <= BARS["ttft"] and r["decode_ratio"] >= BARS["decode"]
        runs = [x["capped"] for x in r["rounds"]]

        def listed(key):
            return ", ".join(f"{x[key]:.2f}" for x in r["rounds"])

        text.append(f"| {r['speculate']} | {r['limit'] / 2**20:.0f} | "
                    f"{max(x['peak_rss'] for x in runs) / 2**20:.0f} | "
                    f"{r['ttft_ratio']:.2f} ({listed('ttft_ratio')}) | "
                    f"{r['decode_ratio']:.2f} ({listed('decode_ratio')}); "
                    f"{r['median_ratio']:.2f} | "
                    f"{sum(x['replays'] for x in runs)} "
                    f"({sum(x.get('speculative_steps', 0) for x in runs)}) | "
                    f"{r['free']['bytes_read'] / 2**20:.1f} "
                    f"(experts {experts / 2**20:.0f}) | "
                    f"TTFT ≤ {BARS['ttft']}, decode ≥ {BARS['decode']} | "
                    f"{'pass' if ok else 'FAIL'} |")
    out = "\n".join(text) + "\n"
    print(out)
    (ROOT / f"capped_cpu{'_large' if args.large else ''}.json").write_text(
        json.dumps(dict(ref=ref, refs=refs, rows=rows, spec=spec, prompt=args.prompt), indent=1))
    if args.results:
        write_section(ROOT / "RESULTS.md", section, out)


if __name__ == "__main__":
    main()
