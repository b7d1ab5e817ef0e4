"""Is resident mlx-lm deterministic on this backend? The test suite's tiny model of one family
(tests/conftest.py's shapes) run twice on the same prompt; where the logits differ, the first
module (in the order the model calls them) whose output differs between the two runs, and, for
an attention, its ``scaled_dot_product_attention`` call alone run twice next to a float32
reference. An H100 and an H200 (MLX CUDA 0.32.4) gave deepseek_v3's resident logits unlike
each other twice in a row (2026-12-05); this tells where.

    python bench/resident_probe.py [--family deepseek_v3] [--length 17]
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
from mlx_lm.models.cache import make_prompt_cache

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
        vocab = model.args.vocab_size
        ids = mx.array([[(37 * i + 11) % (vocab - 16) + 8 for i in range(args.length)]])
        (a, ra) = recorded(model, ids)
        print("first run done", flush=True)
        (b, rb) = recorded(model, ids)
        print(f"{args.family}: logits twice equal {mx.array_equal(a, b).item()}; "
              f"first {describe(a)}; second {describe(b)}")
        for (name, x), (_, y) in zip(ra, rb):
            same = mx.array_equal(x, y).item()
            print(f"  {name}: equal {same}; {describe(x)} / {describe(y)}")
        sdpa_alone(model, ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
