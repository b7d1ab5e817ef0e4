"""The overlap benchmark's section of bench/RESULTS.md and its plots (see overlap.py)."""

import time

import common
import numpy as np
from common import ROOT
from overlap import NARROW

HEADER = "## Overlap: prefetch off vs on (decode)"
COMMAND = "`python bench/run.py --only overlap`"


def _runs(learned: dict, fraction: float, mode: str) -> list:
    return [r for r in learned["runs"] if r["fraction"] == fraction and r["mode"] == mode]


def _med(runs: list, get) -> float:
    return float(np.median([get(r) for r in runs]))


def _verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


def _fmt_tps(x: float) -> str:
    return "∞ (no reads)" if not np.isfinite(x) else f"{x:.0f}"


def exposed_table(L: dict) -> list:
    lines = [
        "| arena (rows) | prefetch | exposed µs/layer | of which client path µs | "
        "critical-path copy µs | background copy µs | daemon fill µs | fill wait µs (rounds) | "
        "exposed ÷ (copy + background + fill) (rounds) | exposed on ÷ off | target | pass/fail |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for f in sorted({r["fraction"] for r in L["runs"]}):
        off = _runs(L, f, "off")
        for mode in [m for m in ("off", "on", NARROW) if _runs(L, f, m)]:
            runs = _runs(L, f, mode)
            d = lambda k: _med(runs, lambda r: r["decode"][k])  # noqa: E731
            target, verdict = "–", "–"
            if f == 1.0 and mode == "on":
                target, verdict = "≤ 0.2", _verdict(d("ratio") <= 0.2)
            elif f == 0.25 and mode == "on":
                half = 0.5 * _med(off, lambda r: r["decode"]["fill_wait_us"])
                target = f"fill wait ≤ ½ of off ({half:.0f} µs)"
                verdict = _verdict(d("fill_wait_us") <= half)
            # What the main thread spends besides copies and waits: pool bookkeeping, lookups,
            # validation, committing rows written ahead, Python (not in the ratio's denominator).
            client = _med(runs, lambda r: r["decode"]["exposed_us"] - r["decode"]["copy_us"]
                          - r["decode"]["fill_wait_us"] - r["decode"]["copier_wait_us"])
            vs_off = d("exposed_us") / _med(off, lambda r: r["decode"]["exposed_us"])
            rounds = lambda k, fmt: ", ".join(format(r["decode"][k], fmt) for r in runs)  # noqa
            lines.append(
                f"| {f:.0%} ({runs[0]['rows']}) | {mode} | {d('exposed_us'):.0f} | {client:.0f} | "
                f"{d('copy_us'):.1f} | {d('busy_us'):.1f} | {d('fill_us'):.0f} | "
                f"{d('fill_wait_us'):.0f} ({rounds('fill_wait_us', '.0f')}) | {d('ratio'):.3f} "
                f"({rounds('ratio', '.3f')}) | {'–' if mode == 'off' else f'{vs_off:.2f}'} | "
                f"{target} | {verdict} |")
    return lines


def prediction_table(L: dict) -> list:
    cols = [(f, "on") for f in (0.25, 1.0)]
    head = " | ".join(f"{f:.0%} arena: core P / R | read-ahead P / R" for f, _ in cols)
    lines = [f"| predicted layer | {head} |", "| --- |" + " --- |" * 2 * len(cols)]
    preds = [_runs(L, f, m)[0]["prediction"] for f, m in cols]
    for layer in range(1, L["layers"]):
        cells = []
        for p in preds:
            s = p[layer]
            if s is None or s["precision"] is None:
                cells += ["–", "–"]
                continue
            cells.append(f"{s['precision']:.2f} / {s['recall']:.2f}")
            cells.append(f"{s['wide_precision']:.2f} / {s['wide_recall']:.2f}")
        lines.append(f"| {layer} | {' | '.join(cells)} |")
    return lines


def mean_precision(pred: list) -> float:
    got = [p for p in pred if p is not None and p["guessed"]]
    return sum(p["right"] for p in got) / max(1, sum(p["guessed"] for p in got))


def qwen_table(Q: dict) -> list:
    lines = ["| prefetch | tok/s | exposed µs/layer | critical-path copy µs (MB) per layer | "
             "background copy µs (MB) per layer | guess precision | exposed ÷ copy time |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in Q["runs"]:
        d = r["decode"]
        prec = mean_precision(r["prediction"]) if r["mode"] == "on" else None
        lines.append(
            f"| {r['mode']} | {r['tps']:.2f} | {d['exposed_us']:.0f} | {d['copy_us']:.0f} "
            f"({d['exposed_bytes'] / 1e6:.1f}) | {d['busy_us']:.0f} "
            f"({d['background_bytes'] / 1e6:.1f}) | {'–' if prec is None else f'{prec:.2f}'} | "
            f"{d['ratio']:.3f} |")
    return lines


def curve_table(L: dict) -> list:
    lines = ["| arena (rows) | tok/s off | tok/s on | resident tok/s | TTFT off ms | TTFT on ms "
             "| resident TTFT ms | KiB read per token off / on | SSD bound tok/s off / on |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in L["resident"]:
        f = res["fraction"]
        off, on = _runs(L, f, "off"), _runs(L, f, "on")
        m = lambda runs, k: _med(runs, lambda r: r[k])  # noqa: E731
        lines.append(
            f"| {f:.0%} ({off[0]['rows']}) | {m(off, 'tps'):.1f} | {m(on, 'tps'):.1f} | "
            f"{res['tps']:.1f} | {m(off, 'ttft') * 1e3:.0f} | {m(on, 'ttft') * 1e3:.0f} | "
            f"{res['ttft'] * 1e3:.0f} | {m(off, 'bytes_per_token') / 1024:.0f} / "
            f"{m(on, 'bytes_per_token') / 1024:.0f} | {_fmt_tps(m(off, 'ssd_bound_tps'))} / "
            f"{_fmt_tps(m(on, 'ssd_bound_tps'))} |")
    return lines


def belady_table(L: dict) -> list:
    lines = ["| arena (rows) | prefetch | requests | Belady | LFU hit rate | prefetch saved | "
             "hits / misses / prefetch hits | LFU ÷ Belady (≥ 0.95) | (hits + prefetch hits) ÷ "
             "Belady |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    # Not at 100%: there every expert is fetched before the recorded generations.
    for f in sorted({r["fraction"] for r in L["runs"]} - {1.0}):
        for mode in ("off", "on"):
            r = _runs(L, f, mode)[0]
            b = r["belady"]
            lines.append(
                f"| {f:.0%} ({r['rows']}) | {mode} | {b['requests']} | {b['belady']:.3f} | "
                f"{b['lfu']:.3f} | {b['saved']:.3f} | {b['hits']} / {b['misses']} / "
                f"{b['prefetch_hits']} | {b['ratio']:.3f} ({_verdict(b['ratio'] >= 0.95)}) | "
                f"{b['ratio_with_prefetch']:.3f} |")
    return lines


def plots(L: dict) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fr = [res["fraction"] for res in L["resident"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode, style, colour in (("off", "o-", "tab:blue"), ("on", "s-", "tab:orange")):
        a.plot(fr, [_med(_runs(L, f, mode), lambda r: r["tps"]) for f in fr], style,
               color=colour, label=f"expertd, prefetch {mode}")
        b.plot(fr, [_med(_runs(L, f, mode), lambda r: r["ttft"]) * 1e3 for f in fr], style,
               color=colour, label=f"expertd, prefetch {mode}")
        bound = [_med(_runs(L, f, mode), lambda r: r["ssd_bound_tps"]) for f in fr]
        pts = [(f, x) for f, x in zip(fr, bound) if np.isfinite(x)]
        if pts:
            a.plot(*zip(*pts), ":", color=colour,
                   label=f"SSD bound, prefetch {mode} (none at 100%: no reads)")
    a.plot(fr, [res["tps"] for res in L["resident"]], "k--", label="resident mlx-lm")
    b.plot(fr, [res["ttft"] * 1e3 for res in L["resident"]], "k--", label="resident mlx-lm")
    a.set_yscale("log")
    a.set_title("decode tok/s (higher is better)")
    b.set_title(f"TTFT, {L['prompt_tokens']}-token prompt (lower is better)")
    for ax in (a, b):
        ax.set_xlabel("arena (fraction of all experts)")
        ax.legend(fontsize=7)
    b.set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(ROOT / "overlap_curve.png", dpi=110)

    cases = [(f, m) for f in (0.25, 1.0) for m in ("off", "on")]
    fig, axes = plt.subplots(len(cases), 1, figsize=(11, 1.3 * len(cases) + 1.8), sharex=True)
    colours = dict(sync="tab:blue", exposed="tab:red", rest="tab:green", between="lightgrey")
    for ax, (f, m) in zip(axes, cases):
        rec = _runs(L, f, m)[0]["timeline"]
        t0 = rec[0][1]
        for i, (layer, start, synced, fetched, done) in enumerate(rec):
            spans = [("sync", start, synced), ("exposed", synced, fetched),
                     ("rest", fetched, done)]
            if i + 1 < len(rec):
                spans.append(("between", done, rec[i + 1][1]))
            for name, s, e in spans:
                ax.broken_barh([((s - t0) * 1e3, (e - s) * 1e3)], (0, 1), color=colours[name])
            ax.text((start - t0) * 1e3, 1.05, str(layer), fontsize=6)
        ax.set_yticks([])
        ax.set_ylabel(f"{f:.0%}\n{m}", rotation=0, labelpad=20, fontsize=8)
    handles = [matplotlib.patches.Patch(color=c, label=n) for n, c in (
        ("router sync (incl. lazy compute of the previous layer and attention)", colours["sync"]),
        ("exposed fetch (less is better)", colours["exposed"]),
        ("rest of the call: graph build, guess, write-ahead", colours["rest"]),
        ("between MoE calls (host work outside the switch)", colours["between"]))]
    axes[-1].set_xlabel("ms from the first call shown (3 decode tokens, layer number above)")
    fig.suptitle("learned model, per MoE layer call: arena % and prefetch", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.legend(handles=handles, fontsize=7, loc="lower center", ncol=2)
    fig.savefig(ROOT / "overlap_timeline.png", dpi=110)
    return ["overlap_curve.png", "overlap_timeline.png"]


def notes(L: dict, Q: dict) -> list:
    """The closing notes, every number from this run."""
    pred = _runs(L, 1.0, "on")[0]["prediction"]
    p = {i: x["precision"] for i, x in enumerate(pred) if x is not None and x["guessed"]}
    later = [v for i, v in p.items() if i >= 2]
    wide = {i: x["wide_recall"] for i, x in enumerate(pred) if x is not None and x["guessed"]}
    wide_later = [v for i, v in wide.items() if i >= 2]
    narrow = _runs(L, 0.25, NARROW)
    fw = lambda runs: _med(runs, lambda r: r["decode"]["fill_wait_us"])  # noqa: E731
    kib = lambda runs: _med(runs, lambda r: r["bytes_per_token"]) / 1024  # noqa: E731
    on25, off25 = _runs(L, 0.25, "on"), _runs(L, 0.25, "off")
    fill_us = lambda runs: _med(runs, lambda r: r["decode"]["fill_us"])  # noqa: E731
    narrow_note = ([
        f"- Reading ahead twice the top-k: at the 25% arena the fill wait is {fw(on25):.0f} µs "
        f"per layer against {fw(narrow):.0f} with the read-ahead as narrow as the copy ahead "
        f"(`guess_width=1`) and {fw(off25):.0f} with prefetch off (on ÷ off "
        f"{fw(on25) / fw(off25):.2f}, width 1 ÷ off {fw(narrow) / fw(off25):.2f}). Daemon fill "
        f"time per layer (wrong guesses read too): {fill_us(on25):.0f} µs against "
        f"{fill_us(narrow):.0f}. The price is SSD bytes: {kib(on25):.0f} KiB read per decode "
        f"token against {kib(narrow):.0f} at width 1 and {kib(off25):.0f} with prefetch off. "
        "The daemon reads a guess past its core only while pread workers are spare "
        "(`prefetch_shed` counts what it skips), which they always were here: this run does not "
        "show how much of that tail a daemon the SSD bounds would shed."] if narrow else [])
    fr = [res["fraction"] for res in L["resident"]]
    m = lambda f, mode, k: _med(_runs(L, f, mode), lambda r: r[k])  # noqa: E731
    md = lambda f, mode, k: _med(_runs(L, f, mode), lambda r: r["decode"][k])  # noqa: E731
    tps = ", ".join(f"{f:.0%} {m(f, 'on', 'tps') / m(f, 'off', 'tps'):.2f}" for f in fr)
    hide = {f: md(f, "on", "exposed_us") / md(f, "off", "exposed_us") for f in fr}
    exp = ", ".join(f"{f:.0%} {x:.2f}" for f, x in hide.items())
    capped = [x for f, x in hide.items() if f < 1.0]
    ttft = ", ".join(f"{f:.0%} {m(f, 'on', 'ttft') / m(f, 'off', 'ttft'):.2f}" for f in fr)
    res = [r["tps"] for r in L["resident"]]
    full = lambda k: md(1.0, "on", k)  # noqa: E731
    client = full("exposed_us") - full("copy_us") - full("fill_wait_us") - full("copier_wait_us")
    q_on = next(r for r in Q["runs"] if r["mode"] == "on")["decode"]
    q_off = next(r for r in Q["runs"] if r["mode"] == "off")["decode"]
    cc = _runs(L, 1.0, "on")[0]["copier_costs"]
    # Median per-call spans from the timeline runs: sync, exposed, rest of the call (µs).
    spans = {(f, mode): np.median([[r[2] - r[1], r[3] - r[2], r[4] - r[3]]
                                   for r in _runs(L, f, mode)[0]["timeline"]], axis=0) * 1e6
             for f in (0.25, 1.0) for mode in ("off", "on")}
    tl = "; ".join(f"{f:.0%} {mode}: {a:.0f} / {b:.0f} / {c:.0f}"
                   for (f, mode), (a, b, c) in spans.items())
    return [
        "Notes:", "",
        f"- Prediction precision of the core (the next router's top-k; = its recall, as many "
        f"guesses as routed experts) reached {min(later):.2f}–{max(later):.2f} on layers "
        f"2–{L['layers'] - 1} and {p[1]:.2f} on layer 1 (guessed from layer 0's input, which is "
        "little more than the embedding); the same routing in every run (the tokens are), so the "
        "25% and 100% columns agree. It matches the offline statistics of the learned-model "
        f"section below. The read-ahead (twice as many, best first) recalls "
        f"{min(wide_later):.2f}–{max(wide_later):.2f} on layers 2–{L['layers'] - 1} and "
        f"{wide[1]:.2f} on layer 1.",
        *narrow_note,
        f"- Exposed time, prefetch on ÷ off, per arena: {exp}. Where there are fills, prefetch "
        f"hides {1 - max(capped):.0%}–{1 - min(capped):.0%} of the exposed time; at 100% there "
        "are none, and the guess (its PREFETCH, write-ahead and commit) costs about what the "
        "copies it saves did.",
        f"- The ≤ 0.2 bar at 100% fails on this model by construction of its rows: with 16 KiB "
        f"rows a layer's copies take about {full('copy_us') + full('busy_us'):.0f} µs in all, "
        f"while the client path the ratio's numerator also holds (pool bookkeeping, lookups, "
        f"validation, committing rows written ahead, Python) takes about {client:.0f} µs. At "
        f"Qwen3-30B-A3B shapes (pools of {Q['pool_rows']} rows a layer, the top-k), where "
        f"the copy is what matters, exposed ÷ copy time is {q_on['ratio']:.3f} with prefetch on "
        f"against {q_off['ratio']:.3f} off ({q_on['exposed_us']:.0f} against "
        f"{q_off['exposed_us']:.0f} µs per layer, {q_on['exposed_bytes'] / 1e6:.1f} against "
        f"{q_off['exposed_bytes'] / 1e6:.1f} MB copied on the critical path) with a random "
        "router's guesses.",
        f"- Decode tok/s, on ÷ off: {tps}; TTFT on ÷ off: {ttft}. Within one run the resident "
        f"model alone ranged {min(res):.0f}–{max(res):.0f} tok/s: differences of ±20% between "
        "single points are this shared machine's noise. On this CPU the gap to resident is the "
        "per-layer router sync (one host sync per MoE layer breaks MLX's pipelining; blue in the "
        "timeline), not copies or fills.",
        f"- Not in the exposed time: the main thread's work after the rows are in place, where "
        f"the guess for the next layer is sent as PREFETCH and written ahead. Median per call "
        f"in the timeline runs, router sync / exposed / rest of the call, µs: {tl}. With "
        "prefetch on part of what leaves the exposed column reappears in the rest of the call; "
        "compare the whole call, not the exposed column alone. The guess itself "
        f"(`timing['prestage_s']`) takes {md(0.25, 'on', 'prestage_us'):.0f} µs per layer at "
        f"the 25% arena and {full('prestage_us'):.0f} at 100%.",
        "- Hit rates: prefetched rows used are counted apart (STATS prefetch_hits); LFU's own "
        "hit rate barely moves with prefetch on, the misses it saves move to prefetch hits. "
        "(hits + prefetch hits) ÷ Belady can exceed 1: the side rows are capacity "
        "Belady's cache does not have. The daemon looks up only what the client's pools miss "
        "(and the prompt's calls in groups), so STATS counts far fewer lookups than the trace "
        "holds requests (requests column): LFU ÷ Belady compares the arena's hit rate on the "
        "pools' misses with Belady on every request, not one policy with another on one "
        "stream.",
        f"- Measured alone in the same run (no MLX work, `copier_costs`): the arena lookup of "
        f"top-{L['top_k']} guessed rows takes {cc['lookup']:.0f} µs p50; handing an empty job to "
        f"the copier thread and getting it back costs {cc['empty_job']:.0f} µs (thread wake-up "
        f"and GIL hand-off), and handing over a copy of those rows "
        f"({L['top_k'] * L['stride'] // 1024} KiB) and waiting for it {cc['job_wait']:.0f} µs: "
        "for rows this small the copier costs more than the copy. So the client writes a guess "
        "ahead on the copier only from `copy_ahead_bytes` (512 KiB) up; below it the guess is "
        "the lookup and the PREFETCH alone.", ""]


def section(result: dict) -> str:
    L, Q = result["learned"], result["qwen30b"]
    plots(L)
    full_on = _runs(L, 1.0, "on")
    r25_on, r25_off = _runs(L, 0.25, "on"), _runs(L, 0.25, "off")
    # Resident mlx-lm does not depend on the arena: the median of all its runs in this run.
    res_ttft = _med(L["resident"], lambda r: r["ttft"])
    ttft25 = _med(r25_on, lambda r: r["ttft"]) / res_ttft
    lines = [
        HEADER, "",
        f"Produced by {COMMAND} on {result.get('measured_at') or time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in "  # noqa: E501
        f"{result['seconds'] / 60:.1f} min (Linux x86-64, 2 shared cores, MLX on the CPU, about "
        "100× slower than Metal: the copies here are small next to compute, so tok/s hardly "
        "moves with them; the exposed time is what carries over to Apple Silicon).",
        "",
        f"Learned-routing model ({L['layers']} layers × {L['n_keys'] // L['layers']} experts, "
        f"top-{L['top_k']}, {L['stride'] / 1024:.0f} KiB rows). Each run: a fresh daemon with "
        "that many cache rows (`--cache-gb` sized for them; the daemon's default side rows come on "
        "top: 2 × top-k per generation where the cache keeps 16 times as many rows, top-k "
        "below, so top-k at 10% only), one client (`load(..., prefetch=off|on, "
        "speculate=\"off\")`: prefetch works on the per-layer path; the default pools, 2 × "
        "top-k rows a layer); at 100% every expert is fetched into the arena first; a warm-up "
        "generation on one held-out prompt, then the measured one on another: "
        f"{L['prompt_tokens']}-token held-out prompt, {L['decode_tokens']} tokens "
        f"sampled at temperature 1 with a fixed seed (greedy decoding of this small model repeats "
        "one token, and so would its routing). Per-layer numbers are over the decode calls after "
        f"the first token; medians of {L['rounds']} rounds, off and on alternating, each round "
        "listed. Tokens equal resident mlx-lm's in every run (checked).",
        "",
        "Exposed = the main thread from the router sync until the layer's rows are in place "
        "(`timing['exposed_s']`); critical-path copy = `timing['copy_s']`; background copy = "
        "the copier thread's busy time; daemon fill = the daemon's `fill_seconds` (pread time), "
        "fill wait = demand round trips and drains (`timing['fill_wait_s']`).",
        "", "| row | measured | target | pass/fail |", "| --- | --- | --- | --- |",
        f"| exposed ÷ copy + fill, 100% arena, prefetch on | "
        f"{_med(full_on, lambda r: r['decode']['ratio']):.3f} | ≤ 0.2 | "
        f"{_verdict(_med(full_on, lambda r: r['decode']['ratio']) <= 0.2)} |",
        f"| exposed fill time, 25% arena, on ÷ off | "
        f"{_med(r25_on, lambda r: r['decode']['fill_wait_us']) / _med(r25_off, lambda r: r['decode']['fill_wait_us']):.3f} "  # noqa: E501
        f"| ≤ 0.5 | {_verdict(_med(r25_on, lambda r: r['decode']['fill_wait_us']) <= 0.5 * _med(r25_off, lambda r: r['decode']['fill_wait_us']))} |",  # noqa: E501
        f"| TTFT ÷ resident, 25% arena, prefetch on, {L['prompt_tokens']}-token prompt | "
        f"{ttft25:.2f} ({_med(r25_on, lambda r: r['ttft']) * 1e3:.0f} vs {res_ttft * 1e3:.0f} ms, "
        f"resident: median over the {len(L['resident'])} arena points) | ≤ 1.2 (the issue's "
        f"prefill goal) | {_verdict(ttft25 <= 1.2)} |",
        "",
        "Exposed time per MoE layer (decode):", "", *exposed_table(L), "",
        "Guess precision / recall per predicted layer (prefetch on, whole run incl. warm-up; "
        "layer L's guess is made at layer L−1's router sync):", "", *prediction_table(L), "",
        f"Capped decode (a curve, no bar: tok/s higher is better, TTFT lower is better). SSD "
        f"bound = raw O_DIRECT random reads of {L['stride'] / 1024:.0f} KiB rows, "
        f"{L['ssd_gbps']:.2f} GB/s ({L['ssd_tool']}, 8 threads, same run) ÷ the daemon's "
        "bytes read per decode token:", "", *curve_table(L), "",
        "Hit rate ÷ Belady on the routing each run recorded (warm-up and measured generation, "
        "every call's distinct experts in call order; Belady at the daemon's cache rows, cold "
        "start as the daemon). LFU hit rate = STATS hits ÷ (hits + misses + prefetch hits); a "
        "used prefetched row is a saved miss, counted apart (first round):", "",
        *belady_table(L), "",
        f"Qwen3-30B-A3B expert shapes (`qwen3-30b-like`: {Q['layers']} layers, top-{Q['top_k']},"
        f" {Q['expert_bytes'] / 2**20:.2f} MiB per expert), every expert in the arena, pools of "
        f"{Q['pool_rows']} rows a layer (pools of every expert would move nothing), "
        f"{Q['tokens']} decode tokens, one round, prefetch='on'. Random router, but the synth "
        "model's routing collapses onto few experts, so its guesses beat chance "
        f"({Q['top_k'] / Q['experts']:.2f} for {Q['experts']} experts, top-{Q['top_k']}) and "
        "stay above auto's 0.5 bar; the guess precision column is measured, not assumed.", "",
        *qwen_table(Q), "",
        *notes(L, Q),
        "![overlap curve](overlap_curve.png)", "![overlap timeline](overlap_timeline.png)", ""]
    return "\n".join(lines)


def write_section(results_md, result: dict) -> None:
    """Put the overlap section into RESULTS.md, replacing an older one, other sections kept."""
    common.write_section(results_md, HEADER, section(result))
