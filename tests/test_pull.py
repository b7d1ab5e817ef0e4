"""Rows pulled from the arena during a step (client/pull.py): exact, with one wait a step.

The host puller is the CPU's twin of the device pullers: the same statuses, the same assembled
arrays, the same step check and replay. Each step's logits are compared with resident mlx-lm's,
bit for bit, while pools hold a few rows and the daemon's arena all or few experts.
"""

import mlx.core as mx
import numpy as np
import pytest
from client_helpers import ROWS_ALL, ROWS_TINY, client_flags, pool_gb, routed_model
from harness import Daemon
from test_step import Lockstep, resident_model

from expertd.client import load
from expertd.client.pull import ABSENT, PULLED, decode_status, encode_miss


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
                *client_flags(blob_dir, arena_rows, tmp_path / "s.json")):
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
            print(dict(c), session.pull_counters(), session.pool_counters())
        finally:
            session.close()
