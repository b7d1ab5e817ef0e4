"""Remote checkpoints, without a daemon: HTTP range reads and their faults, coalescing, the
present record, ``expertd convert --lazy`` (from a base URL and from a Hugging Face repo id)
and ``expertd fetch`` (resumed after a real SIGKILL).

Every server is the suite's own (range_server.py) on 127.0.0.1; nothing reaches the internet.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from harness import expected_bytes, expertd_cli, wait_until
from range_server import COMMIT, RangeServer, RangeServerProcess

from expertd.blobstore import BlobStore
from expertd.errors import RemoteError
from expertd.manifest import Manifest
from expertd.present import RECORD, PresentRecords, record_path
from expertd.remote import FetchSettings, RangeReader, merge_ranges, runs
from expertd.rowfetch import RowFetcher
from expertd.tools.lazy import convert_lazy

QUICK = FetchSettings(attempts=2, backoff=0.0, timeout=30.0)


@pytest.fixture
def data_server(tmp_path):
    """A server of one 1 MiB file of known bytes: ``(server, bytes)``."""
    data = os.urandom(1 << 20)
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "blob.bin").write_bytes(data)
    with RangeServer(tmp_path / "www") as server:
        yield server, data


@pytest.fixture(scope="module")
def served_model(models):
    """The tiny qwen3_moe model served over HTTP: ``(server, model_dir, full blob_dir)``."""
    model_dir = models.model(family="qwen3_moe", mode="affine", bits=4)
    with RangeServer(model_dir) as server:
        yield server, model_dir, models.blobs(family="qwen3_moe", mode="affine", bits=4)


def present_count(blob_dir, manifest) -> int:
    records = PresentRecords(blob_dir, manifest.layers)
    records.close()  # read into memory
    return records.count()


def test_ranges_come_back_exact_on_one_kept_alive_connection(data_server):
    server, data = data_server
    reader = RangeReader(QUICK)
    url = f"{server.url}/blob.bin"
    try:
        for start, length in [(0, 8), (1000, 4096), (len(data) - 10, 10), (5, 1)]:
            assert reader.read(url, start, length) == data[start:start + length]
        head, size = reader.head(url, 8)
        assert head == data[:8] and size == len(data)
        assert reader.get(url) == data
        assert reader.get(f"{server.url}/nothing.bin") is None
        assert reader.counters["retries"] == 0 and reader.counters["requests"] == 7
    finally:
        reader.close()


FAULTS = [("truncate", "the response ended after"), ("500", "HTTP 500"),
          ("short", "announced"), ("die", "")]


@pytest.mark.parametrize("mode,reason", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_fault_once_is_retried_and_for_good_names_the_url(data_server, mode, reason):
    server, data = data_server
    url = f"{server.url}/blob.bin"
    reader = RangeReader(QUICK)
    try:
        server.fault(mode, times=1)
        assert reader.read(url, 4096, 65536) == data[4096:4096 + 65536]
        assert reader.counters["retries"] == 1
        server.fault(mode)
        with pytest.raises(RemoteError) as err:
            reader.read(url, 4096, 65536)
    finally:
        reader.close()
    message = str(err.value)
    assert f"{url} bytes 4096-69631" in message and reason in message
    assert "after 2 attempts" in message and "\n" not in message


def test_a_stalled_server_times_out(data_server):
    server, _ = data_server
    reader = RangeReader(FetchSettings(attempts=1, timeout=0.2))
    server.fault("stall")
    try:
        with pytest.raises(RemoteError, match="timed out"):
            reader.read(f"{server.url}/blob.bin", 0, 100)
    finally:
        server.fault("none")
        reader.close()


def test_a_server_without_ranges_is_refused_at_once(data_server):
    server, _ = data_server
    reader = RangeReader(QUICK)
    server.fault("ignore-range")
    try:
        with pytest.raises(RemoteError, match="ignores Range requests"):
            reader.read(f"{server.url}/blob.bin", 100, 100)
        with pytest.raises(RemoteError, match="not found"):
            reader.read(f"{server.url}/nothing.bin", 0, 100)
    finally:
        reader.close()
    assert reader.counters["retries"] == 0  # neither is worth a retry


def test_coalescing_runs_and_merges():
    assert runs([7, 1, 2, 3, 4, 5, 9, 8], 4) == [[1, 2, 3, 4], [5], [7, 8, 9]]
    assert runs([3], 1) == [[3]]
    merged = merge_ranges([("b", 0, 10, "x"), ("a", 10, 5, "z"), ("a", 0, 10, "y"),
                           ("a", 20, 1, "w")])
    assert merged == [("a", 0, 15, [(0, 10, "y"), (10, 5, "z")]), ("a", 20, 1, [(0, 1, "w")]),
                      ("b", 0, 10, [(0, 10, "x")])]


def test_lazy_convert_writes_sparse_blobs_and_the_trunk(served_model, tmp_path):
    server, model_dir, full = served_model
    before = len(server.requests)
    out = tmp_path / "lazy"
    manifest = convert_lazy(server.url, out, progress=False)
    whole = Manifest.load(full)
    assert manifest.remote.source == server.url and manifest.remote.repo is None
    assert [(l.num_experts, l.segments) for l in manifest.layers] == \
        [(l.num_experts, l.segments) for l in whole.layers]
    assert manifest.stride == whole.stride
    for layer in manifest.layers:
        blob = out / layer.file
        assert blob.stat().st_size == layer.num_experts * manifest.stride
        assert blob.stat().st_blocks == 0  # sparse: no row written
        assert record_path(out, layer).read_bytes() == bytes(layer.num_experts * RECORD.size)
    store = BlobStore(out)
    try:
        assert store.lazy and store.records.count() == 0
        store.verify_trunk()
    finally:
        store.close()
    # Only headers, small files and trunk weights: no byte of an expert row.
    expert_spans = [(s, s + l.num_experts * seg.nbytes)
                    for l in manifest.layers for seg, (_, s) in zip(l.segments, l.sources)]
    for _, start, end in server.ranges()[before:]:
        assert not any(a <= start < b for a, b in expert_spans), (start, end)


def test_fetched_rows_equal_a_full_conversion_coalesced(served_model, tmp_path):
    server, _, full = served_model
    out = tmp_path / "lazy"
    manifest = convert_lazy(server.url, out, progress=False)
    before = len(server.ranges())
    records = PresentRecords(out, manifest.layers, writable=True)
    fetcher = RowFetcher(out, manifest, records, RangeReader(QUICK))
    try:
        layer = manifest.layers[1]
        for run in runs(range(layer.num_experts), 4):
            fetcher.fetch(1, run[0], len(run))
    finally:
        fetcher.reader.close()
        fetcher.close()
        records.close()
    runs_of_4 = layer.num_experts // 4
    assert len(server.ranges()) - before == runs_of_4 * len(layer.segments)
    assert fetcher.counters["fetch_requests"] == runs_of_4 * len(layer.segments)
    whole = Manifest.load(full)
    again = PresentRecords(out, manifest.layers)
    try:
        assert again.count(1) == layer.num_experts and again.count() == layer.num_experts
        assert [again.checksum(1, e) for e in range(layer.num_experts)] == \
            list(whole.layers[1].checksums)
    finally:
        again.close()
    want = expected_bytes(full)
    store = BlobStore(out)
    try:
        for e in range(layer.num_experts):
            assert store.read_expert(1, e) == want[(1, e)]
    finally:
        store.close()


def test_a_torn_record_reads_as_absent(served_model, tmp_path):
    server, _, _ = served_model
    out = tmp_path / "lazy"
    manifest = convert_lazy(server.url, out, progress=False)
    records = PresentRecords(out, manifest.layers, writable=True)
    fetcher = RowFetcher(out, manifest, records, RangeReader(QUICK))
    try:
        fetcher.fetch(0, 3, 2)
        assert records.present(0, 3) and records.present(0, 4)
        # Half a record written (8 bytes of the 16): the tag no longer matches.
        with open(record_path(out, manifest.layers[0]), "r+b") as f:
            f.seek(4 * RECORD.size)
            f.write(b"\x01" * 8)
        assert not records.refresh(0, 4) and records.refresh(0, 3)
    finally:
        fetcher.reader.close()
        fetcher.close()
        records.close()


def test_fetch_resumes_after_a_sigkill_mid_transfer(served_model, tmp_path):
    """A fetch killed mid-transfer keeps the rows written before; the next one fetches only
    the rest, and the directory verifies."""
    _, model_dir, full = served_model
    with RangeServerProcess(model_dir, tmp_path / "srv") as server:
        out = tmp_path / "lazy"
        convert_lazy(server.url, out, progress=False)
        manifest = Manifest.load(out)
        total = sum(l.num_experts for l in manifest.layers)
        server.fault("stall")  # every range request from now on hangs
        proc = subprocess.Popen([sys.executable, "-m", "expertd", "fetch", "--blobs", str(out),
                                 "-q", "--connections", "1"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = len(server.ranges())
            wait_until(lambda: len(server.ranges()) > first, 60, "the fetch to ask for a row")
            # Let 2 runs through, then the next request hangs: the kill lands mid-transfer.
            server.fault("none")
            wait_until(lambda: present_count(out, manifest) >= 8, 60, "two runs of rows to arrive")
            before = len(server.requests())
            server.fault("stall")
            wait_until(lambda: any(r["fault"] == "stall" for r in server.requests()[before:]),
                       60, "a request to hang")
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        server.fault("none")
        kept = PresentRecords(out, manifest.layers)
        kept.close()  # read into memory
        present = {(l.index, e) for l in manifest.layers for e in range(l.num_experts)
                   if kept.present(l.index, e)}
        assert 8 <= len(present) < total
        verify = expertd_cli("verify", "--blobs", out, "-q")
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert f": {len(present)} of {total} experts fetched (a lazy directory) in " \
            in verify.stdout, verify.stdout
        seen = len(server.ranges())
        done = expertd_cli("fetch", "--blobs", out, "-q")
        assert done.returncode == 0, done.stderr
        assert f"fetched {total - len(present)} rows" in done.stdout
        assert f"{total}/{total} rows present" in done.stdout
        # The resumed fetch asked for no row that had arrived.
        starts = {(l.index, e): [s + e * seg.nbytes for seg, (_, s) in zip(l.segments, l.sources)]
                  for l in manifest.layers for e in range(l.num_experts)}
        asked = {start for _, start, _ in server.ranges()[seen:]}
        assert not any(set(starts[key]) & asked for key in present)
    want = expected_bytes(full)
    assert expected_bytes(out) == want


def test_lazy_convert_of_a_hub_repo_checks_the_published_sha256(served_model, tmp_path,
                                                                 monkeypatch):
    """A repo id resolved by huggingface_hub against HF_ENDPOINT (the suite's server playing
    the Hub): the commit is pinned, and once every row has arrived each shard is checked
    against its LFS sha256."""
    _, model_dir, full = served_model
    root = tmp_path / "hub"
    shutil.copytree(model_dir, root / "tiny-org" / "tiny-moe")
    with RangeServer(root) as hub:
        for key, value in {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"),
                           "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_test_token_not_real"}.items():
            monkeypatch.setenv(key, value)  # the children inherit them
        out = tmp_path / "lazy"
        done = expertd_cli("convert", "tiny-org/tiny-moe", out, "--lazy", "-q")
        assert done.returncode == 0, done.stderr
        remote = json.loads((out / "manifest.json").read_text())["remote"]
        assert remote["repo"] == "tiny-org/tiny-moe" and remote["revision"] == COMMIT
        shard = remote["files"]["model.safetensors"]
        assert shard["url"] == f"{hub.url}/tiny-org/tiny-moe/resolve/{COMMIT}/model.safetensors"
        assert shard["sha256"]
        done = expertd_cli("fetch", "--blobs", out, "-q")
        assert done.returncode == 0, done.stderr
        assert "1 shards match their published sha256" in done.stdout
    assert expected_bytes(out) == expected_bytes(full)


def test_a_failed_lazy_convert_leaves_nothing_behind(served_model, tmp_path):
    server, _, _ = served_model
    out = tmp_path / "lazy"
    server.fault("500")
    try:
        with pytest.raises(RemoteError, match=f"cannot fetch {server.url}/"):
            convert_lazy(server.url, out, progress=False, settings=QUICK)
    finally:
        server.fault("none")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_url_needs_lazy_and_a_lazy_stage_fetches_its_own_layers(served_model, tmp_path):
    server, _, full = served_model
    done = expertd_cli("convert", server.url, tmp_path / "whole")
    assert done.returncode == 1 and "convert it with --lazy" in done.stderr
    out = tmp_path / "stage"
    manifest = convert_lazy(server.url, out, progress=False, layers="1:3")
    assert str(manifest.stage) == "1:3" and len(manifest.layers) == 2
    done = expertd_cli("fetch", "--blobs", out, "-q", "--layers", "1:2")
    assert done.returncode == 0, done.stderr
    assert "16/32 rows present" in done.stdout
    records = PresentRecords(out, manifest.layers)
    records.close()
    assert records.count(0) == 0 and records.count(1) == 16
    whole = expected_bytes(full)
    store = BlobStore(out)
    try:  # the stage's MoE layer 1 is the model's layer 2
        assert [store.read_expert(1, e) for e in range(16)] == [whole[(2, e)] for e in range(16)]
    finally:
        store.close()


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["layers"][0]["sources"].pop(), "sources for"),
    (lambda m: m["layers"][1]["sources"][0].__setitem__(1, 10**12), "outside the remote file"),
    (lambda m: m["remote"]["files"].clear(), "outside the remote file"),
    (lambda m: m["layers"][0]["sources"].__setitem__(0, "x"), r"is not \[file, offset\]"),
], ids=["missing-source", "past-the-end", "no-file", "malformed"])
def test_a_malformed_lazy_manifest_is_refused(served_model, tmp_path, edit, message):
    from expertd.errors import BlobStoreError

    server, _, _ = served_model
    out = tmp_path / "lazy"
    convert_lazy(server.url, out, progress=False)
    data = json.loads((out / "manifest.json").read_text())
    assert data["version"] == 4
    edit(data)
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BlobStoreError, match=message):
        Manifest.load(out)
