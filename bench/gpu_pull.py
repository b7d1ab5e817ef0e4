"""Device pulls (issue 24): pools at 25% of the experts, next to resident mlx-lm, one process.

    PYTHONSAFEPATH=1 python bench/gpu_pull.py [--small] [--rounds 9] [--tokens 48]
                                              [--out FILE.json] [--results]

For each case a daemon is started, the streamed model is loaded, and it alternates with the
resident model (mlx_lm.load of the same checkpoint) round by round; greedy tokens and the first
token of a 512-token prompt must be equal, or it raises. The cases:

- warm: default pools (every expert on a GPU that holds them), pull auto;
- pools 25%, arena holding every expert: pull auto (the device pulls its misses) and pull off
  (the per-layer host path, the last turn's 0.21x);
- pools 25%, arena 25%: pull auto, against min(resident, disk bound); the disk bound is each
  token's bytes read by the daemon at the O_DIRECT rate of the same blob files (bench/fill.py);
- the pull rate: 8 rows pulled by the kernel from the registered arena, against a pinned
  host-to-device copy of the same bytes (torch, where installed: the reference only).
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, daemon, ensure_model, write_section
from gpu_pools import PROMPT, QWEN3_30B_SHAPES, TINY, side_by_side, summarize
from overlap import arena_gb

CAPPED = 0.25
TTFT_TOKENS = 512
SECTION = "## GPU: device pulls (issue 24)"
SPLIT = ("step_build_s", "step_wait_s", "step_book_s")
BARS = dict(warm=0.95, pooled=0.8, capped=0.8, ttft=2.0, rate=0.7, replays=0.01)


def pull_model(small: bool) -> tuple:
    """``(model_dir, blob_dir, manifest, all_gb, pool_gb)`` of the bench's model: an arena
    holding every expert, and pools of CAPPED of the experts."""
    from expertd.manifest import Manifest

    spec = TINY if small else QWEN3_30B_SHAPES
    name = "gpu-pools-tiny" if small else "gpu-pools-qwen3-30b-shapes"
    model_dir, blob_dir = ensure_model(name, spec)
    m = Manifest.load(blob_dir)
    all_gb = m.total_expert_bytes * 1.3 / 2**30 + 0.01
    pool_gb = CAPPED * sum(la.num_experts * la.expert_bytes for la in m.layers) / 2**30
    return model_dir, blob_dir, m, all_gb, pool_gb


def read_every_expert(session) -> None:
    """Have the daemon read every expert into its arena (one that holds them all)."""
    import numpy as np

    for layer in session.manifest.layers:
        session.demand_absent(layer.index, np.arange(layer.num_experts, dtype=np.int32))


def window_counts(session, before: dict) -> dict:
    c = session.counters
    pulled = session.pull_counters()
    return dict(steps=c["steps"] - before["steps"], host_waits=c["host_waits"] - before["hw"],
                replays=c["replays"] - before["replays"],
                replays_absent=c["replays_absent"] - before["ra"],
                replays_epoch=c["replays_epoch"] - before["re"],
                rows_pulled=pulled["rows_pulled"] - before["rows"],
                bytes_pulled=pulled["bytes_pulled"] - before["bytes"],
                bytes_read=session.stats()["bytes_read"] - before["read"],
                **{k: session.timing[k] - before[k] for k in SPLIT})


def mark(session) -> dict:
    c, p = session.counters, session.pull_counters()
    return dict(steps=c["steps"], hw=c["host_waits"], replays=c["replays"],
                ra=c["replays_absent"], re=c["replays_epoch"], rows=p["rows_pulled"],
                bytes=p["bytes_pulled"], read=session.stats()["bytes_read"],
                **{k: session.timing[k] for k in SPLIT})


def one_case(name, blob_dir, resident, tokenizer, ids, cache_gb, pool_gb, pull, args,
             ) -> dict:
    import mlx.core as mx

    from expertd.client import load

    with daemon(blob_dir, cache_gb):
        streamed, _ = load(blob_dir, pool_gb=pool_gb, pull=pull, prefetch="off"
                           if pull != "off" else "auto")
        session = streamed.expertd_session
        try:
            puller = session.puller.name if session.puller is not None else "none"
            if cache_gb >= args.all_gb:  # the arena holds every expert: read them all first
                read_every_expert(session)
            first = mark(session)
            runs = side_by_side(resident, streamed, tokenizer, ids, args)
            # Host waits per decode step over the decode windows (first token to last: the
            # prompts' per-layer waits are outside them), the issue's "per token".
            window = summarize(runs, len(session.manifest.layers))
            decode_waits = window["host_waits_per_token"]
            # What the waits per decode step are made of: the speculative steps checked (a
            # wait each, replays included) and the steps that waited per layer (auto's timing
            # step among them), over the decode windows' tokens after the first.
            decode_waits_split = dict(speculative_per_step=window["speculative_steps_per_token"],
                                      per_layer_steps=window["per_layer_steps"])
            counts = window_counts(session, first)
            session_counts = dict(session.counters)
            split = streamed_split(streamed, tokenizer) if getattr(args, "own_loop", False) \
                else None
        finally:
            session.close()
        del streamed
        gc.collect()
        mx.clear_cache()
    steps = max(1, counts["steps"])
    res, st = statistics.median(runs["res_tps"]), statistics.median(runs["st_tps"])
    ratios = [s / r for s, r in zip(runs["st_tps"], runs["res_tps"])]
    return dict(case=name, pull=pull, puller=puller, cache_gb=cache_gb, pool_gb=pool_gb,
                resident_tps=res, streamed_tps=st, ratio=st / res,
                ratios=ratios,
                # The median of the rounds' own ratios: each round's two decodes ran back to
                # back, so a slow moment of the machine touches both sides of one ratio.
                paired_ratio=statistics.median(ratios),
                ttft_ratio=statistics.median(s / r for s, r in zip(runs["st_ttft"],
                                                                   runs["res_ttft"])),
                resident_ttft_s=statistics.median(runs["res_ttft"]),
                streamed_ttft_s=statistics.median(runs["st_ttft"]),
                ttft_plain_ratio=statistics.median(
                    s / r for s, r in zip(runs["st_ttft_plain"], runs["res_ttft"]))
                if runs["st_ttft_plain"] else None,
                ttft_ratios=[s / r for s, r in zip(runs["st_ttft"], runs["res_ttft"])],
                prompt_replays={k: session_counts[k] for k in ("replays_absent", "replays_epoch")},
                per_step={k: v / steps for k, v in counts.items() if k != "steps"},
                decode_host_waits=decode_waits, decode_waits_split=decode_waits_split,
                # Rows pulled a decode token (the windows: first token to last), apart from
                # per_step's, which counts the prompts' pulls too, over every model call.
                decode_rows_pulled=window["rows_pulled_per_token"],
                decode_bytes_pulled=window["bytes_pulled_per_token"],
                split=split, **counts)


def resident_split(model, tokenizer, steps: int = 32) -> dict:
    """Resident mlx-lm's decode step, built, launched (``mx.async_eval``, which encodes the
    graph on the host) and then waited for, apart (ms each): what a step that waits at its end
    pays where mlx-lm's loop overlaps building with computing."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = model(mx.array([tokenizer.encode(PROMPT)]), cache=cache)[:, -1].argmax(-1)
    mx.eval(y)
    build = launch = wait = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(y[:, None], cache=cache)
        y = logits[:, -1].argmax(-1)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        build, launch = build + t1 - t, launch + t2 - t1
        wait += time.perf_counter() - t2
    return dict(build_ms=1e3 * build / steps, launch_ms=1e3 * launch / steps,
                wait_ms=1e3 * (launch + wait) / steps)


def streamed_split(model, tokenizer, steps: int = 32, profile: bool = True) -> dict:
    """A streamed speculative decode step launched (its ``mx.async_eval`` timed apart), then
    evaluated with nothing else in flight, then checked (ms each): the device's share of a step
    against resident's ``wait_ms``. With ``profile``, the launches run under cProfile (their
    times then include its overhead) and its top functions by own time print."""
    import cProfile
    import pstats

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from expertd.client.step import StepGuard

    guard = model.__dict__["_expertd_steps"]
    forward = super(StepGuard, model).__call__
    cache = make_prompt_cache(model)
    y = model(mx.array([tokenizer.encode(PROMPT)]), cache=cache)[:, -1].argmax(-1)
    mx.eval(y)
    build = wait = book = 0.0
    encode = [0.0]
    real = mx.async_eval

    def timed(*arrays):
        t = time.perf_counter()
        real(*arrays)
        encode[0] += time.perf_counter() - t

    done = 0
    prof = cProfile.Profile() if profile else None
    mx.async_eval = timed
    try:
        for _ in range(steps):
            t = time.perf_counter()
            if prof is not None:
                prof.enable()
            launched = guard.launch(forward, y[:, None], (), {"cache": cache})
            y = launched.logits[:, -1].argmax(-1)
            mx.async_eval(y, *launched.flat)  # as client/decode.py starts a step
            if prof is not None:
                prof.disable()
            t1 = time.perf_counter()
            mx.eval(y, *launched.flat)
            t2 = time.perf_counter()
            if guard.settle(launched) is not None:
                break  # replayed: the cache is one token ahead; enough steps were timed
            build, wait, book = build + t1 - t, wait + t2 - t1, book + time.perf_counter() - t2
            done += 1
    finally:
        mx.async_eval = real
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    n = max(1, done)
    return dict(build_ms=1e3 * build / n, launch_ms=1e3 * encode[0] / n,
                wait_ms=1e3 * wait / n, book_ms=1e3 * book / n, steps=done)


GRIDS = ((4, 512), (8, 512), (16, 512), (4, 1024), (8, 1024), (32, 256))


def _median_eval(make, repeat: int = 20) -> float:
    """Median seconds of ``mx.eval`` of what ``make()`` builds (built outside the timing)."""
    import mlx.core as mx

    mx.eval(make())  # compiled, warm
    times = []
    for _ in range(repeat):
        out = make()
        t = time.perf_counter()
        mx.eval(out)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _pinned_gbps(nbytes: int) -> float:
    """A pinned host-to-device copy of ``nbytes`` (torch, the reference only)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def pull_rate(blob_dir, cache_gb) -> dict:
    """8 rows pulled by the kernel from the registered arena, against a pinned copy of the same
    bytes: one layer's pull under its own evaluation, and every layer's under one (as in a step,
    where no pull waits for its own evaluation), for each grid of GRIDS."""
    import mlx.core as mx
    import numpy as np

    from expertd.client import pull
    from expertd.client.prompt_pull import Stack
    from expertd.client.session import Session

    out = dict(grids={})
    chosen = (pull.CHUNKS, pull.THREADS)
    with daemon(blob_dir, cache_gb):
        session = Session(blob_dir, pull="device")
        try:
            experts = np.arange(8, dtype=np.int32)
            layers = [la.index for la in session.manifest.layers]
            for layer in layers:
                session.demand_absent(layer, experts)  # resident now
            puller = session.puller
            n = session.manifest.layers[0].num_experts
            empty = Stack([mx.zeros((1, *shape), dtype) for dtype, shape, _ in puller.layers[0]],
                          np.full(n, -1, np.int32))
            ids = mx.array(experts)
            mx.eval(ids, empty.arrays)
            one = _median_eval(lambda: puller.assemble(0, ids, empty))
            every = _median_eval(lambda: [puller.assemble(la, ids, empty) for la in layers])
            nbytes = sum(a.nbytes for a in puller.assemble(0, ids, empty)[0])
            out.update(kernel_gbps=nbytes / one / 1e9, bytes=nbytes, layers=len(layers),
                       step_gbps=len(layers) * nbytes / every / 1e9, grid=list(chosen))
            try:
                for chunks, threads in GRIDS:
                    pull.CHUNKS, pull.THREADS = chunks, threads
                    t = _median_eval(lambda: [puller.assemble(la, ids, empty) for la in layers])
                    out["grids"][f"{chunks}x{threads}"] = len(layers) * nbytes / t / 1e9
            finally:
                pull.CHUNKS, pull.THREADS = chosen
        finally:
            session.close()
    try:
        out["pinned_gbps"] = _pinned_gbps(nbytes)
        out["step_pinned_gbps"] = _pinned_gbps(len(layers) * nbytes)
    except Exception as exc:  # the reference is optional: say why it is missing
        out["pinned_error"] = repr(exc)
    return out


def disk_bound_gbps(blob_dir) -> float:
    from fill import raw_direct_read

    return raw_direct_read(blob_dir, 8, 1)


def run(args) -> dict:
    import mlx.core as mx
    import mlx_lm

    model_dir, blob_dir, m, all_gb, pool_gb = pull_model(args.small)
    spec = TINY if args.small else QWEN3_30B_SHAPES
    capped_gb = arena_gb(blob_dir, round(CAPPED * len(m.layers) * m.max_experts))
    args.all_gb = all_gb
    resident, tokenizer = mlx_lm.load(str(model_dir))
    ids = mx.array([[(37 * i + 11) % (resident.args.vocab_size - 16) + 8
                     for i in range(TTFT_TOKENS)]])
    cases = []
    for case in args.cases.split(","):
        if case == "warm":
            cases.append(one_case("warm", blob_dir, resident, tokenizer, ids, all_gb, None,
                                  "auto", args))
        elif case == "pooled":
            cases.append(one_case("pools 25%, arena all", blob_dir, resident, tokenizer, ids,
                                  all_gb, pool_gb, args.pull, args))
        elif case == "pooled-own":  # decoded by expertd's own loop (client/decode.py)
            args.own_loop = True
            cases.append(one_case("pools 25%, arena all, expertd's loop", blob_dir, resident,
                                  tokenizer, ids, all_gb, pool_gb, args.pull, args))
            args.own_loop = False
        elif case == "pooled-off":
            cases.append(one_case("pools 25%, arena all, pull off", blob_dir, resident,
                                  tokenizer, ids, all_gb, pool_gb, "off", args))
        elif case == "capped-own":
            args.own_loop = True
            cases.append(one_case("pools 25%, arena 25%, expertd's loop", blob_dir, resident,
                                  tokenizer, ids, capped_gb, pool_gb, args.pull, args))
            args.own_loop = False
        elif case == "capped":
            cases.append(one_case("pools 25%, arena 25%", blob_dir, resident, tokenizer, ids,
                                  capped_gb, pool_gb, args.pull, args))
    out = dict(model=spec, device=str(mx.default_device()), mlx=mx.__version__,
               rounds=args.rounds, tokens=args.tokens, cases=cases,
               resident_split=resident_split(resident, tokenizer))
    if "rate" in args.cases:
        out["rate"] = pull_rate(blob_dir, all_gb)
    if "capped" in args.cases:  # capped-own too
        out["disk_gbps"] = disk_bound_gbps(blob_dir)
    return out


def table(r: dict) -> str:
    lines = [f"{SECTION}\n", f"{r['device']}, MLX {r['mlx']}, {r['rounds']} rounds of "
             f"{r['tokens']} greedy tokens and a {TTFT_TOKENS}-token prompt's first token, "
             "resident mlx-lm alternating in the same process; tokens equal in every round.\n",
             "| case | puller | decode ÷ resident | TTFT ÷ resident | host waits / model call "
             "(all; decode steps only) | "
             "replays / step | rows (MB) pulled a decode token; a model call, prompts too | "
             "target | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    disk = r.get("disk_gbps")
    for c in r["cases"]:
        p = c["per_step"]
        ratio = c["ratio"]
        if c["case"] == "warm":
            target, ok = f"≥ {BARS['warm']}", ratio >= BARS["warm"]
        elif "pull off" in c["case"]:
            target, ok = "(last turn's path)", None
        elif "arena 25%" in c["case"]:
            bound = (disk * 1e9 / p["bytes_read"]) if disk and p["bytes_read"] else None
            ratio_b = c["streamed_tps"] / min(c["resident_tps"], bound or c["resident_tps"])
            target = (f"÷ min(resident, disk {disk:.2f} GB/s → "
                      f"{bound or float('inf'):.0f} tok/s) = {ratio_b:.2f} ≥ {BARS['capped']}")
            ok = ratio_b >= BARS["capped"]
        else:
            ok = (ratio >= BARS["pooled"] and c["ttft_ratio"] <= BARS["ttft"]
                  and p["replays"] <= BARS["replays"])
            target = (f"≥ {BARS['pooled']}, TTFT ≤ {BARS['ttft']}, replays ≤ "
                      f"{BARS['replays']:.0%}")
        verdict = "" if ok is None else "pass" if ok else "FAIL"
        plain = (f" (prompt waiting per layer: {c['ttft_plain_ratio']:.2f})"
                 if c.get("ttft_plain_ratio") else "")
        rounds = ", ".join(f"{x:.2f}" for x in c["ratios"])
        lines.append(
            f"| {c['case']} | {c['puller']} | {ratio:.2f} (rounds {rounds}; "
            f"their median {c.get('paired_ratio', float('nan')):.2f}) "
            f"| {c['ttft_ratio']:.2f}{plain} | {p['host_waits']:.2f}; "
            f"{c.get('decode_host_waits', float('nan')):.2f} | {p['replays']:.3f} | "
            f"{c.get('decode_rows_pulled', float('nan')):.1f} "
            f"({c.get('decode_bytes_pulled', float('nan')) / 1e6:.1f}); "
            f"{p['rows_pulled']:.1f} ({p['bytes_pulled'] / 1e6:.1f}) | {target} | {verdict} |")
    split = r.get("resident_split")
    if split:
        lines.append(f"\nResident mlx-lm's decode step built then evaluated apart: build "
                     f"{split['build_ms']:.2f} ms, evaluation {split['wait_ms']:.2f} ms (its async_eval "
                     f"{split.get('launch_ms', 0):.2f} ms).")
        for c in r["cases"]:
            p = c["per_step"]
            if "step_build_s" in p and p["step_wait_s"]:
                lines.append(f"- {c['case']}: a checked step's build {1e3 * p['step_build_s']:.2f}"
                             f" ms, wait {1e3 * p['step_wait_s']:.2f} ms, bookkeeping "
                             f"{1e3 * p['step_book_s']:.2f} ms (per model call)")
            if c.get("split"):
                sp = c["split"]
                lines.append(f"- {c['case']}, a speculative step alone ({sp['steps']} steps): "
                             f"build {sp['build_ms']:.2f} ms (its async_eval "
                             f"{sp['launch_ms']:.2f} ms), evaluation {sp['wait_ms']:.2f} ms, "
                             f"check and bookkeeping {sp['book_ms']:.2f} ms")
            ws = c.get("decode_waits_split")
            if ws:
                lines.append(f"- {c['case']}: the decode windows' host waits a step "
                             f"({c['decode_host_waits']:.2f}) are {ws['speculative_per_step']:.3f}"
                             f" speculative steps checked (replays in it) and "
                             f"{ws['per_layer_steps']:.0f} steps that waited per layer in all "
                             f"(a wait per MoE layer each)")
    rate = r.get("rate")
    if rate:
        pinned, step_pinned = rate.get("pinned_gbps"), rate.get("step_pinned_gbps")
        k, ks = rate["kernel_gbps"], rate["step_gbps"]
        ok = step_pinned and ks / step_pinned >= BARS["rate"]
        lines.append(
            f"\nPull rate, 8 rows of {rate['bytes'] / 1e6:.1f} MB a layer, grid "
            f"{rate['grid'][0]} x {rate['grid'][1]}:\n"
            f"- in a step ({rate['layers']} layers' pulls under one evaluation): kernel "
            f"{ks:.1f} GB/s, pinned copy of the same bytes {step_pinned or float('nan'):.1f} "
            f"GB/s: {ks / step_pinned if step_pinned else float('nan'):.2f} (target ≥ "
            f"{BARS['rate']}: {'pass' if ok else 'FAIL'})\n"
            f"- one layer's pull under its own evaluation: kernel {k:.1f} GB/s, pinned "
            f"{pinned or float('nan'):.1f} GB/s: {k / pinned if pinned else float('nan'):.2f}")
        if rate.get("grids"):
            lines.append("- in a step, by grid (blocks per row x threads): " + ", ".join(
                f"{g} {v:.1f}" for g, v in rate["grids"].items()) + " GB/s")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--rounds", type=int, default=9)  # rounds spread widely (RESULTS.md)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--cases", default="warm,pooled,pooled-own,pooled-off,capped,rate")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_pull.json")
    parser.add_argument("--results", action="store_true", help="write into bench/RESULTS.md")
    parser.add_argument("--chunks", type=int, help="blocks per pair in the pull kernel")
    parser.add_argument("--pull", default="auto", choices=("auto", "device", "host"),
                        help="who pulls in the cases with small pools (host: a CPU's smoke run)")
    args = parser.parse_args()
    if args.chunks:
        from expertd.client import pull

        pull.CHUNKS = args.chunks
    r = run(args)
    args.out.write_text(json.dumps(r, indent=1))
    text = table(r)
    print(text)
    args.out.with_suffix(".md").write_text(text)
    if args.results:
        write_section(ROOT / "RESULTS.md", SECTION, text)


if __name__ == "__main__":
    main()
