"""Invariant 1 (exactness) and 7 (client memory) end to end: a real daemon, a real client.

Every family of conftest.FAMILY_MODES, prompts of 1, 17 and 300 tokens plus 20 greedy decode
steps, caches from fewer rows than one layer has experts (layers run in groups) to every expert
resident; logits must be bit-identical to mlx-lm with the whole model resident.
"""

import gc

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from client_helpers import (ROWS_ALL, ROWS_TINY, client_flags, compare_runs, prompt_ids,
                            routed_model)
from conftest import FAMILY_MODES
from harness import Daemon, finish_client, spawn_client
from expertd.client import load
from expertd.errors import DaemonNotRunning
from expertd.manifest import Manifest

FAMILY_IDS = [f"{family}-{mode}{bits}" for family, mode, bits in FAMILY_MODES]

_resident = {}


def resident_model(model_dir):
    """mlx-lm's own load of the full checkpoint (cached: it is only read)."""
    if model_dir not in _resident:
        _resident[model_dir] = mlx_lm.load(str(model_dir))[0]
    return _resident[model_dir]


def expert_keys(manifest: Manifest) -> set:
    return {f"{layer.module}.{seg.name}" for layer in manifest.layers for seg in layer.segments}


def check_runs(runs: list) -> None:
    for run in runs:
        assert run["mismatch"] is None, (
            f"prompt of {run['length']} tokens: streamed logits differ from resident ones at "
            f"step {run['mismatch']} (0 = the prompt)")
        assert run["ref_digest"] == run["got_digest"]
        assert run["steps"] == 21


# Prefetch on runs every path prefetch off does, and more (the first MoE layer and the prompt
# are never guessed): "off" runs once, at the cache size where its demands and groups differ.
@pytest.mark.parametrize("rows,prefetch", [
    (ROWS_TINY, "on"), (ROWS_ALL, "on"), pytest.param(ROWS_TINY, "off", marks=pytest.mark.once)],
    ids=["8rows-on", "all-rows-on", "8rows-off"])
@pytest.mark.parametrize("family_mode", FAMILY_MODES, ids=FAMILY_IDS)
def test_streamed_logits_equal_resident(models, isolated_env, tmp_path, family_mode, rows,
                                        prefetch):
    model_dir, blob_dir = routed_model(models, *family_mode)
    manifest = Manifest.load(blob_dir)
    every_expert = sum(layer.num_experts for layer in manifest.layers)
    flags = client_flags(blob_dir, rows, tmp_path / "state.json")
    with Daemon(blob_dir, isolated_env, *flags) as daemon:
        expected_rows = min(rows, every_expert)
        assert daemon.ready["arena_rows"] == expected_rows
        # Tiny rows: copy them ahead anyway, so the copier's path is what is checked.
        model, tokenizer = load(blob_dir, prefetch=prefetch, copy_ahead_bytes=0)
        session = model.expertd_session
        try:
            runs = compare_runs(resident_model(model_dir), model, tokenizer.vocab_size)
        finally:
            session.close()
        stats = daemon.stats()
    check_runs(runs)
    if prefetch == "on":
        # Guesses were made for every layer but the first, and their rows were used: copied
        # ahead by the copier where they fit one group, read ahead into side rows otherwise.
        guessed = [p["guessed"] for p in session.prediction()[1:]]
        assert all(guessed), guessed
        if rows == ROWS_ALL:
            assert session.counters["staged_used"] > 0
        else:
            assert stats["prefetch_fills"] > 0 and stats["prefetch_hits"] > 0
    else:
        assert session.counters["prefetch_asked"] == stats["prefetch_requested"] == 0
    if rows == ROWS_TINY:
        # The grouped path really ran, and rows were evicted and refilled.
        assert session.max_group < min(layer.num_experts for layer in manifest.layers)
        assert stats["fills"] > stats["arena_rows"]
    else:
        # Everything fits: each expert is read at most once (by a demand or a prefetch).
        assert stats["fills"] <= every_expert
        assert stats["fills"] == stats["misses"] + stats["prefetch_fills"]
    assert stats["fill_errors"] == 0


@pytest.mark.slow
# Every expert resident is make test's pure-Python pass's (test_streamed_logits_equal_resident);
# this keeps the twins' demand and eviction paths in a Cython-only run as well.
@pytest.mark.parametrize("rows", [ROWS_TINY], ids=["8rows"])
@pytest.mark.parametrize("family_mode", FAMILY_MODES, ids=FAMILY_IDS)
def test_pure_python_twin_logits_equal_resident(models, isolated_env, tmp_path, family_mode,
                                                rows):
    """The same comparison, prefetch on, in a client process that runs the pure-Python twins."""
    model_dir, blob_dir = routed_model(models, *family_mode)
    out = tmp_path / "parity.json"
    with Daemon(blob_dir, isolated_env,
                *client_flags(blob_dir, rows, tmp_path / "state.json")) as daemon:
        proc = spawn_client("parity", "--blobs", blob_dir, "--model", model_dir, "--out", out,
                            "--prefetch", "on", "--copy-ahead-bytes", "0", env=isolated_env,
                            pure=True)
        result = finish_client(proc, out, timeout=120)
        stats = daemon.stats()
    assert result["implementation"] == "python"
    check_runs(result["runs"])
    assert all(p["guessed"] for p in result["prediction"][1:])
    if rows == ROWS_TINY:
        assert result["counters"]["demanded"] > 0
        assert stats["fills"] > stats["arena_rows"]
        assert stats["prefetch_hits"] > 0
    else:
        assert result["counters"]["staged_used"] > 0
    # And the same tokens as this process's own resident run.
    resident = resident_model(model_dir)
    for run in result["runs"]:
        ids = mx.array([prompt_ids(run["length"], resident.args.vocab_size)])
        assert run["tokens"][0] == mx.argmax(resident(ids)[:, -1, :], axis=-1).item()


@pytest.mark.parametrize("family_mode", FAMILY_MODES, ids=FAMILY_IDS)
def test_generate_and_stream_generate_match_resident(models, isolated_env, tmp_path,
                                                     family_mode):
    model_dir, blob_dir = routed_model(models, *family_mode)
    resident, tokenizer = mlx_lm.load(str(model_dir))
    prompt = "Once upon a time there was a small model"
    flags = client_flags(blob_dir, ROWS_TINY, tmp_path / "state.json")
    with Daemon(blob_dir, isolated_env, *flags):
        model, streamed_tokenizer = load(blob_dir)
        try:
            text = mlx_lm.generate(model, streamed_tokenizer, prompt, max_tokens=24)
            stream = [(r.text, r.token) for r in
                      mlx_lm.stream_generate(model, streamed_tokenizer, prompt, max_tokens=24)]
        finally:
            model.expertd_session.close()
    assert text == mlx_lm.generate(resident, tokenizer, prompt, max_tokens=24)
    assert stream == [(r.text, r.token) for r in
                      mlx_lm.stream_generate(resident, tokenizer, prompt, max_tokens=24)]
    assert stream, "no token generated"


def test_load_without_daemon_says_how_to_start_one(models, isolated_env):
    blob_dir = models.blobs(family="qwen3_moe", mode="affine", bits=4)
    with pytest.raises(DaemonNotRunning, match="expertd start --blobs") as info:
        load(blob_dir)
    assert str(blob_dir.resolve()) in str(info.value)


def test_load_after_daemon_was_killed_says_how_to_start_one(models, isolated_env, tmp_path):
    """A daemon killed with SIGKILL leaves its socket file behind: still "not running"."""
    blob_dir = models.blobs(family="qwen3_moe", mode="affine", bits=4)
    with Daemon(blob_dir, isolated_env,
                *client_flags(blob_dir, ROWS_TINY, tmp_path / "state.json")) as daemon:
        daemon.kill()
        with pytest.raises(DaemonNotRunning, match="expertd start --blobs"):
            load(blob_dir)


def test_client_holds_no_expert_memory(models, isolated_env, tmp_path):
    """Invariant 7, client side: two staging buffers whose size does not depend on the model,
    shared by every layer, and no expert array kept by the model between calls."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    manifest = Manifest.load(blob_dir)
    keys = expert_keys(manifest)
    flags = client_flags(blob_dir, ROWS_ALL, tmp_path / "state.json")
    with Daemon(blob_dir, isolated_env, *flags):
        model, tokenizer = load(blob_dir)
        session = model.expertd_session
        try:
            assert not keys & dict(tree_flatten(model.parameters())).keys()
            streamed = [m for _, m in model.named_modules() if "_expertd" in m.__dict__]
            assert len(streamed) == len(manifest.layers)
            stagings = {id(m.__dict__["_expertd"].staging) for m in streamed}
            assert len(stagings) == 1, "every layer should share the one staging pair"
            staging = streamed[0].__dict__["_expertd"].staging
            # The bound is the client's own (64 or 4 x top-k experts), whatever the model size.
            assert session.max_group <= max(64, 4 * manifest.top_k)
            largest = max(layer.expert_bytes for layer in manifest.layers)
            segments = max(len(layer.segments) for layer in manifest.layers)
            assert staging.nbytes <= session.max_group * largest + 64 * segments

            ids = mx.array([prompt_ids(300, tokenizer.vocab_size)])
            mx.eval(model(ids))  # warm-up: the staging buffers and MLX's own are allocated
            assert len(staging.buffers) == 2
            assert all(buf.array.nbytes == staging.nbytes for buf in staging.buffers)
            gc.collect()
            mx.clear_cache()
            before = mx.get_active_memory()
            logits = model(ids)
            mx.eval(logits)
            del logits
            gc.collect()
            after = mx.get_active_memory()
            assert not keys & dict(tree_flatten(model.parameters())).keys()
            for module in streamed:
                for child, attr, *_ in module.__dict__["_expertd"].segments:
                    assert attr not in child, f"{attr} kept between calls"
            # A second forward allocates no more expert memory than the first one did.
            assert after - before <= staging.nbytes, (before, after)
        finally:
            session.close()
