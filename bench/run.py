"""Runs every benchmark side by side and writes bench/RESULTS.md with plots.

    python bench/run.py            (or: make bench)
    python bench/run.py --only fill   (re-measure cold fill; rewrite only its lines in RESULTS.md)
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

import numpy as np  # noqa: E402

import capped  # noqa: E402
import fill  # noqa: E402
import overlap  # noqa: E402
import overlap_report  # noqa: E402
import warm_decode  # noqa: E402
from common import MEDIUM, OUT, QWEN3_30B_LIKE, ROOT, SMALL, daemon, ensure_model, rss_breakdown, stats  # noqa: E402,E501


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
    """Daemon RSS outside the arena, and the client's own expert memory, with a warm cache."""
    from expertd.client import load
    from expertd.manifest import Manifest
    from mlx_lm import generate

    _, blob_dir = ensure_model(name, spec)
    manifest = Manifest.load(blob_dir)
    with daemon(blob_dir, manifest.total_expert_bytes * 1.2 / 2**30 + 0.01) as pid:
        model, tokenizer = load(blob_dir)
        generate(model, tokenizer, "Memory", max_tokens=16)
        session = model.expertd_session
        s = stats(blob_dir)
        rss = rss_breakdown(pid)
        staging = 2 * session.staging_bytes()
        session.close()
    return dict(name=name, arena_bytes=s["arena_bytes"], daemon_rss=rss["VmRSS"],
                daemon_private=rss["RssAnon"] + rss["RssFile"], daemon_shmem=rss["RssShmem"],
                client_expert_bytes=staging, stride=manifest.stride, top_k=manifest.top_k,
                client_bound=2 * manifest.top_k * manifest.stride)


def plots(results: dict) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = ["warm decode\n(small)", "warm decode\n(medium)", "cold fill", "sharing (3÷1)"]
    values = [results["warm_small"]["ratio"], results["warm_big"]["ratio"],
              results["fill"]["ratio"], results["sharing"]["ratio"]]
    bars = [0.95, 0.95, 0.90, 1.10]
    ax.bar(names, values, color=["tab:blue", "tab:blue", "tab:green", "tab:orange"])
    ax.scatter(names, bars, color="black", marker="_", s=600, label="bar", zorder=3)
    ax.set_ylabel("ratio")
    ax.legend(loc="lower left")
    ax.set_title("expertd ratios (measured side by side)")
    fig.tight_layout()
    fig.savefig(ROOT / "ratios.png", dpi=110)
    files.append("ratios.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for key, label in (("warm_small", "small"), ("warm_big", "medium")):
        samples = np.array(results[key]["hit_overhead_samples"])
        ax.hist(samples[samples < np.percentile(samples, 99.5)], bins=80, alpha=0.6, label=label)
    ax.axvline(20, color="black", linestyle="--", label="20 µs bar")
    ax.set_xlabel("client hit path per MoE layer, excluding the byte copy (µs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "hit_path.png", dpi=110)
    files.append("hit_path.png")

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


def report(r: dict) -> str:
    ws, wb, f, c, s, m = (r["warm_small"], r["warm_big"], r["fill"], r["capped"], r["sharing"],
                          r["memory"])
    lines = [
        "# expertd benchmark results", "",
        f"Produced by `python bench/run.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        " (Linux x86-64, 2 cores, MLX on the CPU). Ratios are measured side by side in one run.",
        "", "| benchmark | measured | bar |", "| --- | --- | --- |",
        f"| warm decode, small experts (hidden 256) | {ws['ratio']:.3f} ({ws['streamed_tps']:.1f}"
        f" vs {ws['resident_tps']:.1f} tok/s) | ≥ 0.95 |",
        f"| warm decode, medium experts (hidden 512, top-8) | {wb['ratio']:.3f} "
        f"({wb['streamed_tps']:.1f} vs {wb['resident_tps']:.1f} tok/s) | ≥ 0.95 |",
        fill_row(f),
    ]
    for row in c["rows"]:
        lines.append(f"| capped cache at {row['fraction']:.0%} of experts | {row['ratio']:.3f} "
                     f"(LFU {row['lfu']:.3f} vs Belady {row['belady']:.3f}) | ≥ 0.95 |")
    lines += [
        f"| hit path, small (p50 / p99) | {ws['hit_overhead_p50_us']:.1f} / "
        f"{ws['hit_overhead_p99_us']:.1f} µs | ≤ 20 µs p50 |",
        f"| hit path, medium (p50 / p99) | {wb['hit_overhead_p50_us']:.1f} / "
        f"{wb['hit_overhead_p99_us']:.1f} µs | ≤ 20 µs p50 |",
        f"| sharing, {s['clients']} clients ÷ 1 | {s['ratio']:.3f} ({s['many'] / 2**20:.1f} vs "
        f"{s['one'] / 2**20:.1f} MiB) | ≤ 1.10 |",
        f"| daemon RSS outside the arena | {m['daemon_private'] / 2**20:.1f} MiB | ≤ 100 MB |",
        f"| client expert memory | {m['client_expert_bytes'] / 2**20:.1f} MiB "
        f"(= {m['client_expert_bytes'] / m['client_bound']:.1f} × 2 × top-k × stride) | "
        "≤ 2 × top_k × stride × a small constant |",
        "", "Details:", "",
        f"- Warm decode medians over {len(ws['ratios'])} alternating rounds; per-round ratios: "
        f"small {', '.join(f'{x:.3f}' for x in ws['ratios'])}; medium "
        f"{', '.join(f'{x:.3f}' for x in wb['ratios'])}. Streamed tokens equal resident tokens "
        "in every round (checked).",
        f"- Whole fetch of top-k resident experts per layer (p50): small {ws['fetch_p50_us']:.1f}"
        f" µs of which copy {ws['copy_p50_us']:.1f} µs; medium {wb['fetch_p50_us']:.1f} µs of "
        f"which copy {wb['copy_p50_us']:.1f} µs.",
        fill_detail(f),
        f"- Capped cache trace: {c['trace_len']} expert requests recorded from real generation.",
        "", "![ratios](ratios.png)", "![hit path](hit_path.png)",
        "![capped cache](capped_cache.png)", "",
    ]
    return "\n".join(lines)


def fill_row(f: dict) -> str:
    return (f"| cold fill ({f['threads']} threads, O_DIRECT, checksum of every fill) | "
            f"{f['ratio']:.3f} ({f['fill_gbps']:.2f} vs {'fio' if f['fio_gbps'] else 'raw'} "
            f"{f['raw_gbps']:.2f} GB/s; without checksums {f['ratio_noverify']:.3f}) | ≥ 0.90 |")


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


def patch_fill(results_md: Path, f: dict) -> None:
    """Replace only the cold-fill row and its detail line of an existing RESULTS.md."""
    lines = results_md.read_text().split("\n")
    stamp = (f"Cold fill re-measured alone by `python bench/run.py --only fill` on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.")
    out = []
    for line in lines:
        if line.startswith("| cold fill"):
            line = fill_row(f)
        elif line.startswith("- Cold fill rounds"):
            line = fill_detail(f)
        elif line.startswith("Cold fill re-measured alone"):  # a previous stamp
            if out and not out[-1]:
                out.pop()
            continue
        out.append(line)
        if line.startswith("Produced by"):
            out += ["", stamp]
    results_md.write_text("\n".join(out))


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=("fill", "overlap"),
                        help="run one benchmark and rewrite only its lines in RESULTS.md")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.only == "fill":
        f = fill.run("qwen3-30b-like", QWEN3_30B_LIKE)
        print(json.dumps(f, indent=1))
        patch_fill(ROOT / "RESULTS.md", f)
        print(f"updated the cold-fill lines of {ROOT / 'RESULTS.md'}")
        return 0
    if args.only == "overlap":
        overlap_report.write_section(ROOT / "RESULTS.md", overlap.run())
        print(f"updated the overlap section of {ROOT / 'RESULTS.md'}")
        return 0
    results = {}
    steps = [
        ("warm_small", lambda: warm_decode.run("small", SMALL)),
        ("warm_big", lambda: warm_decode.run("medium", MEDIUM, rounds=5, tokens=24)),
        ("fill", lambda: fill.run("qwen3-30b-like", QWEN3_30B_LIKE)),
        ("capped", lambda: capped.run("small", SMALL)),
        ("sharing", lambda: sharing("small", SMALL)),
        ("memory", lambda: memory("qwen3-30b-like", QWEN3_30B_LIKE)),
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
