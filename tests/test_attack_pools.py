"""Hostile use of the client's expert pools (client/pool.py, layer.py, step.py): lazy graphs
built before evaluation, batches, generate loops, two models, daemon restarts, exceptions in a
forward, edge pool sizes and prompt lengths, memory. Real daemons, real tiny models; every
streamed logit must equal resident mlx-lm's bit for bit."""

import gc
from contextlib import contextmanager

import mlx.core as mx
import mlx_lm
import pytest
from client_helpers import ROWS_TINY, client_daemon, pool_gb, prompt_ids
from harness import wait_until
from mlx_lm.models.cache import KVCache, make_prompt_cache

from expertd.client import load

BACKINGS = ["host", "device"]
def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


def ids(length: int, vocab: int, seed: int = 0):
    return mx.array([prompt_ids(length, vocab, seed)])


@contextmanager
def streamed(blob_dir, rows, **kwargs):
    """A streamed model with ``rows`` pool rows a layer; its session is closed on leaving."""
    kwargs.setdefault("prefetch", "off")
    model = load(blob_dir, pool_gb=pool_gb(blob_dir, rows), **kwargs)[0]
    try:
        yield model
    finally:
        model.expertd_session.close()


def two_copies(model, resident, prompt) -> tuple:
    """Two streamed caches and a resident one after the same prompt; resident's logits."""
    c1, c2, ref = make_prompt_cache(model), make_prompt_cache(model), make_prompt_cache(resident)
    logits = resident(prompt, cache=ref)
    mx.eval(model(prompt, cache=c1), model(prompt, cache=c2), logits)
    return c1, c2, ref, logits


# ---- 1. several lazy forwards before any evaluation ------------------------------------------

@pytest.mark.parametrize("backing,speculate", [("host", "auto")])
def test_two_lazy_forwards_evaluated_together(qwen, isolated_env, tmp_path, backing, speculate):
    _, blob_dir, resident, _ = qwen
    vocab = resident.args.vocab_size
    with client_daemon(blob_dir, isolated_env, tmp_path):
        with streamed(blob_dir, 4, pool_backing=backing, speculate=speculate) as model:
            for la, lb in [(20, 30), (1, 33), (5, 7), (40, 2)]:
                xa, xb = ids(la, vocab, 1), ids(lb, vocab, 2)
                c1, c2 = make_prompt_cache(model), make_prompt_cache(model)
                a = model(xa, cache=c1)
                b = model(xb, cache=c2)
                mx.eval(a, b)
                assert same(a, resident(xa)), (la, lb)
                assert same(b, resident(xb)), (la, lb)
                # and a decode token of each, again both lazy
                ta, tb = mx.argmax(a[:, -1:], -1), mx.argmax(b[:, -1:], -1)
                a2, b2 = model(ta, cache=c1), model(tb, cache=c2)
                r1, r2 = make_prompt_cache(resident), make_prompt_cache(resident)
                resident(xa, cache=r1), resident(xb, cache=r2)
                mx.eval(a2, b2)
                assert same(a2, resident(ta, cache=r1)), (la, lb)
                assert same(b2, resident(tb, cache=r2)), (la, lb)


# The device backing's writes are MLX scatters (an old graph keeps the old buffer): the host
# backing's writes in place are the ones a forgotten pending computation would corrupt.
@pytest.mark.parametrize("backing", ["host"])
def test_a_replayed_step_left_lazy_survives_a_later_speculative_hit(qwen, isolated_env, tmp_path,
                                                                    backing):
    """Two sequences decoded side by side without evaluating the first one's logits (as two beams
    or a careless batch loop would): step a misses a pool and is replayed on the per-layer path
    (its logits lazy, its last layer's output pending in the pool); step b of an identical
    sequence then hits every pool speculatively; a third forward moves rows in the last pool.
    a's logits, evaluated last, must still be resident mlx-lm's."""
    _, blob_dir, resident, _ = qwen
    vocab = resident.args.vocab_size
    with client_daemon(blob_dir, isolated_env, tmp_path):
        with streamed(blob_dir, 8, pool_backing=backing, speculate="on") as model:
            session = model.expertd_session
            c1, c2, ref, first = two_copies(model, resident, ids(5, vocab, 3))
            token = mx.argmax(first[:, -1:], -1)
            mx.eval(model(ids(40, vocab, 9), cache=make_prompt_cache(model)))  # churn the pools
            for pool in session.pools:
                pool.settle()
            session.pools[-1].forget()  # make sure the last layer misses
            replays = session.counters["replays"]
            a = model(token, cache=c1)  # missed and replayed: lazy, per-layer path
            assert session.counters["replays"] == replays + 1
            b = model(token, cache=c2)  # same routing: a hit everywhere, speculative
            assert session.counters["replays"] == replays + 1
            mx.eval(b)
            want = resident(token, cache=ref)
            assert same(b, want)
            # Prompts that move many rows into every pool (grouped: 16 experts, 8 rows), until
            # every row a's last layer read holds another expert.
            last = session.pools[-1]
            held = last.expert_of.copy()
            for seed in range(11, 40):
                mx.eval(model(ids(40, vocab, seed), cache=make_prompt_cache(model)))
                if all(last.expert_of[r] != e for r, e in enumerate(held) if e >= 0):
                    break
            mx.eval(a)
            assert same(a, want), "a lazy replayed step's logits changed under a later write"


@pytest.mark.parametrize("backing", ["host"])
def test_two_sequences_decoded_without_evaluating_the_first(qwen, isolated_env, tmp_path,
                                                            backing):
    """The same bug reached through the public API only: two copies of one sequence decoded in
    lockstep, the first copy's step left lazy whenever it was replayed; the second copy's step
    hits speculatively; then another request's prompt moves rows in."""
    _, blob_dir, resident, _ = qwen
    vocab = resident.args.vocab_size
    with client_daemon(blob_dir, isolated_env, tmp_path):
        with streamed(blob_dir, 4, pool_backing=backing, speculate="on") as model:
            session = model.expertd_session
            c1, c2, ref, want = two_copies(model, resident, ids(5, vocab, 3))
            tried = 0
            for step in range(30):
                token = mx.argmax(want[:, -1:], -1)
                replays = session.counters["replays"]
                a = model(token, cache=c1)
                replayed = session.counters["replays"] > replays
                b = model(token, cache=c2)
                hit = session.counters["replays"] == replays + replayed
                want = resident(token, cache=ref)
                mx.eval(b, want)
                assert same(b, want), f"step {step}: b"
                if replayed and hit:
                    tried += 1
                    mx.eval(model(ids(40, vocab, step), cache=make_prompt_cache(model)))
                mx.eval(a)
                assert same(a, want), f"step {step}: a lazy step's logits changed"
            assert tried, "the scenario never happened"


# ---- 2. batches through speculative steps ---------------------------------------------------

@pytest.mark.parametrize("backing,batch", [("host", 4), ("device", 2)])
def test_batched_decode_is_exact(qwen, isolated_env, tmp_path, backing, batch):
    _, blob_dir, resident, _ = qwen
    vocab = resident.args.vocab_size
    with client_daemon(blob_dir, isolated_env, tmp_path):
        with streamed(blob_dir, 6, pool_backing=backing, speculate="on") as model:
            session = model.expertd_session
            x = mx.array([prompt_ids(3, vocab, s) for s in range(batch)])
            cs, cr = make_prompt_cache(model), make_prompt_cache(resident)
            for step in range(12):
                got, want = model(x, cache=cs), resident(x, cache=cr)
                mx.eval(got, want)
                assert same(got, want), f"batch {batch}, step {step}"
                x = mx.argmax(want[:, -1:], -1)
            assert session.counters["speculative_steps"] > 0


# ---- 3. mlx-lm's generation loops ------------------------------------------------------------

@pytest.mark.parametrize("backing", ["device"])
def test_generate_loops_match_resident(qwen, isolated_env, tmp_path, backing):
    _, blob_dir, resident, tokenizer = qwen
    prompt = "Once upon a time there was a small model that"
    with client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY):
        model, tok = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), pool_backing=backing,
                          prefetch="on", copy_ahead_bytes=0)
        try:
            text = mlx_lm.generate(model, tok, prompt, max_tokens=24)
            stream = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=24)]
        finally:
            model.expertd_session.close()
    assert text == mlx_lm.generate(resident, tokenizer, prompt, max_tokens=24)
    assert stream == [r.token for r in
                      mlx_lm.stream_generate(resident, tokenizer, prompt, max_tokens=24)]


@pytest.mark.parametrize("kv", [dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0),
                                dict(max_kv_size=24)],
                         ids=["quantized-kv", "rotating-kv"])
def test_stream_generate_with_other_caches(qwen, isolated_env, tmp_path, kv):
    """Quantized KV caches (trimmed and replayed) and a rotating cache that wraps mid-run."""
    _, blob_dir, resident, tokenizer = qwen
    prompt = "Once upon a time"
    with client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY):
        model, tok = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), speculate="on",
                          prefetch="on", copy_ahead_bytes=0)
        try:
            got = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=32,
                                                           **kv)]
            replays = model.expertd_session.counters["replays"]
        finally:
            model.expertd_session.close()
    assert replays > 0
    assert got == [r.token for r in mlx_lm.stream_generate(resident, tokenizer, prompt,
                                                           max_tokens=32, **kv)]


@pytest.mark.parametrize("backing", ["host"])
def test_batch_generate_matches_resident(qwen, isolated_env, tmp_path, backing):
    _, blob_dir, resident, tokenizer = qwen
    vocab = resident.args.vocab_size
    prompts = [prompt_ids(n, vocab, s) for n, s in [(3, 0), (9, 1), (1, 2), (20, 3)]]
    with client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY):
        model, tok = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), pool_backing=backing,
                          prefetch="on", copy_ahead_bytes=0)
        try:
            got = mlx_lm.batch_generate(model, tok, prompts, max_tokens=12).texts
        finally:
            model.expertd_session.close()
    want = mlx_lm.batch_generate(resident, tokenizer, prompts, max_tokens=12).texts
    assert got == want


# ---- 4. two models of one blob directory in one process --------------------------------------

def test_two_models_interleaved(qwen, isolated_env, tmp_path):
    _, blob_dir, resident, _ = qwen
    vocab = resident.args.vocab_size
    with client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY):
        with streamed(blob_dir, 4, pool_backing="host", speculate="on", prefetch="on",
                      copy_ahead_bytes=0) as m1:
            with streamed(blob_dir, 5, pool_backing="device", speculate="auto", prefetch="on",
                          copy_ahead_bytes=0) as m2:
                runs = []
                for m, seed in [(m1, 0), (m2, 1), (m1, 2), (m2, 3)]:
                    runs.append([m, make_prompt_cache(m), make_prompt_cache(resident),
                                 ids(7 + seed, vocab, seed)])
                for step in range(10):
                    outs = [(m(x, cache=c), resident(x, cache=r)) for m, c, r, x in runs]
                    mx.eval(outs)
                    for i, (got, want) in enumerate(outs):
                        assert same(got, want), f"run {i} step {step}"
                        runs[i][3] = mx.argmax(want[:, -1:], -1)


# ---- 5. the daemon SIGKILLed and restarted in the middle of a decode -------------------------

@pytest.mark.parametrize("backing", BACKINGS)
def test_daemon_killed_mid_decode_small_pool(qwen, isolated_env, tmp_path, backing):
    _, blob_dir, resident, _ = qwen
    vocab = resident.args.vocab_size
    first = client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY, "a.json")
    try:
        with streamed(blob_dir, 4, pool_backing=backing, speculate="on", prefetch="on",
                      copy_ahead_bytes=0, reconnect_timeout=30.0) as model:
            session = model.expertd_session
            cs, cr = make_prompt_cache(model), make_prompt_cache(resident)
            x = ids(6, vocab, 4)
            pending = None
            for step in range(16):
                if step == 5:
                    # A lazy step built before the kill, evaluated after the restart.
                    pending = (model(x, cache=cs), resident(x, cache=cr))
                    first.kill()
                    wait_until(lambda: session.session._heartbeat.lost, 10.0, "the death noticed")
                    dead = first
                    first = client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY, "b.json")
                    dead.close()
                    got, want = pending
                else:
                    got, want = model(x, cache=cs), resident(x, cache=cr)
                mx.eval(got, want)
                assert same(got, want), f"step {step}"
                x = mx.argmax(want[:, -1:], -1)
            assert session.counters["reconnects"] == 1
    finally:
        first.close()


# ---- 6. an exception inside a forward -------------------------------------------------------

class Exploding(KVCache):
    """A cache that raises when its layer's attention runs (a bad cache / an interrupt)."""

    def update_and_fetch(self, keys, values):
        raise KeyboardInterrupt("boom")


def interrupt_every_layer(model, vocab):
    """Raise from inside each decoder layer's attention (after earlier MoE layers ran)."""
    for prompt_len in (1, 30):
        for where in range(1, len(model.layers)):
            cache = make_prompt_cache(model)
            cache[where] = Exploding()
            with pytest.raises(KeyboardInterrupt):
                model(ids(prompt_len, vocab, where), cache=cache)


@pytest.mark.parametrize("backing,speculate", [("host", "on"), ("device", "off")])
def test_a_forward_interrupted_mid_way_leaves_the_model_exact(qwen, isolated_env, tmp_path,
                                                             backing, speculate):
    _, blob_dir, resident, _ = qwen
    vocab = resident.args.vocab_size
    with client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY):
        with streamed(blob_dir, 4, pool_backing=backing, speculate=speculate, prefetch="on",
                      copy_ahead_bytes=0) as model:
            session = model.expertd_session
            interrupt_every_layer(model, vocab)
            assert not session.steps.mode.speculative
            cs, cr = make_prompt_cache(model), make_prompt_cache(resident)
            x = ids(9, vocab, 5)
            for step in range(10):
                got, want = model(x, cache=cs), resident(x, cache=cr)
                mx.eval(got, want)
                assert same(got, want), f"step {step}"
                x = mx.argmax(want[:, -1:], -1)


def test_an_interrupted_speculative_step_keeps_no_lazy_ids(qwen, isolated_env, tmp_path):
    """The partial step's (layer, lazy ids) records must not outlive it: they hold the
    interrupted graph (and its layers) alive until some later speculative step."""
    _, blob_dir, resident, _ = qwen
    vocab = resident.args.vocab_size
    with client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY):
        with streamed(blob_dir, 4, speculate="on") as model:
            session = model.expertd_session
            interrupt_every_layer(model, vocab)
            # then only prompts (never speculative): nothing resets the records
            mx.eval(model(ids(30, vocab, 1), cache=make_prompt_cache(model)))
            assert session.steps.mode.records is None, session.steps.mode.records


# ---- 7. edge pool sizes and prompt lengths around the speculative threshold ------------------

@pytest.mark.parametrize("backing,rows", [("host", 4), ("device", 16)])
def test_edge_pool_sizes_and_prompt_lengths(qwen, isolated_env, tmp_path, backing, rows):
    _, blob_dir, resident, _ = qwen
    vocab = resident.args.vocab_size
    with client_daemon(blob_dir, isolated_env, tmp_path):
        with streamed(blob_dir, rows, pool_backing=backing, speculate="on") as model:
            session = model.expertd_session
            assert all(p.rows == rows for p in session.pools)
            for length in (1, 15, 16, 17):  # x top-k 4: 4, 60, 64, 68 ids
                cs, cr = make_prompt_cache(model), make_prompt_cache(resident)
                x = ids(length, vocab, length)
                for step in range(4):
                    got, want = model(x, cache=cs), resident(x, cache=cr)
                    mx.eval(got, want)
                    assert same(got, want), f"prompt {length}, step {step}"
                    x = mx.argmax(want[:, -1:], -1)


# ---- 8. memory ------------------------------------------------------------------------------

@pytest.mark.parametrize("backing", ["host"])
def test_repeated_long_prompts_do_not_grow_memory(qwen, isolated_env, tmp_path, backing):
    _, blob_dir, resident, _ = qwen
    vocab = resident.args.vocab_size
    with client_daemon(blob_dir, isolated_env, tmp_path):
        with streamed(blob_dir, 4, pool_backing=backing) as model:
            seen = []
            for i in range(8):
                out = model(ids(100, vocab, i), cache=make_prompt_cache(model))
                mx.eval(out)
                del out
                gc.collect()
                seen.append(mx.get_active_memory())
            assert seen[-1] <= seen[3] + (1 << 20), seen
