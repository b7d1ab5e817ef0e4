"""Checksums beyond the first fill: ``expertd verify`` finds every corrupt expert and trunk file
offline, by name, with bounded memory; and ``expertd.client.load`` refuses a corrupt trunk."""

import json
import subprocess

import pytest
from conftest import PYTHON, TINY, flip_byte, lm_head_offset
from harness import SMALL_CACHE_GB, InProcessDaemon

from expertd.client import load
from expertd.errors import BlobStoreError
from expertd.manifest import Manifest
from expertd.tools.convert import convert
from expertd.tools.synth import SynthConfig, synthesize

EXPERTS = TINY["layers"] * TINY["experts"]


def expertd(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "expertd", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


def test_clean_directory(blob_dir):
    manifest = Manifest.load(blob_dir)
    run = expertd("verify", "--blobs", blob_dir)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        f"{blob_dir}: all {EXPERTS} experts in {TINY['layers']} layers and "
        f"{len(manifest.trunk)} trunk files match their checksums"]
    assert run.stderr == ""  # no progress bar into a pipe (test_convert_output checks a terminal's)
    quiet = expertd("verify", "-q", "--blobs", blob_dir)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, run.stdout, "")
    positional = expertd("verify", "-q", blob_dir)  # as convert names it
    assert (positional.returncode, positional.stdout) == (0, run.stdout)
    # The same directory both ways is that directory; two, or none: an argument error,
    # argparse's exit status, one line.
    same = expertd("verify", "-q", blob_dir, "--blobs", f"{blob_dir}/")
    assert (same.returncode, same.stdout) == (0, run.stdout)
    for argv, said in ((("verify", blob_dir, "--blobs", "elsewhere"),
                        f"{blob_dir} and --blobs elsewhere name two directories; give one"),
                       (("verify",), "give the blob directory: expertd verify BLOB_DIR, or "
                        "expertd verify --blobs BLOB_DIR")):
        done = expertd(*argv)
        assert done.returncode == 2 and done.stderr == f"expertd verify: error: {said}\n", done


def test_every_corrupt_expert_and_file_is_one_line(blob_dir):
    manifest = Manifest.load(blob_dir)
    stride = manifest.stride
    layer1, layer2 = manifest.layers[1], manifest.layers[2]
    flip_byte(blob_dir / layer1.file, 5 * stride)  # first byte of layer 1 expert 5
    last = TINY["experts"] - 1
    flip_byte(blob_dir / layer2.file, last * stride + layer2.expert_bytes - 1)  # its last byte
    flip_byte(blob_dir / "trunk" / "model.safetensors", lm_head_offset(blob_dir))

    run = expertd("verify", "-q", "--blobs", blob_dir)
    assert run.returncode == 1, run.stderr
    assert run.stderr == ""
    assert run.stdout.splitlines() == [
        f"checksum mismatch for layer 1 expert 5 in {blob_dir / layer1.file}",
        f"checksum mismatch for layer 2 expert {last} in {blob_dir / layer2.file}",
        f"{blob_dir / 'trunk' / 'model.safetensors'}: checksum mismatch (the file is corrupt)",
        f"{blob_dir}: 3 problems found checking {EXPERTS} experts in {TINY['layers']} layers "
        f"and {len(manifest.trunk)} trunk files; re-run expertd convert MODEL_DIR {blob_dir}"]


def test_truncated_blob_file(blob_dir):
    manifest = Manifest.load(blob_dir)
    layer = manifest.layers[2]
    path = blob_dir / layer.file
    size = (layer.num_experts - 1) * manifest.stride + layer.expert_bytes - 1  # last row cut
    expected = layer.num_experts * manifest.stride
    with open(path, "r+b") as f:
        f.truncate(size)
    run = expertd("verify", "-q", "--blobs", blob_dir)
    assert run.returncode == 1, run.stderr
    assert run.stdout.splitlines()[:-1] == [
        f"{path}: size {size} bytes, expected {expected} ({layer.num_experts} experts x "
        f"{manifest.stride})",
        f"layer 2 expert {layer.num_experts - 1} in {path}: row past the end of the file"]
    assert "1 problem" not in run.stdout and "2 problems found" in run.stdout


def test_missing_blob_and_trunk_files(blob_dir):
    (blob_dir / "layer-000.blob").unlink()
    (blob_dir / "trunk" / "tokenizer.json").unlink()
    run = expertd("verify", "-q", "--blobs", blob_dir)
    assert run.returncode == 1, run.stderr
    assert run.stdout.splitlines()[:-1] == [
        f"{blob_dir / 'layer-000.blob'}: blob file of layer 0 is missing",
        f"{blob_dir / 'trunk' / 'tokenizer.json'}: trunk file is missing"]


@pytest.mark.parametrize("text,expected", [
    ("[]", "expected a JSON object, found list"),
    ("null", "expected a JSON object, found null"),
    ("{}", "not an expertd manifest"),
    ("{\"stride\": ", "not JSON"),
    (None, "'top_k' is missing"),
])
def test_bad_manifest_is_one_line_from_verify_and_start(blob_dir, isolated_env, text, expected):
    path = blob_dir / "manifest.json"
    if text is None:
        data = json.loads(path.read_text())
        del data["top_k"]
        text = json.dumps(data)
    path.write_text(text)
    for command in (("verify", "-q", "--blobs", blob_dir),
                    ("start", "--blobs", blob_dir, "--cache-gb", SMALL_CACHE_GB)):
        run = expertd(*command)
        assert run.returncode == 1, (command, run.stdout, run.stderr)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1, run.stderr
        assert lines[0].startswith(f"expertd {command[0]}: error: {path}: "), lines[0]
        assert expected in lines[0]
        assert run.stdout == ""


def test_load_refuses_a_corrupt_trunk(blob_dir, isolated_env):
    trunk_file = blob_dir / "trunk" / "model.safetensors"
    offset = lm_head_offset(blob_dir)
    with InProcessDaemon(blob_dir, "--cache-gb", SMALL_CACHE_GB):
        flip_byte(trunk_file, offset)  # lm_head.weight: wrong logits if it were loaded
        with pytest.raises(BlobStoreError) as info:
            load(blob_dir)
        message = str(info.value)
        assert message.startswith(f"{trunk_file}: checksum mismatch")
        assert f"re-run expertd convert MODEL_DIR {blob_dir}" in message

        flip_byte(trunk_file, offset)  # the control: restored, the same load works
        model, _ = load(blob_dir)
        model.expertd_session.close()


# Memory: the check reads a row (or 8 MiB) at a time, whatever the directory's size.

BIGGISH = dict(family="qwen3_moe", mode="none", dtype="bfloat16", layers=4, experts=16, top_k=4,
               hidden=512, moe_inter=512)  # about 100 MB of experts

MEMORY_PROBE = """
import json, resource, sys
from pathlib import Path

import tqdm, xxhash
from expertd.blobstore import DirectoryCheck

def peak_rss():
    kib_or_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib_or_bytes if sys.platform == "darwin" else kib_or_bytes * 1024

before = peak_rss()
check = DirectoryCheck(Path(sys.argv[1]))
faults = list(check.faults())
print(json.dumps({"before": before, "peak": peak_rss(), "faults": len(faults),
                  "total": check.total_bytes}))
"""


def test_memory_stays_small(tmp_path):
    blob_dir = tmp_path / "blobs"
    convert(synthesize(SynthConfig(**BIGGISH), tmp_path / "model"), blob_dir, progress=False)
    run = subprocess.run([PYTHON, "-c", MEMORY_PROBE, str(blob_dir)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rss = json.loads(run.stdout.strip().splitlines()[-1])
    assert rss["faults"] == 0
    assert rss["total"] > 90 * 2**20
    growth = rss["peak"] - rss["before"]
    assert growth < 32 * 2**20, f"verify grew by {growth / 2**20:.0f} MiB"
