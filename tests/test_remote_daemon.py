"""A lazy blob directory served by a real daemon: rows fetched by HTTP range on first use.

Exactness against resident mlx-lm, each routed expert fetched once however many clients want
it, and honest failure: a server killed mid-transfer, a truncated answer, a 500, a wrong byte
count; rows already present keep serving meanwhile, and the daemon's remote reads never hold
up another client. Every server is the suite's own (range_server.py) on 127.0.0.1.
"""

from collections import Counter

import pytest
from client_helpers import ROWS_ALL, ROWS_MEDIUM, client_flags, compare_runs, run_together
from conftest import flip_byte
from harness import SMALL_CACHE_GB, Daemon, RawClient, expected_bytes, expertd_cli, wait_until
from range_server import RangeServer, RangeServerProcess
from test_client_concurrency import MAX_TOKENS, PROMPT_LEN, solo_tokens
from test_client_parity import check_runs

from expertd.client import load
from expertd.errors import DaemonError
from expertd.manifest import Manifest
from expertd.protocol import Op
from expertd.tools.lazy import convert_lazy


def fetched_experts(manifest: Manifest, ranges: list) -> Counter:
    """How many times each ``(layer, expert)``'s bytes were asked for, per segment: an expert
    fetched once counts once for each of its layer's segments."""
    seen = Counter()
    for _, start, end in ranges:
        for layer in manifest.layers:
            for seg, (_, base) in zip(layer.segments, layer.sources):
                if base <= start < base + layer.num_experts * seg.nbytes:
                    first = (start - base) // seg.nbytes
                    for e in range(first, first + (end + 1 - start) // seg.nbytes):
                        seen[(layer.index, e)] += 1
    return seen


def test_streamed_from_a_lazy_directory_equals_resident(qwen, isolated_env, tmp_path):
    """Logits bit-identical to resident mlx-lm from an empty directory, and only the experts
    routed were fetched, each once (prefetch off: nothing is guessed)."""
    with RangeServer(qwen.model_dir) as server:
        out = tmp_path / "lazy"
        manifest = convert_lazy(server.url, out, progress=False)
        before = len(server.ranges())
        with Daemon(out, isolated_env, *client_flags(out, ROWS_ALL, tmp_path / "state")) as daemon:
            model, _ = load(out, prefetch="off", copy_ahead_bytes=0)
            session = model.expertd_session
            try:
                runs = compare_runs(qwen.resident, model, qwen.tokenizer.vocab_size)
            finally:
                session.close()
            stats = daemon.stats()
        ranges = server.ranges()[before:]
    check_runs(runs)
    remote = stats["remote"]
    total = sum(layer.num_experts for layer in manifest.layers)
    seen = fetched_experts(manifest, ranges)
    segments = len(manifest.layers[0].segments)
    assert set(seen.values()) == {segments}, "an expert was fetched twice"
    assert len(seen) == remote["rows_fetched"] == remote["rows_present"] == stats["misses"]
    assert remote["rows_present"] < total, "every expert was fetched: nothing shows laziness"
    assert remote["fetch_errors"] == 0 and stats["fill_errors"] == 0


def test_two_clients_fetch_each_row_once(qwen, isolated_env, tmp_path):
    """Two generate processes at once, prefetch on, evictions: tokens as resident mlx-lm's,
    and each expert's bytes crossed the network once."""
    seeds = [1, 2]
    expected = [solo_tokens(qwen.resident, seed) for seed in seeds]
    with RangeServer(qwen.model_dir) as server:
        out = tmp_path / "lazy"
        manifest = convert_lazy(server.url, out, progress=False)
        before = len(server.ranges())
        flags = client_flags(out, ROWS_MEDIUM, tmp_path / "state")
        with Daemon(out, isolated_env, *flags) as daemon:
            results = run_together(out, isolated_env, tmp_path / "run",
                                   [(PROMPT_LEN, seed) for seed in seeds], MAX_TOKENS,
                                   prefetch="on")
            stats = daemon.stats()
            status = expertd_cli("status", "--blobs", out)
        ranges = server.ranges()[before:]
    for want, got in zip(expected, results):
        assert got["error"] is None, got["error"]
        assert got["tokens"] == want
    seen = fetched_experts(manifest, ranges)
    assert set(seen.values()) == {len(manifest.layers[0].segments)}
    remote = stats["remote"]
    assert len(seen) == remote["rows_fetched"] == remote["rows_present"]
    assert stats["fills"] > stats["arena_rows"]  # evicted rows came back from the disk
    total = sum(layer.num_experts for layer in manifest.layers)
    assert f"remote       {remote['rows_present']}/{total} rows present" in status.stdout
    assert f"from {server.url}" in status.stdout


@pytest.mark.parametrize("mode,reason", [("500", "HTTP 500"), ("truncate", "ended after"),
                                         ("short", "announced")])
def test_a_failed_fetch_fails_the_demand_in_one_line(qwen, isolated_env, tmp_path, mode,
                                                       reason):
    want = expected_bytes(qwen.blob_dir)
    with RangeServer(qwen.model_dir) as server:
        out = tmp_path / "lazy"
        convert_lazy(server.url, out, progress=False)
        with Daemon(out, isolated_env, "--cache-gb", SMALL_CACHE_GB) as daemon, \
                RawClient(out) as client:
            assert client.fetch(0, [0, 1]) == [want[(0, 0)], want[(0, 1)]]
            server.fault(mode)
            with pytest.raises(DaemonError) as err:
                client.demand(1, [5])
            message = str(err.value)
            assert message.startswith("layer 1 expert 5 is not fetched yet and cannot fetch "
                                      f"{server.url}/model.safetensors bytes ")
            assert reason in message and "\n" not in message
            assert client.fetch(0, [0, 1]) == [want[(0, 0)], want[(0, 1)]]  # still served
            server.fault("none")
            assert client.fetch(1, [5]) == [want[(1, 5)]]  # the failure was not kept
            remote = daemon.stats()["remote"]
    assert remote["fetch_errors"] == 1 and remote["rows_present"] == 3


def test_a_server_killed_mid_transfer_and_back(qwen, isolated_env, tmp_path):
    want = expected_bytes(qwen.blob_dir)
    with RangeServerProcess(qwen.model_dir, tmp_path / "srv") as server:
        out = tmp_path / "lazy"
        convert_lazy(server.url, out, progress=False)
        with Daemon(out, isolated_env, "--cache-gb", SMALL_CACHE_GB) as daemon, \
                RawClient(out) as client:
            assert client.fetch(2, [3]) == [want[(2, 3)]]
            server.fault("die")  # half of the next answer, then SIGKILL
            with pytest.raises(DaemonError) as err:
                client.demand(2, [7, 8])
            assert server.proc.wait(30) == -9
            message = str(err.value)
            assert message.startswith("layer 2 expert 7 is not fetched yet and cannot fetch "
                                      f"{server.url}/model.safetensors")
            assert "\n" not in message
            assert client.fetch(2, [3]) == [want[(2, 3)]]
            with RangeServerProcess(qwen.model_dir, tmp_path / "srv2", port=server.port):
                assert client.fetch(2, [7, 8]) == [want[(2, 7)], want[(2, 8)]]
            assert daemon.stats()["remote"]["rows_present"] == 3


def test_a_stalled_fetch_holds_up_no_other_client(qwen, isolated_env, tmp_path):
    """While the remote server does not answer, rows on the disk keep filling for others."""
    want = expected_bytes(qwen.blob_dir)
    with RangeServer(qwen.model_dir) as server:
        out = tmp_path / "lazy"
        convert_lazy(server.url, out, progress=False)
        with Daemon(out, isolated_env, "--cache-gb", "0.0003") as daemon, \
                RawClient(out) as waiting, RawClient(out) as other:
            for e in range(16):  # on the disk now; the 10-row cache keeps only some of them
                assert other.fetch(0, [e]) == [want[(0, e)]]
            server.fault("stall")
            rid = waiting.conn.send(Op.DEMAND, {"layer": 1, "experts": [9]})
            for e in range(16):  # refilled from the disk while the fetch hangs
                assert other.fetch(0, [e]) == [want[(0, e)]]
            stats = daemon.stats()
            assert stats["remote"]["pending"] == 1 and stats["fills"] > 16
            server.fault("none")
            reply = waiting.conn.wait(rid, 60)
            assert waiting.row_bytes(reply["rows"][0], 1) == want[(1, 9)]
            waiting.release(reply["lease"])


def test_verify_checks_what_arrived_and_the_daemon_refuses_a_corrupt_row(qwen, isolated_env,
                                                                        tmp_path):
    want = expected_bytes(qwen.blob_dir)
    with RangeServer(qwen.model_dir) as server:
        out = tmp_path / "lazy"
        manifest = convert_lazy(server.url, out, progress=False)
        with Daemon(out, isolated_env, "--cache-gb", SMALL_CACHE_GB), RawClient(out) as client:
            assert client.fetch(0, [4, 6]) == [want[(0, 4)], want[(0, 6)]]
        total = sum(layer.num_experts for layer in manifest.layers)
        done = expertd_cli("verify", "--blobs", out, "-q")
        assert done.returncode == 0, done.stdout
        assert done.stdout.startswith(f"{out}: 2 of {total} experts fetched (a lazy "
                                      f"directory) in {len(manifest.layers)} layers and "
                                      f"{len(manifest.trunk)} trunk files: all match their "
                                      "checksums"), done.stdout
        flip_byte(out / manifest.layers[0].file, 6 * manifest.stride + 100)
        done = expertd_cli("verify", "--blobs", out, "-q")
        assert done.returncode == 1
        assert "checksum mismatch for layer 0 expert 6" in done.stdout
        with Daemon(out, isolated_env, "--cache-gb", SMALL_CACHE_GB), RawClient(out) as client:
            with pytest.raises(DaemonError, match="checksum mismatch for layer 0 expert 6"):
                client.demand(0, [6])
            assert client.fetch(0, [4]) == [want[(0, 4)]]


def test_the_daemon_checks_a_shards_sha256_once_every_row_arrived(qwen, isolated_env, tmp_path,
                                                                 monkeypatch):
    """From a repo id (the suite's server playing the Hub at HF_ENDPOINT): when the last row of
    the shard arrives, the shard rebuilt from the rows matches its LFS sha256."""
    import shutil

    root = tmp_path / "hub"
    shutil.copytree(qwen.model_dir, root / "tiny-org" / "tiny-moe")
    want = expected_bytes(qwen.blob_dir)
    with RangeServer(root) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        out = tmp_path / "lazy"
        done = expertd_cli("convert", "tiny-org/tiny-moe", out, "--lazy", "-q")
        assert done.returncode == 0, done.stderr
        manifest = Manifest.load(out)
        with Daemon(out, isolated_env, "--cache-gb", SMALL_CACHE_GB) as daemon, \
                RawClient(out) as client:
            for layer in manifest.layers:
                for first in range(0, layer.num_experts, 4):
                    experts = range(first, first + 4)
                    assert client.fetch(layer.index, experts) == \
                        [want[(layer.index, e)] for e in experts]
            # The check runs on its own thread, after the last row's demand was answered.
            wait_until(lambda: (daemon.stats()["remote"]["shards_checked"]
                                + daemon.stats()["remote"]["shard_faults"]) > 0, 10,
                       "the shard check")
            remote = daemon.stats()["remote"]
    assert remote["rows_present"] == remote["rows_total"]
    assert remote["shards_checked"] == 1 and remote["shard_faults"] == 0


def test_status_counts_rows_fetched_beside_the_daemon(qwen, isolated_env, tmp_path):
    """``expertd fetch --all`` in another process while the daemon serves: the daemon's count
    of present rows (status, STATS) follows the disk within a tick, and rows fetched there are
    read from the disk, not fetched again."""
    with RangeServer(qwen.model_dir) as server:
        out = tmp_path / "lazy"
        manifest = convert_lazy(server.url, out, progress=False)
        total = sum(layer.num_experts for layer in manifest.layers)
        with Daemon(out, isolated_env, *client_flags(out, ROWS_ALL, tmp_path / "s")) as daemon:
            client = RawClient(out)
            client.fetch(0, [0, 1])
            assert daemon.stats()["remote"]["rows_present"] == 2
            fetched = expertd_cli("fetch", "--blobs", out, "--all", "-q")
            assert fetched.returncode == 0, fetched.stderr
            wait_until(lambda: daemon.stats()["remote"]["rows_present"] == total, 30,
                       "the daemon to count the rows expertd fetch brought")
            status = expertd_cli("status", "--blobs", out)
            assert f"remote       {total}/{total} rows present" in status.stdout
            before = len(server.ranges())
            client.fetch(1, [2, 3])
            assert len(server.ranges()) == before  # read from the disk, not fetched again
            assert daemon.stats()["remote"]["rows_arrived"] == total - 2
