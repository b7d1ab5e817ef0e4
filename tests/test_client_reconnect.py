"""Invariant 5, client side: a client survives its daemon being SIGKILLed and restarted
mid-generation with exactly the tokens of an undisturbed run, and reports clearly when the
daemon does not come back."""

import signal
import time

import mlx_lm
import pytest

from client_helpers import (ROWS_TINY, Daemon, finish_client, greedy_tokens, prompt_ids,
                            read_tokens, reap, routed_model, spawn_client, wait_for)

FAMILY = ("qwen3_moe", "affine", 4)
PROMPT_LEN = 17
MAX_TOKENS = 40
KILL_AFTER = 3  # tokens the client has produced when the daemon is killed


@pytest.fixture
def qwen(models):
    model_dir, blob_dir = routed_model(models, *FAMILY)
    return model_dir, blob_dir, mlx_lm.load(str(model_dir))[0]


def start_generating(blob_dir, env, tmp_path, reconnect_timeout: float):
    tokens_file, out = tmp_path / "tokens.txt", tmp_path / "client.json"
    proc = spawn_client("generate", ["--blobs", blob_dir, "--prompt-len", PROMPT_LEN,
                                     "--max-tokens", MAX_TOKENS, "--tokens-file", tokens_file,
                                     "--reconnect-timeout", reconnect_timeout, "--out", out], env)

    def started():
        if proc.poll() is not None:
            raise AssertionError(f"the client exited early:\n{proc.communicate()[1].decode()}")
        return len(read_tokens(tokens_file)) >= KILL_AFTER

    wait_for(started, 60.0, f"the client's first {KILL_AFTER} tokens")
    return proc, tokens_file, out


def test_client_survives_daemon_kill_and_restart(qwen, isolated_env, tmp_path):
    model_dir, blob_dir, resident = qwen
    expected = greedy_tokens(resident, prompt_ids(PROMPT_LEN, resident.args.vocab_size),
                             MAX_TOKENS)
    first = Daemon(blob_dir, isolated_env, tmp_path / "state.json", ROWS_TINY)
    proc = None
    try:
        proc, tokens_file, out = start_generating(blob_dir, isolated_env, tmp_path, 60.0)
        first.kill()
        at_kill = len(read_tokens(tokens_file))
        assert at_kill < MAX_TOKENS, "the client finished before the daemon was killed"
        with Daemon(blob_dir, isolated_env, tmp_path / "state.json", ROWS_TINY) as second:
            assert second.pid != first.pid
            result = finish_client(proc, out, timeout=120)
            stats = second.stats()
    finally:
        reap(proc)
        first.kill()
    assert result["error"] is None, result["error"]
    assert result["tokens"] == expected
    assert result["counters"]["reconnects"] >= 1
    assert "re-attached" in result["stderr"]
    # The tokens after the restart really went through the new daemon.
    assert stats["demands"] > 0


def test_client_paused_across_a_restart_attaches_again(qwen, isolated_env, tmp_path):
    """The daemon is killed and restarted while the client is stopped (SIGSTOP), so the
    client's next request reaches the new daemon on the old connection before the client
    could notice the death: it must attach again, not fail."""
    model_dir, blob_dir, resident = qwen
    expected = greedy_tokens(resident, prompt_ids(PROMPT_LEN, resident.args.vocab_size),
                             MAX_TOKENS)
    daemon = Daemon(blob_dir, isolated_env, tmp_path / "state.json", ROWS_TINY)
    proc = None
    try:
        proc, tokens_file, out = start_generating(blob_dir, isolated_env, tmp_path, 60.0)
        for _ in range(3):
            proc.send_signal(signal.SIGSTOP)
            daemon.kill()
            daemon = Daemon(blob_dir, isolated_env, tmp_path / "state.json", ROWS_TINY)
            seen = len(read_tokens(tokens_file))
            proc.send_signal(signal.SIGCONT)
            wait_for(lambda: len(read_tokens(tokens_file)) > seen or proc.poll() is not None,
                     60.0, "a token after the restart")
        result = finish_client(proc, out, timeout=120)
    finally:
        reap(proc)
        daemon.stop()
    assert result["error"] is None, result["error"]
    assert result["tokens"] == expected
    assert result["counters"]["reconnects"] >= 1


def test_client_reports_a_daemon_that_does_not_come_back(qwen, isolated_env, tmp_path):
    model_dir, blob_dir, _ = qwen
    reconnect_timeout = 2.0
    daemon = Daemon(blob_dir, isolated_env, tmp_path / "state.json", ROWS_TINY)
    proc = None
    try:
        proc, tokens_file, out = start_generating(blob_dir, isolated_env, tmp_path,
                                                  reconnect_timeout)
        daemon.kill()
        killed = time.monotonic()
        result = finish_client(proc, out, timeout=60)
        waited = time.monotonic() - killed
    finally:
        reap(proc)
        daemon.kill()
    assert len(result["tokens"]) < MAX_TOKENS
    assert result["error"] is not None, "the client finished without its daemon"
    assert result["error"]["type"] == "DaemonNotRunning"
    message = result["error"]["message"]
    assert f"expertd start --blobs {blob_dir.resolve()}" in message
    assert "did not come back" in message
    # The client gave up about when it was told to (plus process exit), not much later.
    assert waited < reconnect_timeout + 4.0, waited
