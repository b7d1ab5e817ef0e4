"""`generate`, `chat` and `serve` with no daemon: one line saying how to start one, or, with
--start, a daemon started as `expertd start --blobs DIR` starts it, which outlives the command."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from harness import expertd_cli, kill_serving_daemon

from expertd.cli.lifecycle import serving_pid
from expertd.paths import daemon_paths

pytestmark = pytest.mark.timeout(240)


def stats_of(blob_dir) -> dict:
    done = expertd_cli("status", "--blobs", blob_dir, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)[0]


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_no_daemon_is_one_line_naming_both_ways_to_start_one(models, isolated_env, command):
    blob_dir = models.blobs()
    done = expertd_cli(command, "--blobs", blob_dir, *(["--port", "0"] if command == "serve"
                                                      else []), timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"expertd {command}: error: no expertd serves {blob_dir} (its lock is free): start one "
        f"with: expertd start --blobs {blob_dir}, or give this command --start"]
    assert serving_pid(daemon_paths(blob_dir)) is None  # nothing started


def started_line(command: str, stderr: str, blob_dir) -> int:
    """The pid that ``--start`` says it started, from its one line on stderr."""
    lines = [line for line in stderr.splitlines() if " started expertd " in line]
    assert len(lines) == 1, stderr
    match = re.fullmatch(
        rf"expertd {command}: started expertd \(pid (\d+)\) for {re.escape(str(blob_dir))}, "
        rf"log (\S+); it keeps running after this command \(expertd stop --blobs "
        rf"{re.escape(str(blob_dir))} stops it\)", lines[0])
    assert match, lines[0]
    assert os.path.isfile(match.group(2))
    return int(match.group(1))


def test_start_with_generate_and_chat_leaves_the_default_daemon_running(models, isolated_env):
    """generate --start starts the daemon `expertd start --blobs DIR` would (the same arena),
    prints the text alone on stdout, as without --start; the daemon outlives it; chat --start
    and a second generate --start use the daemon that runs, and say nothing of starting."""
    blob_dir = models.blobs()
    paths = daemon_paths(blob_dir)
    flags = ("--prompt", "Once upon a time", "-m", "6", "--verbose", "False")
    try:
        first = expertd_cli("generate", "--blobs", blob_dir, "--start", *flags, timeout=120)
        assert first.returncode == 0, first.stderr
        pid = started_line("generate", first.stderr, blob_dir)
        assert serving_pid(paths) == pid  # it outlived the client
        started = stats_of(blob_dir)
        again = expertd_cli("generate", "--blobs", blob_dir, "--start", *flags, timeout=120)
        chat = expertd_cli("chat", "--blobs", blob_dir, "--start", timeout=120)  # stdin: EOF
        assert again.returncode == 0 and chat.returncode == 0, (again.stderr, chat.stderr)
        assert again.stdout == first.stdout and again.stderr == ""
        assert " started expertd " not in chat.stderr
        assert serving_pid(paths) == pid
        # The plain `expertd start --blobs DIR`, for comparison.
        assert expertd_cli("stop", "--blobs", blob_dir).returncode == 0
        assert serving_pid(paths) is None
        plain = expertd_cli("start", "--blobs", blob_dir)
        assert plain.returncode == 0, plain.stderr
        by_hand = stats_of(blob_dir)
        keys = ("arena_rows", "arena_bytes", "side_rows", "workers", "io", "verify")
        assert {k: started.get(k) for k in keys} == {k: by_hand.get(k) for k in keys}
        assert expertd_cli("stop", "--blobs", blob_dir).returncode == 0
        # chat --start, with no daemon: starts one too.
        chat = expertd_cli("chat", "--blobs", blob_dir, "--start", timeout=120)
        assert chat.returncode == 0, chat.stderr
        assert serving_pid(paths) == started_line("chat", chat.stderr, blob_dir)
    finally:
        kill_serving_daemon(blob_dir)


def test_serve_start_leaves_the_daemon_running_after_serve_stops(models, isolated_env):
    blob_dir = models.blobs()
    paths = daemon_paths(blob_dir)
    proc = subprocess.Popen([sys.executable, "-m", "expertd", "serve", "--blobs", str(blob_dir),
                             "--start", "--port", "0"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # its loading line, then the one with its address
            if " on http://" in line:
                break
        else:
            raise AssertionError(proc.stderr.read())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert serving_pid(paths) == started_line("serve", err, blob_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_serving_daemon(blob_dir)
