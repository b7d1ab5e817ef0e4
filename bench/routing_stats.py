"""Routing statistics of a qwen3_moe checkpoint on held-out text, and its routing trace.

For each MoE layer: how skewed expert popularity is, how much consecutive tokens' expert sets
overlap, and how well layer L+1's (and L+2's) router predicts its experts from the residual stream
entering layer L's MoE block (available at layer L's router sync). The learned-routing model is
printed next to the random-router `expertd synth` model of the same shape, on the same tokens.
"""

import json
import re
import time
from pathlib import Path

import numpy as np
from common import OUT, ROOT, ensure_model

N_SEQ, SEQ_LEN = 4, 512
TRACE_DIR = OUT / "learned"


def held_out_tokens(model_dir: Path) -> np.ndarray:
    """(N_SEQ, SEQ_LEN) token ids from standard-library files the training never saw."""
    from learned import encode_files, stdlib_files

    ids = encode_files(model_dir, stdlib_files(held_out=True), 2_000_000)
    starts = np.linspace(0, len(ids) - SEQ_LEN - 1, N_SEQ).astype(int)
    return np.stack([ids[s:s + SEQ_LEN] for s in starts])


def capture(model_dir: Path, tokens: np.ndarray) -> dict:
    """Route ``tokens`` through the checkpoint (mlx-lm's own forward pass, no cache).

    Returns:
        dict with ``experts`` (seqs, tokens, layers, k) int16, the experts each MoE layer chose;
        ``pred`` {a: (seqs, tokens, layers, 2k)} the experts layer L+a's router ranks highest on
        layer L's MoE input residual (its own norm applied), best first; ``loss`` the mean
        next-token cross-entropy.
    """
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm

    model, _ = mlx_lm.load(str(model_dir))
    layers = model.layers
    k = layers[0].mlp.top_k
    residuals = []
    for layer in layers:
        norm = layer.post_attention_layernorm
        cls = type(norm)

        def call(self, x, _cls=cls):
            residuals.append(x)
            return _cls.__call__(self, x)

        norm.__class__ = type(f"Recording{cls.__name__}", (cls,), {"__call__": call})

    experts, preds, losses = [], {1: [], 2: []}, []
    for seq in tokens:
        residuals.clear()
        x = mx.array(seq[None])
        logits = model(x)
        losses.append(nn.losses.cross_entropy(logits[0, :-1], x[0, 1:]).mean().item())
        chosen, ranked = [], {1: [], 2: []}
        for i, layer in enumerate(layers):
            mlp = layer.mlp
            probs = mx.softmax(mlp.gate(layer.post_attention_layernorm(residuals[i])), axis=-1,
                               precise=True)
            # The same selection as mlx-lm's Qwen3MoeSparseMoeBlock.
            chosen.append(mx.argpartition(probs, kth=-k, axis=-1)[..., -k:])
            for a in (1, 2):
                if i + a < len(layers):
                    ahead = layers[i + a]
                    logits_ahead = ahead.mlp.gate(ahead.post_attention_layernorm(residuals[i]))
                    ranked[a].append(mx.argsort(-logits_ahead, axis=-1)[..., :2 * k])
        mx.eval(chosen, ranked)
        experts.append(np.stack([np.sort(np.array(c[0]), axis=-1) for c in chosen], axis=1))
        for a in (1, 2):
            preds[a].append(np.stack([np.array(r[0]) for r in ranked[a]], axis=1))
    return dict(experts=np.stack(experts).astype(np.int16),
                pred={a: np.stack(p) for a, p in preds.items()}, loss=float(np.mean(losses)))


def layer_stats(experts: np.ndarray, pred: dict, n_experts: int) -> list:
    """Per-layer statistics from :func:`capture`'s arrays (see the module docstring)."""
    seqs, tokens, n_layers, k = experts.shape
    top = max(1, round(0.1 * n_experts))
    rows = []
    for layer in range(n_layers):
        sets = experts[:, :, layer, :]
        counts = np.bincount(sets.ravel(), minlength=n_experts).astype(float)
        share = counts / counts.sum()
        ordered = np.sort(share)[::-1]
        nonzero = share[share > 0]
        a, b = sets[:, :-1, :, None], sets[:, 1:, None, :]
        inter = (a == b).any(-1).sum(-1)
        row = dict(layer=layer, top10_share=float(ordered[:top].sum()),
                   entropy_ratio=float(-(nonzero * np.log(nonzero)).sum() / np.log(n_experts)),
                   experts_for_90=int(np.searchsorted(np.cumsum(ordered), 0.9) + 1),
                   jaccard=float((inter / (2 * k - inter)).mean()))
        for ahead in (1, 2):
            source = layer - ahead
            if source < 0:
                continue
            guess = pred[ahead][:, :, source, :]
            hits_k = (guess[..., :k, None] == sets[..., None, :]).any(-1).sum(-1)
            hits_2k = (guess[..., None] == sets[..., None, :]).any(-1).sum(-1)
            row[f"p_at_k_{ahead}"] = float(hits_k.mean() / k)   # = recall when guessing k
            row[f"p_at_2k_{ahead}"] = float(hits_2k.mean() / (2 * k))
            row[f"r_at_2k_{ahead}"] = float(hits_2k.mean() / k)
        rows.append(row)
    return rows


def _cell(learned: dict, synth: dict, key: str, fmt: str = "{:.2f}") -> str:
    if key not in learned:
        return "–"
    return f"{fmt.format(learned[key])} / {fmt.format(synth[key])}"


def table(learned_rows: list, synth_rows: list, k: int) -> str:
    """Markdown table, each cell "learned / random-router synth"."""
    keys = [("top10_share", "{:.2f}"), ("entropy_ratio", "{:.2f}"), ("experts_for_90", "{}"),
            ("jaccard", "{:.2f}"), ("p_at_k_1", "{:.2f}"), ("p_at_2k_1", "{:.2f}"),
            ("r_at_2k_1", "{:.2f}"), ("p_at_k_2", "{:.2f}")]
    lines = ["| layer | top-10% experts' share of routings | entropy ÷ log E | experts for 90% "
             f"| Jaccard, consecutive tokens | from L−1: P = R, {k} guesses | from L−1: P, {2 * k} "
             f"guesses | from L−1: R, {2 * k} guesses | from L−2: P = R, {k} guesses |",
             "| --- " * 9 + "|"]
    for lr, sr in zip(learned_rows, synth_rows):
        lines.append(f"| {lr['layer']} | " + " | ".join(_cell(lr, sr, key, f) for key, f in keys)
                     + " |")
    mean_l = {key: np.mean([r[key] for r in learned_rows if key in r]) for key, _ in keys}
    mean_s = {key: np.mean([r[key] for r in synth_rows if key in r]) for key, _ in keys}
    lines.append("| mean | " + " | ".join(_cell(mean_l, mean_s, key, "{:.2f}" if f == "{:.2f}" else "{:.1f}")
                                         for key, f in keys)
                 + " |")
    return "\n".join(lines)


def write_section(text: str) -> None:
    """Put ``text`` under the "Learned-routing model" heading of RESULTS.md, leaving the rest."""
    path = ROOT / "RESULTS.md"
    current = path.read_text()
    heading = "## Learned-routing model"
    pattern = re.compile(rf"\n{re.escape(heading)}\n.*?(?=\n## |\Z)", re.S)
    section = f"\n{heading}\n\n{text.strip()}\n"
    if pattern.search(current):
        current = pattern.sub(lambda _: section, current, count=1)
    else:
        current = current.rstrip("\n") + "\n" + section
    path.write_text(current)


def main(model_dir: Path, blob_dir: Path) -> None:
    import mlx_lm
    from learned import NAME, SPEC

    synth_dir, _ = ensure_model("synth-like-learned", SPEC)
    meta = json.loads((model_dir / "learned.json").read_text())
    tokens = held_out_tokens(model_dir)
    if not np.array_equal(tokens, held_out_tokens(synth_dir)):
        raise RuntimeError("the synth model's tokenizer differs from the learned model's")
    started = time.monotonic()
    runs = {"learned": capture(model_dir, tokens), "synth": capture(synth_dir, tokens)}
    TRACE_DIR.mkdir(parents=True, exist_ok=True)
    for name, run in runs.items():
        np.savez(TRACE_DIR / f"trace-{name}.npz", experts=run["experts"], tokens=tokens)
    rows = {name: layer_stats(run["experts"], run["pred"], SPEC["experts"])
            for name, run in runs.items()}
    (TRACE_DIR / "stats.json").write_text(json.dumps(
        dict(rows=rows, loss={n: r["loss"] for n, r in runs.items()}, train=meta), indent=2))

    model, tokenizer = mlx_lm.load(str(model_dir))
    sample = mlx_lm.generate(model, tokenizer, "def read_config(path):\n", max_tokens=40)
    k = SPEC["top_k"]
    last = meta["log"][-1]
    text = f"""
Produced by `python bench/learned.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}
({time.monotonic() - started:.0f} s for the statistics). Model `{NAME}`: mlx-lm's `qwen3_moe`,
{SPEC['layers']} layers, {SPEC['experts']} experts, top-{k}, hidden {SPEC['hidden']}, expert
intermediate {SPEC['moe_inter']}, {meta['parameters'] / 1e6:.2f} M parameters, saved 4-bit affine
(group 64). Trained on the Python standard library's source (tests excluded, 1 file in 10 held
out), {meta['steps']} steps of {meta['batch']}×{meta['seq']} tokens in {meta['train_seconds']:.0f} s
of wall time on this shared 2-core CPU ({meta['tokens_seen'] / 1e6:.2f} M tokens), AdamW
lr {meta['lr']}, Switch-Transformer load-balancing loss × {meta['aux_coef']} per layer,
training-only expert capacity {meta['capacity_factor']}× the balanced share (last logged step:
loss {last['loss']}, balance loss {last['aux']} (1.0 = balanced), {last['kept'] * 100:.1f}% of slots
within capacity). Held-out next-token loss: {runs['learned']['loss']:.2f} nats, against
{runs['synth']['loss']:.2f} for the random-router synth model (a uniform guess over the
{len(tokenizer.vocab)} tokens: {np.log(len(tokenizer.vocab)):.2f}). The model is small and briefly
trained: its greedy samples are repetitive, but its routing is learned from real text.

Statistics on {N_SEQ} held-out sequences of {SEQ_LEN} tokens (forward pass over the prompt; the
routing is the same as decoding those tokens). Each cell: **learned / random-router synth** (same
shapes, same tokenizer, same tokens). Uniform popularity would give a top-10% share of
{max(1, round(0.1 * SPEC['experts'])) / SPEC['experts']:.2f} and entropy ratio 1.00; independent
random sets give a Jaccard of about {k / (2 * SPEC['experts'] - k):.2f} and a guess precision
of {k / SPEC['experts']:.2f}. "From L−a": layer L's router applied (with layer L's own
post-attention norm) to the residual stream entering layer L−a's MoE block, i.e. known at layer
L−a's router sync; the row's layer is the predicted layer L.

{table(rows['learned'], rows['synth'], k)}

Routing traces (per held-out token, per layer, the top-{k} expert ids, ascending) are in
`bench/out/learned/trace-learned.npz` and `trace-synth.npz`: `experts` int16 of shape
(sequences, tokens, layers, top_k) = {tuple(runs['learned']['experts'].shape)}, `tokens` int32
(sequences, tokens); statistics in `bench/out/learned/stats.json`. `mlx_lm.load` + `generate`
on the checkpoint, prompt `def read_config(path):`: `{sample.strip()[:120]!r}`.
"""
    print(text)
    write_section(text)
