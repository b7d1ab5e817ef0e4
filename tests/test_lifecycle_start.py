"""Starting real daemons: stale runtime files of dead daemons removed and live ones spared,
--cache-gb and the geometry, honest start-up failures, and what an attack found (two starts
at once, pins from the pin file alone, a FIFO at the state file, careless flags)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from harness import (
    SMALL_CACHE_GB,
    RawClient,
    expertd_cli,
    kill_serving_daemon,
    query_stats,
    running_daemon,
    shm_exists,
    wait_until,
)
from harness import TINY_CACHE_GB as CACHE_GB  # 10 rows of the tiny model

from expertd.cli.lifecycle import serving_pid
from expertd.paths import daemon_paths
from expertd.runfile import read_run_info, serving_epoch, sweep_runtime_dir
from expertd.shm.layout import Geometry, unlink_arena

# ---- stale files: the dead daemon's own, and other dead daemons' ------------------------------

@pytest.mark.timeout(120)
def test_start_removes_dead_daemons_files_and_spares_live_ones(models, isolated_env, tmp_path):
    live_blobs = models.blobs()
    dead_blobs, new_blobs = tmp_path / "dead", tmp_path / "new"
    shutil.copytree(live_blobs, dead_blobs)
    shutil.copytree(live_blobs, new_blobs)
    live, dead = daemon_paths(live_blobs), daemon_paths(dead_blobs)
    run_dir = live.lock.parent
    two_days_ago = time.time() - 2 * 86400
    orphan = {run_dir / f"0123456789abcdef.{s}" for s in ("sock", "pid", "err", "log", "log.1")}
    for path in orphan:
        path.write_text("old")
        os.utime(path, (two_days_ago, two_days_ago))
    recent_log = run_dir / "fedcba9876543210.log"
    recent_log.write_text("a crash of this morning")
    unrelated = run_dir / "notes.txt"
    unrelated.write_text("not ours to judge")
    with running_daemon(live_blobs, isolated_env, "--cache-gb", CACHE_GB) as a:
        live_files = sorted(run_dir.glob(f"{live.ident}.*"))
        with running_daemon(dead_blobs, isolated_env, "--cache-gb", CACHE_GB) as b:
            b.kill()
            assert shm_exists(b.arena) and dead.socket.exists() and dead.runfile.exists()
            try:
                started = expertd_cli("start", "--blobs", new_blobs, "--cache-gb", CACHE_GB)
                assert started.returncode == 0, started.stderr
                assert not shm_exists(b.arena), "the dead daemon's arena is still there"
                for path in (dead.socket, dead.runfile, dead.pidfile, dead.lock, *orphan):
                    assert not path.exists(), f"{path} was not removed"
                assert recent_log.exists(), "a dead daemon's recent log should be kept a day"
                assert unrelated.exists()
                # The live daemon lost nothing and still serves.
                assert sorted(run_dir.glob(f"{live.ident}.*")) == live_files
                assert query_stats(live_blobs)["pid"] == a.pid and shm_exists(a.arena)
                assert serving_epoch(live) == read_run_info(live).epoch
                assert expertd_cli("stop", "--blobs", new_blobs).returncode == 0
            finally:
                kill_serving_daemon(new_blobs)
    # Now nobody serves anything: a sweep leaves only the recent logs (and the unrelated file).
    new = daemon_paths(new_blobs)
    assert sweep_runtime_dir(run_dir) >= 2
    assert sorted(p.name for p in run_dir.iterdir() if re.fullmatch(r"[0-9a-f]{16}\..*", p.name)
                  ) == sorted([new.log.name, recent_log.name])


# ---- --cache-gb and the geometry ----------------------------------------------------------------

@pytest.mark.timeout(90)
def test_cache_gb_is_validated_and_the_smallest_budget_named(models, isolated_env):
    blobs = models.blobs()
    for bad in ("nan", "inf", "-inf", "0", "-1"):
        refused = expertd_cli("start", "--blobs", blobs, f"--cache-gb={bad}", timeout=30)
        assert refused.returncode == 2, refused
        assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
        assert "finite number of GiB above 0" in refused.stderr
    small = expertd_cli("start", "--blobs", blobs, "--cache-gb", "0.0001", timeout=30)
    assert small.returncode == 2 and small.stderr.count("\n") == 1, small
    least = re.search(r"smallest cache that serves it is ([0-9.]+ [MG])iB", small.stderr)
    assert least, small.stderr
    assert "8 rows" in small.stderr  # 2 x top_k for the tiny model (top_k = 4)
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", least.group(1))
        assert started.returncode == 0, started.stderr
        assert query_stats(blobs)["arena_rows"] == 8
    finally:
        kill_serving_daemon(blobs)


def test_a_budget_short_of_the_side_rows_says_so():
    stride, side = 16384, 4
    least = Geometry.smallest_budget(3, 16, stride, side_rows=side)
    assert Geometry.for_budget(3, 16, stride, least, side_rows=side).cache_rows == 1
    budget = least - 1  # room for several rows, but not for one beside the side rows
    assert budget > 4 * stride
    with pytest.raises(ValueError) as err:
        Geometry.for_budget(3, 16, stride, budget, side_rows=side)
    message = str(err.value)
    assert "holds no expert row" not in message
    assert "2 x 4 prefetch side rows" in message and f"at least {least} bytes" in message
    for rows in (2, 8, 20):
        budget = Geometry.smallest_budget(3, 16, stride, side_rows=side, cache_rows=rows)
        assert Geometry.for_budget(3, 16, stride, budget, side_rows=side).cache_rows == rows
        assert Geometry.for_budget(3, 16, stride, budget - 1, side_rows=side).cache_rows == rows - 1


def test_default_side_rows_are_twice_top_k_only_in_a_big_enough_arena():
    """Two read-ahead widths per generation when the cache keeps 16 times as many rows beside
    them; top_k when the arena is small, or the model has too few experts to fill it."""
    stride, top_k = 16384, 4
    for rows, want in ((127, 4), (128, 8), (2000, 8)):
        budget = Geometry.smallest_budget(8, 512, stride, side_rows=8, cache_rows=rows)
        assert Geometry.default_side_rows(8, 512, stride, budget, top_k) == want, rows
    budget = Geometry.smallest_budget(3, 16, stride, side_rows=8, cache_rows=2000)
    assert Geometry.default_side_rows(3, 16, stride, budget, top_k) == top_k  # 48 experts
    assert Geometry.default_side_rows(3, 16, stride, 1000, top_k) == top_k  # no room at all


# ---- start-up failures ---------------------------------------------------------------------------

BLOCK_BEFORE_STATE = """
import sys
if "--foreground" in sys.argv:
    import expertd.serving.server as server
    load_state = server.ExpertServer._load_state

    def blocked(self):
        open({fifo!r}).read()
        load_state(self)

    server.ExpertServer._load_state = blocked
"""


# The pin file edited while the daemon starts: `start` and the daemon's flags checked it (it
# was empty), the server reads it again and finds more pins than the cache may hold.
EDIT_PINS_AT_START = """
import sys
if "--foreground" in sys.argv:
    import expertd.serving.server as server
    init = server.ExpertServer.__init__

    def edited(self, *args, **kwargs):
        open({pins!r}, "w").write({text!r})
        init(self, *args, **kwargs)

    server.ExpertServer.__init__ = edited
"""


@pytest.mark.timeout(120)
def test_a_failed_start_shows_only_its_own_error_and_leaves_nothing(models, isolated_env,
                                                                     tmp_path, monkeypatch):
    blobs = models.blobs()
    paths = daemon_paths(blobs)
    pins = tmp_path / "pins.json"
    pins.write_text("[]")
    editor = tmp_path / "editor"
    editor.mkdir()
    (editor / "sitecustomize.py").write_text(EDIT_PINS_AT_START.format(
        pins=str(pins), text=json.dumps([[0, e] for e in range(9)])))  # more than it may pin
    with monkeypatch.context() as mp:
        mp.setenv("PYTHONPATH", str(editor))
        first = expertd_cli("start", "--blobs", blobs, "--cache-gb", CACHE_GB,
                            "--pin-file", pins, timeout=30)
    assert first.returncode == 1
    assert "9 experts to pin" in first.stderr and "exited with status 1" in first.stderr
    assert f"log: {paths.log}" in first.stderr and "Traceback" not in first.stderr
    assert "start-up failed" in paths.log.read_text()
    assert not paths.last_flags.exists()  # only a daemon that served keeps its flags

    # A start blocked after its arena exists, then killed: SIGKILL, as the OOM killer would,
    # then SIGTERM through `expertd stop`. The daemon child blocks on a FIFO nobody writes,
    # just before it reads its hot set: a sitecustomize on the child's path puts the FIFO there.
    fifo = tmp_path / "block.fifo"
    os.mkfifo(fifo, 0o600)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BLOCK_BEFORE_STATE.format(fifo=str(fifo)))
    child_env = {**os.environ, "PYTHONPATH": str(hook)}
    for how, expected in (("kill", "was killed by SIGKILL"), ("stop", "exited with status 143")):
        starter = subprocess.Popen(
            [sys.executable, "-m", "expertd", "start", "--blobs", str(blobs), "--cache-gb",
             CACHE_GB], env=child_env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            info = wait_until(lambda: read_run_info(paths), 30, "the run file")
            assert not info.ready and serving_epoch(paths) == 0
            wait_until(lambda: shm_exists(info.arena), 30, "the arena")
            if how == "kill":
                os.kill(info.pid, signal.SIGKILL)
            else:
                assert expertd_cli("stop", "--blobs", blobs).returncode == 0
            _, err = starter.communicate(timeout=30)
        finally:
            if starter.poll() is None:
                kill_serving_daemon(blobs)
                starter.kill()
                starter.communicate()
            unlink_arena(info.arena)
        assert starter.returncode == 1
        assert expected in err and f"log: {paths.log}" in err, err
        assert "9 experts to pin" not in err, "an earlier run's error was shown"
        assert not shm_exists(info.arena), "the failed start left its arena"
        for path in (paths.socket, paths.runfile, paths.pidfile):
            assert not path.exists(), f"the failed start left {path}"
        assert serving_pid(paths) is None


# ---- what an attack found ---------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_two_starts_at_once_leave_one_daemon_that_stop_stops(models, isolated_env):
    blobs = models.blobs()
    cmd = [sys.executable, "-m", "expertd", "start", "--blobs", str(blobs), "--cache-gb",
           CACHE_GB]
    try:
        starts = [subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [(p.wait(60), *p.communicate()) for p in starts]
        codes = sorted(code for code, _, _ in results)
        assert codes == [0, 1], results
        loser = next(err for code, _, err in results if code == 1)
        assert "already serves" in loser and "Traceback" not in loser
        stopped = expertd_cli("stop", "--blobs", blobs, timeout=30)
        assert stopped.returncode == 0, stopped.stderr
        assert serving_pid(daemon_paths(blobs)) is None  # nobody took over after the stop
    finally:
        kill_serving_daemon(blobs)


@pytest.mark.timeout(150)
def test_one_blob_directory_has_one_daemon_whatever_the_runtime_directory(models, isolated_env,
                                                                          monkeypatch,
                                                                          other_runtime):
    """A service and a shell may see two runtime directories (XDG_RUNTIME_DIR set in one only),
    where daemons cannot see each other's locks: a second daemon for the same blobs would split
    the clients between two caches. The claim in the state directory refuses it, and every
    command of the other runtime directory says where the daemon is and how to reach it."""
    from expertd.connection import Connection
    from expertd.errors import DaemonNotRunning

    blobs = models.blobs()
    first = daemon_paths(blobs)
    other = other_runtime
    reach = f"XDG_RUNTIME_DIR={first.lock.parent.parent}"
    start = ("start", "--blobs", blobs, "--cache-gb", CACHE_GB)
    try:
        assert expertd_cli(*start).returncode == 0
        pid = serving_pid(first)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(other))
        second = daemon_paths(blobs)
        assert second.lock.parent != first.lock.parent and second.claim == first.claim
        for args in (start, start + ("--foreground",)):  # detached, and what launchd runs
            refused = expertd_cli(*args)
            assert refused.returncode == 1, refused.stderr
            assert f"pid {pid}" in refused.stderr and reach in refused.stderr, refused.stderr
            assert "Traceback" not in refused.stderr and refused.stderr.count("\n") == 1
            assert serving_pid(second) is None and not list(second.lock.parent.glob("*.run"))
        for args in (("stop", "--blobs", blobs), ("status", "--blobs", blobs)):
            told = expertd_cli(*args)
            assert told.returncode != 0 and reach in told.stderr, (args, told.stderr)
        every = expertd_cli("status")  # every daemon: the one out of reach is named
        assert every.returncode == 3 and f"served by expertd pid {pid} from the runtime " \
            f"directory {first.lock.parent}" in every.stderr, every.stderr
        (down,) = json.loads(expertd_cli("status", "--blobs", blobs, "--json").stdout)
        assert down["served_from"] == {"pid": pid, "runtime": str(first.lock.parent)}
        assert down["log"] == str(first.log)  # the serving daemon's log, not this directory's
        with pytest.raises(DaemonNotRunning, match=re.escape(reach)):
            Connection(blobs)
        monkeypatch.setenv("XDG_RUNTIME_DIR", isolated_env["XDG_RUNTIME_DIR"])
        assert query_stats(blobs)["pid"] == pid  # the first one never noticed
        assert expertd_cli("stop", "--blobs", blobs).returncode == 0
        assert not first.claim.exists()
        # Stopped there, it may start here.
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(other))
        assert expertd_cli(*start).returncode == 0, "the claim outlived its daemon"
        assert expertd_cli("stop", "--blobs", blobs).returncode == 0
    finally:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(other))
        kill_serving_daemon(blobs)
        monkeypatch.setenv("XDG_RUNTIME_DIR", isolated_env["XDG_RUNTIME_DIR"])
        kill_serving_daemon(blobs)


@pytest.mark.timeout(150)
def test_stop_clears_a_killed_daemons_arena_while_another_directory_serves(models, isolated_env,
                                                                           monkeypatch,
                                                                           other_runtime):
    """A daemon killed in one runtime directory, then one started from another: stop in the
    first says where the blobs are served (nothing is stopped) and still frees the killed
    one's arena, which status there shows as held by nothing."""
    blobs = models.blobs()
    first = daemon_paths(blobs)
    other = other_runtime
    start = ("start", "--blobs", blobs, "--cache-gb", CACHE_GB)
    killed = None
    try:
        assert expertd_cli(*start).returncode == 0
        killed = read_run_info(first)
        os.kill(killed.pid, signal.SIGKILL)
        wait_until(lambda: serving_pid(first) is None, 10, "the daemon to die")
        assert shm_exists(killed.arena)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(other))
        assert expertd_cli(*start).returncode == 0  # the claim died with its daemon
        pid = serving_pid(daemon_paths(blobs))
        monkeypatch.setenv("XDG_RUNTIME_DIR", isolated_env["XDG_RUNTIME_DIR"])
        stopped = expertd_cli("stop", "--blobs", blobs)
        assert stopped.returncode == 1 and f"pid {pid}" in stopped.stderr, stopped.stderr
        assert f"removed what a killed one left here: arena {killed.arena}" in stopped.stderr
        assert not shm_exists(killed.arena)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(other))
        assert query_stats(blobs)["pid"] == pid  # the other one serves on
    finally:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(other))
        kill_serving_daemon(blobs)
        monkeypatch.setenv("XDG_RUNTIME_DIR", isolated_env["XDG_RUNTIME_DIR"])
        kill_serving_daemon(blobs)
        if killed is not None:
            unlink_arena(killed.arena)


def test_status_names_this_machines_claims_from_elsewhere_only(isolated_env):
    """Claims held in the state directory (a shared home holds other machines' too): status
    names this machine's from another runtime directory, and no other machine's."""
    from expertd.paths import state_dir
    from expertd.runfile import take_lock

    held = []
    try:
        for name, host in (("a" * 16, os.uname().nodename), ("b" * 16, "another-host")):
            claim = state_dir() / f"{name}.serving"
            fd = take_lock(claim)
            os.pwrite(fd, json.dumps({"pid": 4242, "runtime": "/run/elsewhere/expertd",
                                      "blob_dir": f"/blobs/{host}", "host": host}).encode(), 0)
            held.append(fd)
        told = expertd_cli("status")
        assert told.returncode == 3, told
        assert f"/blobs/{os.uname().nodename}: served by expertd pid 4242" in told.stderr
        assert "/blobs/another-host" not in told.stderr and "no expertd is running here" in \
            told.stderr, told.stderr
    finally:
        for fd in held:
            os.close(fd)


@pytest.mark.timeout(120)
def test_a_claim_the_state_directory_cannot_hold_refuses_nothing(models, isolated_env):
    """A FIFO planted at the claim's name, as a read-only or full state directory would fail
    it: the daemon serves as it did before claims, saying so in its log, and neither start,
    status nor stop hangs on the FIFO."""
    import stat

    blobs = models.blobs()
    paths = daemon_paths(blobs)
    os.mkfifo(paths.claim)
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", CACHE_GB, timeout=30)
        assert started.returncode == 0, started.stderr
        assert f"cannot claim {paths.blob_dir}" in paths.log.read_text()
        assert expertd_cli("status", "--blobs", blobs, timeout=30).returncode == 0
        assert expertd_cli("stop", "--blobs", blobs, timeout=30).returncode == 0
        assert stat.S_ISFIFO(os.lstat(paths.claim).st_mode)  # not ours to remove
    finally:
        kill_serving_daemon(blobs)
        paths.claim.unlink(missing_ok=True)


@pytest.mark.timeout(120)
def test_pins_come_from_the_pin_file_alone_not_from_an_old_state(models, isolated_env, tmp_path):
    blobs = models.blobs()
    pins = tmp_path / "pins.json"
    pins.write_text("[[0, 1]]")
    state = tmp_path / "hot.json"
    try:
        for flags, pinned in ((["--pin-file", pins], 1), ([], 0)):
            got = expertd_cli("start", "--blobs", blobs, "--cache-gb", CACHE_GB, "--state-file",
                              state, *flags)
            assert got.returncode == 0, got.stderr
            wait_until(lambda: query_stats(blobs)["in_flight"] == 0, 10, "warm-up to end")
            assert query_stats(blobs)["pinned"] == pinned
            assert expertd_cli("stop", "--blobs", blobs).returncode == 0
    finally:
        kill_serving_daemon(blobs)


@pytest.mark.timeout(60)
def test_a_fifo_or_foreign_file_at_the_state_file_is_ignored(models, isolated_env, tmp_path):
    blobs = models.blobs()
    fifo = tmp_path / "hot.json"
    os.mkfifo(fifo, 0o600)
    try:
        got = expertd_cli("start", "--blobs", blobs, "--cache-gb", CACHE_GB, "--state-file",
                          fifo, timeout=30)
        assert got.returncode == 0, got.stderr  # did not hang reading it
        assert expertd_cli("stop", "--blobs", blobs).returncode == 0
    finally:
        kill_serving_daemon(blobs)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"policy": {}, "hot": [[0, 1]]}))
    os.chown(foreign, 65534, 65534)  # as root: a file another user planted
    from expertd.runfile import read_private

    with pytest.raises(PermissionError):
        read_private(foreign)


@pytest.mark.parametrize("flags, message", [
    (["--cache-gb", "1e308"], "more memory than any machine has"),
    (["--cache-gb", CACHE_GB, "--pin-file", "/nonexistent/pins.json"], "cannot read the pin"),
    (["--cache-gb", CACHE_GB, "--pin-file", "{bad}"], "the pin file is not JSON"),
])
def test_start_refuses_careless_flags_in_one_line(models, isolated_env, tmp_path, flags, message):
    flags = [str(tmp_path / "bad.json") if f == "{bad}" else f for f in flags]
    (tmp_path / "bad.json").write_text("{not json")
    got = expertd_cli("start", "--blobs", models.blobs(), *flags, timeout=30)
    assert got.returncode == 2 and message in got.stderr, got.stderr
    assert "Traceback" not in got.stderr and len(got.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(120)
def test_a_pin_whose_blob_is_damaged_is_named_at_start_and_in_plain_status(models, isolated_env,
                                                                           tmp_path):
    """A byte of a pinned expert flipped on the disk: start says at once that the pin cannot
    be served and what to run, and plain status names the expert beside the fills that
    failed (not only the log and --json)."""
    from test_fill_verify import flip_byte

    blobs = tmp_path / "blobs"
    shutil.copytree(models.blobs(), blobs)  # its own copy: the shared one is read by others
    flip_byte(blobs, 1, 2)
    pins = tmp_path / "pins.json"
    pins.write_text("[[0, 1], [1, 2]]")
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", CACHE_GB, "--pin-file",
                              pins, timeout=60)
        assert started.returncode == 0, started.stderr
        assert "pin layer 1 expert 2 cannot be served" in started.stderr, started.stderr
        assert "pin layer 0 expert 1" not in started.stderr  # its blob is sound
        assert f"expertd verify --blobs {blobs}" in started.stderr
        status = expertd_cli("status", "--blobs", blobs, timeout=30)
        assert status.returncode == 0, status.stderr
        assert "1 fills failed; 1 expert cannot be served now:" in status.stdout, status.stdout
        assert "layer 1 expert 2: " in status.stdout and "expertd verify" in status.stdout
        assert expertd_cli("stop", "--blobs", blobs).returncode == 0
    finally:
        kill_serving_daemon(blobs)


@pytest.mark.timeout(180)
def test_a_damaged_pin_is_named_beside_more_damaged_experts_than_status_lists(
        models, isolated_env, tmp_path):
    """The warm-up of a saved hot set reads 16 damaged experts of layer 0, and the pinned
    layer 1 expert 2 is damaged too: start still names the pin (STATS lists 16 failed experts,
    pinned ones first: it listed layer 0's alone), and status counts all 17, not the 16 it
    names."""
    from test_fill_verify import flip_byte

    blobs = tmp_path / "blobs"
    shutil.copytree(models.blobs(), blobs)  # its own copy: the shared one is read by others
    state, pins = tmp_path / "state.json", tmp_path / "pins.json"
    pins.write_text("[[1, 2]]")
    hot = [(0, expert) for expert in range(16)]
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", SMALL_CACHE_GB,
                              "--state-file", state, timeout=60)
        assert started.returncode == 0, started.stderr
        with RawClient(blobs) as client:  # layer 0's experts, read whole: the hot set
            for at in range(0, 16, 4):
                client.fetch(0, range(at, at + 4))
        assert expertd_cli("stop", "--blobs", blobs).returncode == 0
        saved = {tuple(key) for key in json.loads(state.read_text())["hot"]}
        assert saved >= set(hot), saved
        for layer, expert in [*hot, (1, 2)]:
            flip_byte(blobs, layer, expert)
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", SMALL_CACHE_GB,
                              "--state-file", state, "--pin-file", pins, timeout=60)
        assert started.returncode == 0, started.stderr
        assert "pin layer 1 expert 2 cannot be served" in started.stderr, started.stderr
        status = expertd_cli("status", "--blobs", blobs, timeout=30)
        assert "17 experts cannot be served now (the first 16, pinned ones first):" in \
            status.stdout, status.stdout
        listed = re.findall(r"^    layer (\d+) expert (\d+):", status.stdout, re.MULTILINE)
        assert len(listed) == 16 and listed[0] == ("1", "2"), listed
        assert expertd_cli("stop", "--blobs", blobs).returncode == 0
    finally:
        kill_serving_daemon(blobs)


def test_every_damaged_expert_is_counted_past_a_few_hundred(models, isolated_env, tmp_path):
    """A whole damaged blob of a model with more experts than status could list: every one
    of its experts read fails, and STATS counts each (it counted at most 256), status says how
    many, and a repaired expert read again leaves the count."""
    from harness import Daemon, RawClient
    from test_fill_verify import flip_byte

    from expertd.errors import DaemonError

    source = models.blobs(layers=2, experts=160)
    blobs = tmp_path / "blobs"
    shutil.copytree(source, blobs)
    layers, experts = 2, 160  # 320 experts, every one damaged
    for layer in range(layers):
        for expert in range(experts):
            flip_byte(blobs, layer, expert)
    with Daemon(blobs, isolated_env):
        with RawClient(blobs) as client:
            limit = client.hello["max_demand"]
            for layer in range(layers):
                for at in range(0, experts, limit):
                    with pytest.raises(DaemonError, match="checksum"):
                        client.demand(layer, range(at, min(at + limit, experts)))
            flip_byte(blobs, 1, 0)  # repaired: the byte flipped back
            client.fetch(1, [0])
        stats = query_stats(blobs)
        damaged = layers * experts - 1
        assert stats["failed_count"] == damaged and len(stats["failed_experts"]) == 16
        status = expertd_cli("status", "--blobs", blobs, timeout=30)
        assert f"{damaged} experts cannot be served now" in status.stdout, status.stdout
