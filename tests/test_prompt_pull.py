"""A prompt that speculates (client/step.py, StreamedLayer's stacked call): each MoE layer pulls
the rows of the experts its router chose into a stack on the device, and the prompt's model
call waits once, where a prompt that waits in each layer waits once per MoE layer.

The host puller is the CPU's twin of the device pullers (the same statuses and stacks). Every
prompt's logits, and the decode steps' after it, are compared with resident mlx-lm's, bit for
bit.
"""

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from client_helpers import ROWS_TINY, client_flags, pool_gb, prompt_ids, require_repeatable, routed_model
from conftest import FAMILY_MODES
from harness import Daemon
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from test_pull import PULLS, CheckedPuller
from test_step import Lockstep, resident_model

from expertd import native
from expertd.client import load
from expertd.client.kvcache import replayable, stacks_fit
from expertd.client.layer import DECODE_IDS
from expertd.client.pool import free_memory
from expertd.client.pull import HostPuller
from expertd.client.step import PROMPT_RETRY
from expertd.manifest import Manifest
from expertd.shm.layout import available_memory

# An arena that holds every expert of each family's test model for one client (its cap is
# half the rows not pinned, see expertd.serving.config.cache_limits).
ROWS_EVERY = 160
COUNTED = ("steps", "host_waits", "speculative_steps", "replays", "replays_absent",
           "replays_epoch")


def counts(session) -> dict:
    return {k: session.counters[k] for k in COUNTED}


def since(session, before: dict) -> dict:
    return {k: session.counters[k] - before[k] for k in COUNTED}


def every_expert_read(session) -> None:
    """Have the daemon read every expert into its arena: a prompt finds none absent."""
    for layer in session.manifest.layers:
        session.demand_absent(layer.index, np.arange(layer.num_experts, dtype=np.int32))


def prompt_length(top_k: int, tokens: int) -> int:
    """At least ``tokens``, and long enough to be a prompt (more than DECODE_IDS pairs)."""
    return max(tokens, DECODE_IDS // top_k + 1)


class UnsetRowsPuller(HostPuller):
    """The host puller with every row a stack does not want filled with NaN (the device
    kernels leave them unset): a computation that read one would show."""

    def assemble(self, layer, ids, pool):
        arrays, status = super().assemble(layer, ids, pool)
        unwanted = mx.array(np.array(ids).reshape(-1) < 0)
        return [mx.where(unwanted.reshape((-1,) + (1,) * (a.ndim - 1)),
                         mx.array(np.nan, mx.float16).astype(a.dtype) if mx.issubdtype(
                             a.dtype, mx.floating) else mx.array(-1).astype(a.dtype), a)
                for a in arrays], status


def timing_prompt(resident, model, session, layers: int, tokens: int) -> None:
    """A client's first prompt that pulls waits per layer, exactly, and times its pulls (the
    rate status and /metrics show): prompts speculate after it."""
    assert not session.pull_counters()["timed_bytes"]
    before = counts(session)
    Lockstep(resident, model, prompt_len=tokens)
    d = since(session, before)
    assert d["host_waits"] == layers and d["speculative_steps"] == 0, d
    assert session.pull_counters()["timed_bytes"] > 0


def extend(run: Lockstep, tokens: int) -> None:
    """Feed ``tokens`` more prompt tokens to both of ``run``'s models at once (a prompt on a
    cache that holds tokens already), logits compared."""
    run.x = mx.array([prompt_ids(tokens, run.models[0].args.vocab_size, seed=1)])
    run.step()


def streamed(blob_dir, rows: int, speculate: str = "auto", pull: str = "host",
             prompts: bool | None = True):
    """A client whose prompts speculate with the host copy too (``prompts``; by default only
    a device's pulls do: Steps.speculate_prompts), so that this CPU runs the path."""
    model = load(blob_dir, pool_gb=pool_gb(blob_dir, rows), prefetch="off",
                 pool_backing="device", pull=pull, speculate=speculate)[0]
    model.expertd_session.steps.speculate_prompts = prompts
    return model


@contextmanager
def qwen3_client(models, env, tmp_path, arena_rows: int = ROWS_EVERY, speculate: str = "auto",
                 timed: bool = True, prompts: bool | None = True):
    """``(resident, streamed model, its session, MoE layers)`` of the qwen3_moe test model:
    pools of 4 rows, a daemon with an arena of ``arena_rows`` rows, every expert read into it
    where it holds them all; with ``timed``, after the prompt that times the pulls (see
    :func:`timing_prompt`); ``prompts``: see :func:`streamed`."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    layers = len(Manifest.load(blob_dir).layers)
    resident = resident_model(model_dir)
    with Daemon(blob_dir, env, *client_flags(blob_dir, arena_rows, tmp_path / "s.json")):
        model = streamed(blob_dir, 4, speculate=speculate, prompts=prompts)
        session = model.expertd_session
        try:
            if arena_rows >= ROWS_EVERY:
                every_expert_read(session)
            if timed:
                timing_prompt(resident, model, session, layers, 40)
            yield resident, model, session, layers
        finally:
            session.close()


@pytest.mark.parametrize("pull", PULLS)
@pytest.mark.parametrize("family_mode", FAMILY_MODES, ids=[f[0] for f in FAMILY_MODES])
def test_a_prompt_waits_once_and_is_exact(models, isolated_env, tmp_path, family_mode, pull):
    """Every family, pools of top-k rows a layer (the smallest), the arena holding every
    expert: prompts of two lengths each run as one speculative step (one wait, nothing
    replayed), pull the experts their pools lack, and their logits and the decode steps'
    after them are resident mlx-lm's. On a GPU, with the device's pulls too."""
    model_dir, blob_dir = routed_model(models, *family_mode)
    manifest = Manifest.load(blob_dir)
    top_k, layers = manifest.top_k, len(manifest.layers)
    resident = resident_model(model_dir)
    require_repeatable(resident, 300)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_EVERY, tmp_path / "s.json")):
        model = streamed(blob_dir, top_k, pull=pull)
        session = model.expertd_session
        try:
            assert not any(pool.complete for pool in session.pools)
            assert (session.puller.name == "host") == (pull == "host")
            if pull == "host":
                session.session.puller = UnsetRowsPuller(session.session.view, session.puller.layers)
            every_expert_read(session)
            timing_prompt(resident, model, session, layers, prompt_length(top_k, 20))
            for tokens in (prompt_length(top_k, 17), 300):
                before, pulled = counts(session), session.pull_counters()["rows_pulled"]
                run = Lockstep(resident, model, prompt_len=tokens)
                d = since(session, before)
                if replayable(make_prompt_cache(resident), tokens):
                    assert d == dict(steps=1, host_waits=1, speculative_steps=1, replays=0,
                                     replays_absent=0, replays_epoch=0), tokens
                else:  # a sliding window's cache it would wrap (gpt-oss): per layer
                    assert d["speculative_steps"] == 0 and d["host_waits"] == layers, d
                assert session.pull_counters()["rows_pulled"] > pulled
                for _ in range(4):
                    run.step()
        finally:
            session.close()


def test_a_prompt_the_arena_lacks_rows_for_waits_per_layer(models, isolated_env, tmp_path):
    """A cold arena of a few rows: the prompt finds rows absent, is replayed once they were
    demanded, finds others absent (its later layers routed on rows it did not have), and runs
    per layer, exactly; the next PROMPT_RETRY prompts wait per layer straight away, and the
    one after speculates again."""
    with qwen3_client(models, isolated_env, tmp_path, ROWS_TINY) as (resident, model, session,
                                                                     layers):
        before = counts(session)
        Lockstep(resident, model, prompt_len=40)
        d = since(session, before)
        assert d["replays_absent"] == d["replays"] == 2, d
        assert d["host_waits"] == 2 + layers and d["speculative_steps"] == 2, d
        for i in range(PROMPT_RETRY + 1):
            before = counts(session)
            Lockstep(resident, model, prompt_len=33 + i)
            d = since(session, before)
            if i < PROMPT_RETRY:
                assert d["speculative_steps"] == 0 and d["host_waits"] == layers, (i, d)
        assert d["speculative_steps"] >= 1, d  # the retry: speculative again


def test_a_prompt_whose_epoch_is_lost_is_replayed_exactly(models, isolated_env, tmp_path,
                                                          monkeypatch):
    """The daemon revokes the prompt's step (as it does to a step held past the lease bound)
    while a layer pulls: the prompt's logits never leave, it runs again speculatively, and
    the result is resident mlx-lm's."""
    with qwen3_client(models, isolated_env, tmp_path) as (resident, model, session, _):
        puller = session.puller
        assemble = puller.assemble
        revoke = [True]

        def revoked(layer, ids, pool):
            epoch = session.step_epoch
            if epoch.inside and revoke:
                native.publish_u64(epoch._raw, epoch._lost_at, epoch.step)
                revoke.clear()
            return assemble(layer, ids, pool)

        run = Lockstep(resident, model, prompt_len=40)
        run.step()
        monkeypatch.setattr(puller, "assemble", revoked)
        before = counts(session)
        extend(run, 24)  # on a cache holding 41 tokens: the replay trims back to them
        assert not revoke
        assert since(session, before) == dict(
            steps=1, host_waits=2, speculative_steps=2, replays=1, replays_absent=0,
            replays_epoch=1)
        for _ in range(3):
            run.step()


def test_metal_prompts_wait_per_layer_until_their_pulls_agree(models, isolated_env, tmp_path):
    """A puller checked as Metal's is (its pulls compared with the host copy in each layer
    until one agrees): the first prompt waits per layer and is compared there; once every
    layer's pull agreed, prompts speculate."""
    with qwen3_client(models, isolated_env, tmp_path, timed=False) as (resident, model, session,
                                                                       layers):
        checked = CheckedPuller(session.session.view, session.puller.layers, drift=False)
        session.session.puller = checked
        before = counts(session)
        Lockstep(resident, model, prompt_len=40)
        assert since(session, before)["host_waits"] == layers
        assert checked.verified == set(range(layers))
        before = counts(session)
        Lockstep(resident, model, prompt_len=41)
        d = since(session, before)
        assert d["host_waits"] == d["speculative_steps"] == 1, d


def test_a_prompt_with_speculation_off_waits_per_layer(models, isolated_env, tmp_path):
    """``speculate="off"``: a prompt waits in each MoE layer, as every step does."""
    with qwen3_client(models, isolated_env, tmp_path, speculate="off",
                      timed=False) as (resident, model, session, layers):
        before = counts(session)
        Lockstep(resident, model, prompt_len=40)
        d = since(session, before)
        assert d["host_waits"] == layers and d["speculative_steps"] == 0, d


def test_a_prompt_with_the_host_copy_waits_per_layer_by_default(models, isolated_env, tmp_path):
    """The host copy waits for each layer's ids anyway: by default a prompt speculates only
    where the device pulls, else a speculative prompt would hold its epoch (and so other
    clients' refills) for the whole prompt and replay it whole on a row the arena lacks."""
    with qwen3_client(models, isolated_env, tmp_path, prompts=None) as (resident, model, session,
                                                                        layers):
        assert session.puller.name == "host" and not session.puller.traceable
        before = counts(session)
        run = Lockstep(resident, model, prompt_len=40)
        d = since(session, before)
        assert d["host_waits"] == layers and d["speculative_steps"] == 0, d
        run.step()


def test_a_prompt_speculates_only_where_every_stack_fits_in_half_the_free_memory():
    """Every layer's stack may be allocated before the first is freed: a prompt speculates
    only where they all fit in half the free memory (a model larger than memory waits per
    layer, one stack at a time); where the free memory is unknown, it speculates."""
    assert stacks_fit(10, None)
    assert stacks_fit(10, 20)
    assert not stacks_fit(11, 20)
    assert not stacks_fit(1, 0)


@pytest.mark.skipif(mx.device_info().get("free_memory") is not None,
                    reason="a discrete GPU says its own free memory")
def test_free_memory_on_shared_memory_is_the_hosts_available_memory(monkeypatch):
    """Where the GPU shares the host's memory (this CPU; Metal), what a prompt's stacks may
    take is bounded by the host's available memory, which counts other processes and the
    arena (MLX's own figures count neither)."""
    from expertd.client import pool

    host = available_memory()
    assert host is not None and host > 0
    monkeypatch.setattr(pool, "available_memory", lambda: 12345)  # a host short of memory
    assert free_memory() == 12345
    monkeypatch.setattr(pool, "available_memory", lambda: None)  # one that does not say
    assert free_memory() == pool.free_device_bytes()  # MLX's own figure, or None (the CPU)


@pytest.mark.parametrize("room", [0, 1], ids=["short-by-a-byte", "room"])
def test_a_prompt_whose_stacks_do_not_fit_waits_per_layer(models, isolated_env, tmp_path,
                                                          monkeypatch, room):
    """The free memory a prompt's stacks are weighed against (a machine short of memory,
    stood in for by the figure the step reads): a byte short of twice every layer's stack,
    the prompt waits per layer, exactly; with room, it speculates."""
    from expertd.client import step

    with qwen3_client(models, isolated_env, tmp_path) as (resident, model, session, layers):
        manifest = session.manifest
        stacks = sum(layer.num_experts * layer.expert_bytes for layer in manifest.layers)
        monkeypatch.setattr(step, "free_memory", lambda: 2 * stacks - 1 + room)
        before = counts(session)
        run = Lockstep(resident, model, prompt_len=40)
        d = since(session, before)
        assert d["speculative_steps"] == room and d["host_waits"] == (1 if room else layers), d
        run.step()


def test_a_batched_decode_step_is_one_pulled_step_and_fills_the_pools(models, isolated_env,
                                                                       tmp_path):
    """Twenty sequences decoding together (80 pairs a step, one token each) are not a
    prompt: each step is one speculative step, one host wait, whose layers pull the union of
    their sequences' experts once each (fewer than the pairs), exact; the experts that keep
    coming join the pools."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    vocab, batch = resident.args.vocab_size, 20
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_EVERY, tmp_path / "s.json")):
        model = streamed(blob_dir, 12, speculate="on")
        session = model.expertd_session
        try:
            every_expert_read(session)
            x = mx.array([prompt_ids(6, vocab, seed=i) for i in range(batch)])
            caches = [[BatchKVCache([0] * batch) for _ in resident.layers] for _ in range(2)]
            for step in range(12):
                ref, got = resident(x, cache=caches[0]), model(x, cache=caches[1])
                assert mx.array_equal(ref, got).item(), f"step {step}"
                x = mx.argmax(ref[:, -1:], axis=-1)
                if step == 0:
                    before = counts(session)
            d = since(session, before)
            assert d["speculative_steps"] == d["host_waits"] == d["steps"] == 11, d
            c = session.counters
            layers = len(session.pools)
            assert c["batch_steps"] == 11
            assert c["routed_pairs"] == 11 * batch * session.manifest.top_k * layers
            assert 0 < c["union_experts"] < c["routed_pairs"]
            assert all((pool.expert_of >= 0).sum() == pool.rows for pool in session.pools)
        finally:
            session.close()


@pytest.mark.parametrize("arena_rows", [ROWS_EVERY, ROWS_TINY])
def test_a_prompt_of_embeddings_alone_is_exact(models, isolated_env, tmp_path, arena_rows):
    """A model call given input embeddings and ids of size 0 (mlx-lm's models take those): its
    tokens are the embeddings', so it is a prompt, and a replay takes the cache back by them
    (one counted by its ids took back none and left the cache 80 tokens too long)."""
    with qwen3_client(models, isolated_env, tmp_path, arena_rows) as (resident, model, session,
                                                                      _):
        ids = mx.array([prompt_ids(40, resident.args.vocab_size, seed=2)])
        embeddings = resident.model.embed_tokens(ids)
        empty = mx.zeros((1, 0), mx.int32)
        caches = make_prompt_cache(resident), make_prompt_cache(model)
        ref = resident(empty, cache=caches[0], input_embeddings=embeddings)
        got = model(empty, cache=caches[1], input_embeddings=embeddings)
        assert mx.array_equal(ref, got).item()
        assert caches[1][0].offset == caches[0][0].offset == 40
        y = mx.argmax(ref[:, -1:], axis=-1)
        assert mx.array_equal(resident(y, cache=caches[0]), model(y, cache=caches[1])).item()


@pytest.mark.parametrize("pull", PULLS)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "plain"])
@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "waiting"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_each_path_alone_is_exact(models, isolated_env, tmp_path, family, speculative, compiled,
                                  pull):
    """A prompt speculative or waiting per layer, then decode steps with each MoE block's call
    compiled or not: each combination alone is exact, which tells a difference apart on a
    backend where one of them differs. Resident mlx-lm must first give the same logits twice:
    on MLX CUDA 0.32.4 the earlier tiny deepseek_v3's did not (NaN rows from its first
    attention's 64-input q_b_proj, on an H100 and an H200), and such cases are expected
    failures there (see require_repeatable)."""
    model_dir, blob_dir = routed_model(models, family, "affine", 4)
    manifest = Manifest.load(blob_dir)
    resident = resident_model(model_dir)
    length = prompt_length(manifest.top_k, 17)
    require_repeatable(resident, length)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_EVERY, tmp_path / "s.json")):
        model = streamed(blob_dir, manifest.top_k, pull=pull)
        session = model.expertd_session
        try:
            every_expert_read(session)
            timing_prompt(resident, model, session, len(manifest.layers), 40)
            session.steps.speculate_prompts = speculative
            for layer in session.steps.layers:
                layer.compiled = compiled
            before = counts(session)
            run = Lockstep(resident, model, prompt_len=length)
            assert since(session, before)["speculative_steps"] == int(speculative)
            for _ in range(5):
                run.step()
        finally:
            session.close()
