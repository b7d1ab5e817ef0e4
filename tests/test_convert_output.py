"""What the converter writes: exact expert bytes, a bit-exact reassembled model, the trunk's
checksums, one pipeline stage's directory (--layers), and what the command draws (bars on a
terminal only)."""

import json
import os
import subprocess
from contextlib import closing
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import xxhash
from conftest import TINY
from harness import EXPERTD, drawn, terminal
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from expertd.blobstore import BlobStore
from expertd.manifest import STRIDE_ALIGN, Manifest
from expertd.tools.convert import convert, expert_slice
from expertd.tools.safetensors import read_header

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, 1 2 3!"

MX_DTYPES = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32, "U32": mx.uint32,
             "U8": mx.uint8, "I32": mx.int32, "U16": mx.uint16, "I8": mx.int8}

# Where each family keeps its switch module, and its first MoE layer.
SWITCH = {"qwen3_moe": "mlp.switch_mlp", "mixtral": "block_sparse_moe.switch_mlp",
          "deepseek_v3": "mlp.switch_mlp", "gpt_oss": "mlp.experts"}
FIRST_MOE_LAYER = {"deepseek_v3": 1}
# The per-expert tensors of each projection, by quantization mode.
PARTS = {"affine": ("weight", "scales", "biases"), "mxfp4": ("weight", "scales"),
         "mxfp8": ("weight", "scales"), "nvfp4": ("weight", "scales"), "none": ("weight",)}

CASES = [
    pytest.param("qwen3_moe", "affine", 4, "bfloat16", id="qwen3_moe-affine4"),
    pytest.param("mixtral", "affine", 8, "bfloat16", id="mixtral-affine8"),
    pytest.param("deepseek_v3", "affine", 4, "bfloat16", id="deepseek_v3-affine4"),
    pytest.param("gpt_oss", "mxfp4", 4, "bfloat16", id="gpt_oss-mxfp4"),
    pytest.param("qwen3_moe", "mxfp8", 8, "bfloat16", id="qwen3_moe-mxfp8"),
    pytest.param("qwen3_moe", "nvfp4", 4, "bfloat16", id="qwen3_moe-nvfp4"),
    pytest.param("qwen3_moe", "none", 4, "bfloat16", id="qwen3_moe-none-bf16"),
    pytest.param("mixtral", "none", 4, "float16", id="mixtral-none-f16"),
    pytest.param("qwen3_moe", "none", 4, "float32", id="qwen3_moe-none-f32"),
    pytest.param("qwen3_moe", "affine", 2, "bfloat16", id="qwen3_moe-affine2"),
]


def checkpoint_tensors(model_dir: Path) -> dict:
    tensors = {}
    for shard in sorted(model_dir.glob("model*.safetensors")):
        tensors.update(read_header(shard))
    return tensors


def tensor_bytes(info) -> bytes:
    with open(info.path, "rb") as f:
        f.seek(info.start)
        return f.read(info.nbytes)


def reassemble(blob_dir: Path, order=None):
    """The trunk plus every expert read back from the blobs, as one mlx-lm model.

    ``order(layer_index, experts)`` may permute a layer's experts (to show the check can fail).
    """
    store = BlobStore(blob_dir)
    weights = []
    try:
        for layer in store.layers:
            experts = list(range(layer.num_experts))
            if order is not None:
                experts = order(layer.index, experts)
            rows = [np.frombuffer(store.read_expert(layer.index, e), np.uint8) for e in experts]
            for seg in layer.segments:
                stacked = np.stack([row[seg.offset:seg.offset + seg.nbytes] for row in rows])
                array = mx.array(stacked).view(MX_DTYPES[seg.dtype])
                weights.append((f"{layer.module}.{seg.name}",
                                array.reshape((layer.num_experts,) + tuple(seg.shape))))
    finally:
        store.close()
    model, _ = load_model(blob_dir / "trunk", lazy=True, strict=False)
    model.load_weights(weights, strict=False)
    return model


def runnable(model, dtype: str):
    # mlx's CPU gather_mm only supports float32: run unquantized half-precision models in float32.
    if dtype != "float32" and mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
    return model


def assert_same_parameters(a, b) -> None:
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert sorted(pa) == sorted(pb)
    differ = [k for k in pa if pa[k].dtype != pb[k].dtype or not mx.array_equal(pa[k], pb[k])]
    assert not differ, f"parameters differ: {differ[:5]}"


@pytest.mark.parametrize("family,mode,bits,dtype", CASES)
def test_blobs_hold_exact_expert_slices(models, family, mode, bits, dtype):
    model_dir = models.model(family=family, mode=mode, bits=bits, dtype=dtype)
    blob_dir = models.blobs(family=family, mode=mode, bits=bits, dtype=dtype)
    original = checkpoint_tensors(model_dir)
    manifest = Manifest.load(blob_dir)

    first = FIRST_MOE_LAYER.get(family, 0)
    assert [layer.module for layer in manifest.layers] == [
        f"model.layers.{i}.{SWITCH[family]}" for i in range(first, TINY["layers"])]
    parts = PARTS[mode] + (("bias",) if family == "gpt_oss" else ())
    expected_segments = sorted(f"{proj}.{part}" for proj in ("gate_proj", "up_proj", "down_proj")
                               for part in parts)
    assert manifest.stride % STRIDE_ALIGN == 0
    assert manifest.top_k == TINY["top_k"]

    expert_names = set()
    with closing(BlobStore(blob_dir)) as store:
        for layer in store.layers:
            assert layer.num_experts == TINY["experts"]
            assert sorted(seg.name for seg in layer.segments) == expected_segments
            for expert in range(layer.num_experts):
                row = store.read_expert(layer.index, expert)  # verifies the checksum
                assert len(row) == layer.expert_bytes <= store.stride
                for seg in layer.segments:
                    info = original[f"{layer.module}.{seg.name}"]
                    assert (seg.dtype, seg.shape) == (info.dtype, info.shape[1:])
                    assert row[seg.offset:seg.offset + seg.nbytes] == expert_slice(info, expert)
            expert_names.update(f"{layer.module}.{seg.name}" for seg in layer.segments)

    # The trunk holds every other tensor, byte for byte, and no expert.
    trunk = checkpoint_tensors(blob_dir / "trunk")
    assert not expert_names & set(trunk)
    assert set(trunk) | expert_names == set(original)
    for name, info in trunk.items():
        assert (info.dtype, info.shape) == (original[name].dtype, original[name].shape)
        assert tensor_bytes(info) == tensor_bytes(original[name]), name


@pytest.mark.parametrize("family,mode,bits,dtype", CASES)
def test_trunk_plus_experts_is_bit_exact(models, family, mode, bits, dtype):
    model_dir = models.model(family=family, mode=mode, bits=bits, dtype=dtype)
    blob_dir = models.blobs(family=family, mode=mode, bits=bits, dtype=dtype)
    original, tokenizer = mlx_lm.load(str(model_dir))
    rebuilt = reassemble(blob_dir)
    assert_same_parameters(original, rebuilt)

    x = mx.array([tokenizer.encode(PROMPT)])
    if mode == "none":
        original, rebuilt = runnable(original, dtype), runnable(rebuilt, dtype)
    expected, got = original(x), rebuilt(x)
    assert got.shape == expected.shape == (1, x.shape[1], tokenizer.vocab_size)
    assert got.dtype == expected.dtype
    assert mx.array_equal(expected, got).item()


def test_reassembly_check_sees_misplaced_experts(models):
    """Control for the test above: experts put back in the wrong rows change the logits."""
    model_dir, blob_dir = models.model(), models.blobs()
    original, tokenizer = mlx_lm.load(str(model_dir))
    rebuilt = reassemble(blob_dir, order=lambda layer, experts: experts[::-1] if layer == 0
                         else experts)
    x = mx.array([tokenizer.encode(PROMPT)])
    assert not mx.array_equal(original(x), rebuilt(x)).item()


def test_cli_synth_then_convert(tmp_path):
    model_dir, blob_dir = tmp_path / "model", tmp_path / "blobs"
    synth = subprocess.run([EXPERTD, "synth", "--family", "mixtral", "--layers", "2",
                            "--experts", "4", "--top-k", "2", "--out", str(model_dir)],
                           capture_output=True, text=True, timeout=120)
    assert synth.returncode == 0, synth.stderr
    assert (model_dir / "config.json").is_file()

    run = subprocess.run([EXPERTD, "convert", str(model_dir), str(blob_dir)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "wrote 2 MoE layers" in run.stdout and str(blob_dir) in run.stdout
    assert "%|" not in synth.stderr + run.stderr  # no bar frames into a pipe (issue 16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs", "model"]  # no partial left

    with closing(BlobStore(blob_dir)) as store:
        assert store.manifest.model_type == "mixtral"
        assert [layer.num_experts for layer in store.layers] == [4, 4]
        for layer in store.layers:
            for expert in range(layer.num_experts):
                store.read_expert(layer.index, expert)  # verifies the checksum


# The trunk's checksums.

def test_manifest_lists_every_trunk_file_with_its_checksum(models):
    blob_dir = models.blobs()
    manifest = Manifest.load(blob_dir)
    trunk = blob_dir / "trunk"
    assert sorted(f.name for f in manifest.trunk) == sorted(p.name for p in trunk.iterdir())
    for entry in manifest.trunk:
        data = (trunk / entry.name).read_bytes()
        assert (entry.size, entry.checksum) == (len(data), xxhash.xxh3_64_intdigest(data))


# ---- --layers A:B: one pipeline stage's directory ----------------------------------------------

def test_layers_writes_only_the_stage_and_records_its_range(models, tmp_path):
    """deepseek_v3's layer 0 is dense: layers 0:2 hold one MoE layer, 2:4 hold two."""
    model = models.model(family="deepseek_v3", layers=4)
    whole = Manifest.load(models.blobs(family="deepseek_v3", layers=4))
    for spec, start, stop in (("0:2", 0, 2), ("2:", 2, 4)):
        out = tmp_path / spec.replace(":", "-")
        proc = subprocess.run([EXPERTD, "convert", str(model), str(out), "--layers", spec, "-q"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert f"of transformer layers {start}:{stop} (of 4)" in proc.stdout
        m = Manifest.load(out)
        assert json.loads((out / "manifest.json").read_text())["version"] == 3
        assert (m.stage.start, m.stage.stop, m.stage.num_layers) == (start, stop, 4)
        expected = [layer for layer in whole.layers
                    if start <= int(layer.module.split(".")[2]) < stop]
        # The same blobs as the whole model's, renumbered from 0 within the directory.
        assert [(l.module, l.file, l.checksums) for l in m.layers] == \
            [(l.module, l.file, l.checksums) for l in expected]
        assert [l.index for l in m.layers] == list(range(len(expected)))
        assert sorted(p.name for p in out.glob("*.blob")) == [l.file for l in expected]
        for layer in m.layers:
            assert (out / layer.file).read_bytes() == (whole_dir(models) / layer.file).read_bytes()
        # The trunk: what no layer owns, and the non-expert weights of the stage's layers.
        names = set(read_header(out / "trunk" / "model.safetensors"))
        layer_of = {n: int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert set(layer_of.values()) == set(range(start, stop))
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    # A whole model's manifest stays version 2 (older expertd versions still read it).
    assert json.loads((whole_dir(models) / "manifest.json").read_text())["version"] == 2
    assert whole.stage is None


def whole_dir(models) -> Path:
    return models.blobs(family="deepseek_v3", layers=4)


@pytest.mark.parametrize("spec,message", [
    ("2", "--layers 2: expected A:B, a range of transformer layers as a Python slice (e.g. 0:2)"),
    ("a:b", "--layers a:b: expected A:B, a range of transformer layers as a Python slice"),
    ("3:9", "--layers 3:9: the model has transformer layers 0:4; give a non-empty range "
            "within it"),
    ("2:2", "--layers 2:2: the model has transformer layers 0:4; give a non-empty range"),
    ("0:1", "--layers 0:1: transformer layers 0:1 hold no MoE layer; such a stage needs no "
            "expertd (run it with mlx-lm alone)"),
])
def test_layers_errors_are_one_line_and_leave_nothing(models, tmp_path, spec, message):
    model = models.model(family="deepseek_v3", layers=4)
    proc = subprocess.run([EXPERTD, "convert", str(model), str(tmp_path / "out"), "--layers",
                           spec, "-q"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"expertd convert: error: {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_stage_manifest_with_a_bad_range_is_refused(models, tmp_path):
    out = tmp_path / "stage"
    convert(models.model(layers=4), out, progress=False, layers="2:4")
    data = json.loads((out / "manifest.json").read_text())
    data["stage"]["stop"] = 9
    (out / "manifest.json").write_text(json.dumps(data))
    from expertd.errors import BlobStoreError
    with pytest.raises(BlobStoreError, match=r"stage: layers 2:9 are not a range within 4 "
                       r"layers; re-run expertd convert"):
        Manifest.load(out)


# ---- issue 16: bars only on a terminal ---------------------------------------------------------

def on_a_terminal(*args) -> tuple:
    """Run ``expertd ARGS`` with its stderr on a pseudo-terminal: (returncode, what it drew)."""
    master, slave = terminal()
    try:
        proc = subprocess.Popen([EXPERTD, *map(str, args)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        slave = None
        said = drawn(master)  # read first: a child drawing more than the pty holds would block
        return proc.wait(timeout=120), said
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)


def test_convert_and_verify_draw_bars_on_a_terminal_only(models, tmp_path):
    model_dir, blob_dir = models.model(), tmp_path / "blobs"
    code, drawn = on_a_terminal("convert", model_dir, blob_dir)
    assert code == 0 and "convert: 100%" in drawn and "\r" in drawn, drawn
    code, drawn = on_a_terminal("verify", "--blobs", blob_dir)
    assert code == 0 and "verify: 100%" in drawn, drawn
    # Into a pipe (a log, `make demo > log`): the results, and not one bar frame.
    run = subprocess.run([EXPERTD, "verify", "--blobs", str(blob_dir)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "match their checksums" in run.stdout, run
    assert run.stderr == ""
