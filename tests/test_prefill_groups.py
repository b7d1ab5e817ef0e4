"""Invariant 1 (exactness) for layers that run in groups, and the cost of those groups.

A layer that routes to more distinct experts than the client may fetch at once runs in groups;
each group computes only the (token, slot) pairs routed into it (client/switch.py). That is
exact only if a pair's result does not depend on which other pairs share the call, so that
property of MLX's kernels is tested directly on each family's real switch modules, then end to
end: every position's logits bit-identical to resident mlx-lm, with each pair computed once.
"""

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from client_helpers import ROWS_ALL, ROWS_TINY, client_flags, pool_gb, prompt_ids, routed_model
from conftest import FAMILY_MODES
from harness import Daemon

from expertd.client import layer as layer_module
from expertd.client import load, switch
from expertd.manifest import Manifest

FAMILY_IDS = [f"{family}-{mode}{bits}" for family, mode, bits in FAMILY_MODES]


def switch_inputs(model, length: int) -> list:
    """``(module, x, indices, output)`` of every switch call of one resident forward pass."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    seen = []
    switches = [m for _, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]
    classes = [type(m) for m in switches]
    for module, cls in zip(switches, classes):
        def recording(self, x, indices, _cls=cls):
            y = _cls.__call__(self, x, indices)
            seen.append((self, x, indices, y))
            return y

        module.__class__ = type(f"Recording{cls.__name__}", (cls,), {"__call__": recording})
    try:
        mx.eval(model(mx.array([prompt_ids(length, model.args.vocab_size)])))
    finally:
        for module, cls in zip(switches, classes):
            module.__class__ = cls
    return seen


@pytest.mark.parametrize("family_mode", FAMILY_MODES, ids=FAMILY_IDS)
def test_pair_results_do_not_depend_on_call_mates(models, family_mode):
    """The kernel property the grouped path relies on, on this backend (mx.default_device()):
    each (token, slot) pair computed alone, in small unsorted calls, in calls just below and
    above mlx-lm's 64-pair sort threshold, or with another layer's worth of pairs, gives the
    bits the whole layer's call gave it."""
    model_dir, _ = routed_model(models, *family_mode)
    model = mlx_lm.load(str(model_dir))[0]
    rng = np.random.default_rng(0)
    for length in (5, 300):
        for module, x, indices, full in switch_inputs(model, length):
            idx = np.array(indices)
            flat = idx.reshape(-1)
            k = idx.shape[-1]
            rows = x.reshape(-1, x.shape[-1])
            want = full.reshape(-1, full.shape[-1])
            sizes = sorted({1, 3, 17, 63, 64, 65, 257, flat.size} & set(range(1, flat.size + 1)))
            for size in sizes:
                pick = rng.choice(flat.size, size, replace=False)
                # mlx-lm's own call, as the resident model makes it, on a subset of the pairs.
                got = type(module).__call__(module, rows[mx.array(pick // k)],
                                            mx.array(flat[pick][:, None]))[:, 0]
                assert mx.array_equal(got, want[mx.array(pick)]).item(), (
                    f"{mx.default_device()}: {size} of {flat.size} pairs computed together give "
                    f"other bits than the whole layer's call; grouping by pairs is not exact")


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
def test_grouped_prefill_is_exact_and_computes_each_pair_once(models, isolated_env, tmp_path,
                                                              monkeypatch, family_mode, rows):
    model_dir, blob_dir = routed_model(models, *family_mode)
    manifest = Manifest.load(blob_dir)
    resident = mlx_lm.load(str(model_dir))[0]
    # The grouped path's computation (a call that fits its pool is not counted here).
    calls = counted_calls(monkeypatch, switch, lambda arrays, rows: rows.size)
    pool_rows = 4  # every layer of 16 experts needs several groups for a long prompt
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, rows, tmp_path / "s.json")):
        # Groups run on device pools without a puller (a discrete GPU with pull off); unified
        # memory stages a prompt's call whole (test below).
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, pool_rows), pool_backing="device",
                        pull="off")
        assert [p.rows for p in model.expertd_session.pools] == [pool_rows] * len(
            manifest.layers)
        try:
            # 5 tokens: groups of fewer than 64 pairs, unsorted, as resident's call is. 17: at
            # least 4 pairs per expert, so resident's call is sorted and small groups are padded.
            # 300: groups of hundreds of pairs.
            padded = 0
            for length in (5, 17, 300):
                ids = mx.array([prompt_ids(length, resident.args.vocab_size)])
                calls.clear()
                got = model(ids)
                ref = resident(ids)
                mx.eval(got, ref)
                # Every position, not only the last one.
                assert got.dtype == ref.dtype and got.shape == ref.shape
                assert mx.array_equal(got, ref).item(), (
                    f"prompt of {length} tokens: grouped logits differ from resident ones")
                pairs = length * manifest.top_k  # per layer
                for layer in {c[0] for c in calls}:
                    mine = [c for c in calls if c[0] == layer]
                    computed = sum(c[1] for c in mine)
                    # The pairs once, plus at most the padding that keeps each group on the
                    # resident call's kernel path.
                    assert pairs <= computed <= pairs + len(mine) * max(64, 4 * pool_rows)
                    padded += computed > pairs
                    if length == 300:
                        assert len(mine) > 1, "the grouped path did not run"
                        # Rerunning the layer per group (the old path) computes groups x pairs.
                        assert computed < 2 * pairs
            assert padded, "no group was padded: the padding path went untested"
        finally:
            model.expertd_session.close()


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
