"""Rows pulled from the arena during a step (client/pull.py): exact, with one wait a step.

The host puller is the CPU's twin of the device pullers: the same statuses, the same assembled
arrays, the same step check and replay. Each step's logits are compared with resident mlx-lm's,
bit for bit, while pools hold a few rows and the daemon's arena all or few experts.
"""

import gc
import os
import time

import mlx.core as mx
import numpy as np
import pytest
from client_helpers import (
    PROMPT_LENGTHS,
    ROWS_ALL,
    ROWS_MEDIUM,
    ROWS_TINY,
    client_flags,
    compare_runs,
    parse_metrics,
    pool_gb,
    replay_causes_shown,
    require_repeatable,
    routed_model,
)
from conftest import FAMILY_MODES
from harness import Daemon, expertd_cli, query_stats, wait_until
from test_step import Lockstep, resident_model

from expertd import native
from expertd.client import load
from expertd.client.counters import REPLAY_COUNTERS
from expertd.client.pull import (
    ABSENT,
    PULLED,
    HostPuller,
    decode_status,
    encode_miss,
    make_puller,
)
from expertd.client.pull_kernels import (
    N_FIXED,
    P_N_ROWS,
    cuda_source,
    input_names,
    kernel_params,
    metal_source,
    output_names,
    vector_copy,
)
from expertd.client.session import Session
from expertd.manifest import Manifest
from expertd.shm.layout import SLOT_DTYPE


def test_status_codes_round_trip():
    experts = np.array([0, 5, 127, 3])
    kinds = np.array([PULLED, ABSENT, PULLED, ABSENT])
    status = np.concatenate([[4, 0], encode_miss(experts, kinds)])
    rows, got_experts, got_kinds = decode_status(status)
    assert rows.tolist() == [4, 0, -1, -1, -1, -1]
    assert got_experts.tolist() == [-1, -1, 0, 5, 127, 3]
    assert got_kinds.tolist() == [-1, -1, PULLED, ABSENT, PULLED, ABSENT]


def device_pulls() -> bool:
    """The device can pull here (a GPU run of the suite): the device pullers are tested too."""
    return mx.default_device() == mx.gpu


PULLS = ["host"] + (["device"] if device_pulls() else [])


@pytest.mark.parametrize("pull", PULLS)
@pytest.mark.parametrize("family,mode,bits", [("qwen3_moe", "affine", 4)])
@pytest.mark.parametrize("arena_rows", [ROWS_ALL, ROWS_TINY])
def test_pulled_steps_are_exact(models, isolated_env, tmp_path, family, mode, bits, arena_rows,
                                pull):
    model_dir, blob_dir = routed_model(models, family, mode, bits)
    with Daemon(blob_dir, isolated_env,
                *client_flags(blob_dir, arena_rows, tmp_path / "s.json")) as daemon:
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off",
                        pool_backing="device", pull=pull, speculate="on")
        session = model.expertd_session
        try:
            assert session.puller is not None and session.step_epoch is not None
            run = Lockstep(resident_model(model_dir), model, prompt_len=9)
            for _ in range(10):
                run.step()
            c = session.counters
            assert c["pulled_steps"] > 0
            assert session.pull_counters()["rows_pulled"] > 0
            assert c["replays"] == c["replays_absent"] + c["replays_epoch"]
            # The heartbeat carries them to status: rows and bytes pulled, steps replayed.
            pulled = session.pull_counters()

            pull_us = round(1e6 * pulled["pull_s"])
            assert pull_us > 0 and pulled["timed_bytes"] > 0  # the prompt's pulls, timed

            def reported():
                mine = [p for p in daemon.stats()["client_pools"] if p["pid"] == os.getpid()]
                return (mine and mine[0].get("pulled_rows") == pulled["rows_pulled"]
                        and mine[0].get("pull_us") == pull_us and mine[0])

            mine = wait_until(reported, 30, "the heartbeat to report the pulls")
            assert mine["pulled_bytes"] == pulled["bytes_pulled"]
            assert mine["pull_timed_bytes"] == pulled["timed_bytes"]
            for key in ("replays", *REPLAY_COUNTERS):
                assert mine[key] == c[key], key
            status = expertd_cli("status", "--blobs", blob_dir)
            causes = replay_causes_shown(c)
            shown = (f"{c['replays']} replayed ({causes}), pulled " if c["replays"]
                     else "a step, pulled ")
            assert shown in status.stdout, status.stdout
            gbps = pulled["timed_bytes"] / pull_us / 1e3
            assert f"a step, prompt pulls at {gbps:.1f} GB/s" in status.stdout, status.stdout
            # /metrics: the same counts, and the rate of the timed pulls.
            from expertd.client.serve_metrics import ServerCounters, render_metrics

            values, _ = parse_metrics(render_metrics(None, ServerCounters(),
                                                     model.expertd_session.all_counters()))
            assert values["expertd_client_pulled_rows_total"] == pulled["rows_pulled"]
            for key in ("replays", *REPLAY_COUNTERS):
                assert values[f"expertd_client_{key}_total"] == c[key], key
            assert values["expertd_client_pull_timed_bytes_total"] == pulled["timed_bytes"]
            assert values["expertd_client_pull_gbps"] == (
                pulled["timed_bytes"] / pulled["pull_s"] / 1e9) > 0
        finally:
            session.close()


def test_the_pull_rate_leaves_out_a_kernels_first_pass(models, isolated_env, tmp_path):
    """A device kernel's first pull is mostly its compilation (1.4 s for 0.4 MB on an H200,
    which made the rate 0.0003 GB/s): the pass after a kernel is built counts its rows, not
    its time and bytes in the rate. Two prompts, the first with a kernel just built."""
    _, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    with Daemon(blob_dir, isolated_env,
                *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off",
                        pool_backing="device", pull="host", speculate="on")
        puller = model.expertd_session.puller
        # Both prompts wait per layer, whose passes are timed (a speculative one's are not).
        model.expertd_session.steps.speculate_prompts = False
        ids = mx.array([[(7 * i + 3) % 400 + 8 for i in range(40)]])
        try:
            for warming in (True, False):
                before = dict(puller.counters)
                puller.warming = warming  # as _KernelPuller.kernel leaves it after a build
                mx.eval(model(ids))
                got = {k: puller.counters[k] - before[k] for k in before}
                assert got["bytes_pulled"] > 0 and not puller.warming
                if warming:  # the first pass taken, left out of the rate; the others in it
                    assert 0 < got["timed_bytes"] < got["bytes_pulled"], got
                else:
                    assert got["timed_bytes"] == got["bytes_pulled"] and got["pull_s"] > 0, got
        finally:
            model.expertd_session.close()


@pytest.mark.parametrize("family_mode", FAMILY_MODES, ids=[f"{f}-{m}{b}" for f, m, b in
                                                          FAMILY_MODES])
def test_every_family_at_the_smallest_pools(models, isolated_env, tmp_path, family_mode):
    """Pools of top-k rows a layer (the smallest that works), an arena of a few rows: prompts
    of 1, 17 and 300 tokens and 20 decode steps, logits bit-identical to resident mlx-lm."""
    family, mode, bits = family_mode
    model_dir, blob_dir = routed_model(models, family, mode, bits)
    top_k = Manifest.load(blob_dir).top_k
    require_repeatable(resident_model(model_dir), max(PROMPT_LENGTHS))
    with Daemon(blob_dir, isolated_env,
                *client_flags(blob_dir, ROWS_MEDIUM, tmp_path / "s.json")):
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, top_k), prefetch="off",
                        pool_backing="device", pull="host", speculate="on")
        session = model.expertd_session
        try:
            assert all(pool.rows == top_k for pool in session.pools)
            runs = compare_runs(resident_model(model_dir), model,
                                resident_model(model_dir).args.vocab_size)
            for run in runs:
                assert run["mismatch"] is None, f"prompt {run['length']}: step {run['mismatch']}"
            assert session.counters["pulled_steps"] > 0
        finally:
            session.close()


class CheckedPuller(HostPuller):
    """A puller checked as Metal's is on a user's Mac (its pulls compared with the host copy
    until one with rows from the arena agrees), whose output is the host copy's, or with
    ``drift`` that copy with one byte of every pulled row changed (a device reading the arena
    wrong)."""

    name = "metal"
    verify_first = True

    def __init__(self, view, layers, drift: bool):
        super().__init__(view, layers)
        self.drift, self.assembled = drift, 0

    def assemble(self, layer, ids, pool):
        self.assembled += 1
        arrays, status = super().assemble(layer, ids, pool)
        if not self.drift:
            return arrays, status
        pulled = mx.array(decode_status(np.array(status))[2] == PULLED)
        first = arrays[0]
        flat = first.reshape(first.shape[0], -1)
        changed = mx.where(pulled[:, None], flat + 1, flat).reshape(first.shape)
        return [changed, *arrays[1:]], status


@pytest.mark.parametrize("prompt,speculate", [(1, "on"), (40, "on"), (9, "off")],
                         ids=["speculative", "long-prompt", "per-layer"])
@pytest.mark.parametrize("drift", [False, True], ids=["faithful", "drifting"])
def test_a_pull_unlike_the_host_copy_stops_pulling(models, isolated_env, tmp_path, capfd,
                                                   drift, prompt, speculate):
    """Metal's safety on a user's Mac, run here through a puller checked as Metal's is, on the
    speculative path (the step's end), a prompt's per-layer calls and the per-layer decode:
    pulls equal to the host copy keep pulling, and once a pull with arena rows agreed a layer
    is compared no more; one that differs switches the process to the host path with one
    warning line, and no step's logits ever leave wrong."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off",
                        pool_backing="device", pull="host", speculate=speculate)
        session = model.expertd_session
        try:
            checked = CheckedPuller(session.session.view, session.puller.layers, drift)
            session.session.puller = checked  # the client session's puller (the runtime's)
            if prompt == 1:  # every expert in the arena: the first steps pull, speculatively
                for layer in session.manifest.layers:
                    session.demand_absent(layer.index,
                                          np.arange(layer.num_experts, dtype=np.int32))
            run = Lockstep(resident_model(model_dir), model, prompt_len=prompt)
            for _ in range(12):
                run.step()
            warned = [line for line in capfd.readouterr().err.splitlines()
                      if "differs from the host copy" in line]
            if drift:
                assert session.puller is None and session.session.pull_mode == "off"
                assert len(warned) == 1 and "metal pull of layer" in warned[0]
                if speculate == "on" and prompt == 1:  # caught at the step's end
                    assert session.counters["replays_device"] == 1
            else:
                assert session.puller is checked and warned == []
                assert checked.verified == set(range(len(session.pools)))
                assert session.counters["replays_device"] == 0
        finally:
            session.close()


class TornOnce(CheckedPuller):
    """A checked puller whose first pull inside an epoch finds the epoch revoked (as the
    daemon marks it when it gives up on a step) and its bytes torn, as a row refilled while
    the device read it would leave them."""

    def __init__(self, view, layers, session):
        super().__init__(view, layers, drift=False)
        self.session, self.torn = session, False

    def assemble(self, layer, ids, pool):
        epoch = self.session.step_epoch
        self.drift = not self.torn and epoch is not None and epoch.inside
        if self.drift:
            native.publish_u64(epoch._raw, epoch._lost_at, epoch.step)  # the daemon gave up
            self.torn = True
        return super().assemble(layer, ids, pool)


def test_a_torn_read_in_a_revoked_epoch_is_retried_not_blamed_on_the_device(
        models, isolated_env, tmp_path, capfd):
    """A prompt's pull whose epoch was revoked may read rows refilled under it: its bytes
    differ from the host copy, and the pass is retried (found by a review: it was taken for
    device drift, and the process stopped pulling for good)."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off",
                        pool_backing="device", pull="host", speculate="off")
        session = model.expertd_session.session
        try:
            for layer in session.manifest.layers:  # the prompt's pulls find every expert
                session.demand_absent(layer.index, np.arange(layer.num_experts, dtype=np.int32))
            puller = session.puller = TornOnce(session.view, session.puller.layers, session)
            retries = session.counters["retries"]
            run = Lockstep(resident_model(model_dir), model, prompt_len=9)
            for _ in range(3):
                run.step()
            assert puller.torn and session.counters["retries"] > retries
            assert session.puller is puller
            assert "differs from the host copy" not in capfd.readouterr().err
        finally:
            session.close()


def test_two_clients_evicting_each_others_rows(models, isolated_env, tmp_path):
    """Two clients pulling from an arena of a few rows, each exact while the other's demands
    evict the rows it pulls from."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    resident = resident_model(model_dir)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_TINY, tmp_path / "s.json")):
        clients = [load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off",
                        pool_backing="device", pull="host", speculate="on")[0]
                   for _ in range(2)]
        try:
            runs = [Lockstep(resident, m, prompt_len=5 + 4 * i) for i, m in enumerate(clients)]
            for _ in range(8):
                for run in runs:
                    run.step()
            stats = clients[0].expertd_session.stats()
            assert stats["fills"] > ROWS_TINY  # the rows were refilled under both clients
        finally:
            for m in clients:
                m.expertd_session.close()


def test_a_lost_epoch_replays_the_step_exactly(models, isolated_env, tmp_path, monkeypatch):
    """The daemon revokes a step (writes it into the client's ``lost``, as it does for a step
    held past the lease bound): the step's logits never leave the model, the step is replayed
    and the result is resident mlx-lm's."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off",
                        pool_backing="device", pull="host", speculate="on")
        session = model.expertd_session
        try:
            run = Lockstep(resident_model(model_dir), model, prompt_len=5)
            for _ in range(3):
                run.step()
            puller = session.puller
            assemble = puller.assemble
            revoke = [True]

            def revoked(layer, ids, pool):
                epoch = session.step_epoch
                if epoch.inside and revoke:  # as the daemon's EpochBook does to a step held
                    native.publish_u64(epoch._raw, epoch._lost_at, epoch.step)  # too long
                    revoke.clear()
                return assemble(layer, ids, pool)

            monkeypatch.setattr(puller, "assemble", revoked)
            before = session.counters["replays_epoch"]
            run.step()
            assert session.counters["replays_epoch"] == before + 1
            monkeypatch.setattr(puller, "assemble", assemble)
            run.step()
            assert session.counters["replays_epoch"] == before + 1
        finally:
            session.close()


def test_kernel_arguments():
    """The CUDA and Metal kernels' names, inputs, outputs and sources, built here (neither runs
    on this machine): one input per pool segment, one output per segment and the statuses,
    the arena's slot layout and the status codes written into both sources."""
    assert input_names(3) == ["ids", "table", "params", "pool0", "pool1", "pool2"]
    assert input_names(1, 2)[-3:] == ["arena_index", "arena_rows0", "arena_rows1"]
    assert output_names(2) == ["out0", "out1", "status"]
    for source in (cuda_source(3, True), metal_source(3, True)):
        for name in ("pool0", "pool2", "out0", "out2", "status", "params"):
            assert name in source
        assert f"* {SLOT_DTYPE.itemsize}" in source  # the slot record's size
        assert "-1 - 2 * code" in source and "-2 - 2 * code" in source
        # A row number out of the arena's range in slot_of (a client's scribble) is a miss.
        assert f"slot < params[{P_N_ROWS}]" in source
    assert "uint4" in cuda_source(1, True) and "uint4" not in cuda_source(1, False)
    assert "threadgroup_position_in_grid" in metal_source(1, False)
    assert "blockIdx" in cuda_source(1, False)


def test_metal_adopts_the_arena_in_windows_within_its_largest_buffer():
    """Metal's largest buffer can be smaller than an arena of most of a Mac's memory: the arena
    is adopted as its index and windows of whole rows, each within the limit and 16 KiB-aligned;
    past the windows a kernel can bind beside its own buffers (or a row larger than the
    limit), the host copy stays, saying why."""
    from expertd.client.pull_kernels import METAL_BUFFERS, max_windows, metal_windows
    from expertd.shm.layout import ROW_ALIGN, Geometry

    # 9 segments (qwen3's affine): 8 windows; 12 (gpt-oss's affine): 2; every buffer counted.
    assert max_windows(9) == 8 and max_windows(12) == 2
    for n in (1, 9, 12):
        assert len(input_names(n, max_windows(n))) + len(output_names(n)) == METAL_BUFFERS
    g = Geometry(n_layers=48, n_experts=128, cache_rows=1000, side_rows=8, stride=4 * ROW_ALIGN)
    assert metal_windows(g, g.total_size, 1) == (g.rows_offset, 1, g.total_rows)
    for limit in (g.stride * 300, g.stride * 300 + g.stride - 1, g.total_size // 3):
        index, count, per = metal_windows(g, limit, 8)
        assert index == g.rows_offset and per * g.stride <= limit and count * per >= g.total_rows
        assert (count - 1) * per < g.total_rows and per == limit // g.stride
        assert (g.rows_offset + per * g.stride) % ROW_ALIGN == 0
    assert metal_windows(g, g.stride * 300, 8)[1] == 4  # 1016 rows, 300 a window
    with pytest.raises(RuntimeError, match="one row"):
        metal_windows(g, g.stride - 1, 8)
    with pytest.raises(RuntimeError, match=f"need {-(-g.total_rows // 100)} Metal buffers"):
        metal_windows(g, g.stride * 100, 8)
    with pytest.raises(RuntimeError, match="need 4 Metal buffers .* binds 2 beside"):
        metal_windows(g, g.stride * 300, max_windows(12))
    assert metal_windows(g, g.stride * -(-g.total_rows // 8), 8)[1] == 8


@pytest.mark.skipif(device_pulls(), reason="the device pulls here")
def test_a_device_pull_refused_leaves_nothing_attached(models, isolated_env, tmp_path):
    """``pull="device"`` where the device cannot read the arena (MLX on the CPU) is refused
    in one line, and the failed attach leaves nothing behind: its connection is closed (the
    daemon forgets the client well before its time-out), and no finalizer later uses the
    closed socket (an unraisable error at collection, which pytest turns into this test's
    failure)."""
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    flags = client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json", client_timeout=60)
    with Daemon(blob_dir, isolated_env, *flags):  # no time-out forgets the client in the test
        with pytest.raises(RuntimeError, match="the device cannot pull from the arena: MLX "
                                               "runs on the CPU"):
            Session(blob_dir, pull="device")
        gc.collect()  # the failed session's finalizer runs here
        wait_until(lambda: query_stats(blob_dir)["clients"] == 0, 10,
                   "the daemon to forget the refused client")
        session = Session(blob_dir, pull="host")  # and the next attaches as before
        try:
            assert session.puller is not None and query_stats(blob_dir)["clients"] == 1
        finally:
            session.close()


def test_a_puller_slower_to_make_than_a_heartbeat_keeps_the_attach(models, isolated_env,
                                                                    tmp_path, monkeypatch):
    """Making the puller may take longer than a heartbeat interval (CUDA registering a large
    arena): the heartbeat thread starts only after it, so the first beat does not find the
    attachment half set, call the daemon lost, and have every later step attach again."""
    import expertd.client.pulling as pulling

    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    made = pulling.make_puller

    def slow(*args):  # a registration that takes three heartbeat intervals
        time.sleep(1.5)
        return made(*args)

    monkeypatch.setattr(pulling, "make_puller", slow)
    flags = client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json", heartbeat=0.5)
    with Daemon(blob_dir, isolated_env, *flags):
        session = Session(blob_dir, pull="host")
        try:
            session.check_alive()
            assert session.counters["reconnects"] == 0 and session.puller is not None
        finally:
            session.close()


def test_kernel_params_follow_the_arena(models, isolated_env, tmp_path):
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    with Daemon(blob_dir, isolated_env, *client_flags(blob_dir, ROWS_ALL, tmp_path / "s.json")):
        session = Session(blob_dir, pull="host")
        try:
            view = session.view
            g = view.arena.geometry
            params = kernel_params(view, 1, 12345)
            offsets, nbytes = view.segment_table(1)
            assert params[:N_FIXED].tolist() == [1, g.n_experts, g.slot_of_offset,
                                                 g.slots_offset, g.rows_offset, g.stride, 12345,
                                                 g.total_rows]
            assert params[N_FIXED::2].tolist() == offsets.tolist()
            assert params[N_FIXED + 1::2].tolist() == nbytes.tolist()
            assert vector_copy(view, 1) == all(x % 16 == 0 for x in (*offsets, *nbytes))
            # On this CPU, auto keeps the per-layer host path, and device says why it cannot.
            assert make_puller("auto", view, {}) is None
            with pytest.raises(RuntimeError, match="cannot pull"):
                make_puller("device", view, {})
        finally:
            session.close()
