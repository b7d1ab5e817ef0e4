"""Invariant 1 (exactness) and 7 (client memory) end to end: a real daemon, a real client.

Every family of conftest.FAMILY_MODES, prompts of 1, 17 and 300 tokens plus 20 greedy decode
steps, caches from fewer rows than one layer has experts (layers run in groups) to every expert
resident; logits must be bit-identical to mlx-lm with the whole model resident.
"""

import gc
import os

import mlx.core as mx
import mlx_lm
import pytest
from client_helpers import (
    PROMPT_LENGTHS,
    ROWS_ALL,
    ROWS_MEDIUM,
    ROWS_TINY,
    client_flags,
    compare_runs,
    pool_gb,
    prompt_ids,
    require_repeatable,
    routed_model,
)
from conftest import FAMILY_MODES
from harness import Daemon, expertd_cli, finish_client, query_stats, spawn_client, wait_until
from mlx.utils import tree_flatten

from expertd.client import load
from expertd.client.runtime import Runtime
from expertd.client.switch import StreamedSwitch
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
    require_repeatable(resident_model(model_dir), max(PROMPT_LENGTHS))
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
            assert session.all_counters()["ahead_used"] > 0
        else:
            assert stats["prefetch_fills"] > 0 and stats["prefetch_hits"] > 0
    else:
        assert session.counters["prefetch_asked"] == stats["prefetch_requested"] == 0
    if rows == ROWS_TINY:
        # Calls routed to more experts than the pools hold, and rows were evicted and refilled.
        assert max(p.rows for p in session.pools) < min(l.num_experts for l in manifest.layers)
        assert stats["fills"] > stats["arena_rows"]
    else:
        # Everything fits: each expert is read at most once (by a demand or a prefetch).
        assert stats["fills"] <= every_expert
        assert stats["fills"] == stats["misses"] + stats["prefetch_fills"]
    assert stats["fill_errors"] == 0


# Pools from the smallest that works (top-k rows a layer) to every expert, on both backings:
# rows the host writes into (unified memory) and rows MLX scatters into (a discrete GPU's).
POOLS = [(4, "host"), (4, "device"), (10, "device"), (16, "host")]


# Every family at the smallest pool (both passes); one family at the other sizes and backings
# (the Cython pass).
POOL_CASES = [pytest.param(family_mode, 4, "host", id=f"{name}-4rows-host")
              for family_mode, name in zip(FAMILY_MODES, FAMILY_IDS)] + [
    pytest.param(FAMILY_MODES[0], rows, backing, marks=pytest.mark.once,
                 id=f"{FAMILY_IDS[0]}-{rows}rows-{backing}") for rows, backing in POOLS[1:]]


@pytest.mark.parametrize("family_mode,pool_rows,backing", POOL_CASES)
def test_every_pool_size_and_backing_is_exact(models, isolated_env, tmp_path, family_mode,
                                              pool_rows, backing):
    """Arena of 24 rows (evictions), prefetch on (rows written ahead into the pools)."""
    model_dir, blob_dir = routed_model(models, *family_mode)
    manifest = Manifest.load(blob_dir)
    flags = client_flags(blob_dir, ROWS_MEDIUM, tmp_path / "state.json")
    with Daemon(blob_dir, isolated_env, *flags):
        model, tokenizer = load(blob_dir, prefetch="on", copy_ahead_bytes=0,
                                pool_gb=pool_gb(blob_dir, pool_rows), pool_backing=backing)
        session = model.expertd_session
        try:
            assert [p.rows for p in session.pools] == [
                min(pool_rows, layer.num_experts) for layer in manifest.layers]
            runs = compare_runs(resident_model(model_dir), model, tokenizer.vocab_size)
            counters = session.all_counters()
        finally:
            session.close()
    check_runs(runs)
    assert counters["pool_moved"] > 0 and counters["pool_hits"] > 0
    if pool_rows < manifest.layers[0].num_experts:
        assert counters["ahead"] > 0, counters  # guesses were written into the pools


@pytest.mark.slow
# Every expert resident is make test's pure-Python pass's (test_streamed_logits_equal_resident);
# this keeps the twins' demand and eviction paths in a Cython-only run as well.
@pytest.mark.parametrize("rows", [ROWS_TINY], ids=["8rows"])
@pytest.mark.parametrize("family_mode", FAMILY_MODES, ids=FAMILY_IDS)
def test_pure_python_twin_logits_equal_resident(models, isolated_env, tmp_path, family_mode,
                                                rows):
    """The same comparison, prefetch on, in a client process that runs the pure-Python twins."""
    model_dir, blob_dir = routed_model(models, *family_mode)
    require_repeatable(resident_model(model_dir), max(PROMPT_LENGTHS))
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
        assert result["counters"]["ahead_used"] > 0
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


def test_device_pools_move_rows_through_one_host_buffer(models, isolated_env, tmp_path):
    """The host memory that device pools' moves go through is one buffer for the model, of at
    most one move's rows, not a buffer per layer (gigabytes on a 48-layer model)."""
    from expertd.client.backing import buffer_bytes

    _, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL,
                                                      tmp_path / "state.json")):
        model, tokenizer = load(blob_dir, pool_backing="device")
        session = model.expertd_session
        try:
            mx.eval(model(mx.array([prompt_ids(40, tokenizer.vocab_size)])))
            backings = [pool.backing for pool in session.pools]
            assert len({id(b.staging) for b in backings}) == 1
            biggest = max(buffer_bytes(b.batch, b.nbytes) for b in backings)
            assert 0 < backings[0].staging.nbytes <= biggest
        finally:
            session.close()


def test_client_expert_memory_is_its_pools(models, isolated_env, tmp_path):
    """Invariant 7, client side: the client's expert memory is its pools, within the budget it
    was given and reported to the daemon; the model holds no expert array between calls, and a
    forward allocates no expert memory beyond the pools."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    manifest = Manifest.load(blob_dir)
    keys = expert_keys(manifest)
    budget = pool_gb(blob_dir, 6)
    flags = client_flags(blob_dir, ROWS_ALL, tmp_path / "state.json")
    with Daemon(blob_dir, isolated_env, *flags) as daemon:
        model, tokenizer = load(blob_dir, pool_gb=budget)
        session = model.expertd_session
        try:
            assert not keys & dict(tree_flatten(model.parameters())).keys()
            # Installed in place, not changed in class: the model is still of mlx-lm's class,
            # a StreamedSwitch sits at each switch's path, and every other parameter keeps
            # mlx-lm's path.
            resident = mlx_lm.load(str(model_dir))[0]
            assert isinstance(model, type(resident)) and type(model) is not type(resident)
            streamed = [m for _, m in model.named_modules() if isinstance(m, StreamedSwitch)]
            assert sorted(p for p, m in model.named_modules() if isinstance(m, StreamedSwitch)
                          ) == sorted(layer.module for layer in manifest.layers)
            assert set(dict(tree_flatten(model.parameters()))) == set(
                dict(tree_flatten(resident.parameters()))) - keys
            assert {id(m.layer) for m in streamed} == {id(la) for la in session.steps.layers}
            # The loader built the runtime in one piece: the session (the daemon's side) holds
            # none of the model's parts.
            assert isinstance(session, Runtime) and session.layers == session.steps.layers
            assert not any(hasattr(session.session, name)
                           for name in ("pools", "steps", "guessers", "layers"))
            assert len(streamed) == len(manifest.layers) == len(session.pools)
            assert [pool.rows for pool in session.pools] == [6] * len(manifest.layers)
            assert session.pool_bytes == sum(pool.nbytes for pool in session.pools)
            assert session.pool_bytes <= budget * 2**30
            assert [(c["pid"], c["pool_bytes"]) for c in daemon.stats()["client_pools"]] == [
                (os.getpid(), session.pool_bytes)]
            status = expertd_cli("status", "--blobs", blob_dir)
            assert f"pools {session.pool_bytes / 2**20:.1f} MiB" in status.stdout

            ids = mx.array([prompt_ids(300, tokenizer.vocab_size)])
            mx.eval(model(ids))  # warm-up: MLX's own buffers are allocated
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
                for child, attr in module.layer.segments:
                    assert attr not in child, f"{attr} kept between calls"
            # Rows moved into the pools' own memory: no expert memory grew beyond them.
            assert after - before < min(pool.nbytes for pool in session.pools), (before, after)
        finally:
            session.close()


def test_a_pool_budget_below_the_smallest_is_refused_naming_it(models, isolated_env, tmp_path):
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    manifest = Manifest.load(blob_dir)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        with pytest.raises(ValueError, match=f"smallest that works.*{manifest.top_k} rows"):
            load(blob_dir, pool_gb=pool_gb(blob_dir, manifest.top_k - 1))
        out = expertd_cli("generate", "--blobs", blob_dir, "--prompt", "hi", "--pool-gb",
                          repr(pool_gb(blob_dir, 1)))
        assert out.returncode != 0
        assert "smallest that works" in out.stderr and "Traceback" not in out.stderr
        # Nothing leaked: the refused client said goodbye.
        wait_until(lambda: query_stats(blob_dir)["clients"] == 0, 10, "the refused clients gone")
