"""expertd's own token loop (client/decode.py): the next step built before this one is checked.

Each token and its log-probabilities equal resident mlx-lm's ``generate_step``, bit for bit,
while steps pull from an arena that holds every expert or a few rows (absent rows: a bad step
and the one built on its token are replayed), while the daemon revokes a step in flight, and
while a second client evicts the rows pulled.
"""

import mlx.core as mx
import numpy as np
import pytest
from client_helpers import ROWS_ALL, ROWS_TINY, client_flags, pool_gb, routed_model
from harness import Daemon
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer
from test_pull import PULLS
from test_step import resident_model

from expertd import native
from expertd.client import load
from expertd.client.arena_view import StepEpoch
from expertd.client.decode import pipelined_step, pipelines, stream_generate
from expertd.shm.layout import EPOCH_DTYPE

TOKENS = 24


def prompt(vocab: int, n: int = 7) -> mx.array:
    return mx.array([(31 * i + 5) % (vocab - 8) + 4 for i in range(n)])


def reference(model_dir, ids, tokens: int = TOKENS) -> list:
    return [(t, lp) for t, lp in generate_step(ids, resident_model(model_dir), max_tokens=tokens)]


def assert_same(got: list, want: list) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for i, ((_, a), (_, b)) in enumerate(zip(got, want)):
        assert mx.array_equal(a, b).item(), f"token {i}: log-probabilities differ"


def streamed(blob_dir, rows: int = 4, pull: str = "host"):
    return load(blob_dir, pool_gb=pool_gb(blob_dir, rows), prefetch="off",
                pool_backing="device", pull=pull, speculate="on")[0]


@pytest.mark.parametrize("pull", PULLS)
@pytest.mark.parametrize("arena_rows", [ROWS_ALL, ROWS_TINY])
def test_pipelined_tokens_are_resident_ones(models, isolated_env, tmp_path, arena_rows, pull):
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    ids = prompt(resident_model(model_dir).args.vocab_size)
    want = reference(model_dir, ids)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, arena_rows, tmp_path / "s.json")):
        model = streamed(blob_dir, pull=pull)
        session = model.expertd_session
        try:
            assert pipelines(model, {})
            got = list(pipelined_step(ids, model, max_tokens=TOKENS))
            assert_same(got, want)
            c = session.counters
            assert c["speculative_steps"] >= TOKENS // 2 and c["pulled_steps"] > 0
            if arena_rows == ROWS_TINY:  # rows the arena lacked: bad steps, replayed exactly
                assert c["replays_absent"] > 0
            assert not session.step_epoch.inside  # the loop leaves no step open
            loop = pipelined_step(ids, model, max_tokens=TOKENS)
            assert [next(loop) for _ in range(3)] and session.step_epoch.inside  # in flight
            loop.close()  # a consumer that stops early: nothing stays in flight
            assert not session.step_epoch.inside
        finally:
            session.close()


def test_sampled_tokens_are_resident_ones_through_replays(models, isolated_env, tmp_path):
    """Sampling at temperature 1 from one seed: a replayed step samples its token again with
    the random key it had, so the tokens are the ones mlx-lm draws with the model resident,
    whatever was replayed (an arena of 8 rows: absent experts)."""
    from mlx_lm.sample_utils import make_sampler

    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    ids = prompt(resident_model(model_dir).args.vocab_size)
    sampler = make_sampler(1.0)
    mx.random.seed(11)
    want = [t for t, _ in generate_step(ids, resident_model(model_dir), max_tokens=TOKENS,
                                        sampler=sampler)]
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_TINY, tmp_path / "s.json")):
        model = streamed(blob_dir)
        session = model.expertd_session
        try:
            mx.random.seed(11)
            got = [t for t, _ in pipelined_step(ids, model, max_tokens=TOKENS, sampler=sampler)]
            assert session.counters["replays"] > 0  # the case this test is about
        finally:
            session.close()
    assert got == want


def revoke_every(n: int, session, monkeypatch) -> None:
    """Have every ``n``-th pull of ``session`` find its step revoked, as the daemon revokes a
    step held past the lease bound: the record's step written into ``lost`` mid-step."""
    puller = session.puller
    assemble = puller.assemble
    calls = [0]

    def revoking(layer, idx, pool):
        calls[0] += 1
        epoch = session.step_epoch
        if calls[0] % n == 0 and epoch.inside:
            native.publish_u64(epoch._raw, epoch._lost_at, epoch.step)
        return assemble(layer, idx, pool)

    monkeypatch.setattr(puller, "assemble", revoking)


def test_a_step_revoked_in_flight_is_replayed_with_the_one_built_on_it(
        models, isolated_env, tmp_path, monkeypatch):
    """The daemon writes the record's step into ``lost`` while two steps are in flight: the
    first is replayed, the one built on its token abandoned, and the tokens stay exact."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    ids = prompt(resident_model(model_dir).args.vocab_size, 11)
    want = reference(model_dir, ids)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model = streamed(blob_dir)
        session = model.expertd_session
        try:
            revoke_every(25, session, monkeypatch)
            got = list(pipelined_step(ids, model, max_tokens=TOKENS))
            assert_same(got, want)
            assert session.counters["replays_epoch"] >= 2
        finally:
            session.close()


def test_two_pipelining_clients_evicting_each_others_rows(models, isolated_env, tmp_path):
    """This process and an ``expertd generate`` beside it, both pipelining over an arena of a
    few rows: each one's demands evict the rows the other pulls, and both stay exact."""
    import subprocess
    import sys

    import mlx_lm

    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    tokenizer = load_tokenizer(model_dir)
    text = "Two clients share one arena"
    want_text = mlx_lm.generate(resident_model(model_dir), tokenizer, text, max_tokens=40)
    ids = prompt(resident_model(model_dir).args.vocab_size, 9)
    want = reference(model_dir, ids, 40)
    with Daemon(blob_dir, isolated_env,
                *client_flags(blob_dir, ROWS_TINY, tmp_path / "s.json")) as daemon:
        other = subprocess.Popen(
            [sys.executable, "-m", "expertd", "generate", "--blobs", str(blob_dir), "--prompt",
             text, "--ignore-chat-template", "--max-tokens", "40", "--prefetch", "off",
             "--pool-gb", str(pool_gb(blob_dir, 4)), "--pull", "host", "--speculate", "on",
             "--verbose", "False"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            model = streamed(blob_dir)
            try:
                assert_same(list(pipelined_step(ids, model, max_tokens=40)), want)
            finally:
                model.expertd_session.close()
            out, err = other.communicate(timeout=240)
        finally:
            if other.poll() is None:
                other.kill()
                other.communicate()
        assert other.returncode == 0, err
        assert out.rstrip("\n") == want_text, err
        assert daemon.stats()["fills"] > ROWS_TINY


def test_stream_generate_matches_mlx_lm_and_leaves_the_rest_to_it(models, isolated_env,
                                                                   tmp_path):
    import mlx_lm

    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    tokenizer = load_tokenizer(model_dir)
    text = "Pipelined steps stay exact"
    want = [r.token for r in mlx_lm.stream_generate(resident_model(model_dir), tokenizer, text,
                                                   max_tokens=10)]
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model = streamed(blob_dir)
        try:
            out = list(stream_generate(model, tokenizer, text, max_tokens=10))
            assert [r.token for r in out] == want
            assert out[-1].finish_reason in ("stop", "length") and out[-1].generation_tokens
            steps = model.expertd_session.counters["speculative_steps"]
            assert steps > 0
            # A quantized KV cache is mlx-lm's loop (which this one does not do): same tokens.
            assert not pipelines(model, {"kv_bits": 8})
            assert not pipelines(resident_model(model_dir), {})
            again = [r.token for r in stream_generate(model, tokenizer, text, max_tokens=10,
                                                      kv_bits=8, quantized_kv_start=10**6)]
            assert again == want
        finally:
            model.expertd_session.close()


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_turns_on_one_kept_cache_are_mlx_lm_s(models, isolated_env, tmp_path, temp):
    """A chat's turns: ``stream_generate`` on one KV cache kept across turns, each turn ended by
    its token limit, over an arena of a few rows (bad steps replayed). As mlx-lm's loop, the
    step launched on a turn's last token leaves its KV entries in the cache, checked (and
    replayed if bad), and its sample draws from the random key: the next turn's tokens are
    mlx-lm's."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    tokenizer = load_tokenizer(model_dir)
    turns = ["first turn", "and the second", "a third one"]

    def chat(model, generate):
        mx.random.seed(5)
        cache, sampler = make_prompt_cache(model), make_sampler(temp)
        return [[r.token for r in generate(model, tokenizer, text, max_tokens=9,
                                           prompt_cache=cache, sampler=sampler)]
                for text in turns]

    want = chat(resident_model(model_dir), mlx_lm.stream_generate)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_TINY, tmp_path / "s.json")):
        model = streamed(blob_dir)
        try:
            assert chat(model, stream_generate) == want
            assert model.expertd_session.counters["replays_absent"] > 0
        finally:
            model.expertd_session.close()


def test_a_pipelining_record_advances_by_two_and_sees_a_loss_of_any_step_in_flight():
    raw = np.zeros(EPOCH_DTYPE.itemsize, np.uint8)
    pid_at = EPOCH_DTYPE.fields["pid"][1]
    step_at, lost_at = EPOCH_DTYPE.fields["step"][1], EPOCH_DTYPE.fields["lost"][1]
    native.publish_u64(raw, pid_at, 1234)
    epoch = StepEpoch(raw, 0)
    epoch.begin()
    first = epoch.step
    epoch.begin()  # a second launch while the first is in flight: the record stays
    assert epoch.step == first == native.read_u64(raw, step_at)
    assert not epoch.check(first, more=True)  # the first checked, the second still in flight
    assert epoch.step == first + 2 == native.read_u64(raw, step_at)
    native.publish_u64(raw, lost_at, first + 2)  # the daemon gives up while it shows first + 2
    assert epoch.check(first, more=True)  # launched at first, in flight at first + 2: lost
    assert epoch.check(first + 2, more=True)  # launched while first + 2 showed: lost too
    assert not epoch.check(first + 4, more=False)  # launched after the loss: not covered
    assert not epoch.inside and epoch.step == first + 7 == native.read_u64(raw, step_at)


def test_a_puller_dropped_at_a_drain_leaves_the_loop_pipelining(models, isolated_env, tmp_path):
    """A pull found to differ from the host copy (Metal's check; forced here) at a drain drops
    the puller for the rest of the process: later steps pull nothing, so they are never
    drained (there is nothing to promote), and the loop goes on launching each step before
    checking the one before. (The drains' interval moved only on pulled steps, so one that
    was due when the puller went stayed due for good: every later step waited for the one
    before, the device idle while the host built.) Each generation starts draining at the
    shortest interval."""
    from expertd.client.speculation import DRAIN_EVERY, MAX_DRAIN_EVERY, Drains

    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    ids = prompt(resident_model(model_dir).args.vocab_size)
    want = reference(model_dir, ids, 64)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model = streamed(blob_dir)
        session = model.expertd_session
        steps = model.__dict__["_expertd_steps"]
        try:
            steps.drains = Drains(every=MAX_DRAIN_EVERY)  # a previous generation's
            loop = pipelined_step(ids, model, max_tokens=40)
            next(loop)
            assert steps.drains.every == DRAIN_EVERY
            loop.close()
            settles, dropped = [], []
            settle, drifted = steps.settle, steps.checks.drifted

            def recorded(step, after=None):
                settles.append((bool(dropped), after is not None))
                return settle(step, after)

            def drifting_at_a_drain(pulled, kinds):
                if not dropped and steps._settled is None and steps.drains.due():
                    dropped.append(True)
                    return pulled[0][0].layer.index  # the step is replayed, the puller dropped
                return drifted(pulled, kinds)

            steps.settle, steps.checks.drifted = recorded, drifting_at_a_drain
            # (the first drain comes once replays of rows absent from the cold arena, each
            # a drain, stopped resetting the interval: 36 steps in)
            got = list(pipelined_step(ids, model, max_tokens=64))
            assert_same(got, want)
            assert dropped and session.puller is None
            later = [pipelined for was_dropped, pipelined in settles if was_dropped]
            assert len(later) > 10 and sum(later) > len(later) // 2
        finally:
            session.close()


def test_a_replay_that_promoted_brings_the_drains_back_to_the_shortest_interval(
        models, isolated_env, tmp_path):
    """A replayed step (and the prompt's last) runs checked with nothing in flight, so it is a
    drain: what it promoted sets the interval as a pipelined loop's drain does (a promotion in
    a replay left the interval where 64 steps of promoting nothing had put it)."""
    from expertd.client.speculation import DRAIN_EVERY, MAX_DRAIN_EVERY, Drains

    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    ids = prompt(resident_model(model_dir).args.vocab_size)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model = streamed(blob_dir)
        session = model.expertd_session
        steps = model.__dict__["_expertd_steps"]
        try:
            cache = mlx_cache(model)
            model(ids[:-1][None], cache=cache)  # the prompt, on the checked path
            promoted = []
            for layer in steps.layers:  # a decode's drain promotes what it pulled
                real = layer.promote_pulled

                def promote_pulled(experts, arrays, counted=True, real=real):
                    promoted.append(real(experts, arrays, counted))
                    return 1  # as if the policy had promoted one of them

                layer.promote_pulled = promote_pulled
            steps.drains = Drains(every=MAX_DRAIN_EVERY, pipelined=5)
            pulled = session.counters["pulled_steps"]
            mx.eval(model(ids[-1:][None], cache=cache))  # a decode step through Steps.run
            assert session.counters["pulled_steps"] > pulled and promoted
            assert steps.drains == Drains(every=DRAIN_EVERY, pipelined=0)
        finally:
            session.close()


def mlx_cache(model):
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


@pytest.mark.parametrize("loop", ["pipelined", "mlx-lm"])
def test_replays_on_rows_absent_from_the_arena_are_told_to_speculation(
        models, isolated_env, tmp_path, loop):
    """Every replay of a decode step is told to Speculation, one on rows absent from the arena
    as such (Steps.settle in expertd's loop, Steps.run in mlx-lm's and in a replay): auto
    weighs those in its cost, so that where the arena is too small for what the steps route
    to it may stop for steps that wait per layer. Speculating "on" here, so that every step
    speculates; the tokens stay resident's."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    ids = prompt(resident_model(model_dir).args.vocab_size)
    want = reference(model_dir, ids)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_TINY, tmp_path / "s.json")):
        model = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off",
                     pool_backing="device", pull="host", speculate="on")[0]
        session = model.expertd_session
        speculation = model.__dict__["_expertd_steps"].speculation
        told, record = [], speculation.record

        def recording(replayed: bool, absent: bool = False) -> None:  # passed on as it came
            told.append((replayed, absent))
            record(replayed, absent)

        speculation.record = recording
        try:
            run = pipelined_step if loop == "pipelined" else generate_step
            assert_same(list(run(ids, model, max_tokens=TOKENS)), want)
            c = session.counters
            assert c["replays_absent"] > 0  # the case this test is about
            assert sum(r for r, _ in told) == c["replays"], (told, dict(c))
            assert sum(r and a for r, a in told) == c["replays_absent"], (told, dict(c))
        finally:
            session.close()
