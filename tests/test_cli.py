"""The daemon command line behaves like pg_ctl or systemctl: --version, restart, stop of a
stopped daemon, status --json/--watch without a daemon, the log's path, --cache-gb sizes and
their errors, every flag's default in --help. Real daemons, started detached by the CLI."""

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest
from harness import (
    TINY_CACHE_GB,
    Daemon,
    expertd_cli,
    kill_serving_daemon,
    query_stats,
    sigint_as_usual,
    wait_until,
)

from expertd.cli.daemon_control import parse_size
from expertd.cli.main import DefaultsHelpFormatter, build_parser
from expertd.manifest import Manifest
from expertd.paths import daemon_paths
from expertd.serving.config import ServerConfig
from expertd.shm.layout import Geometry

DEFAULT_WORKERS = ServerConfig.workers


def test_version_comes_from_the_package_metadata():
    got = expertd_cli("--version")
    assert got.returncode == 0 and got.stdout == f"expertd {version('expertd')}\n", got


def test_a_command_with_a_closed_stream_runs_as_with_dev_null(blobs, isolated_env, tmp_path):
    """Started with stdin or stdout closed (``<&-``, ``>&-``), a command behaves as with
    /dev/null there: its answer and exit status, one line of error, never a traceback (a
    closed stream was None to Python: chat, generate --prompt - and status raised)."""
    def run(closed: int, *args, stdin=None):
        return subprocess.run([sys.executable, "-m", "expertd", *map(str, args)],
                              preexec_fn=lambda: os.close(closed), capture_output=closed != 1,
                              stdout=subprocess.DEVNULL if closed == 1 else None,
                              stderr=subprocess.PIPE if closed == 1 else None, text=True,
                              timeout=60)

    status = run(1, "status", "--blobs", blobs)  # stdout closed: nothing runs, exit 3
    assert status.returncode == 3 and "Traceback" not in status.stderr, status.stderr
    # stdin closed: read as empty, as /dev/null is.
    got = run(0, "generate", "--blobs", blobs, "--prompt", "-")
    assert got.returncode == 1 and "Traceback" not in got.stderr, got.stderr
    assert got.stderr.count("\n") == 1 and "the prompt read from stdin is empty" in got.stderr
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB):  # chat reads stdin once
        got = run(0, "chat", "--blobs", blobs, "--max-tokens", "3")  # loaded: at its end
    assert got.returncode == 0 and "Traceback" not in got.stderr, got.stderr
    assert "bye" in got.stdout + got.stderr, got
    done = run(1, "synth", "--out", tmp_path / "m")  # stdout closed: the command's own work
    assert done.returncode == 0 and (tmp_path / "m" / "config.json").exists(), done.stderr


def test_stop_and_status_without_a_daemon(blobs, isolated_env):
    stop = expertd_cli("stop", "--blobs", blobs)
    assert stop.returncode == 0, stop
    assert f"no expertd serves {blobs}" in stop.stdout and "nothing to stop" in stop.stdout
    # A path that is no blob directory is a typo, not a stopped daemon: said, exit 1.
    typo = expertd_cli("stop", "--blobs", blobs / "nope")
    assert typo.returncode == 1 and "does not exist" in typo.stderr, typo
    assert "nothing was stopped" in typo.stderr and "Traceback" not in typo.stderr
    status = expertd_cli("status", "--blobs", blobs, "--json")
    assert status.returncode == 3, status
    assert json.loads(status.stdout) == [{"running": False, "blob_dir": str(blobs),
                                          "log": str(daemon_paths(blobs).log), "leftover": None,
                                          "served_from": None}]
    plain = expertd_cli("status", "--blobs", blobs)
    assert plain.returncode == 3 and "no expertd serves" in plain.stderr
    assert f"log: {daemon_paths(blobs).log}" in plain.stderr and "Traceback" not in plain.stderr
    every = expertd_cli("status", "--json")  # nothing runs: 3, as in text
    assert every.returncode == 3 and json.loads(every.stdout) == []
    # Not a blob directory: said, not "start one" (start would refuse it).
    for wrong, said in ((blobs / "nope", "does not exist"),
                        (blobs / "trunk", "run expertd convert first")):
        plain = expertd_cli("status", "--blobs", wrong)
        assert plain.returncode == 3 and said in plain.stderr, plain.stderr
        assert "expertd start" not in plain.stderr


@pytest.mark.timeout(120)
def test_start_status_restart_stop(blobs, isolated_env, tmp_path):
    log = daemon_paths(blobs).log
    try:
        restarted = expertd_cli("restart", "--blobs", blobs, "--cache-gb", "50%")
        assert restarted.returncode == 0, restarted.stderr
        assert "no expertd serves" in restarted.stdout and "starting one" in restarted.stdout
        assert f"log: {log}" in restarted.stdout
        first = query_stats(blobs)
        status, = json.loads(expertd_cli("status", "--blobs", blobs, "--json").stdout)
        assert status["running"] is True and status["pid"] == first["pid"]
        assert status["log"] == str(log)
        shown = expertd_cli("status", "--blobs", blobs).stdout
        assert f"log          {log}" in shown
        assert f"  arena        {first['arena_bytes'] / 2**20:.2f} MiB, " in shown  # not 0.001 GiB
        # The longest timeout there is, and a reader that has gone: neither changes the answer.
        assert expertd_cli("status", "--blobs", blobs, "--timeout", "86400").returncode == 0
        piped = closed_pipe_run("status", "--blobs", blobs, "--json")
        assert (piped.returncode, piped.stderr) == (0, "")

        # Bad flags are refused before the working daemon is stopped.
        refused = expertd_cli("restart", "--blobs", blobs, "--cache-gb", "0")
        assert refused.returncode == 2 and "smallest cache that serves" in refused.stderr
        assert query_stats(blobs)["pid"] == first["pid"]

        again = expertd_cli("restart", "--blobs", blobs, "--cache-gb", "100%", "--workers", "2")
        assert again.returncode == 0, again.stderr
        assert f"stopped expertd pid {first['pid']}" in again.stdout
        second = query_stats(blobs)
        # A bad flag given anew beside kept ones: its own error (exit 2), not a kept flag's.
        bad = expertd_cli("restart", "--blobs", blobs, "--cache-gb", "1K")
        assert bad.returncode == 2 and "a flag it was started with" not in bad.stderr, bad
        assert bad.stderr.startswith("expertd restart: error: --cache-gb 1K ") and \
            bad.stderr.count("\n") == 1, bad.stderr
        assert query_stats(blobs)["pid"] == second["pid"]
        assert second["pid"] != first["pid"] and second["arena_rows"] > first["arena_rows"]

        # Without flags, restart keeps those the daemon was started with (as pg_ctl does): it
        # came back at the default size.
        kept = expertd_cli("restart", "--blobs", blobs)
        assert kept.returncode == 0, kept.stderr
        assert "the flags it was started with: --cache-gb 100% --workers 2" in kept.stdout
        third = query_stats(blobs)
        assert third["pid"] != second["pid"] and third["arena_rows"] == second["arena_rows"]
        assert third["workers"] == 2
        # A flag given anew replaces its recorded one; the others are kept.
        anew = expertd_cli("restart", "--blobs", blobs, "--workers", "3")
        assert anew.returncode == 0, anew.stderr
        assert "the flags it was started with: --cache-gb 100%; with --workers 3 anew" in \
            anew.stdout, anew.stdout
        fourth = query_stats(blobs)
        assert fourth["workers"] == 3 and fourth["arena_rows"] == third["arena_rows"]
        # Given anew at its default value, a flag still replaces the recorded one: the next
        # restart keeps the cache size alone.
        default = expertd_cli("restart", "--blobs", blobs, "--workers", str(DEFAULT_WORKERS))
        assert default.returncode == 0, default.stderr
        assert f"--cache-gb 100%; with --workers {DEFAULT_WORKERS} anew" in default.stdout
        assert query_stats(blobs)["workers"] == DEFAULT_WORKERS
        alone = expertd_cli("restart", "--blobs", blobs)
        assert alone.returncode == 0, alone.stderr
        assert "the flags it was started with: --cache-gb 100%\n" in alone.stdout, alone.stdout
        fourth = query_stats(blobs)
        assert fourth["workers"] == DEFAULT_WORKERS and fourth["arena_rows"] == third["arena_rows"]
        third = fourth
        # Recorded flags that no longer parse (another version's): said, nothing stopped.
        from dataclasses import replace

        from expertd.runfile import read_run_info, write_run_info

        info = read_run_info(daemon_paths(blobs))
        write_run_info(daemon_paths(blobs), replace(info, flags=["--no-such-flag", "1"]))
        stale = expertd_cli("restart", "--blobs", blobs)
        assert stale.returncode == 1 and "unrecognized arguments: --no-such-flag" in stale.stderr, \
            stale.stderr
        assert "restart it with the flags it should have" in stale.stderr
        assert query_stats(blobs)["pid"] == third["pid"]

        stopped = expertd_cli("stop", "--blobs", blobs)
        assert stopped.returncode == 0 and f"stopped expertd pid {third['pid']}" in stopped.stdout
        # Stopped, restart starts it with the flags it last ran with (pg_ctl's options file).
        back = expertd_cli("restart", "--blobs", blobs)
        assert back.returncode == 0 and "starting one" in back.stdout, back.stderr
        assert "keeping the flags it last ran with: --cache-gb 100%\n" in back.stdout, back.stdout
        assert query_stats(blobs)["arena_rows"] == third["arena_rows"]
        assert expertd_cli("stop", "--blobs", blobs).returncode == 0
        # A recorded flag given anew is not parsed from the record (its log's directory gone).
        from expertd.runfile import write_last_flags

        paths = daemon_paths(blobs)
        write_last_flags(paths, ["--log-file", str(tmp_path / "gone" / "d.log"),
                                 "--cache-gb", "100%"])
        moved = expertd_cli("restart", "--blobs", blobs, "--log-file", tmp_path / "d.log")
        assert moved.returncode == 0, moved.stderr
        assert "it last ran with: --cache-gb 100%; with --log-file" in moved.stdout, moved.stdout
        assert expertd_cli("stop", "--blobs", blobs).returncode == 0
        # Recorded flags that no longer parse, nothing running: said, started without them.
        write_last_flags(paths, ["--no-such-flag", "1"])
        fresh = expertd_cli("restart", "--blobs", blobs, "--cache-gb", "50%")
        assert fresh.returncode == 0 and "do not go now" in fresh.stderr, fresh
        assert "starting with the defaults and the flags given" in fresh.stderr
        assert query_stats(blobs)["arena_rows"] == first["arena_rows"]
    finally:
        kill_serving_daemon(blobs)


def interrupt_cleanly(watch: subprocess.Popen) -> None:
    """Ctrl-C a ``status --watch``: it must exit 0 without a traceback (killed if it does not)."""
    watch.send_signal(signal.SIGINT)
    try:
        _, err = watch.communicate(timeout=30)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
    assert watch.returncode == 0 and "Traceback" not in err, err


@pytest.mark.timeout(120)
def test_status_watch_refreshes_until_ctrl_c(blobs, isolated_env):
    try:
        assert expertd_cli("start", "--blobs", blobs, "--cache-gb", "50%").returncode == 0
        pid = query_stats(blobs)["pid"]
        watch = subprocess.Popen([sys.executable, "-m", "expertd", "status", "--blobs",
                                  str(blobs), "--json", "--watch", "0.1"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 preexec_fn=sigint_as_usual)
        try:
            docs = [json.loads(watch.stdout.readline())[0] for _ in range(3)]
            assert [d["pid"] for d in docs] == [pid] * 3
            assert docs[2]["uptime_s"] > docs[0]["uptime_s"]  # refreshed, not repeated
        finally:
            interrupt_cleanly(watch)
    finally:
        kill_serving_daemon(blobs)
    # Watching a daemon that is not running keeps watching, and says so each time.
    watch = subprocess.Popen([sys.executable, "-m", "expertd", "status", "--blobs", str(blobs),
                              "--watch", "0.1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_usual)
    try:
        wait_until(lambda: "no expertd serves" in watch.stdout.readline(), 30, "a refresh")
    finally:
        interrupt_cleanly(watch)
    bad = expertd_cli("status", "--blobs", blobs, "--watch", "0")
    assert bad.returncode == 2 and "--watch: must be a number of seconds above 0" in bad.stderr


# ---- --cache-gb ---------------------------------------------------------------------------------

def test_cache_sizes_parse():
    total = 3 * 2**30
    assert parse_size("8", total) == 8
    assert parse_size("8G", total) == 8 and parse_size("8gib", total) == 8
    assert parse_size("512M", total) == 0.5 and parse_size("512 MB", total) == 0.5
    assert parse_size("2T", total) == 2048 and parse_size("64K", total) == 2**-14
    assert parse_size("30%", total) == pytest.approx(0.9)
    assert parse_size("-5%", total) < 0
    for garbage in ("", "G", "8X", "eight", "8GG", "%"):
        with pytest.raises(ValueError):
            parse_size(garbage, total)


@pytest.mark.timeout(120)
def test_a_size_is_the_arena_never_more_and_small_ones_print_in_mib(blobs, isolated_env):
    m = Manifest.load(blobs)
    budget = 640 * 2**10
    want = Geometry.for_budget(len(m.layers), m.max_experts, m.stride, budget, side_rows=m.top_k)
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", "640K")
        assert started.returncode == 0, started.stderr
        stats = query_stats(blobs)
        assert stats["arena_bytes"] <= budget  # side rows and slot tables included
        assert stats["arena_rows"] == want.cache_rows
        assert stats["arena_bytes"] == want.total_size
        assert f"{want.cache_rows} rows, {want.total_size / 2**20:.2f} MiB arena)" in started.stdout
        assert "more than every expert needs" not in started.stdout
    finally:
        kill_serving_daemon(blobs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("share, rows", [("60%", 29), ("100%", 48)])
def test_a_share_counts_experts_with_side_rows_on_top(blobs, isolated_env, share, rows):
    """N% caches N% of the 48 experts (rounded up): 100% holds every one, beside the side rows."""
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", share)
        assert started.returncode == 0, started.stderr
        stats = query_stats(blobs)
        assert stats["arena_rows"] == rows and stats["side_rows"] > 0
        assert not stats["cache_capped"] and "more than every expert" not in started.stdout
    finally:
        kill_serving_daemon(blobs)


@pytest.mark.timeout(120)
def test_a_size_above_every_expert_is_cut_and_start_says_so(blobs, isolated_env):
    log = daemon_paths(blobs).log
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", "99999")
        assert started.returncode == 0, started.stderr
        stats = query_stats(blobs)
        assert stats["arena_rows"] == 48 and stats["cache_capped"]
        arena = f"{stats['arena_bytes'] / 2**20:.2f} MiB"
        assert (f"  --cache-gb 99999 is more than every expert needs: the arena holds all 48 in "
                f"{arena}\n") in started.stdout
        lines = [line for line in log.read_text().splitlines() if "every expert needs" in line]
        assert len(lines) == 1 and lines[0].endswith(
            f"the cache budget of 99999.00 GiB is more than every expert needs: the arena holds "
            f"all 48 in {arena}"), lines
    finally:
        kill_serving_daemon(blobs)


@pytest.mark.parametrize("size", ["nan", "inf", "-inf", "0", "-1", "0%", "-5%", "0M", "lots",
                                  "8X"])
def test_bad_cache_sizes_name_the_smallest_that_works(blobs, isolated_env, size):
    got = expertd_cli("start", "--blobs", blobs, f"--cache-gb={size}", timeout=30)
    assert got.returncode == 2, got
    assert got.stderr.count("\n") == 1 and "Traceback" not in got.stderr
    assert (f"expertd start: error: --cache-gb {size} is not a cache size: give a finite "
            "number of GiB above 0 (e.g. 8), or 8G, 512M, 30% (of the experts' 0.75 MiB); "
            f"the smallest cache that serves {blobs} is 0.27 MiB\n") == got.stderr


def test_a_cache_too_small_says_how_small_it_may_be(blobs, isolated_env):
    got = expertd_cli("start", "--blobs", blobs, "--cache-gb", "10%", timeout=30)
    assert got.returncode == 2 and got.stderr.count("\n") == 1, got
    assert (f"--cache-gb 10% is too small for {blobs}: the smallest cache that serves it is "
            "0.27 MiB (8 rows of 16384 bytes") in got.stderr


@pytest.mark.timeout(120)
def test_side_rows_come_out_of_the_budget(blobs, isolated_env):
    """--side-rows N: 2 x N prefetch rows, taken from a --cache-gb size (a share of the experts
    gets them on top)."""
    m = Manifest.load(blobs)
    budget = m.total_expert_bytes
    want = Geometry.for_budget(len(m.layers), m.max_experts, m.stride, budget, side_rows=10)
    assert want.cache_rows < Geometry.for_budget(len(m.layers), m.max_experts, m.stride, budget,
                                                 side_rows=m.top_k).cache_rows
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", "768K", "--side-rows", "10")
        assert started.returncode == 0, started.stderr
        stats = query_stats(blobs)
        assert stats["side_rows"] == 20 and stats["arena_rows"] == want.cache_rows
        assert stats["arena_bytes"] == want.total_size <= budget
        restarted = expertd_cli("restart", "--blobs", blobs, "--cache-gb", "100%",
                                "--side-rows", "10")
        assert restarted.returncode == 0, restarted.stderr
        stats = query_stats(blobs)
        assert stats["side_rows"] == 20 and stats["arena_rows"] == 48
    finally:
        kill_serving_daemon(blobs)


@pytest.mark.timeout(120)
def test_a_big_enough_arena_gets_two_read_ahead_widths_of_side_rows(models, isolated_env):
    """Without --side-rows: 2 x top_k per generation once the cache keeps 16 times as many
    rows beside them, top_k in a smaller arena."""
    blobs = models.blobs(layers=3, experts=64, top_k=4)
    for size, side in (("100%", 8), ("30%", 4)):
        try:
            started = expertd_cli("start", "--blobs", blobs, "--cache-gb", size)
            assert started.returncode == 0, started.stderr
            stats = query_stats(blobs)
            assert stats["side_rows"] == 2 * side, (size, stats["arena_rows"])
        finally:
            kill_serving_daemon(blobs)


@pytest.mark.parametrize("rows", ["-1", "257"])
def test_side_rows_out_of_range_are_refused_in_one_line(blobs, isolated_env, rows):
    got = expertd_cli("start", "--blobs", blobs, "--side-rows", rows, timeout=30)
    assert got.returncode == 2 and got.stderr.count("\n") == 1, got
    assert f"--side-rows must be between 0 and 256 (64 x top_k = 4), not {rows}" in got.stderr


# ---- --help -------------------------------------------------------------------------------------

def _parsers(parser, name="expertd"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child_name, child in action.choices.items():
                yield from _parsers(child, f"{name} {child_name}")


def test_every_flag_shows_its_default_in_help():
    checked = 0
    for name, parser in _parsers(build_parser()):
        assert parser.formatter_class is DefaultsHelpFormatter or name == "expertd"
        formatter = DefaultsHelpFormatter(name)
        for action in parser._actions:
            if (not action.option_strings or action.required or action.help == argparse.SUPPRESS
                    or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
                continue
            assert "default" in formatter._get_help_string(action), (name, action.dest)
            checked += 1
    assert checked > 40
    shown = expertd_cli("start", "--help").stdout
    for text in ("(default: 8)", "(default: 4)", "(default: direct)", "(default: none)",
                 "30%)"):
        assert text in shown, text
    assert "no progress bar (default: off)" in expertd_cli("verify", "--help").stdout


# ---- issue 16: a reader that goes away (`expertd status | head`) ------------------------------

def closed_pipe_run(*args) -> subprocess.CompletedProcess:
    """``expertd ARGS`` with stdout a pipe whose reader is gone before it writes a byte."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "expertd", *map(str, args)],
                              stdin=subprocess.DEVNULL, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args, code", [
    (("status", "--json"), 3),  # no daemon at all: an empty list
    (("status", "--blobs", "BLOBS", "--json"), 3),  # this one does not run
    (("verify", "-q", "--blobs", "BLOBS"), 0),
])
def test_a_closed_pipe_ends_the_command_quietly_with_its_code(blobs, isolated_env, args, code):
    """A command that finished before the pipe failed keeps its exit code (git's way: the
    pipeline's status is the reader's); a closed pipe adds nothing to stderr."""
    run = closed_pipe_run(*(blobs if a == "BLOBS" else a for a in args))
    assert (run.returncode, run.stderr) == (code, "")


def test_a_reader_leaving_mid_watch_ends_it_quietly(blobs, isolated_env):
    """`status --watch | head -1`: the pipe closes between two refreshes."""
    watch = subprocess.Popen([sys.executable, "-m", "expertd", "status", "--blobs", str(blobs),
                              "--json", "--watch", "0.05"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(watch.stdout.readline())[0]["running"] is False
        watch.stdout.close()  # as head does once it has its line
        _, err = watch.communicate(timeout=30)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
    assert (watch.returncode, err) == (1, "")


# ---- issue 16: after `make demo`, expertd is in .venv, not on PATH ------------------------------

@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the suite runs outside a venv")
def test_the_demo_says_how_to_put_expertd_on_path(monkeypatch, tmp_path):
    from expertd.tools.demo import _activate

    here = Path(sys.executable).parent
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a fresh shell: the venv is not on it
    monkeypatch.chdir(Path(sys.prefix).parent)
    said = _activate()
    activate = os.path.relpath(Path(sys.prefix) / "bin" / "activate")
    assert said == f". {activate} (puts expertd on your PATH), then "
    shell = subprocess.run(["sh", "-c", f". {activate} && command -v expertd"],
                           capture_output=True, text=True, timeout=30)
    assert Path(shell.stdout.strip()) == here / "expertd", shell
    monkeypatch.setenv("PATH", f"{here}:/usr/bin:/bin")  # already on it: nothing to say
    assert _activate() == ""


# ---- issue 16: every input checked in the parent, in one line ----------------------------------

def refusal(capsys, *argv) -> str:
    """The one error line argparse gives for ``argv``; fails unless it exits with 2 and says
    nothing else."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(list(argv))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err  # one line, no usage block before it
    return lines[0]


SECONDS = "must be a number of seconds above 0, at most 86400 (a day)"
TIMED = [("status", "--timeout"), ("status", "--blobs", "B", "--watch"),
         ("stop", "--blobs", "B", "--timeout"), ("restart", "--blobs", "B", "--timeout"),
         ("start", "--blobs", "B", "--client-timeout"), ("start", "--blobs", "B",
                                                         "--lease-timeout"),
         ("start", "--blobs", "B", "--heartbeat"), ("restart", "--blobs", "B", "--heartbeat")]


@pytest.mark.parametrize("flag", TIMED, ids=" ".join)
@pytest.mark.parametrize("value", ["inf", "1e30", "nan", "0", "-1", "86401", "soon", ""])
def test_every_timeout_is_a_bounded_number_of_seconds(capsys, flag, value):
    said = refusal(capsys, *flag, value)
    assert said == (f"expertd {flag[0]}: error: argument {flag[-1]}: {SECONDS}, not {value!r}")
    assert getattr(build_parser().parse_args([*flag, "86400"]),
                   flag[-1].lstrip("-").replace("-", "_")) == 86400


def test_a_log_file_and_a_pin_file_are_checked_before_the_daemon_starts(capsys, tmp_path):
    """A typo must not create directories (as convert refuses); a bad path is named by the
    command, not by the detached child three lines later."""
    start = ("start", "--blobs", "B")
    missing = tmp_path / "nonexistent" / "x.log"
    assert refusal(capsys, *start, "--log-file", str(missing)) == (
        f"expertd start: error: argument --log-file: {missing.parent}: no such directory (the "
        f"parent of {missing}); create it first or choose another path")
    assert not missing.parent.exists()
    assert refusal(capsys, *start, "--log-file", str(tmp_path)) == (
        f"expertd start: error: argument --log-file: {tmp_path} is a directory: give a file's "
        "path in it")
    for flag in ("--log-file", "--pin-file"):
        assert refusal(capsys, *start, flag, "") == (
            f"expertd start: error: argument {flag}: must be a file's path, not ''")
    log = tmp_path / "x.log"
    assert build_parser().parse_args([*start, "--log-file", str(log)]).log_file == str(log)


def test_a_pin_file_the_model_cannot_hold_is_refused_before_the_daemon_starts(
        blobs, isolated_env, tmp_path):
    """Pins of an expert the model lacks, or more pins than the cache may hold, are bad input:
    start refuses them in one line with exit 2, as a malformed pin file, and starts nothing
    (the detached daemon refused them with exit 1)."""
    from harness import try_stats

    m = Manifest.load(blobs)
    cases = {"lacking": ([[0, m.layers[0].num_experts]],
                         f"no expert {m.layers[0].num_experts} in layer 0"),
             "layer": ([[len(m.layers), 0]], f"no expert 0 in layer {len(m.layers)}"),
             "too many": ([[la, ex] for la in range(len(m.layers))
                           for ex in range(m.layers[la].num_experts)], "can pin at most")}
    for name, (pins, said) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(pins))
        got = expertd_cli("start", "--blobs", blobs, "--pin-file", path, timeout=60)
        assert got.returncode == 2, (name, got.returncode, got.stderr)
        assert got.stderr.startswith(f"expertd start: error: --pin-file {path}: ") and \
            said in got.stderr and len(got.stderr.strip().splitlines()) == 1, got.stderr
        assert try_stats(blobs) is None  # nothing started


SYNTH = ("synth", "--out", "M")


@pytest.mark.parametrize("flag", ["--layers", "--experts", "--top-k", "--hidden", "--moe-inter",
                                  "--bits"])
def test_synth_sizes_are_positive_integers(capsys, flag):
    for value in ("0", "-1", "2.5"):
        assert refusal(capsys, *SYNTH, flag, value) == (
            f"expertd synth: error: argument {flag}: must be an integer of at least 1, "
            f"not {value!r}")


def test_synth_seed_is_what_mlx_takes(capsys):
    assert refusal(capsys, *SYNTH, "--seed", "-1") == (
        "expertd synth: error: argument --seed: must be an integer between 0 and "
        "18446744073709551615, not '-1'")


def test_synth_checks_flags_together_in_one_line(tmp_path):
    """What argparse cannot check alone (top-k against experts, bits against the mode, sizes
    against the quantization group) is one line and exit 1, and nothing is written."""
    out = tmp_path / "m"
    for flags, message in (
            (("--experts", "16", "--top-k", "20"),
             "top-k must be between 1 and the number of experts (16), not 20"),
            (("--mode", "mxfp4", "--bits", "8"), "mxfp4 uses 4 bits, not 8"),
            (("--hidden", "16"), "hidden must be a positive multiple of 64, not 16")):
        got = expertd_cli("synth", "--out", out, *flags, timeout=60)
        assert (got.returncode, got.stdout) == (1, ""), got
        assert got.stderr == f"expertd synth: error: {message}\n"
        assert not out.exists()


def test_sizes_print_in_mib_below_a_gib():
    from expertd.cli.daemon_control import status_lines
    from expertd.units import size_text

    assert size_text(274_000) == "0.26 MiB" and size_text(274_000, round_up=True) == "0.27 MiB"
    assert size_text(3 * 2**29) == "1.50 GiB" and size_text(2**30 - 1) == "1024.00 MiB"
    assert size_text(2**30 + 1, round_up=True) == "1.01 GiB"
    stats = dict(pid=1, blob_dir="B", endpoint="ipc://x", uptime_s=1.0, arena_bytes=786432,
                 rows_used=0, arena_rows=48, pinned=0, hits=0, misses=0, hit_rate=0.0,
                 prefetch="auto", prefetch_fills=0, side_rows=8, prefetch_hits=0,
                 prefetch_wasted=0, prefetch_dropped=0, prefetch_shed=0, bytes_read=0,
                 fills=0, fill_gbps=0.0, clients=0, leases=0, log="L")
    assert "  arena        0.75 MiB, 0/48 rows used, 0 pinned" in status_lines(stats)


def test_convert_prints_a_small_model_in_mib(models, tmp_path):
    got = expertd_cli("convert", "-q", models.model(), tmp_path / "blobs", timeout=120)
    assert got.returncode == 0, got
    assert "(0.75 MiB of experts, stride 16384 bytes)" in got.stdout, got.stdout


@pytest.mark.parametrize("value", ["0", "abc", "100000"])
def test_a_bounded_flag_is_refused_while_parsing_in_one_line(capsys, value):
    """--workers 0 and --workers abc are the same kind of mistake: one line, exit status 2."""
    said = refusal(capsys, "start", "--blobs", "B", "--workers", value)
    assert said.startswith("expertd start: error: argument --workers: must be ")
    assert "256" in said and repr(value if value == "abc" else int(value)) in said


def test_an_unknown_flag_gets_the_closest_and_an_mlx_lm_flag_says_so(capsys):
    said = refusal(capsys, "generate", "--blobs", "B", "--xtc-probablity", "0.5")
    assert said == ("expertd generate: error: no flag --xtc-probablity; did you mean "
                    "--xtc-probability? (see expertd generate --help)")
    said = refusal(capsys, "generate", "--blobs", "B", "--quantize-activations")
    assert said.startswith("expertd generate: error: --quantize-activations is mlx-lm's, and "
                           "expertd generate does not take it: ")
    said = refusal(capsys, "chat", "--blobs", "B", "--draft-model=D")
    assert "--draft-model is mlx-lm's, and expertd chat does not take it" in said
    # mlx_lm.chat's and mlx_lm.generate's flags that these commands lack: said so, not "no
    # flag" (or a near name that means something else).
    for command, flag in (("serve", "--xtc-probability"), ("chat", "--min-tokens-to-keep"),
                          ("chat", "--use-default-chat-template")):
        said = refusal(capsys, command, "--blobs", "B", flag)
        assert said.startswith(f"expertd {command}: error: {flag} is mlx-lm's, and "), said


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("typed", ["--num-draft-tokens", "--num-draft-tokens=4", "--num-draft"])
def test_num_draft_tokens_without_a_draft_model_is_refused(capsys, command, typed):
    """It was accepted and did nothing."""
    said = refusal(capsys, command, "--blobs", "B", *([typed, "4"] if "=" not in typed
                                                       else [typed]))
    assert said == (f"expertd {command}: error: --num-draft-tokens needs --draft-model (see "
                    f"expertd {command} --help)")


def test_v_after_the_subcommand_says_where_it_goes(capsys):
    said = refusal(capsys, "start", "-v", "--blobs", "B")
    assert said == "expertd start: error: -v goes before the subcommand: expertd -v start ..."


def test_top_p_reads_the_same_in_every_help():
    """generate, chat and serve keep their mlx-lm command's top-p default (0.0 or 1.0), and
    every --help says the same thing of it: off."""
    for command in ("generate", "chat", "serve"):
        done = expertd_cli(command, "--help")
        text = " ".join(done.stdout.split())
        at = text.index("--top-p TOP_P ")
        assert "(default: off (mlx-lm's " in text[at:at + 120], (command, text[at:at + 120])
        # Issue 26 item 6: --blobs has help, and --model (mlx-lm's name) is the same flag.
        assert ("--blobs BLOB_DIR, --model BLOB_DIR the blob directory (expertd convert's "
                "output) of a running daemon") in text, command


def test_an_interrupt_python_swallows_is_delivered_again():
    """A KeyboardInterrupt raised inside a callback Python runs for itself (here a weakref
    callback, as an import lock's is) is printed as "Exception ignored" and lost; under
    expertd's hook it reaches the command's own code (synth once went on to exit 0)."""
    program = textwrap.dedent("""
        import sys, time, weakref
        from expertd.cli.main import deliver_lost_interrupts
        hooked = sys.argv[1] == "hooked"
        if hooked:
            deliver_lost_interrupts()
        class Lock: pass
        def callback(ref):
            raise KeyboardInterrupt  # a SIGINT landing in the callback
        held = Lock()
        ref = weakref.ref(held, callback)
        try:
            del held
            # The command's own work: a second without the hook (it goes on, and ends), up
            # to a minute with it (the interrupt ends it as soon as it is delivered).
            end = time.monotonic() + (60 if hooked else 1)
            while time.monotonic() < end:
                pass
            print("went on")
        except KeyboardInterrupt:
            print("interrupted")
    """)
    got = {how: subprocess.run([sys.executable, "-c", program, how], capture_output=True,
                               text=True, timeout=120, preexec_fn=sigint_as_usual).stdout.strip()
           for how in ("plain", "hooked")}
    assert got == {"plain": "went on", "hooked": "interrupted"}


def test_status_names_the_log_file_the_daemon_was_started_with(blobs, isolated_env, tmp_path):
    """A daemon started with --log-file logs there; status named the default log (another
    run's, or none)."""
    log = tmp_path / "mine.log"
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", "50%", "--log-file", log)
        assert started.returncode == 0, started.stderr
        status, = json.loads(expertd_cli("status", "--blobs", blobs, "--json").stdout)
        assert status["log"] == str(log) and log.stat().st_size > 0
        assert f"log          {log}" in expertd_cli("status", "--blobs", blobs).stdout
    finally:
        kill_serving_daemon(blobs)
