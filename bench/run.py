"""Runs every benchmark side by side and writes bench/RESULTS.md with plots.

    python bench/run.py            (or: make bench)
    python bench/run.py --only fill   (re-measure cold fill; rewrite only its lines in RESULTS.md)
    python bench/run.py --only warm   (re-measure warm decode; rewrite only its lines)
    python bench/run.py --only overlap   (prefetch off vs on; rewrite only its section)

Absolute numbers vary from run to run on a shared machine; the ratios are what to read.
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import capped
import fill
import overlap
import overlap_report
import reclaim
import warm_decode
from common import MEDIUM, OUT, QWEN3_30B_LIKE, ROOT, SMALL, daemon, ensure_model, rss_breakdown, stats


def sharing(name: str, spec: dict, clients: int = 3, tokens: int = 32) -> dict:
    """SSD bytes read for ``clients`` processes generating the same prompt together ÷ one alone."""
    from expertd.manifest import Manifest

    _, blob_dir = ensure_model(name, spec)
    cache_gb = Manifest.load(blob_dir).total_expert_bytes * 0.6 / 2**30
    read = {}
    for n in (1, clients):
        with daemon(blob_dir, cache_gb):
            with tempfile.TemporaryDirectory() as tmp:
                procs = [subprocess.Popen(
                    [sys.executable, "-m", "expertd", "generate", "--blobs", str(blob_dir),
                     "--prompt", "Shared experts for every process", "--max-tokens", str(tokens),
                     "--temp", "1.0", "--seed", "3", "--json-summary", f"{tmp}/{i}.json"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(n)]
                for p in procs:
                    if p.wait(timeout=600) != 0:
                        raise RuntimeError("a sharing client failed")
                tokens_seen = {tuple(json.loads(Path(f"{tmp}/{i}.json").read_text())["tokens"])
                               for i in range(n)}
            read[n] = stats(blob_dir)["bytes_read"]
        if len(tokens_seen) != 1:
            raise AssertionError("clients generating the same prompt disagreed")
    return dict(name=name, one=read[1], many=read[clients], clients=clients,
                ratio=read[clients] / read[1])


def memory(name: str, spec: dict) -> dict:
    """Daemon RSS outside the arena, and the client's own expert memory (its pools) against the
    pool budget it was given, with a warm cache."""
    from mlx_lm import generate

    from expertd.client import load
    from expertd.manifest import Manifest

    _, blob_dir = ensure_model(name, spec)
    manifest = Manifest.load(blob_dir)
    # The CPU's default pool (2 x top-k rows a layer), given as an explicit budget.
    budget = 2 * manifest.top_k * max(layer.expert_bytes for layer in manifest.layers) * len(
        manifest.layers)
    with daemon(blob_dir, manifest.total_expert_bytes * 1.2 / 2**30 + 0.01) as pid:
        model, tokenizer = load(blob_dir, pool_gb=budget / 2**30)
        generate(model, tokenizer, "Memory", max_tokens=16)
        session = model.expertd_session
        s = stats(blob_dir)
        rss = rss_breakdown(pid)
        pool_bytes = session.pool_bytes
        session.close()
    return dict(name=name, arena_bytes=s["arena_bytes"], daemon_rss=rss["VmRSS"],
                daemon_private=rss["RssAnon"] + rss["RssFile"], daemon_shmem=rss["RssShmem"],
                pool_bytes=pool_bytes, pool_budget=budget, top_k=manifest.top_k)


def plots(results: dict) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(9, 3.5))
    warm = [(key, mode) for key in ("warm_small", "warm_big") for mode in warm_decode.SPECULATE]
    names = [f"warm {'small' if key == 'warm_small' else 'medium'}\nspeculate {mode}"
             for key, mode in warm] + ["cold fill", "sharing (3÷1)"]
    values = [results[key][mode]["ratio"] for key, mode in warm] + [results["fill"]["ratio"],
                                                                    results["sharing"]["ratio"]]
    bars = [0.95] * len(warm) + [0.90, 1.10]
    ax.bar(names, values, color=["tab:blue"] * len(warm) + ["tab:green", "tab:orange"])
    ax.scatter(names, bars, color="black", marker="_", s=600, label="bar", zorder=3)
    ax.set_ylabel("ratio")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(loc="lower left")
    ax.set_title("expertd ratios (measured side by side)")
    fig.tight_layout()
    fig.savefig(ROOT / "ratios.png", dpi=110)
    files.append("ratios.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    rows = results["capped"]["rows"]
    x = [r["fraction"] for r in rows]
    ax.plot(x, [r["belady"] for r in rows], "o-", label="Belady (optimal)")
    ax.plot(x, [r["lfu"] for r in rows], "o-", label="expertd LFU")
    ax.set_xlabel("cache capacity (fraction of all experts)")
    ax.set_ylabel("hit rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "capped_cache.png", dpi=110)
    files.append("capped_cache.png")
    return files


TABLE_HEAD = "| benchmark | measured | bar: pass/fail |"
WARM_LABELS = ("small experts (hidden 256)", "medium experts (hidden 512, top-8)")
# Lines of the warm-decode rows, this format's and the older one's (hit path rows).
WARM_ROWS = ("| warm decode", "| host waits per model step", "| client time per MoE layer",
             "| hit path")
WARM_DETAILS = ("- Warm decode", "- Whole fetch of top-k")
# µs: the bar of the old hit path rows, the client's own work for a layer whose rows are all
# resident (now: pooled) between the router's ids and computing
CLIENT_US = 20


def report(r: dict) -> str:
    ws, wb, f, c, s, m = (r["warm_small"], r["warm_big"], r["fill"], r["capped"], r["sharing"],
                          r["memory"])
    lines = [
        "# expertd benchmark results", "",
        f"Produced by `python bench/run.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        " (Linux x86-64, 2 cores, MLX on the CPU). Ratios are measured side by side in one run.",
        "", TABLE_HEAD, "| --- | --- | --- |",
        *warm_rows(ws, wb),
        fill_row(f),
    ]
    for row in c["rows"]:
        lines.append(f"| capped cache at {row['fraction']:.0%} of experts | {row['ratio']:.3f} "
                     f"(LFU {row['lfu']:.3f} vs Belady {row['belady']:.3f}) | "
                     f"{verdict('≥ 0.95', row['ratio'] >= 0.95)} |")
    lines += [
        f"| sharing, {s['clients']} clients ÷ 1 | {s['ratio']:.3f} ({s['many'] / 2**20:.1f} vs "
        f"{s['one'] / 2**20:.1f} MiB) | {verdict('≤ 1.10', s['ratio'] <= 1.10)} |",
        f"| daemon RSS outside the arena | {m['daemon_private'] / 2**20:.1f} MiB | "
        f"{verdict('≤ 100 MB', m['daemon_private'] <= 100e6)} |",
        f"| client expert memory (its pools) | {m['pool_bytes'] / 2**20:.1f} MiB of a "
        f"{m['pool_budget'] / 2**20:.1f} MiB budget (`pool_gb`: 2 × top-k rows a layer) | "
        f"{verdict('≤ the budget', m['pool_bytes'] <= m['pool_budget'])} |",
        reclaim.row(r["reclaim"]),
        "", "Details:", "",
        warm_detail(ws, wb),
        fill_detail(f),
        f"- Capped cache trace: {c['trace_len']} expert requests recorded from real generation.",
        "", "![ratios](ratios.png)", "![capped cache](capped_cache.png)", "",
    ]
    return "\n".join(lines)


def verdict(bar: str, ok: bool) -> str:
    return f"{bar}: {'pass' if ok else 'fail'}"


def warm_rows(*models: dict) -> list:
    """The main table's warm-decode rows of ``models`` (warm_decode.run results): per speculate
    mode the ratio, host waits per model step, and the client's time per MoE layer call on
    the per-layer path (where calls took it)."""
    ratio, waits, client = [], [], []
    for w, label in zip(models, WARM_LABELS):
        for mode in warm_decode.SPECULATE:
            x = w[mode]
            ratio.append(f"| warm decode ÷ resident, {label}, speculate={mode} | {x['ratio']:.3f}"
                         f" ({x['streamed_tps']:.1f} vs {x['resident_tps']:.1f} tok/s) | "
                         f"{verdict('≥ 0.95', x['ratio'] >= 0.95)} |")
            # auto: at most one wait per model step (none where the step is not checked), and
            # nothing to replay with every expert pooled; off: one per MoE layer.
            if mode == "off":
                bar = f"{x['moe_layers']} (one per MoE layer)"
                ok = x["host_waits"] == x["moe_layers"] * x["steps"]
            else:
                bar, ok = "≤ 1, no replay", x["host_waits"] <= x["steps"] and not x["replays"]
            waits.append(f"| host waits per model step, {label}, speculate={mode} | "
                         f"{x['host_waits_per_step']:.2f} ({x['replays']} replays in "
                         f"{x['steps']} steps) | {verdict(bar, ok)} |")
            if x["layer_calls"]:
                client.append(
                    f"| client time per MoE layer, {label}, speculate={mode} | "
                    f"{x['exposed_us']:.1f} µs from the router's ids to the rows in place "
                    f"(router sync {x['sync_us']:.0f} µs; {x['layer_calls']} calls) | "
                    f"{verdict(f'≤ {CLIENT_US} µs', x['exposed_us'] <= CLIENT_US)} |")
    return ratio + waits + client


def warm_detail(*models: dict) -> str:
    rounds = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    per_round = "; ".join(f"{w['name']} {mode} {rounds(w[mode]['ratios'])}"
                          for w in models for mode in warm_decode.SPECULATE)
    runs = "; ".join(f"{w['name']} {w['rounds']} × {w['tokens']} tokens" for w in models)
    auto = "; ".join(f"{w['name']}: of {w['auto']['steps']} steps {w['auto']['unchecked_steps']}"
                     f" not checked, {w['auto']['speculative_steps']} speculative (checked), "
                     f"{w['auto']['layer_calls']} MoE layer calls on the per-layer path"
                     for w in models)
    moved = sum(w[mode]["moved"] for w in models for mode in warm_decode.SPECULATE)
    return (f"- Warm decode: every expert in the arena and in the client's pools (filled before "
            f"the warm-up; rows moved into a pool during the measured rounds: {moved}); medians "
            f"over alternating rounds ({runs}), one client per speculate mode; per-round "
            f"ratios: {per_round}. Streamed tokens equal resident tokens in every round "
            "(checked). The client's host waits and replays are counted over the measured "
            "rounds per model call, the prompt's included; a step the client does not check "
            "(every pool holds every expert: nothing can miss) waits only in mlx-lm's own "
            f"evaluation, as resident's, and counts none. With speculate=auto: {auto} (no "
            "client-time row where there are none). Client time = `timing['exposed_s']` ÷ "
            "layer calls: from the router sync to the layer's rows in place, in the decode "
            "itself (the older hit path rows timed the native lookups alone, in a tight loop); "
            "the router sync (`sync_s`) is mostly MLX computing the layers before it.")


def fill_row(f: dict) -> str:
    return (f"| cold fill ({f['threads']} threads, O_DIRECT, checksum of every fill) | "
            f"{f['ratio']:.3f} ({f['fill_gbps']:.2f} vs {'fio' if f['fio_gbps'] else 'raw'} "
            f"{f['raw_gbps']:.2f} GB/s; without checksums {f['ratio_noverify']:.3f}) | "
            f"{verdict('≥ 0.90', f['ratio'] >= 0.90)} |")


def fill_detail(f: dict) -> str:
    rounds = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    fio = f"fio {rounds(f['fio_rounds'])}" if f["fio_gbps"] else "fio not installed"
    return (f"- Cold fill rounds (GB/s), {f['stride'] / 2**20:.2f} MiB rows on {f['filesystem']}: "
            f"our threaded O_DIRECT reader {rounds(f['raw_rounds'])} (median "
            f"{f['python_raw_gbps']:.2f}); {fio}; daemon verifying every fill "
            f"{rounds(f['fill_rounds'])}, without checksums {rounds(f['fill_noverify_rounds'])}; "
            f"checksum cost {f['verify_cost']:.1%} of fill throughput; daemon CPU "
            f"{f['fill_cpu_per_gb']:.3f} vs {f['fill_noverify_cpu_per_gb']:.3f} s per GB read. "
            f"The pread pool alone "
            f"(no daemon): {f['pool_gbps']:.2f} GB/s verifying, {f['pool_noverify_gbps']:.2f} "
            f"without (medians), {f['pool_cpu_per_gb']:.3f} vs {f['pool_noverify_cpu_per_gb']:.3f}"
            f" CPU s per GB read. xxh3 hashes "
            f"{f['hash_gbps']:.1f} GB/s on one thread ({f['hash_gbps_2threads']:.1f} on two; "
            f"xxhash {f['xxhash_version']} "
            f"{'releases' if f['hash_releases_gil'] else 'holds'} the GIL for a row).")


def patch(results_md: Path, groups: list, what: str, only: str) -> None:
    """Rewrite only some lines of the main table and its details in an existing RESULTS.md
    (the "## " sections below are kept as they are): per ``(prefixes, lines)`` of ``groups``,
    the lines starting with one of ``prefixes`` give way to ``lines``, written where the first
    of them was; under the "Produced by" line, a stamp saying that ``what`` was re-measured
    alone by ``--only only`` (in place of an older one)."""
    mark = f"{what} re-measured alone"
    stamp = (f"{mark} by `python bench/run.py --only {only}` on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.")
    text = results_md.read_text()
    cut = text.find("\n## ") + 1 or len(text)
    out, written = [], set()
    for line in text[:cut].split("\n"):
        group = next((i for i, (prefixes, _) in enumerate(groups) if line.startswith(prefixes)),
                     None)
        if group is not None:
            if group not in written:
                out += groups[group][1]
                written.add(group)
            continue
        if line.startswith(mark):  # a previous stamp
            if out and not out[-1]:
                out.pop()
            continue
        out.append(line)
        if line.startswith("Produced by"):
            out += ["", stamp]
    results_md.write_text("\n".join(out) + text[cut:])


def patch_fill(results_md: Path, f: dict) -> None:
    """Replace only the cold-fill row and its detail line of an existing RESULTS.md."""
    patch(results_md, [(("| cold fill",), [fill_row(f)]),
                       (("- Cold fill rounds",), [fill_detail(f)])], "Cold fill", "fill")


def patch_warm(results_md: Path, ws: dict, wb: dict) -> None:
    """Replace only the warm-decode rows and their detail line of an existing RESULTS.md (the
    older hit-path rows, detail and plot go)."""
    patch(results_md, [(("| benchmark |",), [TABLE_HEAD]), (WARM_ROWS, warm_rows(ws, wb)),
                       (WARM_DETAILS, [warm_detail(ws, wb)]), (("![hit path]",), [])],
          "Warm decode", "warm")


def warm_small() -> dict:
    return warm_decode.run("small", SMALL)


def warm_big() -> dict:
    return warm_decode.run("medium", MEDIUM, rounds=5, tokens=24)


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=("fill", "warm", "overlap"),
                        help="run one benchmark and rewrite only its lines in RESULTS.md")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.only == "fill":
        f = fill.run("qwen3-30b-like", QWEN3_30B_LIKE)
        print(json.dumps(f, indent=1))
        patch_fill(ROOT / "RESULTS.md", f)
        print(f"updated the cold-fill lines of {ROOT / 'RESULTS.md'}")
        return 0
    if args.only == "warm":
        ws, wb = warm_small(), warm_big()
        print(json.dumps(dict(warm_small=ws, warm_big=wb), indent=1))
        patch_warm(ROOT / "RESULTS.md", ws, wb)
        print(f"updated the warm-decode lines of {ROOT / 'RESULTS.md'}")
        return 0
    if args.only == "overlap":
        overlap_report.write_section(ROOT / "RESULTS.md", overlap.run())
        print(f"updated the overlap section of {ROOT / 'RESULTS.md'}")
        return 0
    results = {}
    steps = [
        ("warm_small", warm_small),
        ("warm_big", warm_big),
        ("fill", lambda: fill.run("qwen3-30b-like", QWEN3_30B_LIKE)),
        ("capped", lambda: capped.run("small", SMALL)),
        ("sharing", lambda: sharing("small", SMALL)),
        ("memory", lambda: memory("qwen3-30b-like", QWEN3_30B_LIKE)),
        ("reclaim", reclaim.run),
        ("overlap", overlap.run),
    ]
    for key, step in steps:
        t0 = time.monotonic()
        results[key] = step()
        shown = {k: v for k, v in results[key].items() if not isinstance(v, (list, dict))}
        print(f"{key} ({time.monotonic() - t0:.0f} s): {shown}", flush=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=1))
    plots(results)
    # The sections below the main table (written by other scripts) are kept; the overlap
    # section is written again from this run.
    results_md = ROOT / "RESULTS.md"
    old = results_md.read_text() if results_md.exists() else ""
    kept = old[old.find("\n## ") + 1:] if "\n## " in old else ""
    results_md.write_text(report(results) + ("\n" + kept if kept else ""))
    overlap_report.write_section(results_md, results["overlap"])
    print(f"wrote {ROOT / 'RESULTS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
