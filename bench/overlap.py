"""Overlap benchmarks: how much of the copy and fill time prefetch hides, decode only.

    python bench/run.py --only overlap      (runs this, rewrites only its section of RESULTS.md)

One daemon per arena size, one client at a time, prefetch off and on alternating at each size:
- exposed time (main thread after the router sync until the rows are in place) ÷ copy + fill time
  (critical-path copies + the copier's background copies + the daemon's fill time), per layer;
- capped decode tok/s and TTFT vs the arena, next to resident mlx-lm and the SSD bound;
- LFU hit rate from STATS (prefetched rows apart) ÷ Belady on the routing the run recorded;
- a per-layer timeline of a few decode tokens, and what the copier costs with prefetch on.
The learned-routing model is the subject; the Qwen3-30B-A3B-shaped synth model (random router)
gives absolute copy sizes and times at real expert shapes.
"""

import json
import math
import time
from contextlib import ExitStack

import numpy as np
from belady import belady_hits
from common import OUT, daemon, ensure_model, stats

FRACTIONS = (0.10, 0.25, 0.50, 0.75, 1.00)
MODES = ("off", "on")
# At the 25% arena (the fill-wait bar) also prefetch on with the read-ahead as narrow as the
# copy ahead (guess_width=1, what the client did before it read ahead twice the top-k).
NARROW = "on, width 1"
PROMPT_TOKENS = 32
DECODE_TOKENS = 64
TEMP = 1.0  # greedy decoding of this small model repeats one token: its routing would too
TIMELINE_TOKENS = 3
STAT_KEYS = ("hits", "misses", "prefetch_hits", "prefetch_requested", "prefetch_fills",
             "prefetch_wasted", "prefetch_dropped", "prefetch_shed", "prefetch_merged",
             "bytes_read", "fill_seconds")


def arena_gb(blob_dir, rows: int) -> float:
    """``--cache-gb`` that gives exactly ``rows`` cache rows, the daemon's default side rows
    (``Geometry.default_side_rows``) on top."""
    from expertd.manifest import Manifest
    from expertd.protocol import GUESS_WIDTH
    from expertd.shm.layout import Geometry

    m = Manifest.load(blob_dir)
    shape = (len(m.layers), m.max_experts, m.stride)
    for side in (GUESS_WIDTH * m.top_k, m.top_k):
        least = Geometry.smallest_budget(*shape, side_rows=side, cache_rows=rows)
        gb = math.ceil(least / 2**30 * 1e6) / 1e6
        if Geometry.default_side_rows(*shape, int(gb * 2**30), m.top_k, GUESS_WIDTH) == side:
            return gb
    raise AssertionError(f"no budget gives {rows} cache rows")


def record_routing(model) -> list:
    """Record, after each streamed switch call, the distinct experts it routed: (layer, ids).

    Read after the call, when the indices are evaluated already, so it adds no host sync.
    """
    trace = []
    for _, module in model.named_modules():
        st = getattr(module, "layer", None)
        if st is None:
            continue
        cls = type(module)

        def call(self, x, indices, _cls=cls, _layer=st.index):
            out = _cls.__call__(self, x, indices)
            trace.append((_layer, np.unique(np.array(indices))))
            return out

        module.__class__ = type(f"Traced{cls.__name__}", (cls,), {"__call__": call})
    return trace


def snapshot(session, blob_dir) -> dict:
    s = stats(blob_dir)
    return dict(timing=dict(session.timing), counters=session.all_counters(),
                busy=session.session.copier.busy_seconds, stats={k: s[k] for k in STAT_KEYS},
                rows=s["arena_rows"])


def generate(model, tokenizer, ids, tokens: int, on_first=None) -> dict:
    """Sampled decode (fixed seed): TTFT, decode tok/s (after the first token), the tokens."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(0)
    out, first = [], None
    started = time.perf_counter()
    for r in stream_generate(model, tokenizer, ids, max_tokens=tokens, sampler=make_sampler(TEMP)):
        if first is None:
            first = time.perf_counter()
            if on_first is not None:
                on_first()
        out.append(r.token)
    done = time.perf_counter()
    return dict(ttft=first - started, tps=(len(out) - 1) / (done - first), tokens=out)


def copier_costs(session, n: int = 1000) -> dict:
    """The copier alone (no MLX work in flight), every expert resident: µs p50 of the lookup of
    top_k guessed rows in the arena, of handing the copier an empty job and getting it back,
    and of waiting for a copy of those rows just handed over (what writing a guess ahead costs
    besides the copy)."""
    rng = np.random.default_rng(0)
    dest = np.empty(session.session.staging_bytes(), np.uint8)
    layers, k = len(session.manifest.layers), session.manifest.top_k
    positions = np.arange(k, dtype=np.int32)
    out = {key: [] for key in ("lookup", "empty_job", "job_wait")}
    for i in range(n):
        layer = 1 + i % (layers - 1)
        guessed = np.sort(rng.choice(session.manifest.layers[layer].num_experts, k,
                                     replace=False)).astype(np.int32)
        view, bases = session.session.view, session.session.bases(layer)
        t0 = time.perf_counter()
        slots = view.lookup(layer, guessed).slots
        t1 = time.perf_counter()
        session.session.copier.submit(lambda: None).wait()
        t2 = time.perf_counter()
        session.session.copier.submit(lambda: view.copy(layer, slots, dest, bases, positions)).wait()
        t3 = time.perf_counter()
        for key, span in (("lookup", t1 - t0), ("empty_job", t2 - t1),
                          ("job_wait", t3 - t2)):
            out[key].append(span * 1e6)
    return {key: float(np.median(v)) for key, v in out.items()}


def delta(a: dict, b: dict) -> dict:
    """What happened between two snapshots, per decode layer call where it is a time."""
    layers = max(1, b["timing"]["layers"] - a["timing"]["layers"])
    d = {k: b["timing"][k] - a["timing"][k] for k in a["timing"]}
    d.update({k: b["counters"][k] - a["counters"][k] for k in a["counters"]})
    d.update({k: b["stats"][k] - a["stats"][k] for k in a["stats"]})
    d["busy_s"] = b["busy"] - a["busy"]
    d["calls"] = layers
    total = d["copy_s"] + d["busy_s"] + d["fill_seconds"]
    d["ratio"] = d["exposed_s"] / total if total else float("nan")
    for k in ("exposed_s", "copy_s", "busy_s", "fill_seconds", "fill_wait_s", "copier_wait_s",
              "sync_s", "prestage_s"):
        d[k.removesuffix("_s").removesuffix("_seconds") + "_us"] = d[k] / layers * 1e6
    return d


def one_run(blob_dir, tokenizer, prompts, rows: int, mode: str, all_resident: bool,
            tokens: int | None = None, probe: bool = False, timeline: bool = False,
            warm_tokens: int | None = None, pool_gb: float | None = None) -> dict:
    """A fresh daemon of ``rows`` cache rows, one client with prefetch ``mode`` (and pools of
    ``pool_gb``, default the client's): a warm-up generation on one held-out prompt, then the
    measured one on another. ``probe``: also time the copier alone (prefetch on)."""
    from expertd.client import load

    warm_ids, ids = prompts
    tokens = tokens or DECODE_TOKENS
    # Prefetch works on the per-layer path (a speculative step guesses nothing, and the
    # routing trace would add a host wait to it): every step takes that path.
    options = dict(pool_gb=pool_gb, speculate="off")
    with ExitStack() as stack:
        _start(stack, blob_dir, rows)
        if mode == NARROW:
            model, _ = load(blob_dir, prefetch="on", guess_width=1, **options)
        else:
            model, _ = load(blob_dir, prefetch=mode, **options)
        session = model.expertd_session
        try:
            trace = record_routing(model)
            if all_resident:  # every expert in the arena before anything is measured
                dest = np.empty(session.session.staging_bytes(), np.uint8)
                for layer in session.manifest.layers:
                    every = np.arange(layer.num_experts, dtype=np.int32)
                    for s in range(0, len(every), session.session.max_group):
                        session.session.fetch(layer.index, every[s:s + session.session.max_group], dest)
            generate(model, tokenizer, warm_ids, warm_tokens or tokens)
            begin = snapshot(session, blob_dir)
            marks = {}
            run = generate(model, tokenizer, ids, tokens,
                           on_first=lambda: marks.update(first=snapshot(session, blob_dir)))
            end = snapshot(session, blob_dir)
            result = dict(mode=mode, rows=end["rows"], **run, decode=delta(marks["first"], end),
                          whole=delta(begin, end), prediction=session.prediction())
            result["whole_stats"] = end["stats"]
            result["trace"] = [(layer, ids_.astype(np.int64)) for layer, ids_ in trace]
            if probe and mode == "on":
                result["copier_costs"] = copier_costs(session)
            if timeline:
                session.session.timeline = []
                generate(model, tokenizer, ids, TIMELINE_TOKENS + 2)
                n = TIMELINE_TOKENS * len(session.manifest.layers)
                result["timeline"] = [r for r in session.session.timeline if r[3] is not None][-n:]
        finally:
            session.close()
    return result


def _start(stack: ExitStack, blob_dir, rows: int, attempts: int = 3) -> None:
    """A benchmark daemon; tried again a few seconds later if it did not start (the shared
    working tree may be mid-edit by another engineer for a moment)."""
    for attempt in range(attempts):
        try:
            stack.enter_context(daemon(blob_dir, arena_gb(blob_dir, rows), "--prefetch", "on"))
            return
        except RuntimeError:
            if attempt + 1 == attempts:
                raise
            time.sleep(10)


def belady_ratio(run: dict) -> dict:
    """LFU (the daemon's STATS over the whole run) ÷ Belady on the same recorded requests."""
    trace = np.array([(layer, e) for layer, ids in run["trace"] for e in ids.tolist()])
    best = belady_hits(trace, run["rows"]) / len(trace)
    s = run["whole_stats"]
    looked = s["hits"] + s["misses"] + s["prefetch_hits"]
    return dict(requests=len(trace), looked_up=looked, belady=best, lfu=s["hits"] / looked,
                saved=s["prefetch_hits"] / looked, hits=s["hits"], misses=s["misses"],
                prefetch_hits=s["prefetch_hits"], ratio=s["hits"] / looked / best,
                ratio_with_prefetch=(s["hits"] + s["prefetch_hits"]) / looked / best)


def resident(model_dir, tokenizer, ids, rounds: int = 3) -> dict:
    import mlx_lm

    model, _ = mlx_lm.load(str(model_dir))
    generate(model, tokenizer, ids, 8)
    runs = [generate(model, tokenizer, ids, DECODE_TOKENS) for _ in range(rounds)]
    return dict(tps=float(np.median([r["tps"] for r in runs])),
                ttft=float(np.median([r["ttft"] for r in runs])), tokens=runs[0]["tokens"])


def ssd_gbps(blob_dir, threads: int = 8) -> tuple:
    """Raw O_DIRECT random-read GB/s of the blob files, rows of the model's stride (fio if
    installed, else the same pattern in Python), median of 3."""
    from fill import fio_direct_read, raw_direct_read

    got = [fio_direct_read(blob_dir, threads, seconds=2) for _ in range(3)]
    if got[0] is not None:
        return float(np.median(got)), "fio"
    return float(np.median([raw_direct_read(blob_dir, threads, s) for s in range(3)])), "python"


def learned(rounds: int = 5, log=print) -> dict:
    """Everything on the learned-routing model: the arena curve, off and on at each size."""
    from learned import ensure_learned_model
    from mlx_lm.utils import load_tokenizer
    from routing_stats import held_out_tokens

    from expertd.manifest import Manifest

    model_dir, blob_dir = ensure_learned_model()
    manifest = Manifest.load(blob_dir)
    n_keys = sum(layer.num_experts for layer in manifest.layers)
    tokenizer = load_tokenizer(model_dir)
    held = held_out_tokens(model_dir)
    prompts = (held[1][:PROMPT_TOKENS].tolist(), held[0][:PROMPT_TOKENS].tolist())
    # The warm-up run at 100% (MLX's first calls, the blob files) before anything is measured.
    one_run(blob_dir, tokenizer, prompts, n_keys, "on", True, tokens=16)
    gbps, tool = ssd_gbps(blob_dir)
    res, runs = [], []
    for f in FRACTIONS:
        rows = max(2 * manifest.top_k, round(f * n_keys))
        res.append(dict(fraction=f, **resident(model_dir, tokenizer, prompts[1])))
        for round_ in range(rounds):
            # Alternating, so the machine's noise hits every mode alike.
            for mode in MODES + ((NARROW,) if f == 0.25 else ()):
                full = f == 1.0
                first = round_ == 0
                r = one_run(blob_dir, tokenizer, prompts, rows, mode, full, probe=full and first,
                            timeline=first and f in (0.25, 1.0))
                if r["tokens"] != res[-1]["tokens"]:
                    raise AssertionError(f"streamed tokens differ from resident ones at {f:.0%} "
                                         f"prefetch {mode}")
                r.update(fraction=f, round=round_, belady=belady_ratio(r))
                per_token = r["decode"]["bytes_read"] / (len(r["tokens"]) - 1)
                r["bytes_per_token"] = per_token
                r["ssd_bound_tps"] = gbps * 1e9 / per_token if per_token else float("inf")
                d = r["decode"]
                log(f"  learned {f:.0%} prefetch {mode}: {r['tps']:.1f} tok/s, TTFT "
                    f"{r['ttft'] * 1e3:.0f} ms, exposed {d['exposed_us']:.0f} µs/layer, ratio "
                    f"{d['ratio']:.3f}, fill wait {d['fill_wait_us']:.0f} µs, "
                    f"LFU/Belady {r['belady']['ratio']:.3f}", flush=True)
                r.pop("trace")
                r.pop("tokens")
                runs.append(r)
    return dict(runs=runs, resident=res, ssd_gbps=gbps, ssd_tool=tool, n_keys=n_keys,
                stride=manifest.stride, top_k=manifest.top_k, layers=len(manifest.layers),
                prompt_tokens=PROMPT_TOKENS, decode_tokens=DECODE_TOKENS, rounds=rounds)


def qwen30b(tokens: int = 6, log=print) -> dict:
    """Prefetch off vs on at Qwen3-30B-A3B expert shapes, every expert in the arena and pools of
    top-k rows a layer (of every expert, nothing would move)."""
    from common import QWEN3_30B_LIKE
    from mlx_lm.utils import load_tokenizer

    from expertd.manifest import Manifest

    model_dir, blob_dir = ensure_model("qwen3-30b-like", QWEN3_30B_LIKE)
    manifest = Manifest.load(blob_dir)
    n_keys = sum(layer.num_experts for layer in manifest.layers)
    expert_bytes = manifest.layers[0].expert_bytes
    # Half a row over the smallest pool, so that rounding cannot take a row off.
    pool_gb = (manifest.top_k + 0.5) * expert_bytes * len(manifest.layers) / 2**30
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode("The shared cache serves")
    out = []
    for mode in MODES:
        r = one_run(blob_dir, tokenizer, (ids, ids), n_keys, mode, True, tokens=tokens,
                    warm_tokens=2, pool_gb=pool_gb)
        d = r["decode"]
        d["exposed_bytes"] = (d["fast_hits"] + d["demanded"]) * expert_bytes / d["calls"]
        # Rows the copier wrote ahead and the pool took in (used or not).
        d["background_bytes"] = d["ahead"] * expert_bytes / d["calls"]
        r.pop("trace")
        out.append(r)
        log(f"  qwen3-30b-like prefetch {mode}: {r['tps']:.2f} tok/s, exposed "
            f"{d['exposed_us']:.0f} µs/layer, copy {d['copy_us']:.0f}, background "
            f"{d['busy_us']:.0f}", flush=True)
    if out[0]["tokens"] != out[1]["tokens"]:
        raise AssertionError("qwen3-30b-like: prefetch on changed the tokens")
    for r in out:
        r.pop("tokens")
    return dict(runs=out, stride=manifest.stride, top_k=manifest.top_k,
                layers=len(manifest.layers), tokens=tokens, experts=manifest.layers[0].num_experts,
                expert_bytes=expert_bytes, pool_rows=manifest.top_k)


def run(log=print) -> dict:
    started = time.monotonic()
    result = dict(learned=learned(log=log), qwen30b=qwen30b(log=log))
    result["seconds"] = time.monotonic() - started
    result["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = _json(result)
    (OUT / "overlap.json").write_text(text)
    return json.loads(text)  # plain Python values from here on


def _json(obj) -> str:
    def default(o):
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, np.generic):
            return o.item()
        raise TypeError(type(o))

    return json.dumps(obj, indent=1, default=default)
