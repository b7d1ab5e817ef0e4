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
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from client_helpers import prompt_ids
from harness import Daemon
from expertd.client import load
from expertd.client.predict import MIN_PRECISION, RETEST_AFTER, WINDOW, Guesser, LayerGuesses
from expertd.tools.convert import convert

RANDOM = dict(layers=4, experts=64, top_k=2)
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


def test_auto_keeps_guessing_where_it_pays(models, isolated_env, tmp_path):
    model_dir = predictable_copy(models.model(**RANDOM), tmp_path / "model")
    blob_dir = tmp_path / "blobs"
    convert(model_dir, blob_dir, progress=False)
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
            assert session.copy_ahead_bytes == 512 * 1024
            prompt = mx.array(prompt_ids(8, 512))
            for _ in generate_step(prompt, model, max_tokens=16):
                pass
            assert session.copier.jobs == 0 and session.all_counters()["ahead_used"] == 0
            assert all(p["calls"] >= 16 for p in session.prediction()[1:])
        finally:
            session.close()
