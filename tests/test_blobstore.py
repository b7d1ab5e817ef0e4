"""The blob store: validation that names the file and the fault, checksums, reads into buffers."""

import json
import mmap
import os
import re
import shutil
from contextlib import closing
from pathlib import Path

import pytest
from conftest import TINY, flip_byte, lm_head_offset, mounted
from harness import expertd_cli

from expertd.blobstore import BlobStore, trunk_faults
from expertd.errors import BlobStoreError, ChecksumError


def open_fds() -> int:
    return len(os.listdir("/dev/fd"))


def edit_manifest(blob_dir: Path, edit) -> Path:
    path = blob_dir / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def test_valid_directory_opens(blob_dir):
    store = BlobStore(blob_dir)
    try:
        assert len(store.layers) == TINY["layers"]
        assert all(layer.num_experts == TINY["experts"] for layer in store.layers)
        for layer in store.layers:
            size = (blob_dir / layer.file).stat().st_size
            assert size == layer.num_experts * store.stride
    finally:
        store.close()


@pytest.mark.parametrize("change", [-1, -4096, +1])
def test_blob_of_wrong_size(blob_dir, change):
    path = blob_dir / "layer-001.blob"
    size = path.stat().st_size
    os.truncate(path, size + change)
    fds = open_fds()
    with pytest.raises(BlobStoreError) as info:
        BlobStore(blob_dir)
    message = str(info.value)
    assert str(path) in message
    assert f"size {size + change} bytes, expected {size}" in message
    assert open_fds() == fds  # the blobs opened before the bad one are closed again


def test_missing_blob_file(blob_dir):
    path = blob_dir / "layer-002.blob"
    path.unlink()
    with pytest.raises(BlobStoreError, match="blob file of layer 2 is missing") as info:
        BlobStore(blob_dir)
    assert str(path) in str(info.value)


def test_missing_manifest(blob_dir):
    (blob_dir / "manifest.json").unlink()
    with pytest.raises(BlobStoreError, match="is not a blob directory") as info:
        BlobStore(blob_dir)
    assert str(blob_dir / "manifest.json") in str(info.value)
    assert "expertd convert" in str(info.value)  # says how to make one


def test_wrong_targets_are_named_for_what_they_are(models, tmp_path):
    """A file, a path that does not exist, and an mlx-lm checkpoint given where a blob
    directory belongs: each refused with what it is and what to do, on the command line too."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    checkpoint = models.model()
    cases = [(a_file, "is a file, not a directory"), (tmp_path / "nowhere", "does not exist"),
             (checkpoint, f"is an mlx-lm checkpoint, not a blob directory: run expertd convert "
                          f"first (expertd convert {checkpoint} BLOB_DIR)")]
    for target, message in cases:
        with pytest.raises(BlobStoreError, match=re.escape(message)):
            BlobStore(target)
        start = expertd_cli("start", "--blobs", target)
        assert start.returncode != 0 and message in start.stderr, start.stderr
        assert start.stderr.count("\n") == 1 and "Traceback" not in start.stderr


def test_missing_trunk(blob_dir):
    shutil.rmtree(blob_dir / "trunk")
    fds = open_fds()
    with pytest.raises(BlobStoreError, match="trunk model directory is missing") as info:
        BlobStore(blob_dir)
    assert str(blob_dir / "trunk") in str(info.value)
    assert open_fds() == fds


def test_manifest_not_json(blob_dir):
    path = blob_dir / "manifest.json"
    path.write_text(path.read_text()[:200])
    with pytest.raises(BlobStoreError, match="malformed manifest") as info:
        BlobStore(blob_dir)
    assert str(path) in str(info.value)


def _drop(key):
    return lambda data: data.pop(key)


def _set(key, value):
    return lambda data: data.update({key: value})


def _set_layer(index, key, value):
    return lambda data: data["layers"][index].update({key: value})


def _shorten_checksums(data):
    data["layers"][1]["checksums"].pop()


def _grow_segment(data):
    data["layers"][0]["segments"][0]["nbytes"] += 1


def _overlap_segments(data):
    segments = data["layers"][0]["segments"]
    segments[1]["offset"] = segments[0]["offset"]


@pytest.mark.parametrize("edit,expected", [
    pytest.param(_set("version", 1), "format version 1, this expertd reads versions 2 to 4; "
                 "re-run expertd convert", id="old-version"),
    pytest.param(_set("version", 5), "format version 5, this expertd reads versions 2 to 4; "
                 "upgrade expertd", id="newer-version"),
    pytest.param(_set("format", "something-else"), "not an expertd manifest", id="format"),
    pytest.param(_set("checksum", "md5"), "unknown checksum 'md5'", id="checksum"),
    pytest.param(_drop("layers"), "malformed manifest", id="no-layers"),
    pytest.param(_set("layers", []), "no MoE layers", id="empty-layers"),
    pytest.param(_set("stride", 17384), "stride 17384 is not a multiple of 16384", id="stride"),
    pytest.param(_set("stride", "big"), "malformed manifest", id="stride-type"),
    pytest.param(_shorten_checksums, "15 checksums for 16 experts", id="checksums"),
    pytest.param(_set_layer(0, "file", "../escape.blob"), "is not allowed", id="file-name"),
    pytest.param(_set_layer(1, "index", 5), "index 5 out of order", id="index"),
    pytest.param(_grow_segment, "size does not match its shape", id="segment-size"),
    pytest.param(_overlap_segments, "overlaps the one before it", id="segment-overlap"),
    pytest.param(_set_layer(0, "expert_bytes", 10 ** 9), "segments do not fit", id="too-big"),
])
def test_bad_manifest(blob_dir, edit, expected):
    path = edit_manifest(blob_dir, edit)
    with pytest.raises(BlobStoreError) as info:
        BlobStore(blob_dir)
    assert str(path) in str(info.value)
    assert expected in str(info.value)


@pytest.mark.parametrize("where", ["first", "last"])
def test_flipped_byte_fails_its_checksum_only(models, blob_dir, where):
    layer, expert = 1, 5
    clean = BlobStore(models.blobs())
    info = clean.layers[layer]
    at = 0 if where == "first" else info.expert_bytes - 1  # the checksum covers the whole row
    with open(blob_dir / info.file, "r+b") as f:
        f.seek(expert * clean.stride + at)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))

    store = BlobStore(blob_dir)
    try:
        with pytest.raises(ChecksumError) as exc:
            store.read_expert(layer, expert)
        assert (exc.value.layer, exc.value.expert) == (layer, expert)
        assert f"layer {layer} expert {expert}" in str(exc.value)
        assert str(blob_dir / info.file) in str(exc.value)

        corrupt = store.read_expert(layer, expert, verify=False)
        original = clean.read_expert(layer, expert)
        assert [i for i in range(len(original)) if corrupt[i] != original[i]] == [at]

        for other in store.layers:
            for e in range(other.num_experts):
                if (other.index, e) != (layer, expert):
                    assert store.read_expert(other.index, e) == clean.read_expert(other.index, e)
    finally:
        store.close()
        clean.close()


def test_read_into_caller_buffers_agree(blob_dir):
    buffered, direct = BlobStore(blob_dir), BlobStore(blob_dir, direct=True)
    try:
        stride = buffered.stride
        for layer in buffered.layers:
            for expert in (0, 7, layer.num_experts - 1):
                plain = bytearray(stride)
                assert buffered.read_into(layer.index, expert, plain) == stride
                with mmap.mmap(-1, stride) as page, mmap.mmap(-1, 2 * stride) as bigger:
                    buffered.read_into(layer.index, expert, page)
                    assert page[:] == plain
                    # Direct reads need page-aligned memory: mmap gives it.
                    assert direct.read_into(layer.index, expert, bigger) == stride
                    assert bigger[:stride] == plain
                    assert bigger[stride:] == bytes(stride)  # nothing written past the row
                    direct.verify(layer.index, expert, bigger)
                expected = buffered.read_expert(layer.index, expert)
                assert plain[:layer.expert_bytes] == expected
                assert direct.read_expert(layer.index, expert) == expected
                buffered.verify(layer.index, expert, plain)
    finally:
        buffered.close()
        direct.close()


def test_read_into_refuses_small_buffer(blob_dir):
    store = BlobStore(blob_dir)
    try:
        with pytest.raises(ValueError, match=f"at least {store.stride} bytes"):
            store.read_into(0, 0, bytearray(store.stride - 1))
    finally:
        store.close()


@pytest.mark.parametrize("layer,expert,expected", [
    (-1, 0, "layer -1 out of range"),
    (TINY["layers"], 0, f"layer {TINY['layers']} out of range"),
    (0, -1, "expert -1 out of range for layer 0"),
    (2, TINY["experts"], f"expert {TINY['experts']} out of range for layer 2"),
])
def test_out_of_range(blob_dir, layer, expert, expected):
    store = BlobStore(blob_dir)
    try:
        buf = bytearray(store.stride)
        with pytest.raises(IndexError, match=expected):
            store.read_into(layer, expert, buf)
        with pytest.raises(IndexError, match=expected):
            store.read_expert(layer, expert)
        with pytest.raises(IndexError, match=expected):
            store.verify(layer, expert, buf)
    finally:
        store.close()


# Manifests of the wrong shape: always a BlobStoreError naming the file, never another exception.

def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("text,expected", [
    pytest.param("[]", "expected a JSON object, found list", id="list"),
    pytest.param("null", "expected a JSON object, found null", id="null"),
    pytest.param('"manifest"', "expected a JSON object, found str", id="string"),
    pytest.param("7", "expected a JSON object, found int", id="number"),
    pytest.param("{}", "not an expertd manifest", id="empty-object"),
    pytest.param("", "not JSON", id="empty-file"),
    pytest.param("{\"format\": ", "not JSON", id="truncated"),
    pytest.param(_nested(100_000), "not JSON", id="deeply-nested"),
])
def test_manifest_of_the_wrong_shape(blob_dir, text, expected):
    path = blob_dir / "manifest.json"
    path.write_text(text)
    with pytest.raises(BlobStoreError) as info:
        BlobStore(blob_dir)
    assert str(info.value).startswith(f"{path}: ")
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_manifest_not_utf8(blob_dir):
    path = blob_dir / "manifest.json"
    path.write_bytes(b'{"format": "\xff\xfe"}')
    with pytest.raises(BlobStoreError, match="not JSON") as info:
        BlobStore(blob_dir)
    assert str(path) in str(info.value)


def _set_trunk_entry(name, value):
    return lambda data: data["trunk"].update({name: value})


@pytest.mark.parametrize("edit,expected", [
    pytest.param(_drop("stride"), "'stride' is missing", id="no-stride"),
    pytest.param(_drop("model_type"), "'model_type' is missing", id="no-model-type"),
    pytest.param(_drop("top_k"), "'top_k' is missing", id="no-top-k"),
    pytest.param(_drop("trunk"), "'trunk' is missing", id="no-trunk"),
    pytest.param(_set("top_k", "4"), "'top_k' must be an integer, not str", id="top-k-str"),
    pytest.param(_set("top_k", True), "'top_k' must be an integer, not bool", id="top-k-bool"),
    pytest.param(_set("stride", 16384.0), "'stride' must be an integer, not float",
                 id="stride-float"),
    pytest.param(_set("layers", {}), "'layers' must be a list, not dict", id="layers-dict"),
    pytest.param(_set("layers", None), "'layers' must be a list, not NoneType", id="layers-null"),
    pytest.param(_set("layers", [1, 2]), "layer 0: malformed manifest, expected a JSON object",
                 id="layer-int"),
    pytest.param(_set("model_type", ["qwen"]), "'model_type' must be a string", id="type-list"),
    pytest.param(_set_layer(0, "checksums", [1] * 16), "checksum 1 is not 16 hex digits",
                 id="checksum-int"),
    pytest.param(_set_layer(0, "checksums", ["zz" * 8] * 16), "is not 16 hex digits",
                 id="checksum-not-hex"),
    pytest.param(_set_layer(0, "segments", "abc"), "'segments' must be a list", id="segments"),
    pytest.param(lambda data: data["layers"][0]["segments"][0].update(shape=[1, "2"]),
                 "is not a list of sizes", id="shape"),
    pytest.param(_set_layer(2, "num_experts", None), "'num_experts' must be an integer",
                 id="num-experts"),
    pytest.param(_set("trunk", []), "'trunk' must be an object, not list", id="trunk-list"),
    pytest.param(_set_trunk_entry("model.safetensors", {"size": 1}), "'checksum' is missing",
                 id="trunk-no-checksum"),
    pytest.param(_set_trunk_entry("../escape", {"size": 1, "checksum": "0" * 16}),
                 "file name is not allowed", id="trunk-escape"),
    pytest.param(lambda data: data["trunk"].pop("config.json"), "lists no config.json",
                 id="trunk-no-config"),
])
def test_manifest_fields_of_the_wrong_type(blob_dir, edit, expected):
    path = edit_manifest(blob_dir, edit)
    with pytest.raises(BlobStoreError) as info:
        BlobStore(blob_dir)
    assert str(path) in str(info.value)
    assert expected in str(info.value)


# The trunk's checksums.

def test_clean_trunk_verifies(blob_dir):
    store = BlobStore(blob_dir)
    try:
        store.verify_trunk()
        names = {f.name for f in store.manifest.trunk}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    finally:
        store.close()


def test_one_flipped_byte_in_the_trunk_is_named(blob_dir):
    path = blob_dir / "trunk" / "model.safetensors"
    flip_byte(path, lm_head_offset(blob_dir))
    store = BlobStore(blob_dir)  # opening does not read the trunk: the client's load does
    try:
        with pytest.raises(BlobStoreError) as info:
            store.verify_trunk()
    finally:
        store.close()
    message = str(info.value)
    assert message.startswith(f"{path}: checksum mismatch")
    assert f"re-run expertd convert MODEL_DIR {blob_dir}" in message


@pytest.mark.parametrize("fault,expected", [
    ("missing", "trunk file is missing"),
    ("longer", "the manifest says"),
    ("unlisted", "not written by expertd convert"),
])
def test_trunk_faults_are_named(blob_dir, fault, expected):
    trunk = blob_dir / "trunk"
    if fault == "missing":
        path = trunk / "tokenizer.json"
        path.unlink()
    elif fault == "longer":
        path = trunk / "config.json"
        with open(path, "a") as f:
            f.write(" ")
    else:
        path = trunk / "model-00002-of-00002.safetensors"  # mlx-lm would load it too
        path.write_bytes(b"x")
    store = BlobStore(blob_dir)
    try:
        with pytest.raises(BlobStoreError, match=expected) as info:
            store.verify_trunk()
        assert str(path) in str(info.value)
    finally:
        store.close()


def test_dot_files_in_the_trunk_are_not_the_model(blob_dir):
    """A dot file (Finder's .DS_Store) in trunk/ is no fault; the same file without the dot,
    which mlx-lm might load, is one."""
    trunk = blob_dir / "trunk"
    (trunk / ".DS_Store").write_bytes(b"finder")
    store = BlobStore(blob_dir)
    try:
        assert list(trunk_faults(blob_dir, store.manifest)) == []
        store.verify_trunk()  # raises on any fault
        # The same file, its dot gone: the check does see unlisted files.
        (trunk / ".DS_Store").rename(trunk / "DS_Store")
        faults = list(trunk_faults(blob_dir, store.manifest))
        assert [(f.path, f.layer, f.expert) for f in faults] == [(trunk / "DS_Store", None, None)]
        assert "not written by expertd convert" in faults[0].message
        with pytest.raises(BlobStoreError, match="DS_Store: not written by expertd convert"):
            store.verify_trunk()
    finally:
        store.close()


# What the reads really are: direct, or buffered because a file system refused O_DIRECT.

@pytest.fixture
def ramfs(tmp_path):
    """A ramfs mount (which refuses O_DIRECT, unlike tmpfs since Linux 6.6), unmounted after."""
    with mounted(tmp_path / "ramfs", "ramfs") as where:
        yield where


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux only")
def test_io_mode_says_direct_when_the_file_system_takes_it(blob_dir):
    store = BlobStore(blob_dir, direct=True)
    try:
        assert (store.io_mode, store.direct, store.io_reason) == ("direct", True, "O_DIRECT")
    finally:
        store.close()


def test_io_mode_says_buffered_when_asked(blob_dir):
    store = BlobStore(blob_dir)
    try:
        assert (store.io_mode, store.direct) == ("buffered", False)
        assert store.io_reason == "buffered reads were asked for"
    finally:
        store.close()


def test_io_mode_says_buffered_when_o_direct_is_refused(models, ramfs):
    blob_dir = ramfs / "blobs"
    shutil.copytree(models.blobs(), blob_dir)
    store = BlobStore(blob_dir, direct=True)
    try:
        assert (store.io_mode, store.direct) == ("buffered", False)
        assert store.io_reason.startswith("O_DIRECT refused by the file system of ")
        assert str(blob_dir / "layer-000.blob") in store.io_reason
        # The reads still work, through the page cache.
        with closing(BlobStore(models.blobs())) as clean:
            assert store.read_expert(1, 3) == clean.read_expert(1, 3)
    finally:
        store.close()
