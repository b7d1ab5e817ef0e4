"""Several client processes on one daemon: invariants 1-2 under eviction pressure, and the
shared cache reading the SSD once for clients that need the same experts."""

import pytest
from client_helpers import (
    ROWS_ALL,
    ROWS_MEDIUM,
    client_flags,
    greedy_tokens,
    prompt_ids,
    run_together,
)
from harness import Daemon, wait_until

from expertd import native
from expertd.manifest import Manifest

PROMPT_LEN = 17
MAX_TOKENS = 24
SHARING_BOUND = 1.10


def solo_tokens(resident, seed: int) -> list:
    prompt = prompt_ids(PROMPT_LEN, resident.args.vocab_size, seed)
    return greedy_tokens(resident, prompt, MAX_TOKENS)


def wait_released(daemon, timeout: float = 15.0) -> None:
    """Leases released and clients forgotten once the clients are gone (invariant 5)."""
    last = {}

    def released():
        last.update(daemon.stats())
        return last["leases"] == 0 and last["clients"] == 0

    try:
        wait_until(released, timeout, "the clients' leases to be released")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last['leases']} leases, {last['clients']} clients") from None


@pytest.mark.parametrize("prefetch", ["on", pytest.param("off", marks=pytest.mark.once)])
@pytest.mark.parametrize("n_clients", [2, 3])
def test_concurrent_clients_under_eviction_match_solo(qwen, isolated_env, tmp_path, n_clients,
                                                      prefetch):
    """With prefetch on, the clients' guesses, side-row fills, promotions and demands race
    under eviction too; every token must still be the resident model's."""
    model_dir, blob_dir, resident, _ = qwen
    every_expert = sum(layer.num_experts for layer in Manifest.load(blob_dir).layers)
    seeds = list(range(1, n_clients + 1))
    expected = [solo_tokens(resident, seed) for seed in seeds]
    assert len({tuple(t) for t in expected}) == n_clients, "prompts should differ"
    flags = client_flags(blob_dir, ROWS_MEDIUM, tmp_path / "state.json", client_timeout=3.0)
    with Daemon(blob_dir, isolated_env, *flags) as daemon:
        assert daemon.ready["arena_rows"] == ROWS_MEDIUM < every_expert
        results = run_together(blob_dir, isolated_env, tmp_path,
                               [(PROMPT_LEN, seed) for seed in seeds], MAX_TOKENS,
                               prefetch=prefetch)
        stats = daemon.stats()
        wait_released(daemon)
    for seed, want, got in zip(seeds, expected, results):
        assert got["error"] is None, got["error"]
        assert got["implementation"] == native.IMPLEMENTATION  # the client processes' too
        assert got["tokens"] == want, f"client with prompt seed {seed} diverged from its solo run"
        assert got["counters"]["demanded"] > 0
    # Eviction pressure: rows were refilled with other experts while the clients ran.
    assert stats["fills"] > stats["arena_rows"]
    if prefetch == "on":
        assert stats["prefetch_fills"] > 0 and stats["prefetch_hits"] > 0
        assert sum(r["counters"]["ahead_used"] for r in results) > 0
    else:
        assert stats["prefetch_requested"] == 0
    assert stats["fill_errors"] == 0


def test_three_clients_read_the_ssd_once(qwen, isolated_env, tmp_path):
    """Sharing: 3 clients on the same prompt read about what 1 client alone reads."""
    model_dir, blob_dir, resident, _ = qwen
    expected = solo_tokens(resident, 1)
    reads = {}
    for n in (1, 3):
        # A fresh state file each time, so the daemon starts cold (no warm-up reads).
        flags = client_flags(blob_dir, ROWS_ALL, tmp_path / f"state-{n}.json")
        with Daemon(blob_dir, isolated_env, *flags) as daemon:
            assert daemon.ready["bytes_read"] == 0
            results = run_together(blob_dir, isolated_env, tmp_path / f"run-{n}",
                                   [(PROMPT_LEN, 1)] * n, MAX_TOKENS)
            reads[n] = daemon.stats()["bytes_read"]
        for result in results:
            assert result["error"] is None, result["error"]
            assert result["tokens"] == expected
    assert reads[1] > 0
    ratio = reads[3] / reads[1]
    assert ratio <= SHARING_BOUND, (
        f"3 clients read {reads[3]} bytes, 1 client alone {reads[1]}: ratio {ratio:.3f}")
