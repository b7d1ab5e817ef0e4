"""Invariant 1 (exactness) for a call routing to more experts than its pool holds (a prompt).

Such a call runs as resident mlx-lm's does, in one piece: on unified memory on a stage (a row per
expert at its own index), on device pools on a stack laid out as a pulled call's. Every
position's logits are bit-identical to resident's, and each (token, slot) pair is computed once.
It used to run in groups of half the pool, each computing only its own pairs: exact where a
pair's result does not depend on the call it shares, which held on the CPU and not on an H100.
"""

import mlx.core as mx
import mlx_lm
import pytest
from client_helpers import ROWS_ALL, ROWS_TINY, client_flags, pool_gb, prompt_ids, routed_model
from conftest import FAMILY_MODES
from harness import Daemon

from expertd.client import layer as layer_module
from expertd.client import load, switch
from expertd.manifest import Manifest

FAMILY_IDS = [f"{family}-{mode}{bits}" for family, mode, bits in FAMILY_MODES]


def counted_calls(monkeypatch, where, size) -> list:
    """``switch.compute``, as ``where`` calls it, recording (MoE layer, ``size(arrays, rows)``)
    per call; the list it records into."""
    calls, compute = [], switch.compute

    def counting_compute(module, segments, arrays, x, rows):
        calls.append((module.layer.index, size(arrays, rows)))
        return compute(module, segments, arrays, x, rows)

    monkeypatch.setattr(where, "compute", counting_compute)
    return calls


@pytest.mark.parametrize("rows", [ROWS_TINY, ROWS_ALL], ids=["8rows", "all-rows"])
@pytest.mark.parametrize("family_mode", FAMILY_MODES, ids=FAMILY_IDS)
def test_a_prompt_on_device_pools_runs_in_one_call_a_layer(models, isolated_env, tmp_path,
                                                           monkeypatch, family_mode, rows):
    """Device pools of 4 rows without a puller (a discrete GPU with pull off) and prompts that
    route to more experts than that: each layer's call runs once, on a stack laid out as a
    pulled call's (a row per expert and the router's own ids, or the routed experts in order
    for fewer pairs than experts), and every position's logits are resident's. It used to run
    in groups of half the pool, which is exact on the CPU and was not on an H100 (a pair's
    result there depends on the call it shares). The experts a prompt keeps routing to are
    promoted into the pools' free rows from the stack."""
    model_dir, blob_dir = routed_model(models, *family_mode)
    manifest = Manifest.load(blob_dir)
    resident = mlx_lm.load(str(model_dir))[0]
    pools = []  # the pools' first arrays, once loaded: a call on them is not on a stack
    calls = counted_calls(monkeypatch, layer_module, lambda arrays, rows_: (
        None if any(arrays[0] is a for a in pools) else arrays[0].shape[0], rows_.size))
    pool_rows = 4  # fewer than a long prompt's experts in every layer of 16
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, rows, tmp_path / "s.json")):
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, pool_rows), pool_backing="device",
                        pull="off")
        session = model.expertd_session
        assert [p.rows for p in session.pools] == [pool_rows] * len(manifest.layers)
        pools += [p.arrays[0] for p in session.pools]
        try:
            # 2 tokens: fewer pairs than experts (a compact stack); 300: a row per expert.
            for length in (2, 17, 300):
                ids = mx.array([prompt_ids(length, resident.args.vocab_size)])
                before = session.pool_counters()
                calls.clear()
                got, ref = model(ids), resident(ids)
                mx.eval(got, ref)
                # Every position, not only the last one.
                assert got.dtype == ref.dtype and got.shape == ref.shape
                assert mx.array_equal(got, ref).item(), f"{length} tokens: logits differ"
                after = session.pool_counters()
                pairs = length * manifest.top_k
                assert len(calls) == len(manifest.layers)  # one call a layer, each pair once
                for layer, (stack, computed) in calls:
                    assert computed == pairs
                    # On the pool where its experts fit it, else on a stack.
                    assert stack in (None, min(pairs, manifest.layers[layer].num_experts))
                assert any(stack is not None for _, (stack, _) in calls)
                assert after["staged"] > before["staged"]  # misses read into the stacks
                if length == 300:
                    assert after["hits"] > before["hits"]  # hits taken from the pools
            # Into the pools' free rows (a prompt takes no row its decode uses: test_pool.py).
            assert session.pool_counters()["promoted"] > 0
        finally:
            session.close()


@pytest.mark.parametrize("rows", [ROWS_TINY, ROWS_ALL], ids=["8rows", "all-rows"])
@pytest.mark.parametrize("family_mode", FAMILY_MODES, ids=FAMILY_IDS)
def test_a_prompt_on_unified_memory_runs_in_one_call_a_layer(models, isolated_env, tmp_path,
                                                             monkeypatch, family_mode, rows):
    """Host pools of top-k rows (unified memory's default size) and prompts that route to more
    experts than that: each layer's call runs once, on the stage (rows outside the pool, at the
    experts' own indices), with the router's own ids; every position's logits are resident's."""
    model_dir, blob_dir = routed_model(models, *family_mode)
    manifest = Manifest.load(blob_dir)
    resident = mlx_lm.load(str(model_dir))[0]
    calls = counted_calls(monkeypatch, layer_module, lambda arrays, rows_: arrays[0].shape[0])

    pool_rows = manifest.top_k
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, rows, tmp_path / "s.json")):
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, pool_rows), pool_backing="host")
        session = model.expertd_session
        try:
            hits = []
            for length in (17, 300):
                ids = mx.array([prompt_ids(length, resident.args.vocab_size)])
                mx.eval(model(ids[:, :1]))  # one token: its experts move into the pools
                before = session.pool_counters()["hits"]
                calls.clear()
                got, ref = model(ids), resident(ids)
                mx.eval(got, ref)
                assert mx.array_equal(got, ref).item(), f"{length} tokens: logits differ"
                staged = [c for c in calls if c[1] == manifest.layers[c[0]].num_experts]
                assert len(staged) == len(calls) == len(manifest.layers)
                hits.append(session.pool_counters()["hits"] - before)
            assert session.pool_counters()["staged"] > 0
            assert all(hits), "no expert of a prompt came from a pool: that copy went untested"
        finally:
            session.close()
