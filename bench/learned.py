"""A small MoE with learned routing, trained here on the Python standard library's source.

Random routers say nothing about caching or prediction, so the hit-rate, prediction and exposed-time
benchmarks use this model. It is mlx-lm's own ``qwen3_moe`` class, trained for a few minutes on
this CPU with a load-balancing auxiliary loss, saved 4-bit like ``expertd synth``'s models and
converted to blobs. It is cached under bench/out/ and rebuilt when missing:

    python bench/learned.py            (build if missing, then print and record routing statistics)
    python bench/learned.py --retrain  (train again)

MLX's Linux CPU wheel ships a reference BLAS (~2 GFLOPS here); for the training run only, a
ten-line shim routes ``cblas_sgemm`` to the OpenBLAS that numpy already bundles (~20x faster).
Without a C compiler the training falls back to the plain wheel and does fewer steps.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OUT

NAME = "learned-qwen3-moe"
# The synth fields of the trained model: `expertd synth` with the same fields builds the
# random-router model it is compared with (same shapes, same tokenizer).
SPEC = dict(family="qwen3_moe", layers=8, experts=64, top_k=4, hidden=128, moe_inter=64,
            bits=4, mode="affine", seed=7)
TRAIN_SECONDS = 540      # wall-time budget of the optimisation loop
BATCH, SEQ = 8, 128      # tokens per step: 1024
LR, WARMUP = 1e-3, 30
AUX_COEF = 0.05          # load-balancing loss weight (Switch Transformer), per MoE layer
CAPACITY_FACTOR = 3.0    # training only: slots per expert = 3 x the balanced share
TRAIN_CHARS = 6_000_000  # enough text for more steps than the budget allows


def stdlib_files(held_out: bool) -> list:
    """The standard library's .py files (tests excluded), split ~90/10 by a hash of the path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "test/", "idlelib/idle_test/")) or "/tests/" in rel:
            continue
        if (zlib.crc32(rel.encode()) % 10 == 0) == held_out:
            files.append(path)
    return files


def encode_files(tokenizer_dir: Path, files: list, max_chars: int):
    """Token ids of the files' text, joined by end-of-text tokens, up to ``max_chars`` of text."""
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    texts, total = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.array(ids, dtype=np.int32)


def _capacity_glu(switch, x, inds, capacity: int):
    """SwitchGLU's function, computed as padded per-expert matmuls (fast gradients on CPU).

    mlx's gather_mm weight gradient is slow on the CPU; dispatching each expert's slots into a
    fixed-capacity buffer turns the expert work into one batched matmul. Slots past an expert's
    capacity are dropped (output zero), as in Switch/GShard training; inference never drops.

    Returns:
        (output shaped like ``switch(x, inds)``, fraction of slots kept).
    """
    import mlx.core as mx
    import mlx.nn as nn

    n_experts, hidden, k = switch.gate_proj.weight.shape[0], x.shape[-1], inds.shape[-1]
    tokens = x.reshape(-1, hidden)
    flat = inds.reshape(-1)
    slots = flat.shape[0]
    onehot = (flat[:, None] == mx.arange(n_experts)[None]).astype(mx.int32)
    pos = mx.take_along_axis(mx.cumsum(onehot, axis=0), flat[:, None], axis=1)[:, 0] - 1
    keep = pos < capacity
    dest = mx.where(keep, flat * capacity + pos, n_experts * capacity)
    table = mx.zeros((n_experts * capacity + 1,), mx.int32)
    table = table.at[dest].add(mx.arange(slots, dtype=mx.int32) + 1)[:-1] - 1
    source = mx.stop_gradient(mx.where(table >= 0, table // k, tokens.shape[0]))
    dest = mx.stop_gradient(dest)
    padded = mx.concatenate([tokens, mx.zeros((1, hidden), tokens.dtype)])
    xe = padded[source].reshape(n_experts, capacity, hidden)
    gate = xe @ switch.gate_proj.weight.swapaxes(-1, -2)
    up = xe @ switch.up_proj.weight.swapaxes(-1, -2)
    out = (nn.silu(gate) * up) @ switch.down_proj.weight.swapaxes(-1, -2)
    out = mx.concatenate([out.reshape(-1, hidden), mx.zeros((1, hidden), out.dtype)])
    return out[dest].reshape(*inds.shape, hidden), keep.astype(mx.float32).mean()


def _instrument(model, records: list, capacity: int) -> None:
    """Swap each MoE block's call for a training twin that records router output for the aux loss."""
    import mlx.core as mx

    for layer in model.layers:
        block = layer.mlp
        cls = type(block)

        def call(self, x):
            probs = mx.softmax(self.gate(x), axis=-1, precise=True)
            inds = mx.stop_gradient(mx.argpartition(probs, kth=-self.top_k, axis=-1)[..., -self.top_k:])
            scores = mx.take_along_axis(probs, inds, axis=-1)
            if self.norm_topk_prob:
                scores = scores / mx.sum(scores, axis=-1, keepdims=True)
            y, kept = _capacity_glu(self.switch_mlp, x, inds, capacity)
            records.append((probs, inds, kept))
            return (y * scores[..., None]).sum(axis=-2)

        block.__class__ = type(f"Training{cls.__name__}", (cls,), {"__call__": call})


def _balance_loss(probs, inds, n_experts: int):
    """Switch Transformer's loss: n * sum_i (share of slots routed to i) * (mean probability of i)."""
    import mlx.core as mx

    probs = probs.reshape(-1, n_experts)
    routed = (inds.reshape(-1)[:, None] == mx.arange(n_experts)[None]).astype(mx.float32)
    return n_experts * mx.sum(routed.mean(axis=0) * probs.mean(axis=0))


def train_into(out_dir: Path) -> None:
    """Train the model and write a 4-bit mlx-lm checkpoint into ``out_dir`` (runs in a child)."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    from expertd.tools.mlxlm import model_classes
    from expertd.tools.synth import SynthConfig, build_tokenizer_into

    synth = SynthConfig(**SPEC)
    synth.validate()
    out_dir.mkdir(parents=True)
    vocab_size = build_tokenizer_into(out_dir, synth.vocab)
    config = synth.model_config(vocab_size)
    data = encode_files(out_dir, stdlib_files(held_out=False), TRAIN_CHARS)

    mx.random.seed(synth.seed)
    rng = np.random.default_rng(synth.seed)
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    records: list = []
    capacity = int(CAPACITY_FACTOR * BATCH * SEQ * synth.top_k / synth.experts)
    _instrument(model, records, capacity)
    n_params = sum(p.size for _, p in tree_flatten(model.parameters()))

    def loss_fn(model, x, y):
        records.clear()
        lm = nn.losses.cross_entropy(model(x), y).mean()
        aux = sum(_balance_loss(p, i, synth.experts) for p, i, _ in records) / len(records)
        kept = sum(k for _, _, k in records) / len(records)
        return lm + AUX_COEF * aux, (lm, aux, kept)

    schedule = optim.linear_schedule(1e-5, LR, WARMUP)  # then stays at LR
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    step_fn = nn.value_and_grad(model, loss_fn)
    log, start, step = [], time.monotonic(), 0
    while time.monotonic() - start < TRAIN_SECONDS:
        starts = rng.integers(0, len(data) - SEQ - 1, BATCH)
        batch = mx.array(np.stack([data[s:s + SEQ + 1] for s in starts]))
        (_, (lm, aux, kept)), grads = step_fn(model, batch[:, :-1], batch[:, 1:])
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, lm, aux, kept)
        step += 1
        if step % 10 == 0 or step == 1:
            log.append(dict(step=step, seconds=round(time.monotonic() - start, 1),
                            loss=round(lm.item(), 4), aux=round(aux.item(), 4),
                            kept=round(kept.item(), 4)))
            print(json.dumps(log[-1]), flush=True)
    seconds = time.monotonic() - start

    # Back to mlx-lm's own MoE call for saving (the training twin only changed __call__).
    for layer in model.layers:
        layer.mlp.__class__ = type(layer.mlp).__mro__[1]
    model, config = quantize_model(model, config, 64, synth.bits, mode=synth.mode)
    mx.eval(model.parameters())
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    (out_dir / "expertd-synth.json").write_text(json.dumps(synth.__dict__, indent=2))
    (out_dir / "learned.json").write_text(json.dumps(dict(
        steps=step, train_seconds=round(seconds, 1), tokens_seen=step * BATCH * SEQ,
        train_tokens=len(data), parameters=n_params, batch=BATCH, seq=SEQ, lr=LR,
        aux_coef=AUX_COEF, capacity_factor=CAPACITY_FACTOR, blas=os.environ.get("LD_PRELOAD", "reference"),
        log=log), indent=2))


_SHIM = """
#include <stdint.h>
void scipy_cblas_sgemm64_(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                          const float *, int64_t, float, float *, int64_t);
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    scipy_cblas_sgemm64_(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""


def _blas_shim() -> "Path | None":
    """Build (once) a cblas_sgemm shim onto numpy's bundled OpenBLAS; None where that fails."""
    import numpy

    libs = sorted((Path(numpy.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas64_*.so"))
    cc = shutil.which("cc")
    if not libs or not cc:
        return None
    shim = OUT / "learned" / "sgemm_shim.so"
    if not shim.exists():
        shim.parent.mkdir(parents=True, exist_ok=True)
        src = shim.with_suffix(".c")
        src.write_text(_SHIM)
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", str(src), "-o", str(shim), str(libs[0]),
                               f"-Wl,-rpath,{libs[0].parent}"], capture_output=True)
        if done.returncode != 0:
            return None
    return shim


def ensure_learned_model(retrain: bool = False) -> tuple:
    """(model_dir, blob_dir) of the learned-routing model, trained and converted when missing."""
    from expertd.tools.convert import convert

    model_dir, blob_dir = OUT / "models" / NAME, OUT / "blobs" / NAME
    if retrain:
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.rmtree(blob_dir, ignore_errors=True)
    if not (model_dir / "learned.json").exists():
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.rmtree(blob_dir, ignore_errors=True)
        partial = model_dir.with_name(NAME + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        env = dict(os.environ)
        shim = _blas_shim()
        if shim is not None:
            env["LD_PRELOAD"] = str(shim)
        print(f"training {NAME} for {TRAIN_SECONDS} s (BLAS: {shim or 'reference'})", flush=True)
        subprocess.run([sys.executable, __file__, "--train-into", str(partial)], env=env, check=True)
        partial.rename(model_dir)
    if not blob_dir.exists():
        blob_dir.parent.mkdir(parents=True, exist_ok=True)
        convert(model_dir, blob_dir, progress=False)
    return model_dir, blob_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--retrain", action="store_true", help="train the model again")
    parser.add_argument("--train-into", type=Path, help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.train_into is not None:
        train_into(args.train_into)
    else:
        import routing_stats

        model_dir, blob_dir = ensure_learned_model(retrain=args.retrain)
        routing_stats.main(model_dir, blob_dir)
