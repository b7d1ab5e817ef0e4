"""Shared fixtures: tiny synthetic models and their blob directories, built once per session."""

import os
import shutil
import tempfile
import sys
from pathlib import Path

import pytest

from expertd.tools.convert import convert
from expertd.tools.synth import SynthConfig, synthesize

# Small enough to build in a second, big enough that routing spreads over many experts.
TINY = dict(layers=3, experts=16, top_k=4, hidden=128, moe_inter=64)
FAMILY_MODES = [
    ("qwen3_moe", "affine", 4),
    ("mixtral", "affine", 8),
    ("deepseek_v3", "affine", 4),
    ("gpt_oss", "mxfp4", 4),
]


class ModelCache:
    """Builds each (config) model and its blob directory once, under one session directory."""

    def __init__(self, root: Path):
        self.root = root

    def model(self, **kwargs) -> Path:
        cfg = SynthConfig(**{**TINY, **kwargs})
        name = "-".join(f"{k}{v}" for k, v in sorted(cfg.__dict__.items()))
        out = self.root / "models" / name
        if not (out / "config.json").exists():
            synthesize(cfg, out)
        return out

    def blobs(self, **kwargs) -> Path:
        model = self.model(**kwargs)
        out = self.root / "blobs" / model.name
        if not (out / "manifest.json").exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            convert(model, out, progress=False)
        return out


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> ModelCache:
    return ModelCache(tmp_path_factory.mktemp("expertd-models"))


@pytest.fixture
def isolated_env(tmp_path, monkeypatch):
    """Per-test runtime and state directories, so daemons of different tests never meet.

    The runtime directory is short on purpose: unix socket paths are limited to 104 bytes.
    """
    runtime = Path(tempfile.mkdtemp(prefix="xd", dir="/tmp"))
    state = tmp_path / "state"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    yield {"XDG_RUNTIME_DIR": str(runtime), "XDG_STATE_HOME": str(state)}
    shutil.rmtree(runtime, ignore_errors=True)


def python_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    return env


PYTHON = sys.executable
