"""The blob store: validation that names the file and the fault, checksums, reads into buffers."""

import json
import mmap
import os
import shutil
from pathlib import Path

import pytest

from conftest import TINY
from expertd.blobstore import BlobStore
from expertd.errors import BlobStoreError, ChecksumError


@pytest.fixture
def blob_dir(models, tmp_path) -> Path:
    """A private copy of the tiny model's blob directory, free to corrupt."""
    out = tmp_path / "blobs"
    shutil.copytree(models.blobs(), out)
    return out.resolve()


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
    pytest.param(_set("version", 2), "format version 2, this expertd reads version 1",
                 id="version"),
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
