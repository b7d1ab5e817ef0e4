"""Is resident mlx-lm deterministic on this backend? The test suite's tiny model of one family
(tests/conftest.py's shapes) run twice on the same prompt; where the logits differ, the first
module (in the order the model calls them) whose output differs between the two runs, and, for
an attention, its ``scaled_dot_product_attention`` call alone run twice next to a float32
reference. An H100 and an H200 (MLX CUDA 0.32.4) gave deepseek_v3's resident logits unlike
each other twice in a row (2026-12-05); this tells where.

    python bench/resident_probe.py [--family deepseek_v3] [--length 17]

For deepseek_v3 it then runs layer 0's attention op by op (see deepseek_ops).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import mlx_lm
from mlx_lm.models import base
from mlx_lm.models.cache import KVCache, make_prompt_cache

from tools.synth import TINY, SynthConfig, synthesize


def recorded(model, ids) -> tuple:
    """``(logits, [(name, output)])``: each attention's and MLP's output, in call order."""
    outputs = []
    names = {id(getattr(layer, part)): f"{i}.{part}"
             for i, layer in enumerate(model.model.layers) for part in ("self_attn", "mlp")}
    # A module's call is its class's: each class is wrapped once, its modules told by name.
    hooks = {cls: cls.__call__ for cls in {type(getattr(layer, part)) for layer in
                                           model.model.layers for part in ("self_attn", "mlp")}}

    def wrapped(original):
        def call(self, *a, **k):
            out = original(self, *a, **k)
            if id(self) in names:
                mx.eval(out)
                outputs.append((names[id(self)], out))
            return out
        return call

    for cls, original in hooks.items():
        cls.__call__ = wrapped(original)
    try:
        logits = model(ids, cache=make_prompt_cache(model))
        mx.eval(logits)
    finally:
        for cls, original in hooks.items():
            cls.__call__ = original
    return logits, outputs


def describe(a) -> str:
    return f"{a.shape} {a.dtype} nan={mx.isnan(a).sum().item()} inf={mx.isinf(a).sum().item()}"


def sdpa_alone(model, ids) -> None:
    """Each ``scaled_dot_product_attention`` call of a run, captured, run alone twice and
    against a float32 softmax reference."""
    calls = []
    original = base.mx.fast.scaled_dot_product_attention

    def capture(q, k, v, scale, mask=None, **kw):
        calls.append((q, k, v, scale, mask, kw))
        return original(q, k, v, scale=scale, mask=mask, **kw)

    base.mx.fast.scaled_dot_product_attention = capture
    try:
        mx.eval(model(ids, cache=make_prompt_cache(model)))
    finally:
        base.mx.fast.scaled_dot_product_attention = original
    for n, (q, k, v, scale, mask, kw) in enumerate(calls):
        mx.eval(q, k, v, mask) if isinstance(mask, mx.array) else mx.eval(q, k, v)
        a = original(q, k, v, scale=scale, mask=mask, **kw)
        b = original(q, k, v, scale=scale, mask=mask, **kw)
        mask_text = describe(mask) if isinstance(mask, mx.array) else repr(mask)
        repeats = q.shape[1] // k.shape[1]  # grouped-query attention: k and v heads shared
        k32, v32 = (mx.repeat(t.astype(mx.float32), repeats, axis=1) for t in (k, v))
        s = (q.astype(mx.float32) * scale) @ k32.swapaxes(-1, -2)
        if isinstance(mask, str):  # "causal": query i sees keys up to its own position
            lq, lk = q.shape[2], k.shape[2]
            mask = mx.arange(lk)[None] <= mx.arange(lk - lq, lk)[:, None]
            s = mx.where(mask, s, -mx.inf)
        elif isinstance(mask, mx.array):
            s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask.astype(mx.float32)
        ref = (mx.softmax(s, axis=-1) @ v32).astype(a.dtype)
        print(f"sdpa call {n}: q {q.shape} k {k.shape} v {v.shape} {q.dtype} scale {scale:.4f} "
              f"mask {mask_text}; twice equal {mx.array_equal(a, b).item()}; out {describe(a)}; "
              f"largest difference from float32 reference "
              f"{mx.abs(a.astype(mx.float32) - ref.astype(mx.float32)).max().item()!r}")


def probe_ids(vocab: int, length: int):
    """A prompt of ``length`` token ids spread over the vocabulary (the tests' prompt_ids)."""
    return mx.array([[(37 * i + 11) % (vocab - 16) + 8 for i in range(length)]])


def poison() -> None:
    """Fill MLX's buffer cache with NaN in many sizes: an op that reads memory it never wrote
    (its output's or a temporary's) then shows NaN where a fresh buffer's zeros hid it."""
    for shift in range(6, 23):
        held = [mx.full((1 << shift,), mx.nan, mx.float32) for _ in range(4)]
        mx.eval(*held)
        del held


def twice(fn, *inputs) -> tuple:
    """``(first, text)``: ``fn`` of ``inputs`` (evaluated first) run twice with NaN in MLX's
    buffer cache before each (:func:`poison`) and once on the CPU stream, and what differed."""
    mx.eval(*inputs)
    outs = []
    for _ in range(2):
        poison()
        outs.append(fn(*inputs))
        mx.eval(outs[-1])
    with mx.stream(mx.cpu):
        ref = fn(*[mx.array(i) for i in inputs])
        mx.eval(ref)
    diff = mx.abs(outs[0].astype(mx.float32) - ref.astype(mx.float32)).max().item()
    return outs[0], (f"twice equal {mx.array_equal(outs[0], outs[1], equal_nan=True).item()}; "
                     f"{describe(outs[0])} / nan={mx.isnan(outs[1]).sum().item()}; "
                     f"cpu nan={mx.isnan(ref).sum().item()}, largest difference {diff!r}")


def deepseek_ops(model, ids) -> None:
    """Layer 0's attention of deepseek_v3 (mlx-lm's ``DeepseekV3Attention.__call__``) op by
    op: each op's inputs evaluated first, then the op alone, twice, with NaN in MLX's buffer
    cache before each, and against the same op on the CPU stream. Strided inputs (the splits)
    are tried as they come and made contiguous."""
    attn, layer = model.model.layers[0].self_attn, model.model.layers[0]
    x = layer.input_layernorm(model.model.embed_tokens(ids))
    mx.eval(x)
    B, L, _ = x.shape
    nope, rope_dim = attn.qk_nope_head_dim, attn.qk_rope_head_dim
    mask = mx.arange(L)[None] <= mx.arange(L)[:, None]

    def step(name, fn, *inputs):
        first, text = twice(fn, *inputs)
        print(f"op {name}: {text}", flush=True)
        return first

    qa = step("q_a_proj", attn.q_a_proj, x)
    qn = step("q_a_layernorm", attn.q_a_layernorm, qa)
    q = step("q_b_proj", attn.q_b_proj, qn)
    q = q.reshape(B, L, attn.num_heads, attn.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [nope], axis=-1)
    ckv = step("kv_a_proj_with_mqa", attn.kv_a_proj_with_mqa, x)
    latent, k_pe = mx.split(ckv, [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, rope_dim).transpose(0, 2, 1, 3)
    kv = step("kv_a_layernorm (strided)", attn.kv_a_layernorm, latent)
    step("kv_a_layernorm (contiguous)", attn.kv_a_layernorm, mx.contiguous(latent))
    rq = step("rope q_pe (strided)", lambda t: attn.rope(t, 0), q_pe)
    step("rope q_pe (contiguous)", lambda t: attn.rope(t, 0), mx.contiguous(q_pe))
    rk = step("rope k_pe (strided)", lambda t: attn.rope(t, 0), k_pe)
    step("rope k_pe (contiguous)", lambda t: attn.rope(t, 0), mx.contiguous(k_pe))
    pe = step("pe_scores, k broadcast over heads", lambda a, b: (a * attn.scale) @ b.swapaxes(-1, -2),
              rq, rk)
    step("pe_scores, k repeated per head", lambda a, b: (a * attn.scale) @ mx.repeat(
        b, attn.num_heads, axis=1).swapaxes(-1, -2), rq, rk)
    pe = step("pe_scores masked", lambda t: mx.where(mask, t, mx.array(mx.finfo(t.dtype).min, t.dtype)),
              pe)
    kv = mx.expand_dims(kv, axis=1)
    # The model's call passes a cache: k_pe and the latent come back as slices of its buffers.
    step("KVCache latent", lambda a, b: KVCache().update_and_fetch(a, b)[0], kv, rk)
    step("KVCache k_pe", lambda a, b: KVCache().update_and_fetch(a, b)[1], kv, rk)
    step("pe_scores, cached k_pe", lambda a, b: (a * attn.scale) @ b.swapaxes(-1, -2), rq,
         KVCache().update_and_fetch(kv, rk)[1])
    k = step("embed_q (transpose=False)", lambda t: attn.embed_q(t, transpose=False), kv)
    v = step("unembed_out", attn.unembed_out, kv)
    step("sdpa, mask pe_scores", lambda a, b, c, m: mx.fast.scaled_dot_product_attention(
        a, b, c, scale=attn.scale, mask=m), q_nope, k, v, pe)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="deepseek_v3")
    parser.add_argument("--length", type=int, default=17, help="prompt tokens")
    args = parser.parse_args()
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model"
        synthesize(SynthConfig(**{**TINY, "family": args.family, "mode": "affine", "bits": 4}), out,
                   progress=False)
        print("synthesized", flush=True)
        model = mlx_lm.load(str(out))[0]
        ids = probe_ids(model.args.vocab_size, args.length)
        (a, ra) = recorded(model, ids)
        print("first run done", flush=True)
        (b, rb) = recorded(model, ids)
        print(f"{args.family}: logits twice equal {mx.array_equal(a, b).item()}; "
              f"first {describe(a)}; second {describe(b)}")
        for (name, x), (_, y) in zip(ra, rb):
            same = mx.array_equal(x, y).item()
            print(f"  {name}: equal {same}; {describe(x)} / {describe(y)}")
        sdpa_alone(model, ids)
        if args.family == "deepseek_v3":
            deepseek_ops(model, ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
