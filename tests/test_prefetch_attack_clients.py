"""Model-level clients with prefetch on (guesses, the copier, PREFETCHes in flight): a daemon
killed or restarted mid-generation, and SIGINT landing anywhere in the decode; the tokens stay
exactly resident mlx-lm's.

Run as a script (``python test_prefetch_attack_clients.py interrupted BLOBS OUT EXPECTED``)
this file is also the client process a test interrupts.
"""

import json
import sys
import time

import pytest
from harness import InProcessDaemon, spawn_client, stop_process, wait_until

SCRIPT = __file__


# ---- model-level clients with prefetch on -----------------------------------------------------

@pytest.mark.parametrize("how", ["kill", "restart"])
def test_a_guessing_client_survives_its_daemon_restarting(qwen, isolated_env, tmp_path, how):
    """Prefetch on (guesses, the copier, PREFETCHes in flight): the daemon SIGKILLed, or
    stopped and started again, mid-generation; the client re-attaches and its tokens are
    exactly resident mlx-lm's."""
    from client_helpers import ROWS_TINY, client_flags, greedy_tokens, prompt_ids, read_tokens
    from harness import Daemon, finish_client

    model_dir, blob_dir, resident, _ = qwen
    expected = greedy_tokens(resident, prompt_ids(17, resident.args.vocab_size), 30)
    flags = client_flags(blob_dir, ROWS_TINY, tmp_path / "state.json")
    first = Daemon(blob_dir, isolated_env, *flags)
    tokens_file, out = tmp_path / "tokens.txt", tmp_path / "client.json"
    proc = spawn_client("generate", "--blobs", blob_dir, "--prompt-len", 17, "--max-tokens", 30,
                        "--tokens-file", tokens_file, "--prefetch", "on",
                        "--copy-ahead-bytes", 0, "--out", out, env=isolated_env)
    try:
        def started():
            assert proc.poll() is None, proc.communicate()[1]
            return len(read_tokens(tokens_file)) >= 3
        wait_until(started, 60.0, "the client's first tokens")
        if how == "kill":
            first.kill()
        else:
            first.close()
        assert len(read_tokens(tokens_file)) < 30, "the client finished before the restart"
        with Daemon(blob_dir, isolated_env, *flags) as second:
            result = finish_client(proc, out, timeout=120)
            stats = second.stats()
    finally:
        stop_process(proc)
        first.close(check=False)
    assert result["error"] is None, result["error"]
    assert result["tokens"] == expected
    assert result["counters"]["reconnects"] >= 1 and result["counters"]["prefetch_asked"] > 0
    assert stats["demands"] > 0 and stats["internal_errors"] == 0


def test_interrupts_while_the_copier_runs_change_no_token(qwen, isolated_env, tmp_path):
    """SIGINT lands anywhere in a guessing client's decode (the copier's wait included), over
    and over; each generation after an interrupt is still exactly resident mlx-lm's, and no
    lease is left behind."""
    from client_helpers import ROWS_ALL, client_flags, greedy_tokens, prompt_ids

    model_dir, blob_dir, resident, _ = qwen
    expected = greedy_tokens(resident, prompt_ids(9, resident.args.vocab_size), 40)
    out = tmp_path / "client.json"
    with InProcessDaemon(blob_dir, *client_flags(blob_dir, ROWS_ALL, tmp_path / "state.json")) as d:
        proc = spawn_client("interrupted", blob_dir, out, json.dumps(expected), script=SCRIPT,
                            env=isolated_env)
        try:
            _, stderr = proc.communicate(timeout=120)
        finally:
            stop_process(proc)
        assert proc.returncode == 0, stderr
        result = json.loads(out.read_text())
        stats = quiet_stats(d)
    assert result["interrupted"] >= 10, result
    assert result["wrong"] == [], result
    assert result["leases"] == 0 and stats["leased_rows"] == 0, (result, stats)


def quiet_stats(d) -> dict:
    return wait_until(lambda: (s := d.stats())["in_flight"] == 0 and s, 10.0, "quiet")


# ---- the client process a test interrupts ---------------------------------------------------

def interrupted(blobs, out, expected) -> None:
    """Decode with prefetch on while a thread sends this process SIGINT at random moments;
    after each interrupt, decode again from the start. Write which runs went wrong."""
    import os
    import random
    import signal
    import threading

    import mlx.core as mx
    from client_helpers import prompt_ids
    from mlx_lm.generate import generate_step

    from expertd.client import load

    expected = json.loads(expected)
    model, tokenizer = load(blobs, prefetch="on", copy_ahead_bytes=0)
    session = model.expertd_session
    prompt = mx.array(prompt_ids(9, tokenizer.vocab_size))
    stop = threading.Event()
    rng = random.Random(1)

    def interrupter():
        while not stop.wait(rng.uniform(0.01, 0.3)):
            os.kill(os.getpid(), signal.SIGINT)

    interrupts, wrong, runs = 0, [], 0
    thread = threading.Thread(target=interrupter, daemon=True)
    thread.start()
    while interrupts < 10 or runs < 3:
        tokens = []
        try:
            for token, _ in generate_step(prompt, model, max_tokens=len(expected)):
                tokens.append(int(token))
        except KeyboardInterrupt:
            interrupts += 1
        if tokens != expected[:len(tokens)]:
            wrong.append(tokens)
        runs += 1
        if interrupts >= 10:
            stop.set()
    thread.join()
    # A last SIGINT may be on its way: take it here, not in the check below.
    for _ in range(3):
        try:
            time.sleep(0.05)
        except KeyboardInterrupt:
            pass
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=len(expected))]
    if tokens != expected:
        wrong.append(tokens)
    leases = len(session.session._leases)
    session.close()
    with open(out, "w") as f:
        json.dump({"interrupted": interrupts, "runs": runs, "wrong": wrong, "leases": leases,
                   "counters": dict(session.counters)}, f)


if __name__ == "__main__":
    if sys.argv[1] == "interrupted":
        interrupted(*sys.argv[2:5])
