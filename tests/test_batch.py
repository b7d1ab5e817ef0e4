"""A batch decoded on expertd's pipelined step (client/batch.py): mlx-lm's BatchGenerator, each
step launched before the last is checked.

Every sequence's tokens and log-probabilities equal resident mlx-lm's ``BatchGenerator`` run
on the same requests with the same batch sizes, bit for bit: for 1 to 16 sequences at once,
greedy and sampled, with requests joining and leaving mid-batch, while rows are absent from
the arena (bad steps replayed), while the daemon revokes a step in flight, and with pools
too small for a batch where nothing pulls (every step's misses replayed).
"""

import mlx.core as mx
import pytest
from client_helpers import ROWS_ALL, ROWS_TINY, client_flags, pool_gb, routed_model
from harness import Daemon
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.sample_utils import make_sampler
from test_decode import revoke_every
from test_pull import PULLS
from test_step import GatherPuller, expert_stacks, resident_model

from expertd.client import load
from expertd.client.batch import StreamedBatchGenerator, batch_generate

SIZES = (1, 2, 4, 8, 16)


def prompts(vocab: int, n: int) -> list:
    return [[(31 * i + 7 * s) % (vocab - 8) + 4 for i in range(3 + s % 5)] for s in range(n)]


def decode(cls, model, requests: list, *, temp: float = 0.0, join_after: int | None = None,
           draw_between: bool = False, **sizes) -> list:
    """Each request's ``(tokens, logprobs)`` from a ``cls`` batch generator: ``requests`` are
    ``(prompt, max_tokens)``; with ``join_after``, the second half is inserted once that many
    batches of tokens came out (they join mid-batch); with ``draw_between``, the caller draws
    from MLX's random key between batches. Seeded alike for every ``cls``."""
    mx.random.seed(11)
    gen = cls(model, **sizes)
    half = len(requests) // 2 if join_after is not None else len(requests)
    out = {}

    def insert(part):
        samplers = [make_sampler(temp) for _ in part] if temp else None
        uids = gen.insert([p for p, _ in part], [m for _, m in part], samplers=samplers)
        out.update({uid: ([], []) for uid in uids})
        return uids

    uids = insert(requests[:half])
    batches = 0
    try:
        while responses := gen.next_generated():
            for r in responses:
                out[r.uid][0].append(r.token)
                out[r.uid][1].append(r.logprobs)
            batches += 1
            if batches == join_after:
                uids += insert(requests[half:])
            if draw_between:
                mx.eval(mx.random.uniform(shape=(3,)))
    finally:
        gen.close()
    return [out[uid] for uid in uids]


def assert_same(got: list, want: list) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for s, ((_, a), (_, b)) in enumerate(zip(got, want)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert mx.array_equal(x, y).item(), f"sequence {s}, token {i}: logprobs differ"


def streamed(blob_dir, rows: int = 4, pull: str = "host"):
    return load(blob_dir, pool_gb=pool_gb(blob_dir, rows), prefetch="off",
                pool_backing="device", pull=pull, speculate="on")[0]


@pytest.mark.parametrize("pull", PULLS)
def test_batches_of_1_to_16_are_resident_ones_through_replays(models, isolated_env, tmp_path,
                                                              pull):
    """Batches of 1, 2, 4, 8 and 16 sequences over an arena of a few rows: every step is one
    pulled step whose absent rows replay it (and the one built on its tokens), exactly (the
    host copy here; on a GPU the device's own pull too)."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_TINY, tmp_path / "s.json")):
        model = streamed(blob_dir, pull=pull)
        session = model.expertd_session
        try:
            for size in SIZES:
                requests = [(p, 6 + s % 3) for s, p in enumerate(
                    prompts(resident.args.vocab_size, size))]
                sizes = dict(completion_batch_size=size, prefill_batch_size=size)
                want = decode(BatchGenerator, resident, requests, **sizes)
                before = dict(session.counters)
                assert_same(decode(StreamedBatchGenerator, model, requests, **sizes), want)
                d = {k: session.counters[k] - before[k] for k in before}
                assert d["pulled_steps"] > 0 and d["decode_tokens"] >= sum(m for _, m in requests)
                if size > 1:
                    assert d["batch_steps"] > 0 and 0 < d["union_experts"] <= d["routed_pairs"]
                assert not session.step_epoch.inside  # the generator closed: nothing in flight
            assert session.counters["replays_absent"] > 0  # rows the arena lacked: replayed
            assert session.counters["union_experts"] < session.counters["routed_pairs"]
        finally:
            session.close()


def test_a_device_puller_s_batch_steps_are_one_compiled_graph_a_layer(models, isolated_env,
                                                                      tmp_path):
    """With a device puller (its stand-in here, device operations alone as the kernels are), a
    batch's decode step is traced once a batch size and then runs compiled in every MoE layer:
    its routed experts pulled once into a stack, exactly resident's tokens and logprobs for
    2, 4, 8 and 16 sequences, promotions and all."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model = streamed(blob_dir)
        runtime, steps = model.expertd_session, model.__dict__["_expertd_steps"]
        session, layers = steps.session, steps.layers
        session.puller = GatherPuller(session.puller, expert_stacks(resident, session.manifest))
        try:
            for size in SIZES[1:]:
                requests = [(p, 8) for p in prompts(resident.args.vocab_size, size)]
                sizes = dict(completion_batch_size=size, prefill_batch_size=size)
                want = decode(BatchGenerator, resident, requests, **sizes)
                before = [layer.traces for layer in layers]
                assert_same(decode(StreamedBatchGenerator, model, requests, **sizes), want)
                # traced for this batch size (and for the sizes it shrank to as requests
                # finished), run compiled at the steps after
                assert all(layer.traces > b for layer, b in zip(layers, before))
                assert all(("block", "stacked") in layer._graphs for layer in layers)
            assert sum(layer.pool.counters["promoted"] for layer in layers) > 0
            assert steps.counters["union_experts"] < steps.counters["routed_pairs"]
        finally:
            session.puller = None
            runtime.close()


@pytest.mark.parametrize("pull", ["host", "off"])
def test_sampled_requests_joining_and_leaving_are_resident_ones(models, isolated_env, tmp_path,
                                                                pull):
    """Six requests of different lengths at temperature 1, per-request samplers, three decoding
    at most, prompts two at a time, half of them inserted mid-batch, the caller drawing from
    the random key between batches: each replayed step draws its tokens again with the key it
    had, and the caller's draws keep theirs. Without a puller (``off``) a pool of 4 rows misses
    at most steps of a batch, which are replayed per layer."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    requests = [(p, 8 + 3 * (s % 3)) for s, p in enumerate(
        prompts(resident.args.vocab_size, 6))]
    sizes = dict(completion_batch_size=3, prefill_batch_size=2)
    want = decode(BatchGenerator, resident, requests, temp=1.0, join_after=4, draw_between=True,
                  **sizes)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_TINY, tmp_path / "s.json")):
        model = streamed(blob_dir, pull=pull)
        session = model.expertd_session
        try:
            got = decode(StreamedBatchGenerator, model, requests, temp=1.0, join_after=4,
                         draw_between=True, **sizes)
            assert_same(got, want)
            assert session.counters["batch_steps"] > 0
            if pull == "off":
                assert session.counters["replays"] > 0  # the pool missed: replayed exactly
            assert not session.step_epoch or not session.step_epoch.inside
        finally:
            session.close()


def test_a_batch_step_revoked_in_flight_is_replayed(models, isolated_env, tmp_path, monkeypatch):
    """The daemon writes the record's step into ``lost`` while a batch's steps are in flight:
    the held step is replayed and the one built on its tokens abandoned, exactly."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    requests = [(p, 16) for p in prompts(resident.args.vocab_size, 4)]
    want = decode(BatchGenerator, resident, requests)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model = streamed(blob_dir)
        session = model.expertd_session
        try:
            revoke_every(20, session, monkeypatch)
            assert_same(decode(StreamedBatchGenerator, model, requests), want)
            assert session.counters["replays_epoch"] >= 2
        finally:
            session.close()


def test_batch_generate_is_mlx_lm_s(models, isolated_env, tmp_path):
    """expertd's ``batch_generate`` gives mlx-lm's token ids and texts, each sequence's final
    stop token left out as mlx-lm leaves it."""
    from mlx_lm import batch_generate as mlx_batch_generate
    from mlx_lm.utils import load_tokenizer

    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    ids = prompts(resident.args.vocab_size, 5)
    want = mlx_batch_generate(resident, tokenizer, ids, max_tokens=12, return_token_ids=True)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model = streamed(blob_dir)
        try:
            got = batch_generate(model, tokenizer, ids, max_tokens=12)
            assert got.token_ids == want.token_ids and got.texts == want.texts
            assert got.stats.generation_tokens == want.stats.generation_tokens
        finally:
            model.expertd_session.close()


def test_two_batches_on_one_model_take_turns(models, isolated_env, tmp_path):
    """Two batch generators on one model, stepped in turn at temperature 1 over an arena of a
    few rows: one's step launched settles the other's held step first (one step in flight at
    a time), and both draw what two resident generators stepped alike draw."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    ps = prompts(resident.args.vocab_size, 6)

    def turns(cls, model, check=None):
        mx.random.seed(3)
        gens = [cls(model, completion_batch_size=3, prefill_batch_size=3) for _ in range(2)]
        out = {}
        for g, part in zip(gens, (ps[:3], ps[3:])):
            uids = g.insert(part, [10] * 3, samplers=[make_sampler(1.0)] * 3)
            out.update({(id(g), u): [] for u in uids})
        try:
            live = list(gens)
            while live:
                for g in list(live):
                    responses = g.next_generated()
                    if not responses:
                        live.remove(g)
                    for r in responses:
                        out[(id(g), r.uid)].append(r.token)
                    if check is not None:
                        check(gens)
        finally:
            for g in gens:
                g.close()
        return list(out.values())

    def one_in_flight(gens):
        held = [g._generation_batch._held is not None for g in gens]
        assert sum(held) <= 1, held

    want = turns(BatchGenerator, resident)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_TINY, tmp_path / "s.json")):
        model = streamed(blob_dir)
        session = model.expertd_session
        try:
            assert turns(StreamedBatchGenerator, model, one_in_flight) == want
            assert session.counters["replays_absent"] > 0
            assert not session.step_epoch.inside
        finally:
            session.close()


def test_a_batch_whose_daemon_died_inside_a_step_decodes_no_more(models, isolated_env,
                                                                tmp_path):
    """The daemon killed while a batch step is in flight, a client that does not wait for it
    (reconnect_timeout 0): the step's check fails, nothing stays in flight, and the batch
    refuses to go on (its caches may hold a step that was never checked) rather than decode
    wrong tokens once a daemon is back. A batch emptied of its requests takes new ones."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    with Daemon(blob_dir, isolated_env,
                *client_flags(blob_dir, ROWS_TINY, tmp_path / "s.json")) as daemon:
        model = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off", pull="host",
                     speculate="on", reconnect_timeout=0)[0]
        session = model.expertd_session
        gen = StreamedBatchGenerator(model, completion_batch_size=4)
        try:
            uids = gen.insert(prompts(resident.args.vocab_size, 4), [40] * 4)
            for _ in range(3):
                assert gen.next_generated()
            assert gen._generation_batch._held is not None  # a step in flight
            daemon.kill()
            with pytest.raises(Exception) as failed:
                while gen.next_generated():
                    pass
            assert not isinstance(failed.value, RuntimeError) or "stopped inside" not in str(
                failed.value)
            assert gen._generation_batch._held is None  # the session detached: no epoch
            with pytest.raises(RuntimeError, match="stopped inside a step"):
                gen.next_generated()
            gen.remove(uids)
            assert gen._generation_batch._broken is None
        finally:
            gen.close()
            session.close()


def test_a_request_whose_prompt_a_cache_covers_whole(models, isolated_env, tmp_path):
    """A request inserted with a cache of its whole prompt and nothing left to compute (what
    mlx_lm.server's prompt cache gives a prompt it holds exactly): mlx-lm's batch raises, on
    the server's generation thread; expertd's gives its last token again, its cache trimmed
    by one, as mlx-lm's single-request path does, and decodes what resident mlx-lm's batch
    decodes from its own cache trimmed so. (Not compared with a fresh prefill of the whole
    prompt: mlx-lm does not make a prompt's entries for a position equal a decode step's, and
    on an H100 that comparison failed; the trimmed one is what mlx-lm's own path computes.)"""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    prompt = prompts(resident.args.vocab_size, 1)[0]

    def first(gen):
        gen.insert([prompt], [5])
        while responses := gen.next_generated():
            done = [r for r in responses if r.finish_reason is not None]
        return done[0].prompt_cache, done[0].all_tokens

    def rest(gen):
        got = []
        while responses := gen.next_generated():
            got += [r.token for r in responses]
        return got

    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model = streamed(blob_dir)
        try:
            mine, theirs = StreamedBatchGenerator(model), BatchGenerator(resident)
            try:
                cache, tokens = first(mine)
                with pytest.raises(ValueError, match="empty prompt"):
                    theirs.insert_segments([[]], [4], [first(theirs)[0]], [tokens])
                mine.insert_segments([[]], [4], [cache], [tokens])
                got = rest(mine)
            finally:
                mine.close()
                theirs.close()
            theirs = BatchGenerator(resident)
            try:
                cache, resident_tokens = first(theirs)
                assert resident_tokens == tokens
                trim_prompt_cache(cache, 1)
                theirs.insert_segments([[tokens[-1:]]], [4], [cache], [tokens[:-1]])
                want = rest(theirs)
            finally:
                theirs.close()
            assert len(got) == 4 and got == want
        finally:
            model.expertd_session.close()


@pytest.mark.parametrize("room", [0, 1])
def test_a_batch_whose_stacks_do_not_fit_waits_per_layer(models, isolated_env, tmp_path,
                                                         monkeypatch, room):
    """The free memory a pulled batch step's stacks are weighed against (every layer's, a row
    per routed expert: they may all be allocated at once), stood in for by the figure the
    step reads: a byte short of twice them, the batch's steps wait per layer, exactly; with
    room, they speculate."""
    from expertd.client import step

    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    requests = [(p, 8) for p in prompts(resident.args.vocab_size, 4)]
    sizes = dict(completion_batch_size=4, prefill_batch_size=4)
    want = decode(BatchGenerator, resident, requests, **sizes)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model = streamed(blob_dir)
        session = model.expertd_session
        try:
            m = session.manifest
            stacks = sum(min(layer.num_experts, 4 * m.top_k) * layer.expert_bytes
                         for layer in m.layers)
            monkeypatch.setattr(step, "free_memory", lambda: 2 * stacks - 1 + room)
            assert_same(decode(StreamedBatchGenerator, model, requests, **sizes), want)
            c = session.counters
            assert c["batch_steps"] > 0
            if room:
                assert c["routed_pairs"] and c["speculative_steps"] >= c["batch_steps"] // 2, c
            else:
                assert c["speculative_steps"] == 0, c
        finally:
            session.close()
