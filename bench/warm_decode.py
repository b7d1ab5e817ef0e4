"""Warm decode: tok/s with every expert in the arena ÷ tok/s of mlx-lm with the model resident.

Both models run in this process, alternating, so that the machine's noise hits both alike. Also
measures the client's per-layer hit path: ``Session.fetch`` of top-k resident experts, with and
without its byte copy.
"""

import time

import numpy as np

from common import daemon, ensure_model


def _decode_tps(model, tokenizer, prompt: str, tokens: int) -> tuple:
    from mlx_lm import stream_generate

    out = []
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=tokens):
        out.append(last.token)
    return last.generation_tps, out


def run(name: str, spec: dict, rounds: int = 5, tokens: int = 64) -> dict:
    import mlx_lm

    from expertd.client import load
    from expertd.manifest import Manifest

    model_dir, blob_dir = ensure_model(name, spec)
    total = Manifest.load(blob_dir).total_expert_bytes
    resident, tokenizer = mlx_lm.load(str(model_dir))
    prompt = "The shared cache serves every client from one copy of the experts"
    with daemon(blob_dir, total * 1.3 / 2**30 + 0.01):
        streamed, _ = load(blob_dir)
        session = streamed.expertd_session
        _decode_tps(streamed, tokenizer, prompt, tokens)  # fills the arena: warm from here on
        _decode_tps(resident, tokenizer, prompt, tokens)
        ratios, res_tps, str_tps = [], [], []
        for _ in range(rounds):
            a, toks_a = _decode_tps(resident, tokenizer, prompt, tokens)
            b, toks_b = _decode_tps(streamed, tokenizer, prompt, tokens)
            if toks_a != toks_b:
                raise AssertionError("streamed tokens differ from resident ones")
            res_tps.append(a)
            str_tps.append(b)
            ratios.append(b / a)
        demanded = session.counters["demanded"]
        hit = _hit_path(session, spec["top_k"])
        session.close()
    return dict(name=name, resident_tps=float(np.median(res_tps)),
                streamed_tps=float(np.median(str_tps)), ratio=float(np.median(ratios)),
                ratios=ratios, demanded_after_warmup=demanded, **hit)


def _hit_path(session, top_k: int) -> dict:
    """The client's per-layer hit path in µs, all experts resident.

    ``hit`` is what ``Session.fetch`` does besides the byte copy when every expert is present:
    buffers, lock-free remap, seqlock validation, hit counters. ``fetch`` is the whole call,
    ``copy`` the byte copy alone (timed on the same rows right after).
    """
    from expertd import native

    n = max(300, min(3000, int(4e9 / (3 * top_k * session.manifest.stride))))
    rng = np.random.default_rng(0)
    dest = np.empty(session.staging_bytes(), np.uint8)
    layers = len(session.manifest.layers)
    raw, slot_of, slots_off = session.raw, session._slot_of_offset, session._slots_offset
    hit, full, copy = [], [], []
    for i in range(n):
        layer = i % layers
        experts = np.sort(rng.choice(session.manifest.layers[layer].num_experts, top_k,
                                     replace=False)).astype(np.int32)
        session.fetch(layer, experts, dest)  # make sure they are resident
        t0 = time.perf_counter_ns()
        slots = np.empty(top_k, np.int32)
        versions = np.empty(top_k, np.uint64)
        filling = np.empty(top_k, np.int32)
        missing = native.remap(raw, slot_of, slots_off, session._n_experts, layer, experts,
                               slots, versions, filling)
        ok = native.validate(raw, slots_off, slots, versions)
        native.bump_hits(raw, slots_off, slots)
        t1 = time.perf_counter_ns()
        session.fetch(layer, experts, dest)
        t2 = time.perf_counter_ns()
        offsets, nbytes = session._segment_tables[layer]
        native.copy_segments(raw, session._rows_offset, session._stride, slots, offsets, nbytes,
                             session.bases(layer, top_k), dest)
        t3 = time.perf_counter_ns()
        if missing or not ok:
            continue  # evicted in between: not a hit-path sample
        hit.append((t1 - t0) / 1e3)
        full.append((t2 - t1) / 1e3)
        copy.append((t3 - t2) / 1e3)
    hit = np.array(hit)
    return dict(fetch_p50_us=float(np.percentile(full, 50)),
                fetch_p99_us=float(np.percentile(full, 99)),
                copy_p50_us=float(np.percentile(copy, 50)),
                hit_overhead_p50_us=float(np.percentile(hit, 50)),
                hit_overhead_p99_us=float(np.percentile(hit, 99)),
                hit_overhead_samples=hit.tolist())
