"""The converter: exact expert bytes, a bit-exact reassembled model, refusals, atomicity and
bounded memory."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import xxhash
from conftest import PYTHON, TINY, mounted
from harness import drawn, terminal, wait_until
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from expertd.blobstore import BlobStore
from expertd.errors import ModelDirError
from expertd.manifest import STRIDE_ALIGN, Manifest
from expertd.tools.convert import convert, expert_slice
from expertd.tools.safetensors import read_header
from expertd.tools.synth import SynthConfig, synthesize

EXPERTD = str(Path(sys.executable).with_name("expertd"))
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


# Refusals: each names what is wrong, and leaves nothing behind.

def write_dense_model(out: Path) -> Path:
    """A tiny llama checkpoint (no MoE layer), saved with mlx-lm's own utilities."""
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
              "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 2,
              "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
    out.mkdir()
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def rewrite_weights(model_dir: Path, out: Path, edit) -> Path:
    """Copy a checkpoint with its weights passed through ``edit(dict) -> dict``."""
    shutil.copytree(model_dir, out)
    shards = sorted(out.glob("model*.safetensors"))
    weights = {}
    for shard in shards:
        weights.update(mx.load(str(shard)))
        shard.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), edit(weights), metadata={"format": "mlx"})
    return out


def drop_last_expert(weights: dict) -> dict:
    name = "model.layers.1.mlp.switch_mlp.up_proj.scales"
    return weights | {name: weights[name][:-1]}


def unstack_experts(weights: dict) -> dict:
    """The Hugging Face layout: one tensor per expert instead of one stacked tensor."""
    out = {}
    for name, array in weights.items():
        if ".switch_mlp." not in name:
            out[name] = array
            continue
        module, rest = name.split(".switch_mlp.")
        for e in range(array.shape[0]):
            out[f"{module}.experts.{e}.{rest}"] = array[e]
    return out


def test_refuses_missing_dir(tmp_path):
    with pytest.raises(ModelDirError, match=r"not an mlx-lm model directory \(no config.json\)"):
        convert(tmp_path / "nowhere", tmp_path / "blobs", progress=False)
    assert sorted(tmp_path.iterdir()) == []


def test_refuses_empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelDirError, match=r"empty is not an mlx-lm model directory"
                                            r" \(no config.json\)"):
        convert(tmp_path / "empty", tmp_path / "blobs", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_refuses_dir_without_weights(models, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(models.model(), model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ModelDirError, match=r"no model\*\.safetensors"):
        convert(model_dir, tmp_path / "blobs", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_refuses_unknown_model_type(models, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(models.model(), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"model_type": "no_such_moe"}))
    with pytest.raises(ModelDirError, match="mlx-lm does not know this model.*no_such_moe"):
        convert(model_dir, tmp_path / "blobs", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_refuses_dense_model(tmp_path):
    model_dir = write_dense_model(tmp_path / "dense")
    load_model(model_dir)  # a real checkpoint that mlx-lm loads
    with pytest.raises(ModelDirError, match=r"model type 'llama' has no MoE layers"):
        convert(model_dir, tmp_path / "blobs", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


def test_refuses_wrong_expert_count(models, tmp_path):
    model_dir = rewrite_weights(models.model(), tmp_path / "model", drop_last_expert)
    n = TINY["experts"]
    with pytest.raises(ModelDirError, match=(
            rf"unknown layout: model\.layers\.1\.mlp\.switch_mlp\.up_proj\.scales has shape "
            rf"\[{n - 1}, .*\], expected a leading dimension of {n} experts")):
        convert(model_dir, tmp_path / "blobs", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_refuses_unstacked_experts(models, tmp_path):
    model_dir = rewrite_weights(models.model(), tmp_path / "model", unstack_experts)
    with pytest.raises(ModelDirError, match=r"unknown layout: no tensor under "
                                            r"model\.layers\.0\.mlp\.switch_mlp.*stacked"):
        convert(model_dir, tmp_path / "blobs", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_refuses_existing_output(models, tmp_path):
    blob_dir = tmp_path / "blobs"
    blob_dir.mkdir()
    (blob_dir / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=rf"{blob_dir} already exists"):
        convert(models.model(), blob_dir, progress=False)
    assert [p.name for p in blob_dir.iterdir()] == ["keep.txt"]
    assert (blob_dir / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("case", ["dense", "exists"])
def test_cli_refusal_is_one_clear_line(models, tmp_path, case):
    if case == "dense":
        model_dir, blob_dir = write_dense_model(tmp_path / "dense"), tmp_path / "blobs"
        expected = "has no MoE layers"
    else:
        model_dir, blob_dir = models.model(), tmp_path / "blobs"
        blob_dir.mkdir()
        expected = "already exists"
    run = subprocess.run([EXPERTD, "convert", str(model_dir), str(blob_dir)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("expertd convert: error: ") and expected in lines[0]
    assert "Traceback" not in run.stderr


# Atomicity and memory, on a checkpoint large enough to take a while.

BIG = dict(family="qwen3_moe", mode="none", dtype="bfloat16", layers=4, experts=64, top_k=4,
           hidden=512, moe_inter=512)  # about 400 MB of bfloat16 experts


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    return synthesize(SynthConfig(**BIG), tmp_path_factory.mktemp("big") / "model")


def wait_for(condition, proc, what: str, timeout: float = 60.0) -> None:
    """Poll ``condition`` while ``proc`` runs; fail if it exits first or time runs out."""
    wait_until(lambda: condition() or proc.poll() is not None, timeout, what, interval=0.001)
    assert condition(), f"converter exited ({proc.returncode}) before {what}"


def assert_valid(blob_dir: Path) -> None:
    with closing(BlobStore(blob_dir)) as store:
        for layer in store.layers:
            for expert in range(layer.num_experts):
                store.read_expert(layer.index, expert)
    assert (blob_dir / "trunk" / "model.safetensors").is_file()


# The expertd command, with Ctrl-C raising KeyboardInterrupt even when this test runs in a
# background job (which starts with SIGINT ignored, and Python then keeps it ignored).
CLI_WITH_SIGINT = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "from expertd.cli.main import main; sys.exit(main(sys.argv[1:]))")


def signal_mid_conversion(model_dir: Path, blob_dir: Path, signum: int):
    """Run ``expertd convert``, send ``signum`` once the second layer is being written.

    Returns:
        (exit code, stderr) of the converter.
    """
    partial = blob_dir.parent / f".{blob_dir.name}.partial"
    proc = subprocess.Popen([PYTHON, "-c", CLI_WITH_SIGINT, "convert", "-q", str(model_dir),
                             str(blob_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (partial / "layer-001.blob").exists(), proc, "layer 1 started")
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, stderr


def test_killed_run_leaves_no_output_and_rerun_succeeds(big_model, tmp_path):
    blob_dir, partial = tmp_path / "blobs", tmp_path / ".blobs.partial"
    returncode, stderr = signal_mid_conversion(big_model, blob_dir, signal.SIGKILL)
    assert returncode == -signal.SIGKILL, stderr
    assert not blob_dir.exists()
    assert partial.is_dir()  # nothing could clean up after SIGKILL

    manifest = convert(big_model, blob_dir, progress=False)
    assert not partial.exists()
    assert len(manifest.layers) == BIG["layers"]
    assert_valid(blob_dir)


def test_interrupted_run_cleans_up(big_model, tmp_path):
    returncode, stderr = signal_mid_conversion(big_model, tmp_path / "blobs", signal.SIGINT)
    assert returncode == 130, stderr
    assert stderr.strip() == "expertd convert: interrupted"
    assert sorted(tmp_path.iterdir()) == []  # neither the output nor the partial directory


def test_leftover_partial_dir_is_replaced(models, tmp_path):
    blob_dir, partial = tmp_path / "blobs", tmp_path / ".blobs.partial"
    partial.mkdir()
    (partial / "layer-000.blob").write_bytes(b"stale")
    (partial / "junk").write_text("from an earlier run")
    convert(models.model(), blob_dir, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs"]
    assert not (blob_dir / "junk").exists()
    assert_valid(blob_dir)


MEMORY_PROBE = """
import json, resource, sys
from pathlib import Path

def peak_rss():
    kib_or_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib_or_bytes if sys.platform == "darwin" else kib_or_bytes * 1024

import mlx.core, mlx_lm.utils, mlx_lm.models.qwen3_moe, tqdm, xxhash
from expertd.tools.convert import convert

before = peak_rss()  # the high-water mark once everything is imported
convert(Path(sys.argv[1]), Path(sys.argv[2]), progress=False)
print(json.dumps({"before": before, "peak": peak_rss()}))
"""


def test_memory_stays_small(big_model, tmp_path):
    checkpoint = sum(p.stat().st_size for p in big_model.glob("*.safetensors"))
    run = subprocess.run([PYTHON, "-c", MEMORY_PROBE, str(big_model), str(tmp_path / "blobs")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rss = json.loads(run.stdout.strip().splitlines()[-1])
    growth = rss["peak"] - rss["before"]
    manifest = Manifest.load(tmp_path / "blobs")
    assert manifest.total_expert_bytes > 0.9 * checkpoint  # the experts are most of the model
    assert growth < 0.25 * checkpoint, (
        f"converter grew by {growth / 2**20:.0f} MiB "
        f"for a {checkpoint / 2**20:.0f} MiB checkpoint")


# The trunk's checksums.

def test_manifest_lists_every_trunk_file_with_its_checksum(models):
    blob_dir = models.blobs()
    manifest = Manifest.load(blob_dir)
    trunk = blob_dir / "trunk"
    assert sorted(f.name for f in manifest.trunk) == sorted(p.name for p in trunk.iterdir())
    for entry in manifest.trunk:
        data = (trunk / entry.name).read_bytes()
        assert (entry.size, entry.checksum) == (len(data), xxhash.xxh3_64_intdigest(data))


# One run at a time per destination: a lock file next to it.

def expertd_convert(model_dir, blob_dir, **popen) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "expertd", "convert", "-q", str(model_dir),
                             str(blob_dir)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("expertd convert: error: "), lines[0]
    return lines[0]


def verify_clean(blob_dir: Path) -> None:
    run = subprocess.run([PYTHON, "-m", "expertd", "verify", "-q", "--blobs", str(blob_dir)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_held_lock_refuses_at_once_and_touches_nothing(models, tmp_path):
    blob_dir, partial = tmp_path / "blobs", tmp_path / ".blobs.partial"
    partial.mkdir()
    (partial / "layer-000.blob").write_bytes(b"being written by the other run")
    with open(tmp_path / ".blobs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("4242\n")
        lock.flush()
        run = expertd_convert(models.model(), blob_dir)
        _, stderr = run.communicate(timeout=120)
    assert run.returncode == 1
    assert one_error_line(stderr) == (f"expertd convert: error: another expertd convert is "
                                      f"writing {blob_dir} (pid 4242); wait for it to finish "
                                      "or choose another path")
    assert (partial / "layer-000.blob").read_bytes() == b"being written by the other run"
    assert (tmp_path / ".blobs.lock").read_text() == "4242\n"  # the holder's file stays
    assert not blob_dir.exists()


def test_a_stale_lock_file_does_not_block(models, tmp_path):
    (tmp_path / ".blobs.lock").write_text("999999999\n")  # left by a run that was killed
    convert(models.model(), tmp_path / "blobs", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs"]


def test_second_convert_while_the_first_writes(big_model, tmp_path):
    """Two real ``expertd convert`` processes: the second one arrives mid-write."""
    blob_dir, partial = tmp_path / "blobs", tmp_path / ".blobs.partial"
    first = expertd_convert(big_model, blob_dir)
    try:
        wait_for(lambda: (partial / "layer-001.blob").exists(), first, "layer 1 started")
        first.send_signal(signal.SIGSTOP)  # held mid-write for as long as the second one runs
        try:
            second = expertd_convert(big_model, blob_dir)
            _, second_err = second.communicate(timeout=120)
            assert (partial / "layer-001.blob").exists()  # the first one's work is still there
        finally:
            first.send_signal(signal.SIGCONT)
        out, first_err = first.communicate(timeout=120)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 1
    assert one_error_line(second_err).startswith(
        f"expertd convert: error: another expertd convert is writing {blob_dir} "
        f"(pid {first.pid})")
    assert first.returncode == 0, first_err
    assert f"to {blob_dir}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs"]  # no partial, no lock
    verify_clean(blob_dir)


def test_concurrent_converts_make_one_good_directory(models, tmp_path):
    """Started together, in whatever order the scheduler picks: one wins, one says why not."""
    model_dir = models.model()
    for attempt in range(3):
        blob_dir = tmp_path / f"blobs{attempt}"
        runs = [expertd_convert(model_dir, blob_dir) for _ in range(2)]
        results = [run.communicate(timeout=120) + (run.returncode,) for run in runs]
        codes = sorted(code for _, _, code in results)
        assert codes == [0, 1], results
        loser = next(err for _, err, code in results if code == 1)
        line = one_error_line(loser)
        assert ("another expertd convert is writing" in line or "already exists" in line), line
        verify_clean(blob_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blobs0", "blobs1", "blobs2"]


# A full disk and unreadable input: one line through the real command, nothing left behind.

@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs, too small for the tiny model's blobs (about 0.8 MB), unmounted after."""
    with mounted(tmp_path / "small", "tmpfs", "-o", "size=256k") as where:
        yield where


def test_full_disk_is_one_line_and_leaves_nothing(models, small_tmpfs):
    blob_dir = small_tmpfs / "blobs"
    run = expertd_convert(models.model(), blob_dir)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 1, out
    line = one_error_line(err)
    assert line.startswith(f"expertd convert: error: {blob_dir}: no space left on the device, "
                           "the disk is full"), line
    assert list(small_tmpfs.iterdir()) == []  # neither the partial directory nor the lock


# Root reads everything: the command drops to nobody after its imports to see a refusal.
# (Python's own modules are root's here: everything the command imports is imported first.)
AS_NOBODY = ("import os, sys; import tqdm, expertd.tools.convert; "
             "from expertd.cli.main import build_parser, main; build_parser(); "
             "os.setgroups([]); os.setgid(65534); os.setuid(65534); sys.exit(main(sys.argv[1:]))")


@pytest.fixture
def shared_dir():
    """A directory the unprivileged user can enter and write (tmp_path is root's alone)."""
    where = Path(tempfile.mkdtemp(prefix="expertd-perm-", dir="/tmp"))
    where.chmod(0o777)
    yield where
    for path in where.rglob("*"):
        path.chmod(0o755)
    shutil.rmtree(where)


@pytest.mark.parametrize("what", ["directory", "weights"])
def test_unreadable_model_is_one_line(models, shared_dir, what):
    model_dir, blob_dir = shared_dir / "model", shared_dir / "blobs"
    shutil.copytree(models.model(), model_dir)
    unreadable = model_dir if what == "directory" else model_dir / "model.safetensors"
    unreadable.chmod(0)
    if os.geteuid() == 0:
        cmd = [PYTHON, "-c", AS_NOBODY]
    else:
        cmd = [PYTHON, "-m", "expertd"]
    run = subprocess.run(cmd + ["convert", "-q", str(model_dir), str(blob_dir)],
                         capture_output=True, text=True, timeout=120, cwd=shared_dir)
    assert run.returncode == 1, run.stdout
    line = one_error_line(run.stderr)
    if what == "directory":
        assert line == (f"expertd convert: error: {model_dir}: permission denied: cannot read "
                        "the model directory")
    else:
        assert line == (f"expertd convert: error: {unreadable}: cannot read (Permission "
                        "denied)")
    assert sorted(p.name for p in shared_dir.iterdir()) == ["model"]


# ---- mlx-lm's conventions: Hugging Face repo ids and ~ --------------------------------------

def hf_cache_with(model_dir: Path, hf_home: Path, repo: str) -> Path:
    """A Hugging Face cache (the hub's own layout: blobs, refs/main, a snapshot of symlinks)
    holding ``model_dir`` as ``repo``; returns the snapshot directory."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    snapshot.mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    for f in model_dir.iterdir():
        blob = root / "blobs" / f.name
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    return snapshot


def test_a_hugging_face_repo_id_converts_from_the_local_cache_offline(models, tmp_path):
    model_dir = models.model(**TINY)
    hf_home = tmp_path / "hf"
    snapshot = hf_cache_with(model_dir, hf_home, "acme/tiny-moe")
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    for name, spec in (("by-id", "acme/tiny-moe"), ("by-snapshot-path", str(snapshot))):
        out = tmp_path / name
        proc = subprocess.run([EXPERTD, "convert", spec, str(out), "-q"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        # The same blobs as converting the directory itself.
        assert Manifest.load(out).digest == Manifest.load(models.blobs(**TINY)).digest


def test_an_unknown_repo_id_offline_is_one_clear_line(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([EXPERTD, "convert", "acme/no-such-model", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "expertd convert: error: acme/no-such-model: no such directory, and no Hugging Face repo "
        "of that name was found in the local Hugging Face cache (HF_HUB_OFFLINE is set) "
        "(LocalEntryNotFoundError)"]
    assert not (tmp_path / "out").exists()


def test_tilde_is_expanded_in_both_paths(models, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(models.model(**TINY), home / "models" / "tiny")
    (home / "blobs").mkdir()  # convert creates no missing parent
    env = {**os.environ, "HOME": str(home)}
    proc = subprocess.run([EXPERTD, "convert", "~/models/tiny", "~/blobs/tiny", "-q"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (home / "blobs" / "tiny" / "manifest.json").is_file()
    assert not (Path.cwd() / "~").exists()


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
    assert proc.returncode == 1
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


# ---- issue 16: a missing parent is refused; bars only on a terminal ----------------------------

def test_a_missing_parent_is_refused_in_one_line_and_never_created(models, tmp_path):
    blob_dir = tmp_path / "no-such-parent" / "blobs"
    run = subprocess.run([EXPERTD, "convert", str(models.model()), str(blob_dir)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr == (f"expertd convert: error: {blob_dir.parent}: no such directory (the "
                          f"parent of {blob_dir}); create it first or choose another path\n")
    assert sorted(tmp_path.iterdir()) == []


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
