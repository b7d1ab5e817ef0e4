"""Synthetic checkpoints: real mlx-lm models, deterministic by seed, validated sizes."""

import json
import os
import signal
import subprocess
import termios
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from conftest import FAMILY_MODES, TINY, mounted
from harness import EXPERTD, drawn, sigint_as_usual, terminal, wait_until
from mlx.utils import tree_flatten

from expertd.tools.synth import SynthConfig, synthesize

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Words the corpus never saw: zygote, quixotic, Xerxes; and 12345678.",
    "naïve café – 日本語 🙂",
    "  two  spaces,\n\ta tab and a trailing space ",
    "",
]


@pytest.mark.parametrize("family,mode,bits", FAMILY_MODES)
def test_every_family_loads_and_runs(models, family, mode, bits):
    model_dir = models.model(family=family, mode=mode, bits=bits)
    model, tokenizer = mlx_lm.load(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == family
    assert len(model.layers) == TINY["layers"]
    assert config["quantization"]["mode"] == mode and config["quantization"]["bits"] == bits

    # One stacked (experts, out, in) weight per projection of every MoE layer.
    moe_layers = TINY["layers"] - (1 if family == "deepseek_v3" else 0)
    stacked = [p.shape[0] for name, p in tree_flatten(model.parameters())
               if name.endswith("_proj.weight") and p.ndim == 3]
    assert stacked == [TINY["experts"]] * (3 * moe_layers)

    x = mx.array([tokenizer.encode(TEXTS[0])])
    logits = model(x)
    assert logits.shape == (1, x.shape[1], config["vocab_size"])
    assert mx.all(mx.isfinite(logits)).item()


@pytest.mark.parametrize("mode,bits,dtype", [
    ("affine", 3, "bfloat16"), ("affine", 6, "float16"), ("mxfp8", 8, "bfloat16"),
    ("nvfp4", 4, "bfloat16"), ("none", 4, "float32"),
])
def test_quantization_modes_load(models, mode, bits, dtype):
    model_dir = models.model(family="qwen3_moe", mode=mode, bits=bits, dtype=dtype)
    model, tokenizer = mlx_lm.load(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    if mode == "none":
        assert "quantization" not in config
        assert {p.dtype for _, p in tree_flatten(model.parameters())} == {getattr(mx, dtype)}
    else:
        assert (config["quantization"]["mode"], config["quantization"]["bits"]) == (mode, bits)
    logits = model(mx.array([tokenizer.encode(TEXTS[0])]))
    assert mx.all(mx.isfinite(logits)).item()


def test_expert_biases_are_random(models):
    """A lost per-expert bias must change the output, so none is left at zero."""
    model, _ = mlx_lm.load(str(models.model(family="gpt_oss", mode="mxfp4", bits=4)))
    biases = [(n, p) for n, p in tree_flatten(model.parameters())
              if ".experts." in n and n.endswith(".bias")]
    assert len(biases) == 3 * TINY["layers"]
    for name, bias in biases:
        assert bias.shape[0] == TINY["experts"]
        assert mx.all(mx.any(bias != 0, axis=-1)).item(), name  # every expert's row


def test_deepseek_router_spreads_tokens(models):
    """mlx-lm starts deepseek_v3's router at zero; synth must not, or every token would take
    the same experts and no cache test would see eviction."""
    model, tokenizer = mlx_lm.load(str(models.model(family="deepseek_v3", mode="affine", bits=4)))
    gates = [(n, p) for n, p in tree_flatten(model.parameters()) if n.endswith("mlp.gate.weight")]
    assert gates
    for name, weight in gates:
        assert mx.any(weight != 0).item(), name
    layer = model.model.layers[1].mlp
    x = model.model.embed_tokens(mx.array([tokenizer.encode(TEXTS[0] * 4)]))
    indices, _ = layer.gate(x)
    assert len(set(np.array(indices).ravel().tolist())) > TINY["top_k"]


def files(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_seed_same_files(tmp_path):
    cfg = SynthConfig(**TINY, family="mixtral", seed=7)
    a = files(synthesize(cfg, tmp_path / "a"))
    b = files(synthesize(cfg, tmp_path / "b"))
    assert "model.safetensors" in a
    assert a.keys() == b.keys()
    assert [name for name in a if a[name] != b[name]] == []


def test_other_seed_other_weights(tmp_path):
    a = files(synthesize(SynthConfig(**TINY, seed=1), tmp_path / "a"))
    b = files(synthesize(SynthConfig(**TINY, seed=2), tmp_path / "b"))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]  # the tokenizer does not depend on the seed


@pytest.mark.parametrize("change,message", [
    (dict(family="llama"), "family must be one of"),
    (dict(mode="int4"), "mode must be one of"),
    (dict(layers=0), "layers must be at least 1"),
    (dict(family="deepseek_v3", layers=1), "deepseek_v3 needs at least 2 layers"),
    (dict(experts=1, top_k=1), "experts must be at least 2"),
    (dict(experts=4, top_k=5), "top-k must be between 1 and the number of experts"),
    (dict(top_k=0), "top-k must be between 1 and the number of experts"),
    (dict(dtype="int8"), "dtype must be"),
    (dict(bits=7), "affine bits must be one of"),
    (dict(mode="mxfp8", bits=6), "mxfp8 uses 8 bits"),
    (dict(mode="mxfp8", bits=4), "mxfp8 uses 8 bits, not 4"),
    (dict(hidden=100), "hidden must be a positive multiple of 64, not 100"),
    (dict(moe_inter=48), "moe-inter must be a positive multiple of 64"),
    (dict(mode="mxfp4", hidden=80), "hidden must be a positive multiple of 32"),
    (dict(hidden=0), "hidden must be a positive multiple of 64, not 0"),
    (dict(moe_inter=0), "moe-inter must be a positive multiple of 64, not 0"),
    (dict(seed=-1), "seed must be between 0 and 18446744073709551615, not -1"),
])
def test_invalid_config_is_refused(tmp_path, change, message):
    out = tmp_path / "model"
    with pytest.raises(ValueError, match=message):
        synthesize(SynthConfig(**{**TINY, **change}), out)
    assert not out.exists()  # refused before writing anything


def test_refuses_non_empty_output(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists and is not empty"):
        synthesize(SynthConfig(**TINY), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_tokenizer_round_trips_text(models):
    model_dir = models.model()
    _, tokenizer = mlx_lm.load(str(model_dir))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert tokenizer.vocab_size == vocab
    assert tokenizer.eos_token_id is not None
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert all(0 <= i < vocab for i in ids)
        assert tokenizer.decode(ids) == text
    # BPE merges learned from the built-in text: a familiar phrase takes few tokens.
    assert len(tokenizer.encode(TEXTS[0])) < len(TEXTS[0]) / 3


# ---- issue 16: atomic output, a missing parent refused, a bar on a terminal --------------------

SMALL = ("synth", "--layers", "2", "--experts", "4", "--top-k", "2", "--out")


def test_a_missing_parent_is_refused_and_never_created(tmp_path):
    out = tmp_path / "no-such-parent" / "model"
    run = subprocess.run([EXPERTD, *SMALL, str(out)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1 and run.stderr == (
        f"expertd synth: error: {out.parent}: no such directory (the parent of {out}); "
        "create it first or choose another path\n"), run.stderr
    assert sorted(tmp_path.iterdir()) == []


def test_ctrl_c_mid_write_leaves_nothing_and_a_rerun_succeeds(tmp_path):
    """A real SIGINT while synth writes. Its stderr is a terminal whose output is stopped
    (Ctrl-S), so its bar cannot draw and the run cannot get past it: once anything appears
    next to the output, the signal lands while the checkpoint is half-written."""
    out = tmp_path / "model"
    master, slave = terminal()
    try:
        termios.tcflow(slave, termios.TCOOFF)
        proc = subprocess.Popen([EXPERTD, *SMALL, str(out)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=slave,
                                preexec_fn=sigint_as_usual)
        try:
            written = wait_until(lambda: list(tmp_path.iterdir()), 60, "synth to write")
            proc.send_signal(signal.SIGINT)
        finally:
            termios.tcflow(slave, termios.TCOON)  # let it say what happened, and exit
            proc.wait(timeout=60)
    finally:
        os.close(slave)
    said = drawn(master)
    os.close(master)
    assert [p.name.startswith(".model.partial-") for p in written] == [True], written
    assert proc.returncode == 130 and "expertd synth: interrupted" in said, said
    assert sorted(tmp_path.iterdir()) == []  # neither the partial directory nor the output

    # The same command again: the output is free, and on a terminal it draws its bars.
    master, slave = terminal()
    try:
        proc = subprocess.Popen([EXPERTD, *SMALL, str(out)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=slave, text=True)
    finally:
        os.close(slave)
    said = drawn(master)
    os.close(master)
    assert proc.wait(timeout=120) == 0, said
    assert "wrote a synthetic qwen3_moe checkpoint" in proc.stdout.read()
    assert "synth: random weights: 100%" in said and "synth: quantize: 100%" in said, said
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    mlx_lm.load(str(out))


# ---- issue 44: a full disk -----------------------------------------------------------------------

@pytest.mark.parametrize("size,fails_in", [("16k", "the tokenizer's file"),
                                           ("128k", "MLX's weights")])
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, size, fails_in):
    """A real full filesystem (a small tmpfs): the tokenizer library and MLX's writer report a
    failed write without an errno (a bare Exception, a RuntimeError); synth says, as convert
    does, that the disk is full, in one line, and leaves no partial directory."""
    with mounted(tmp_path / "small", "tmpfs", "-o", f"size={size}") as small:
        out = small / "model"
        run = subprocess.run([EXPERTD, *SMALL, str(out)], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 1, (fails_in, run.stdout)
        assert run.stderr == (f"expertd synth: error: {out}: no space left on the device, the "
                              "disk is full; the partial output was removed: free some space "
                              "and re-run expertd synth\n"), (fails_in, run.stderr)
        assert list(small.iterdir()) == []
