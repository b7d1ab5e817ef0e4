"""The converter's atomicity and memory: killed and interrupted runs, leftovers, bounded memory,
one run at a time per destination (the lock), a full disk and unreadable input."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
from contextlib import closing
from pathlib import Path

import pytest
from conftest import PYTHON, mounted
from harness import wait_until

from expertd.blobstore import BlobStore
from expertd.manifest import Manifest
from expertd.tools.convert import convert
from expertd.tools.synth import SynthConfig, synthesize

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
