"""Invariant 5, client side: a client survives its daemon being SIGKILLed and restarted
mid-generation with exactly the tokens of an undisturbed run, and reports clearly when the
daemon does not come back."""

import signal
import threading
import time
from contextlib import ExitStack

import pytest
from client_helpers import (
    ROWS_ALL,
    ROWS_TINY,
    client_daemon,
    greedy_tokens,
    prompt_ids,
    read_tokens,
)
from harness import expertd_cli, finish_client, spawn_client, stop_process, wait_until

PROMPT_LEN = 17
MAX_TOKENS = 40
KILL_AFTER = 3  # tokens the client has produced when the daemon is killed


def undisturbed_tokens(resident) -> list:
    return greedy_tokens(resident, prompt_ids(PROMPT_LEN, resident.args.vocab_size), MAX_TOKENS)


def start_generating(blob_dir, env, tmp_path, reconnect_timeout: float):
    tokens_file, out = tmp_path / "tokens.txt", tmp_path / "client.json"
    proc = spawn_client("generate", "--blobs", blob_dir, "--prompt-len", PROMPT_LEN,
                        "--max-tokens", MAX_TOKENS, "--tokens-file", tokens_file,
                        "--reconnect-timeout", reconnect_timeout, "--out", out, env=env)

    def started():
        if proc.poll() is not None:
            raise AssertionError(f"the client exited early:\n{proc.communicate()[1]}")
        return len(read_tokens(tokens_file)) >= KILL_AFTER

    wait_until(started, 60.0, f"the client's first {KILL_AFTER} tokens")
    return proc, tokens_file, out


def test_client_survives_daemon_kill_and_restart(qwen, isolated_env, tmp_path):
    model_dir, blob_dir, resident, _ = qwen
    expected = undisturbed_tokens(resident)
    first = client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY)
    proc = None
    try:
        proc, tokens_file, out = start_generating(blob_dir, isolated_env, tmp_path, 60.0)
        first.kill()
        at_kill = len(read_tokens(tokens_file))
        assert at_kill < MAX_TOKENS, "the client finished before the daemon was killed"
        with client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY) as second:
            assert second.pid != first.pid
            result = finish_client(proc, out, timeout=120)
            stats = second.stats()
    finally:
        stop_process(proc)
        first.close()
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
    model_dir, blob_dir, resident, _ = qwen
    expected = undisturbed_tokens(resident)
    daemon = client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY)
    proc = None
    try:
        proc, tokens_file, out = start_generating(blob_dir, isolated_env, tmp_path, 60.0)
        for _ in range(3):
            proc.send_signal(signal.SIGSTOP)
            daemon.kill()
            dead, daemon = daemon, client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY)
            dead.close()  # only now: the new daemon starts as it would after a real crash
            seen = len(read_tokens(tokens_file))
            proc.send_signal(signal.SIGCONT)
            wait_until(lambda: len(read_tokens(tokens_file)) > seen or proc.poll() is not None,
                       60.0, "a token after the restart")
        result = finish_client(proc, out, timeout=120)
    finally:
        stop_process(proc)
        daemon.close()
    assert result["error"] is None, result["error"]
    assert result["tokens"] == expected
    assert result["counters"]["reconnects"] >= 1


def test_client_reports_a_daemon_that_does_not_come_back(qwen, isolated_env, tmp_path):
    model_dir, blob_dir, _, _ = qwen
    reconnect_timeout = 2.0
    daemon = client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY)
    proc = None
    try:
        proc, tokens_file, out = start_generating(blob_dir, isolated_env, tmp_path,
                                                  reconnect_timeout)
        daemon.kill()
        killed = time.monotonic()
        result = finish_client(proc, out, timeout=60)
        waited = time.monotonic() - killed
    finally:
        stop_process(proc)
        daemon.close()
    assert len(result["tokens"]) < MAX_TOKENS
    assert result["error"] is not None, "the client finished without its daemon"
    assert result["error"]["type"] == "DaemonNotRunning"
    message = result["error"]["message"]
    assert f"expertd start --blobs {blob_dir.resolve()}" in message
    assert "did not come back" in message
    # The wait was announced with its length, before it began.
    assert f"waiting up to {reconnect_timeout:g} s for it to answer again" in result["stderr"]
    # The client gave up about when it was told to (plus process exit), not much later.
    assert waited < reconnect_timeout + 4.0, waited


@pytest.mark.parametrize("rows", [(ROWS_ALL, ROWS_TINY), (ROWS_TINY, ROWS_ALL)],
                         ids=["cache-shrinks", "cache-grows"])
def test_restarted_daemon_with_another_cache_size(qwen, isolated_env, tmp_path, rows):
    """The read buffers are sized at load; a daemon that comes back with a smaller cache
    (leasing fewer rows at once) or a larger one must still give exactly the same logits."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from expertd.client import load

    _, blob_dir, resident, _ = qwen
    prompt = mx.array([prompt_ids(PROMPT_LEN, resident.args.vocab_size)])
    daemon = client_daemon(blob_dir, isolated_env, tmp_path, rows[0])
    try:
        streamed, _ = load(blob_dir, reconnect_timeout=30.0)
        caches = make_prompt_cache(resident), make_prompt_cache(streamed)
        a, b = resident(prompt, cache=caches[0]), streamed(prompt, cache=caches[1])
        assert mx.array_equal(a, b).item()
        daemon.kill()
        # Every expert may be a hit in the dead daemon's arena; the client must notice anyway.
        wait_until(lambda: streamed.expertd_session.session._heartbeat.lost, 10.0, "the death noticed")
        dead, daemon = daemon, client_daemon(blob_dir, isolated_env, tmp_path, rows[1])
        dead.close()
        for step in range(6):
            token = mx.argmax(a[:, -1:], axis=-1)
            a, b = resident(token, cache=caches[0]), streamed(token, cache=caches[1])
            assert mx.array_equal(a, b).item(), f"decode step {step} after the restart"
        # A prompt wide enough to need more rows than the small cache leases at once.
        a = resident(prompt, cache=make_prompt_cache(resident))
        b = streamed(prompt, cache=make_prompt_cache(streamed))
        assert mx.array_equal(a, b).item()
        assert streamed.expertd_session.counters["reconnects"] == 1
        streamed.expertd_session.close()
    finally:
        daemon.close()


def same_as_resident(resident, streamed, prompt, steps: int = 4) -> None:
    """The prompt's logits and ``steps`` greedy decode steps equal resident mlx-lm's, bit for
    bit (fresh caches: a failed call leaves its caches part-updated)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(resident), make_prompt_cache(streamed)
    a, b = resident(prompt, cache=caches[0]), streamed(prompt, cache=caches[1])
    assert mx.array_equal(a, b).item(), "the prompt's logits"
    for step in range(steps):
        token = mx.argmax(a[:, -1:], axis=-1)
        a, b = resident(token, cache=caches[0]), streamed(token, cache=caches[1])
        assert mx.array_equal(a, b).item(), f"decode step {step}"


def killed_and_noticed(daemon, session) -> None:
    daemon.kill()
    # Every expert may be a hit in the dead daemon's arena: wait until the client knows.
    wait_until(lambda: session._heartbeat.lost, 10.0, "the death noticed")


def test_calls_after_a_reconnect_gave_up_attach_again_once_the_daemon_is_back(
        qwen, isolated_env, tmp_path):
    """A reconnect that gave up leaves the session detached: each later call raises a clean
    DaemonNotRunning while the daemon is gone, and the first one after it is back attaches
    again and gives resident mlx-lm's logits."""
    import mlx.core as mx

    from expertd.client import load
    from expertd.errors import DaemonNotRunning

    _, blob_dir, resident, _ = qwen
    prompt = mx.array([prompt_ids(PROMPT_LEN, resident.args.vocab_size)])
    daemon = client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY)
    try:
        streamed, _ = load(blob_dir, reconnect_timeout=0.05)
        session = streamed.expertd_session
        same_as_resident(resident, streamed, prompt, steps=1)
        killed_and_noticed(daemon, session.session)
        for _ in range(3):  # each call starts from the state the previous failure left
            with pytest.raises(DaemonNotRunning) as failed:
                same_as_resident(resident, streamed, prompt, steps=1)
            message = str(failed.value)
            assert f"start it with: expertd start --blobs {blob_dir.resolve()}" in message
            assert message.count("expertd start") == 1, message  # one sentence, one hint
        dead, daemon = daemon, client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY)
        dead.close()
        same_as_resident(resident, streamed, prompt)
        assert session.counters["reconnects"] == 1
        assert daemon.stats()["demands"] > 0  # the new daemon served it
        session.close()
    finally:
        daemon.close()


def test_a_call_after_an_interrupted_reconnect_attaches_again(qwen, isolated_env, tmp_path):
    """Ctrl-C while a call waits for its daemon to come back; once it is back, the next call
    attaches again and gives resident mlx-lm's logits."""
    import mlx.core as mx

    from expertd.client import load

    _, blob_dir, resident, _ = qwen
    prompt = mx.array([prompt_ids(PROMPT_LEN, resident.args.vocab_size)])
    daemon = client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        streamed, _ = load(blob_dir, reconnect_timeout=120.0)
        session = streamed.expertd_session
        same_as_resident(resident, streamed, prompt, steps=1)
        killed_and_noticed(daemon, session.session)

        def interrupt_the_wait():
            # The session detaches as its wait for the daemon begins.
            wait_until(lambda: session.session.view is None, 60.0, "the wait for the daemon")
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        interrupter = threading.Thread(target=interrupt_the_wait)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                same_as_resident(resident, streamed, prompt, steps=1)
        finally:
            interrupter.join()
        dead, daemon = daemon, client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY)
        dead.close()
        same_as_resident(resident, streamed, prompt)
        assert session.counters["reconnects"] == 1
        session.close()
    finally:
        signal.signal(signal.SIGINT, previous)
        daemon.close()


def test_a_daemon_gone_between_its_hello_and_the_arena_map_is_waited_through(
        qwen, isolated_env, tmp_path, monkeypatch):
    """The daemon answers a reconnecting client's hello, then dies and its arena is unlinked
    before the client maps it (the race a client stopped across restarts runs into): the
    client waits for the next daemon instead of failing on the missing shared memory."""
    import mlx.core as mx

    from expertd.client import load
    from expertd.client.requester import Requester

    _, blob_dir, resident, _ = qwen
    prompt = mx.array([prompt_ids(PROMPT_LEN, resident.args.vocab_size)])
    daemons = [client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY)]
    try:
        streamed, _ = load(blob_dir, reconnect_timeout=120.0)
        session = streamed.expertd_session
        same_as_resident(resident, streamed, prompt, steps=1)
        killed_and_noticed(daemons[0], session.session)
        daemons[0].close()
        daemons.append(client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY))
        hello, raced = Requester.hello, []

        def hello_then_gone(requester, *args, **kwargs):
            reply = hello(requester, *args, **kwargs)
            if not raced:  # the daemon that answered dies with its arena
                raced.append(reply["arena"])
                daemons[-1].kill()
                daemons[-1].close()
                daemons.append(client_daemon(blob_dir, isolated_env, tmp_path, ROWS_TINY))
            return reply

        monkeypatch.setattr(Requester, "hello", hello_then_gone)
        same_as_resident(resident, streamed, prompt)
        assert raced and session.session.hello["arena"] != raced[0]
        assert session.session.hello["pid"] == daemons[-1].pid
        session.close()
    finally:
        with ExitStack() as stack:  # every daemon is stopped, even if one's close fails
            for daemon in daemons:
                stack.callback(daemon.close)


def test_reconnect_timeout_zero_fails_at_once(qwen, isolated_env, tmp_path):
    """``reconnect_timeout=0`` (``--reconnect-timeout 0``): a step after the daemon died
    raises at once, saying so, instead of waiting for it; a bad value is one line."""
    import mlx.core as mx

    from expertd.client import load
    from expertd.errors import DaemonNotRunning

    _, blob_dir, _, _ = qwen
    daemon = client_daemon(blob_dir, isolated_env, tmp_path, ROWS_ALL)
    model = None
    try:
        model, _ = load(blob_dir, reconnect_timeout=0, prefetch="off")
        mx.eval(model(mx.array([prompt_ids(5, model.args.vocab_size)])))
        daemon.kill()
        with pytest.raises(DaemonNotRunning, match="within 0 s|no expertd serves"):
            mx.eval(model(mx.array([[7]])))
    finally:
        if model is not None:
            model.expertd_session.close()
        daemon.close()
    with pytest.raises(ValueError, match="reconnect_timeout must be"):
        load(blob_dir, reconnect_timeout=-1)
    for command in ("generate", "serve", "chat"):  # each of the three takes the flag
        bad = expertd_cli(command, "--blobs", blob_dir, "--reconnect-timeout", "soon")
        assert bad.returncode == 2, (command, bad.stderr)
        assert "--reconnect-timeout: must be a number of seconds" in bad.stderr, command
