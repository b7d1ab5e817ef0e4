"""What the converter refuses, each in one line naming what is wrong and leaving nothing behind,
and what it accepts as a model: a directory, a Hugging Face repo id in the local cache, ~."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import TINY
from harness import EXPERTD
from mlx_lm.utils import load_model

from expertd.errors import ModelDirError
from expertd.manifest import Manifest
from expertd.tools.convert import convert

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


# ---- issue 16: a missing parent is refused -----------------------------------------------------

def test_a_missing_parent_is_refused_in_one_line_and_never_created(models, tmp_path):
    blob_dir = tmp_path / "no-such-parent" / "blobs"
    run = subprocess.run([EXPERTD, "convert", str(models.model()), str(blob_dir)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr == (f"expertd convert: error: {blob_dir.parent}: no such directory (the "
                          f"parent of {blob_dir}); create it first or choose another path\n")
    assert sorted(tmp_path.iterdir()) == []
