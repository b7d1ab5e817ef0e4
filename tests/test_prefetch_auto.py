"""prefetch="auto": a layer keeps guessing the next layer's experts only where the guesses pay.

Two real models through a real daemon: a random-router synth model (its next-layer guesses are
right 16-38% of the time here) and the same model made predictable the way trained models are
where cross-layer prediction works: consecutive layers share one router and each layer adds
little to the residual stream, so layer L+1's router on layer L's input picks what layer L+1
really picks.
"""

import re
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from client_helpers import prompt_ids
from harness import Daemon
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from expertd.client import load
from expertd.client.predict import MIN_PRECISION, READ_WINDOW, RETEST_AFTER, WINDOW, Guesser, LayerGuesses
from expertd.manifest import Manifest
from expertd.tools.convert import convert

RANDOM = dict(layers=4, experts=64, top_k=2)
DEMO_SHAPE = dict(layers=8, experts=32, top_k=4)  # make demo's model, smaller experts
CACHE_GB = "0.02"  # every expert resident: the copier's rows written ahead are what is measured
TOKENS = 80


def decode(blob_dir, prefetch: str = "auto"):
    """Sampled decoding of TOKENS tokens; the session's per-layer guess summaries and counters."""
    model, _ = load(blob_dir, prefetch=prefetch, copy_ahead_bytes=0)
    session = model.expertd_session
    try:
        mx.random.seed(0)
        prompt = mx.array(prompt_ids(8, 512))
        for _ in generate_step(prompt, model, max_tokens=TOKENS, sampler=make_sampler(1.0)):
            pass
        return session.prediction(), session.all_counters()
    finally:
        session.close()


def predictable_copy(model_dir, out):
    """``model_dir`` with every MoE layer's router set to layer 0's and the attention and expert
    output projections scaled down 50 times (affine-quantized: scales and biases scale the
    weight)."""
    shutil.copytree(model_dir, out)
    for path in out.glob("*.safetensors"):
        weights = dict(mx.load(str(path)))
        for name in list(weights):
            gate = re.match(r"model\.layers\.\d+\.mlp\.gate\.(\w+)$", name)
            if gate:
                weights[name] = weights[f"model.layers.0.mlp.gate.{gate.group(1)}"]
            elif re.search(r"(o_proj|down_proj)\.(scales|biases)$", name):
                weights[name] = (weights[name] * 0.02).astype(weights[name].dtype)
        mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return out


def test_auto_stops_guessing_on_the_random_router_model(models, isolated_env):
    blob_dir = models.blobs(**RANDOM)
    with Daemon(blob_dir, isolated_env, "--cache-gb", CACHE_GB):
        layers, _ = decode(blob_dir)
    assert layers[0] is None  # nothing guesses the first MoE layer
    for n, layer in enumerate(layers[1:], 1):
        assert layer["precision"] < MIN_PRECISION, (n, layer)
        assert not layer["active"] and layer["switched_off"] == 1, (n, layer)
        # It stopped after one window of guesses and had no reason to retest yet.
        assert layer["calls"] == WINDOW, (n, layer)


@pytest.fixture(scope="module")
def predictable(models, tmp_path_factory):
    """The blob directory of the predictable copy of the RANDOM model."""
    root = tmp_path_factory.mktemp("predictable")
    model_dir = predictable_copy(models.model(**RANDOM), root / "model")
    convert(model_dir, root / "blobs", progress=False)
    return root / "blobs"


def test_auto_keeps_guessing_where_it_pays(predictable, isolated_env):
    blob_dir = predictable
    with Daemon(blob_dir, isolated_env, "--cache-gb", CACHE_GB):
        layers, counters = decode(blob_dir)
    for n, layer in enumerate(layers[1:], 1):
        assert layer["precision"] >= MIN_PRECISION, (n, layer)
        assert layer["active"] and layer["switched_off"] == 0, (n, layer)
        assert layer["calls"] >= TOKENS, (n, layer)  # every forward pass guessed
    # The right guesses were written into the pools by the copier, and used there.
    assert counters["ahead_used"] > TOKENS


def test_off_never_guesses_and_on_never_stops(models, isolated_env):
    blob_dir = models.blobs(**RANDOM)
    with Daemon(blob_dir, isolated_env, "--cache-gb", CACHE_GB):
        off, off_counters = decode(blob_dir, "off")
        on, _ = decode(blob_dir, "on")
    assert off == [None] * len(off) and off_counters["ahead_used"] == 0
    for layer in on[1:]:
        assert layer["active"] and layer["switched_off"] == 0
        assert layer["calls"] >= TOKENS


def test_a_switched_off_layer_tries_again_after_a_while():
    g = LayerGuesses("auto")

    for _ in range(WINDOW):
        assert g.wanted()
        g.record(np.array([0, 1], np.int32), np.array([2, 3], np.int32))
    assert not g.active and g.switched_off == 1
    assert [g.wanted() for _ in range(RETEST_AFTER)] == [False] * (RETEST_AFTER - 1) + [True]
    for _ in range(WINDOW):  # right this time: it stays on
        g.record(np.array([0, 1], np.int32), np.array([0, 1], np.int32))
    assert g.active and g.switched_off == 1 and g.wanted()


def test_auto_judges_the_core_and_scores_the_width_apart():
    """A wide read-ahead is half wrong by design; auto's verdict is on the top-k core alone."""
    g = LayerGuesses("auto")
    for _ in range(2 * WINDOW):
        g.record(np.array([0, 1], np.int32), np.array([0, 1], np.int32),
                 np.array([0, 1, 5, 6], np.int32))
    s = g.summary()
    assert g.active and g.switched_off == 0
    assert (s["precision"], s["recall"]) == (1.0, 1.0)
    assert (s["wide_precision"], s["wide_recall"], s["wide_guessed"]) == (0.5, 1.0, 8 * WINDOW)


def test_a_wide_guess_ranks_the_routers_top_k_first():
    """Guesser.lazy with a width: the first k columns are the router's top-k (the set
    argpartition picks), the rest the next best, in order."""
    mx.random.seed(3)
    router = nn.Linear(32, 24, bias=False)
    x = mx.random.normal((2, 3, 32))
    guess = Guesser(router, None)
    scores = np.array(router(x))
    for width, k in ((1, 4), (2, 4), (3, 8), (9, 4)):
        got = np.array(guess.lazy(x, k, width))
        n = min(k * width, 24)
        assert got.shape == (2, 3, n)
        best = np.argsort(-scores, axis=-1, kind="stable")
        for t in np.ndindex(2, 3):
            assert set(got[t][:k].tolist()) == set(best[t][:k].tolist())
            assert set(got[t].tolist()) == set(best[t][:n].tolist())
            ranked = scores[t][got[t]]
            if width > 1:
                assert (np.diff(ranked) <= 0).all()


@pytest.mark.parametrize("mode", ["sometimes", "", None])
def test_an_unknown_mode_is_refused(models, isolated_env, mode):
    with pytest.raises(ValueError, match="prefetch must be one of auto, on, off"):
        load(models.blobs(**RANDOM), prefetch=mode)


def test_rows_too_small_to_pay_for_a_thread_hand_off_are_not_copied_ahead(models, isolated_env):
    """The default copy_ahead_bytes: this model's guessed rows (a few KiB a layer) are copied
    when their layer runs, never handed to the copier; the guesses are still made and scored."""
    blob_dir = models.blobs(**RANDOM)
    with Daemon(blob_dir, isolated_env, "--cache-gb", CACHE_GB):
        model, _ = load(blob_dir, prefetch="on")
        session = model.expertd_session
        try:
            assert {la.copy_ahead_bytes for la in session.layers} == {512 * 1024}
            prompt = mx.array(prompt_ids(8, 512))
            for _ in generate_step(prompt, model, max_tokens=16):
                pass
            assert session.session.copier.busy_seconds == 0.0 and session.all_counters()["ahead_used"] == 0
            assert all(p["calls"] >= 16 for p in session.prediction()[1:])
        finally:
            session.close()


def arena_gb(blob_dir, fraction: float) -> str:
    """--cache-gb for an arena of ``fraction`` of the model's expert bytes."""
    return f"{Manifest.load(blob_dir).total_expert_bytes * fraction / 2**30:.6f}"


def assert_read_ahead_paid(stats: dict) -> None:
    """What auto promises of the daemon's reads: read-ahead not (yet) used, wasted or still
    waiting in a side row, never exceeds what was read on demand."""
    unpaid = stats["prefetch_fills"] - stats["prefetch_hits"]
    assert stats["misses"] > 0, stats
    assert stats["prefetch_wasted"] <= unpaid <= stats["misses"], {
        k: stats[k] for k in ("misses", "prefetch_fills", "prefetch_hits", "prefetch_wasted")}


def test_auto_reads_ahead_no_more_than_it_demands_on_the_random_router_model(models,
                                                                             isolated_env):
    """make demo's shape and arena: guesses that are mostly wrong must not be read ahead (before
    the read-ahead had verdicts and a budget of its own, it wasted 10 times the misses here)."""
    blob_dir = models.blobs(**DEMO_SHAPE)
    with Daemon(blob_dir, isolated_env, "--cache-gb", arena_gb(blob_dir, 0.35)) as daemon:
        decode(blob_dir)
        assert_read_ahead_paid(daemon.stats())


def test_auto_reads_ahead_where_it_pays_within_the_bound(predictable, isolated_env):
    """Right guesses of experts the arena lacks are read ahead, and used, and what is read
    ahead in vain stays within the bound."""
    with Daemon(predictable, isolated_env, "--cache-gb", arena_gb(predictable, 0.35)) as daemon:
        layers, counters = decode(predictable)
        stats = daemon.stats()
    assert_read_ahead_paid(stats)
    assert counters["prefetch_asked"] > 0 and stats["prefetch_hits"] > 0
    assert all(layer["read_near"]["active"] for layer in layers[1:]), layers


def guess(g: LayerGuesses, ranked, n_core: int, absent, routed, misses: int = 0) -> list:
    """One guess through the verdicts and the budget, scored at the next call: what it read."""
    ranked = np.array(ranked, np.int32)
    read = g.plan(np.array(absent, bool), n_core)
    g.record(ranked[:n_core], np.array(sorted(routed), np.int32), ranked)
    g.settle(misses)
    return ranked[read].tolist()


def test_read_ahead_waits_for_its_own_hits_and_stops_on_its_misses():
    """Pure logic: auto reads a part ahead only once a window of what it would have read was
    mostly routed (scored unread), within the budget the demand misses earned; a window more
    than half wrong stops it at once, however right the copies ahead are."""
    g = LayerGuesses("auto")
    absent = [True, True, False, False]  # the core's absent experts only: the wide part is held
    for _ in range(READ_WINDOW // 2 - 1):
        assert guess(g, [0, 1, 2, 3], 2, absent, {0, 1}) == []
    assert not g.near.active
    assert guess(g, [0, 1, 2, 3], 2, absent, {0, 1}, misses=2) == []
    assert g.near.active and not g.wide.active and g.credit == 2
    assert guess(g, [0, 1, 2, 3], 2, absent, {0, 1}) == [0, 1]  # two earned, two read
    assert guess(g, [0, 1, 2, 3], 2, absent, {0, 1}, misses=1) == [0, 1]  # its hits paid
    assert guess(g, [4, 5, 6, 7], 2, [True] * 4, {8, 9}, misses=2) == [4, 5]
    assert g.held_back == 0 and g.read == 6 and g.read_right == 4
    # Wrong ones: past half a window of them the core's read-ahead stops, the guess goes on.
    for _ in range(3):
        assert guess(g, [4, 5, 6, 7], 2, [True] * 4, {8, 9}, misses=2) == [4, 5]
    assert g.near.active
    assert guess(g, [4, 5, 6, 7], 2, [True] * 4, {8, 9}, misses=2) == [4, 5]
    assert not g.near.active and g.near.stopped == 1 and g.active and g.wanted()
    assert guess(g, [4, 5, 6, 7], 2, [True] * 4, {8, 9}, misses=2) == []


def test_the_wide_read_ahead_is_judged_by_its_own_hits():
    g = LayerGuesses("auto")
    for _ in range(READ_WINDOW):  # the core's absent experts routed, the rest never
        guess(g, [0, 1, 2, 3], 2, [True] * 4, {0, 1}, misses=2)
    assert g.near.active and not g.wide.active
    assert guess(g, [0, 1, 2, 3], 2, [True] * 4, {0, 1}) == [0, 1]
    s = g.summary()
    assert s["read_near"]["precision"] == 1.0 and s["read_wide"]["precision"] == 0.0


def test_on_reads_every_absent_guess_and_off_none():
    on = LayerGuesses("on")
    assert guess(on, [0, 1, 2, 3], 2, [True, False, True, True], set()) == [0, 2, 3]
    off = LayerGuesses("off")
    assert guess(off, [0, 1, 2, 3], 2, [True] * 4, set()) == []


def test_the_budget_bounds_what_read_ahead_wastes_by_the_demand_misses():
    """Whatever the guesses, the routes and the misses: read-ahead not routed never exceeds the
    demand misses since the start, and over any window exceeds them by one guess's width at
    most (the credit kept)."""
    rng = np.random.default_rng(5)
    g = LayerGuesses("auto")
    wasted, misses = [0], [0]
    for _ in range(400):
        g.near.active = g.wide.active = True  # the verdicts passed: the budget alone decides
        ranked = rng.permutation(32)[:8]
        routed = set(rng.choice(32, 4, replace=False).tolist()) | set(ranked[:rng.integers(0, 5)]
                                                                   .tolist())
        m = int(rng.integers(0, 4))
        read = guess(g, ranked, 4, rng.random(8) < 0.7, routed, misses=m)
        wasted.append(wasted[-1] + len(set(read) - routed))
        misses.append(misses[-1] + m)
        assert g.credit <= g.cap == 8
    wasted, misses = np.array(wasted), np.array(misses)
    assert g.read > 200 and wasted[-1] > 0  # it read ahead, and some of it in vain
    assert (wasted <= misses).all()
    windows = (wasted[None, :] - wasted[:, None]) - (misses[None, :] - misses[:, None])
    assert windows[np.triu_indices(len(wasted))].max() <= 8
