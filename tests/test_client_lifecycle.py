"""Nothing a user does with a loaded model hangs the process when its daemon is gone: dropping
the model, loading it again after a restart, exiting (issue 16, item 1; on ZeroMQ, issue 25:
one context per process, its sockets closed with linger 0); a model dropped while
its daemon serves detaches at once; and ``expertd status`` tells a SIGKILLed daemon by its free
lock (item 5).

Each reproduction runs in its own Python process, several times over (the hang was a race in
the garbage collector, which took three of four tries), and must finish within a bound set far
above the daemon's and client's own timeouts: a hang is a failure, not slowness.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from harness import START_TIMEOUT, STOP_TIMEOUT, Daemon, expertd_cli, kill_serving_daemon

ROUNDS = 3
# A child starts at most ROUNDS + 1 daemons, each within START_TIMEOUT and stopped within twice
# STOP_TIMEOUT (the harness fails past those); one still running past them all is hung.
CHILD_TIMEOUT = (ROUNDS + 1) * (START_TIMEOUT + 2 * STOP_TIMEOUT)
TESTS = Path(__file__).resolve().parent

# The reproductions, as a user would write them: python -c SCRIPT BLOBS STATE_FILE CASE ROUNDS.
CHILD = """
import gc, sys, threading
sys.path.insert(0, {tests!r})
from client_helpers import ROWS_ALL, client_flags, greedy_tokens
from harness import Daemon, wait_until
from expertd.client import load

blobs, state, case, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
flags = client_flags(blobs, ROWS_ALL, state)
if case == "drop":
    # The daemon stays up: a dropped model says goodbye and its threads stop.
    daemon = Daemon(blobs, None, *flags)
    for i in range(rounds):
        model, tokenizer = load(blobs, copy_ahead_bytes=0)  # the copier runs too
        greedy_tokens(model, [1, 2, 3], 4)
        del model, tokenizer
        gc.collect()
        left = [t.name for t in threading.enumerate() if t.name.startswith("expertd-")]
        assert not left, f"threads left running: {{left}}"
        wait_until(lambda: daemon.stats()["clients"] == 0, 10.0, "the daemon to see the goodbye")
        print("round", i, "done", flush=True)
    daemon.close()
for i in range(rounds if case != "drop" else 0):
    daemon = Daemon(blobs, None, *flags)
    model, tokenizer = load(blobs)  # a restart: the previous round's model is dropped here
    gc.collect()  # as a large model's load runs it
    if case == "kill":
        daemon.kill()
    daemon.close()
    if case in ("stop", "kill"):
        del model, tokenizer
        gc.collect()
    print("round", i, "done", flush=True)
if case == "restart":
    # Exit with the last model loaded and its daemon still serving (the test stops it).
    daemon = Daemon(blobs, None, *flags)
    model, tokenizer = load(blobs)
print("exiting", flush=True)
"""


def run_child(case: str, blob_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    script = CHILD.format(tests=str(TESTS))
    try:
        # ResourceWarnings shown: Python names each socket left to the collector.
        return subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-c", script,
                               str(blob_dir), str(tmp_path / "state.json"), case, str(ROUNDS)],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout
        raise AssertionError(f"the {case!r} reproduction hung (no exit within "
                             f"{CHILD_TIMEOUT:g} s); it printed:\n{out}") from None
    finally:
        kill_serving_daemon(blob_dir)  # a hung child leaves its daemon behind


@pytest.mark.parametrize("case", ["stop", "restart", "kill", "drop"])
def test_dropping_or_reloading_a_model_never_hangs(case, models, isolated_env, tmp_path):
    done = run_child(case, models.blobs(), tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.splitlines()[-1] == "exiting", done.stdout
    # Every socket was closed by its owner, none by the garbage collector (pyzmq's
    # Context.__del__ is what hung before), and no finalizer failed.
    for sign in ("unclosed", "Unclosed", "Exception ignored"):  # pyzmq: "Unclosed socket"
        assert sign not in done.stderr, done.stderr


def test_status_of_a_killed_daemon_says_not_running(models, isolated_env):
    blob_dir = models.blobs()
    daemon = Daemon(blob_dir, isolated_env)
    try:
        daemon.kill()  # its socket and run files stay behind, its lock goes with it
        status = expertd_cli("status", "--blobs", blob_dir)
    finally:
        daemon.close()
    assert status.returncode == 3, status
    # Only the lock path says this: a timed-out request says "did not answer".
    assert "not running" in status.stdout + status.stderr, status
