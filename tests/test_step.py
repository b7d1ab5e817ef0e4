"""One host wait per decode step (client/step.py): speculative steps, their check and replay.

Real daemons and models; each step's logits are compared with resident mlx-lm's, bit for bit,
while the counters show which path each step took: a warm step waits for the host once, a step
that missed a pool (in the first, a middle or the last MoE layer; with the missing rows absent
from the arena too) is replayed exactly, and caches that cannot be trimmed back never speculate.
"""

import os

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from client_helpers import (
    ROWS_ALL,
    ROWS_TINY,
    client_flags,
    pool_gb,
    prompt_ids,
    require_repeatable,
    routed_model,
)
from conftest import FAMILY_MODES
from harness import Daemon, expertd_cli, wait_until
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
    trim_prompt_cache,
)

from expertd.client import load
from expertd.client.kvcache import replayable
from expertd.client.pull import HostPuller
from expertd.client.speculation import MIN_WINDOW, SHADOW_STEPS

_resident = {}


def resident_model(model_dir):
    if model_dir not in _resident:
        _resident[model_dir] = mlx_lm.load(str(model_dir))[0]
    return _resident[model_dir]


class Lockstep:
    """Resident and streamed models decoding the same greedy tokens, logits compared each step."""

    def __init__(self, resident, streamed, prompt_len: int = 5, max_kv_size=None):
        self.models = resident, streamed
        self.caches = [make_prompt_cache(m, max_kv_size=max_kv_size) for m in self.models]
        self.x = mx.array([prompt_ids(prompt_len, resident.args.vocab_size)])
        self.steps = 0
        self.step()

    def step(self) -> None:
        self.last = self.x
        ref, got = (m(self.x, cache=c)[:, -1, :] for m, c in zip(self.models, self.caches))
        mx.eval(ref, got)
        assert ref.dtype == got.dtype and mx.array_equal(ref, got).item(), (
            f"streamed logits differ from resident ones at step {self.steps} (0: the prompt): "
            f"largest difference {mx.abs(ref - got).max().item()!r}, "
            f"same greedy token: {mx.array_equal(ref.argmax(-1), got.argmax(-1)).item()}")
        self.steps += 1
        self.x = mx.argmax(ref, axis=-1)[:, None]

    def again(self) -> None:
        """The last step once more: both caches trimmed back by its token, the same input."""
        for cache in self.caches:
            trim_prompt_cache(cache, 1)
        self.steps -= 1
        self.x = self.last
        self.step()


def counters(session) -> dict:
    return {k: session.counters[k] for k in ("steps", "host_waits", "speculative_steps",
                                              "unchecked_steps", "replays")}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@pytest.fixture
def warm(models, isolated_env, tmp_path):
    """A qwen3_moe client whose pools hold every expert, after a prompt."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    with Daemon(blob_dir, isolated_env,
                *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")) as daemon:
        # "on": these tests follow the mechanism; auto's verdict (it stops on this CPU when a
        # replay costs more than the waits it saves) has tests of its own.
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 16), prefetch="off",
                        fill_pools=True, speculate="on")
        model.daemon = daemon
        try:
            assert all(pool.complete for pool in model.expertd_session.pools)
            yield resident_model(model_dir), model
        finally:
            model.expertd_session.close()


def test_a_step_that_cannot_miss_is_not_checked(warm):
    """Every pool holds every expert: the client adds no wait to mlx-lm's own evaluation."""
    resident, model = warm
    session = model.expertd_session
    run = Lockstep(resident, model)
    before = counters(session)
    for _ in range(12):
        run.step()
    d = delta(counters(session), before)
    assert d == {"steps": 12, "host_waits": 0, "speculative_steps": 0, "unchecked_steps": 12,
                 "replays": 0}, d


def test_a_warm_decode_step_waits_for_the_host_once(warm):
    """A pool that lacks experts the step does not route to: one wait, at the step's end."""
    resident, model = warm
    session = model.expertd_session
    run = Lockstep(resident, model)
    for _ in range(2):
        run.step()
    pool = session.pools[1]
    routed = set()
    for _ in range(3):  # learn which experts this decode routes to in layer 1, then drop others
        before = pool.uses.copy()
        run.step()
        routed |= set(np.flatnonzero(pool.uses != before).tolist())
    unused = np.array(sorted(set(range(pool.num_experts)) - routed), dtype=np.int32)
    pool._evict(pool.row_of[unused])
    before = counters(session)
    for _ in range(12):
        run.step()
    d = delta(counters(session), before)
    assert d["steps"] == 12 and d["speculative_steps"] == 12 and d["unchecked_steps"] == 0, d
    assert d["host_waits"] == 12 + d["replays"] * len(session.pools), d
    assert d["replays"] < 12
    # The heartbeat carries the counts to the daemon's status.
    mine = counters(session)
    want = {"pid": os.getpid(), "pool_bytes": session.pool_bytes, "steps": mine["steps"],
            "host_waits": mine["host_waits"], "replays": mine["replays"]}
    wait_until(lambda: any(want.items() <= c.items() for c in model.daemon.stats()["client_pools"]),
               10, "the heartbeat's counts")
    status = expertd_cli("status", "--blobs", session.paths.blob_dir).stdout
    assert f"{mine['steps']} steps, {mine['host_waits'] / mine['steps']:.2f} host waits" in status


@pytest.mark.parametrize("family_mode", FAMILY_MODES, ids=[f"{f}-{m}{b}" for f, m, b in FAMILY_MODES])
def test_speculative_calls_run_compiled_and_exact_in_every_family(models, isolated_env, tmp_path,
                                                                  family_mode):
    """A decode's speculative call of a whole MoE block is one compiled graph (the router,
    the switch and the combining: layer.StreamedLayer.block_call; the first call of a shape
    runs plainly, and compiles the switch's call alone, layer.StreamedLayer._graph): its
    logits are resident's bit for bit in every family, on pools that hold every expert (the
    router's ids are the rows) and on pools that hold some (the ids remapped on the device,
    misses replayed), and the compiled graphs are what ran."""
    model_dir, blob_dir = routed_model(models, *family_mode)
    resident = resident_model(model_dir)
    require_repeatable(resident, 5)  # Lockstep's prompt
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        # Every expert at its index; all but two in the pools (few replays: most steps'
        # logits come from the compiled graphs).
        for rows, kind in ((ROWS_ALL, "identity"), (14, "remap")):
            model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, rows), prefetch="off",
                            fill_pools=True, speculate="on")
            session = model.expertd_session
            try:
                run = Lockstep(resident, model)
                before = counters(session)
                for _ in range(10):
                    run.step()
                d = delta(counters(session), before)
                layers = model.__dict__["_expertd_steps"].layers
                assert d["speculative_steps"] + d["unchecked_steps"] == 10, d
                assert d["replays"] <= 3, d
                assert all(set(layer._graphs) == {kind, ("block", kind)} for layer in layers), \
                    [set(layer._graphs) for layer in layers]
                # Traced once (the shape's second call), then run as a graph at every step.
                assert [layer.traces for layer in layers] == [1] * len(layers)
            finally:
                session.close()


class GatherPuller(HostPuller):
    """A device puller's stand-in on this CPU (the CUDA and Metal kernels cannot run here):
    its pull is device operations alone, as theirs, so a decode's call is one compiled graph
    with it. Pool hits from the pool's rows, misses from the checkpoint's own expert stacks
    (the bytes the arena holds), statuses as the kernels write them."""

    traceable = True

    def __init__(self, puller, stacks: dict):
        super().__init__(puller.view, puller.layers)
        self.stacks = stacks

    def pull(self, layer, ids, table, arrays):
        # (a stack's unwanted row, id -1, is never read: it takes expert 0's bytes)
        experts = mx.maximum(ids.reshape(-1).astype(mx.int32), 0)
        rows = mx.where(ids.reshape(-1) >= 0, table[experts], -1)
        hit = rows >= 0
        status = mx.where(hit, rows, -1 - 2 * experts).astype(mx.int32)
        out = []
        for pool, stack in zip(arrays, self.stacks[layer]):
            mask = hit.reshape((-1,) + (1,) * (pool.ndim - 1))
            out.append(mx.where(mask, pool[mx.maximum(rows, 0)], stack[experts]))
        return out, status


def expert_stacks(resident, manifest) -> dict:
    """Per MoE layer, the resident model's expert arrays in the manifest's segment order."""
    modules = dict(resident.named_modules())
    stacks = {}
    for layer in manifest.layers:
        stacks[layer.index] = []
        for seg in layer.segments:
            path, attr = seg.name.rsplit(".", 1)
            child = modules[layer.module]
            for part in path.split("."):
                child = child[part]
            stacks[layer.index].append(child[attr])
    return stacks


@pytest.mark.parametrize("family_mode", [FAMILY_MODES[0], FAMILY_MODES[3]],
                         ids=["qwen3_moe", "gpt_oss"])
def test_pulled_calls_compile_with_the_puller_they_were_made_with(models, isolated_env, tmp_path,
                                                                 family_mode):
    """The device's path: a decode's pulled call compiled whole (the pull among its
    operations, the statuses and rows out for the check and promotions), exact while
    promotions replace the pools' arrays; a new puller (as a new attach makes) is traced
    anew and the graphs made with the old one are dropped (they held its arena mapping);
    without a puller the ids are remapped. A stand-in puller pulls here (GatherPuller)."""
    model_dir, blob_dir = routed_model(models, *family_mode)
    resident = resident_model(model_dir)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 6), prefetch="off", pull="host",
                        speculate="on")
        runtime, steps = model.expertd_session, model.__dict__["_expertd_steps"]
        session, layers = steps.session, steps.layers  # the client session the layers ask
        stacks = expert_stacks(resident, session.manifest)
        first = session.puller = GatherPuller(session.puller, stacks)
        try:
            run = Lockstep(resident, model)
            before = counters(runtime)
            for step in range(18):
                if step == 7:
                    session.puller = GatherPuller(first, stacks)
                if step == 12:
                    session.puller = None
                run.step()
                if step == 7:
                    assert not any(entry[0] is first for layer in layers
                                   for entry in layer._graphs.values())
            d = delta(counters(runtime), before)
            # (a pull that found its expert absent from the arena runs the step again, without
            # waits, once the daemon has read it: a second speculative attempt)
            assert d["steps"] == 18 and d["speculative_steps"] >= 18 and d["replays"] <= 6, d
            assert sum(layer.pool.counters["promoted"] for layer in layers) > 0
            # Pulled with the first puller, with the second, remapped without: one trace each.
            assert [layer.traces for layer in layers] == [3] * len(layers)
        finally:
            session.puller = None
            runtime.close()


@pytest.mark.parametrize("device", [True, False], ids=["device-puller", "host-copy"])
def test_auto_probes_the_per_layer_cost_only_with_the_host_copy(models, isolated_env, tmp_path,
                                                                device):
    """Steps tells Speculation which puller pulls: under auto, a device puller's decode (the
    stand-in, traceable as the kernels are) waits once a step while nothing is replayed, and
    never times a step waiting per layer; the host copy's does (at PROBE_AT, or after rows
    found absent ran a step per layer)."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 6), prefetch="off", pull="host",
                        speculate="auto")
        runtime, steps = model.expertd_session, model.__dict__["_expertd_steps"]
        session = steps.session
        if device:
            session.puller = GatherPuller(session.puller, expert_stacks(resident, session.manifest))
        try:
            run = Lockstep(resident, model)
            before = counters(runtime)
            for _ in range(2 * MIN_WINDOW):
                run.step()
            d = delta(counters(runtime), before)
            if device:  # nothing is ever absent: the stand-in pulls the checkpoint's bytes
                assert d["replays"] == 0 and d["host_waits"] == d["speculative_steps"] \
                    == 2 * MIN_WINDOW, d
                assert steps.speculation.layer_s == 0.0  # never timed: no step waited per layer
            else:  # timed by the probe, or by a step run per layer after rows were absent
                assert steps.speculation.layer_s > 0, d
        finally:
            session.puller = None
            runtime.close()


def test_only_a_block_called_with_its_input_alone_is_guarded(models):
    """guard_block installs a new object of the block's class with BlockGuard in front,
    holding the same children, and leaves the block as it was; a decoder layer (called with
    a mask and a cache) is never guarded: its compiled call would hold the cache's state."""
    from expertd.client.switch import BlockGuard, guard_block

    model, _ = mlx_lm.load(str(routed_model(models, "qwen3_moe", "affine", 4)[0]))
    decoder = model.model.layers[1]
    block = decoder.mlp
    guarded = guard_block(block, "layer")
    assert isinstance(guarded, BlockGuard) and isinstance(guarded, type(block))
    assert not isinstance(block, BlockGuard) and type(guarded) is not type(block)
    assert dict(guarded) == dict(block) and guarded["switch_mlp"] is block["switch_mlp"]
    assert guarded.__dict__["_expertd_layer"] == "layer"
    assert guard_block(decoder, "layer") is None
    block.eval()  # the guarded object keeps the block's mode and frozen parameters
    block.freeze(keys=["gate"], recurse=False)
    guarded = guard_block(block, "layer")
    assert guarded.training is False and "gate" in guarded.__dict__["_no_grad"]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_miss_is_replayed_exactly(warm, where):
    """A pool emptied before a step: that layer misses, the step is trimmed back and replayed
    on the per-layer path (one wait per MoE layer), and the logits are still resident's."""
    resident, model = warm
    session = model.expertd_session
    layers = len(session.pools)
    index = {"first": 0, "middle": layers // 2, "last": layers - 1}[where]
    run = Lockstep(resident, model)
    for _ in range(2):
        run.step()
    before = counters(session)
    session.pools[index].forget()
    run.step()
    d = delta(counters(session), before)
    assert d == {"steps": 1, "host_waits": 1 + layers, "speculative_steps": 1,
                 "unchecked_steps": 0, "replays": 1}, d
    assert session.pools[index].counters["moved"] > 0  # the replay moved the rows back
    before = counters(session)
    for _ in range(3):  # the pool is incomplete now: its layer remaps on the device
        run.step()
    d = delta(counters(session), before)
    assert d["speculative_steps"] == 3 and d["host_waits"] == 3 + d["replays"] * layers


def test_a_miss_during_a_replay_is_read_from_the_disk(models, isolated_env, tmp_path):
    """Arena of 8 rows, pools of 4: replays move rows the daemon must read again, and other
    steps miss in the middle of their replay's moves; every step stays exact."""
    model_dir, blob_dir = routed_model(models, "mixtral", "affine", 8)
    with Daemon(blob_dir, isolated_env,
                *client_flags(blob_dir, ROWS_TINY, tmp_path / "s.json")) as daemon:
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off", speculate="on")
        session = model.expertd_session
        try:
            run = Lockstep(resident_model(model_dir), model, prompt_len=9)
            before, misses = counters(session), daemon.stats()["misses"]
            for _ in range(16):
                run.step()
            d = delta(counters(session), before)
            assert d["speculative_steps"] == 16 and d["replays"] > 0, d
            assert daemon.stats()["misses"] > misses  # the replays' moves read the SSD
        finally:
            session.close()


def test_a_rotating_cache_speculates_until_it_would_wrap(warm):
    resident, model = warm
    session = model.expertd_session
    run = Lockstep(resident, model, prompt_len=5, max_kv_size=12)
    assert isinstance(run.caches[1][0], RotatingKVCache)
    seen = []
    for _ in range(12):
        before = session.counters["unchecked_steps"]
        offset = run.caches[1][0].offset
        run.step()
        seen.append((offset, session.counters["unchecked_steps"] - before))
    # Every expert is in the pools: nothing can miss, so even a wrapping cache speculates.
    assert all(spec == 1 for _, spec in seen), seen
    session.pools[0].forget()  # now a miss is possible: a full rotating cache cannot replay
    before = counters(session)
    run.step()
    d = delta(counters(session), before)
    assert d["speculative_steps"] == 0 and d["host_waits"] == len(session.pools), d


def test_caches_that_cannot_be_trimmed_back_never_replay():
    kv, rotating = KVCache(), RotatingKVCache(max_size=8)
    rotating.offset = 6
    assert replayable([kv, rotating], 1)
    assert not replayable([kv, rotating], 2)  # would wrap
    assert not replayable([ArraysCache(2)], 1)  # SSM / linear-attention state
    assert replayable([], 1)


def test_the_host_copy_speculates_only_where_steps_waiting_per_layer_would_have_hit(
        models, isolated_env, tmp_path):
    """auto with the host copy, where a speculative step that misses a pool is computed twice:
    steps that miss wait per layer and never pay a replay; a step that found every expert in
    its pool (the same step again) counts toward speculating; after SHADOW_STEPS of them a
    step speculates, exactly; a miss then is replayed once, and the steps after it wait per
    layer again. Logits equal resident's throughout."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off")
        session = model.expertd_session
        speculation = session.steps.speculation
        try:
            run = Lockstep(resident_model(model_dir), model)

            def step(miss: bool, again: bool = False) -> dict:
                before = counters(session)
                if miss:
                    for pool in session.pools:
                        pool.forget()
                run.again() if again else run.step()
                return delta(counters(session), before)

            for _ in range(2 * SHADOW_STEPS):
                d = step(miss=True)
                assert d["speculative_steps"] == d["replays"] == 0 and d["host_waits"] > 1
            assert speculation.shadow_hits == 0
            for hits in range(1, SHADOW_STEPS + 1):
                step(miss=False, again=True)  # the same routing: every expert in its pool
                assert speculation.shadow_hits == hits
            d = step(miss=False, again=True)
            assert d["speculative_steps"] == 1 and d["replays"] == 0 and d["host_waits"] == 1
            d = step(miss=True)
            assert d["replays"] == 1 and speculation.shadow_hits == 0
            d = step(miss=True)
            assert d["speculative_steps"] == d["replays"] == 0
            assert speculation.stopped == 0  # waiting for the shadow, not stopped
        finally:
            session.close()
