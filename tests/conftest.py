"""Shared fixtures: tiny synthetic models and their blob directories, built once per session."""

import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest
from harness import SEEN_ARENAS, shm_exists

from expertd.shm.layout import unlink_arena
from expertd.tools.convert import convert
from expertd.tools.safetensors import read_header
from expertd.tools.synth import TINY, SynthConfig, synthesize

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
            out.parent.mkdir(parents=True, exist_ok=True)
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


@contextmanager
def _private_dirs(state: Path, monkeypatch):
    """A fresh runtime directory and ``state`` as this process's XDG_RUNTIME_DIR and
    XDG_STATE_HOME (children inherit them); the runtime directory is removed after.

    The runtime directory is short on purpose: unix socket paths are limited to 104 bytes.
    """
    runtime = short_dir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    monkeypatch.delenv("EXPERTD_API_KEY", raising=False)  # a developer's would guard serve
    try:
        yield {"XDG_RUNTIME_DIR": str(runtime), "XDG_STATE_HOME": str(state)}
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture
def isolated_env(tmp_path, monkeypatch):
    """Per-test runtime and state directories, so daemons of different tests never meet."""
    with _private_dirs(tmp_path / "state", monkeypatch) as env:
        yield env


def short_dir() -> Path:
    """A fresh directory under /tmp with a short name: a runtime directory's socket paths must
    stay within 104 bytes (a test's tmp_path under xdist is too long)."""
    return Path(tempfile.mkdtemp(prefix="xd", dir="/tmp"))


@pytest.fixture
def other_runtime(isolated_env):
    """A second runtime directory beside isolated_env's, for XDG_RUNTIME_DIR as another shell
    (or a service) sets it; the state directory stays the same. Removed after."""
    path = short_dir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def module_env(tmp_path_factory):
    """``isolated_env`` for a module's one daemon (a module-scoped fixture's)."""
    with pytest.MonkeyPatch.context() as mp, \
            _private_dirs(tmp_path_factory.mktemp("state"), mp) as env:
        yield env


@pytest.fixture(scope="session")
def blobs(models) -> Path:
    """The tiny model's blob directory, shared: for tests that only read it."""
    return models.blobs()


class Qwen(NamedTuple):
    model_dir: Path
    blob_dir: Path
    resident: object  # mlx-lm's own load of the whole checkpoint (only ever read)
    tokenizer: object


@pytest.fixture(scope="session")
def qwen(models) -> Qwen:
    """The tiny qwen3_moe model (affine, 4 bits), its blobs and resident mlx-lm model."""
    import mlx_lm

    model_dir = models.model(family="qwen3_moe", mode="affine", bits=4)
    blob_dir = models.blobs(family="qwen3_moe", mode="affine", bits=4)
    return Qwen(model_dir, blob_dir, *mlx_lm.load(str(model_dir)))


@pytest.fixture
def blob_dir(models, tmp_path) -> Path:
    """A private copy of the tiny model's blob directory, free to corrupt."""
    out = tmp_path / "blobs"
    shutil.copytree(models.blobs(), out)
    return out.resolve()


@contextmanager
def mounted(where: Path, fstype: str, *options: str):
    """A fresh ``fstype`` mounted at ``where`` (created), unmounted after; the test is skipped
    where mounting is not allowed (not Linux, not root)."""
    if not sys.platform.startswith("linux"):
        pytest.skip(f"mounting a {fstype} is Linux only")
    where.mkdir()
    run = subprocess.run(["mount", "-t", fstype, *options, fstype, str(where)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} here (needs root / CAP_SYS_ADMIN): "
                    f"{run.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def flip_byte(path: Path, offset: int) -> None:
    """Invert the lowest bit of the byte at ``offset`` of ``path``."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def lm_head_offset(blob_dir: Path) -> int:
    """The file offset of a byte in the middle of ``lm_head.weight`` in the trunk."""
    info = read_header(blob_dir / "trunk" / "model.safetensors")["lm_head.weight"]
    return info.start + info.nbytes // 2


PYTHON = sys.executable


@pytest.fixture(scope="session", autouse=True)
def no_arena_left_behind():
    """Fail the session if any arena a daemon reported still exists at its end.

    Each ``Daemon`` already checks its own arena at teardown; this also catches daemons the
    command line started and arenas of daemons a test forgot to stop. Leftovers are removed
    before failing, so that one failed run does not fail the next one.
    """
    before = _linux_segments()
    yield
    left = sorted(name for name in SEEN_ARENAS if shm_exists(name))
    for name in left:
        unlink_arena(name)
    # Linux only, for information: segments that appeared during the session and that no
    # daemon reported to us (they may be another user's or another run's, so never a failure).
    _UNREPORTED.extend(sorted(_linux_segments() - before - {n.lstrip("/") for n in SEEN_ARENAS}))
    assert not left, f"the test session left {len(left)} shared-memory segments: {left}"


_UNREPORTED: list = []


def _linux_segments() -> set:
    if not sys.platform.startswith("linux"):
        return set()  # no portable way to list POSIX shared memory
    return {p.name for p in Path("/dev/shm").glob("expertd-*")}


# Modules that run once, with the Cython extension (make test's first pass), not again with the
# pure-Python twins: the product surface (command line, services, servers, conversion), pure
# logic, and the daemon's own robustness (hostile frames, fairness, lifecycle, recovery), where
# the twin code is only the seqlock writes that test_daemon and test_side_rows repeat. The hot
# paths the twins replace (remap, drain, copies, validation) are the client, parity, prefill and
# prefetch tests', which both passes run.
ONCE = {"test_cli", "test_service", "test_serve", "test_chat", "test_convert_output",
        "test_convert_refusals", "test_convert_atomicity", "test_synth", "test_blobstore",
        "test_verify", "test_pipeline", "test_policy_ranking", "test_policy_pins",
        "test_policy_quotas", "test_leases", "test_side_book", "test_generate", "test_attack",
        "test_protocol_fuzz", "test_lifecycle_files", "test_lifecycle_start",
        "test_daemon_fairness", "test_daemon_recovery", "test_fill_verify", "test_attack_pools",
        "test_flood", "test_client_flags", "test_client_lifecycle", "test_remote",
        "test_remote_daemon", "test_remote_attack", "test_stats_record", "test_slot_layout",
        "test_packaging", "test_batch"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in ONCE:
            item.add_marker(pytest.mark.once)


def pytest_terminal_summary(terminalreporter):
    if _UNREPORTED:
        terminalreporter.write_line(
            f"note: {len(_UNREPORTED)} expertd-* segments appeared in /dev/shm during the session "
            f"that no test daemon reported (another run's?): {', '.join(_UNREPORTED)}")
