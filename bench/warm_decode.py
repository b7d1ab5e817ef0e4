"""Warm decode: tok/s with every expert in the arena and in the client's pools ÷ tok/s of mlx-lm
with the model resident, once per speculate mode.

Both models run in this process, alternating round by round, so that the machine's noise hits
both alike; tokens differing from resident raise. Also measured over the same rounds: the
client's host waits and replays per model step (``session.counters``; a step it does not check
waits only in mlx-lm's own evaluation, as resident's), and the client's own time per MoE layer
call on the per-layer path (``session.timing``): the router sync, and from it until the rows
are in place, which with every expert pooled is bookkeeping only (nothing moves).
"""

import numpy as np
from common import daemon, ensure_model

SPECULATE = ("auto", "off")
PROMPT = "The shared cache serves every client from one copy of the experts"


def _decode_tps(model, tokenizer, prompt: str, tokens: int) -> tuple:
    from mlx_lm import stream_generate

    out = []
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=tokens):
        out.append(last.token)
    return last.generation_tps, out


def run(name: str, spec: dict, rounds: int = 5, tokens: int = 64) -> dict:
    """Every speculate mode of :data:`SPECULATE` side by side with resident mlx-lm."""
    import mlx_lm

    from expertd.manifest import Manifest

    model_dir, blob_dir = ensure_model(name, spec)
    total = Manifest.load(blob_dir).total_expert_bytes
    # Pools of every expert: a row per expert (an expert's bytes are at most its arena stride).
    pool_gb = total * 1.1 / 2**30 + 0.01
    resident, tokenizer = mlx_lm.load(str(model_dir))
    out = dict(name=name, rounds=rounds, tokens=tokens, pool_gb=pool_gb)
    with daemon(blob_dir, total * 1.3 / 2**30 + 0.01):
        for mode in SPECULATE:
            out[mode] = side_by_side(blob_dir, resident, tokenizer, pool_gb, mode, rounds, tokens)
    return out


def side_by_side(blob_dir, resident, tokenizer, pool_gb: float, speculate: str, rounds: int,
                 tokens: int) -> dict:
    """One streamed client with ``speculate``, its pools filled, ``rounds`` alternating rounds."""
    from expertd.client import load

    streamed, _ = load(blob_dir, pool_gb=pool_gb, speculate=speculate, fill_pools=True)
    session = streamed.expertd_session
    try:
        if not all(pool.complete for pool in session.pools):
            raise AssertionError("a pool does not hold every expert after load(fill_pools=True)")
        _decode_tps(streamed, tokenizer, PROMPT, tokens)  # warm-up of both: MLX's first calls
        _decode_tps(resident, tokenizer, PROMPT, tokens)
        before = snapshot(session)
        ratios, res_tps, str_tps = [], [], []
        for _ in range(rounds):
            a, toks_a = _decode_tps(resident, tokenizer, PROMPT, tokens)
            b, toks_b = _decode_tps(streamed, tokenizer, PROMPT, tokens)
            if toks_a != toks_b:
                raise AssertionError(f"streamed tokens (speculate={speculate}) differ from "
                                     "resident ones")
            res_tps.append(a)
            str_tps.append(b)
            ratios.append(b / a)
        spent = {k: v - before[k] for k, v in snapshot(session).items()}
        return dict(speculate=speculate, resident_tps=float(np.median(res_tps)),
                    streamed_tps=float(np.median(str_tps)), ratio=float(np.median(ratios)),
                    ratios=ratios, moe_layers=len(session.pools), pool_bytes=session.pool_bytes,
                    pools_complete=all(pool.complete for pool in session.pools),
                    **per_step(spent))
    finally:
        session.close()


def snapshot(session) -> dict:
    """The counters and timings that :func:`per_step` reads, as they are now."""
    counters, timing = session.all_counters(), session.timing
    return dict({k: counters[k] for k in ("steps", "host_waits", "speculative_steps",
                                          "unchecked_steps", "replays", "pool_moved")},
                **{k: timing[k] for k in ("sync_s", "exposed_s", "layers")})


def per_step(spent: dict) -> dict:
    """Host waits per model step (the prompt's steps included) and the per-layer path's µs per
    MoE layer call (None where no call took it: every step was speculative or unchecked)."""
    layers = spent["layers"]
    per_layer = lambda key: spent[key] / layers * 1e6 if layers else None  # noqa: E731
    return dict(steps=spent["steps"], host_waits=spent["host_waits"],
                host_waits_per_step=spent["host_waits"] / spent["steps"],
                speculative_steps=spent["speculative_steps"],
                unchecked_steps=spent["unchecked_steps"], replays=spent["replays"],
                moved=spent["pool_moved"], layer_calls=layers, sync_us=per_layer("sync_s"),
                exposed_us=per_layer("exposed_s"))
