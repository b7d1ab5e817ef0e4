"""Daemon lifecycle against real daemons: run file and epoch, names no other user can take,
private writes that never follow a planted symlink, honest start-up failures, stale runtime
files, rotating logs.

The squatting and small-/dev/shm tests run in a private mount namespace (``unshare -m`` as
root), so that what they plant in /tmp or /dev/shm is seen by nothing else on the machine.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import posix_ipc
import pytest
from harness import (
    RawClient,
    expertd_cli,
    kill_serving_daemon,
    query_stats,
    running_daemon,
    shm_exists,
    wait_until,
)

from expertd.cli.lifecycle import serving_pid
from expertd.paths import daemon_paths
from expertd.runfile import ARENA_NAME, read_run_info, serving_epoch, sweep_runtime_dir, write_atomically
from expertd.shm.layout import Geometry, unlink_arena

NOBODY = 65534
CACHE_GB = "0.0003"  # 10 rows of the tiny model


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---- run file, epoch, pid reuse -----------------------------------------------------------------

@pytest.mark.timeout(90)
def test_run_file_publishes_a_random_arena_and_the_epoch(models, isolated_env):
    blobs = models.blobs()
    paths = daemon_paths(blobs)
    names = set()
    for _ in range(2):
        with running_daemon(blobs, isolated_env, "--cache-gb", CACHE_GB) as d, \
                RawClient(blobs) as c:
            info = read_run_info(paths)
            assert info is not None and info.ready
            assert (info.pid, info.arena, info.epoch) == (d.pid, d.arena, c.hello["epoch"])
            assert info.arena == c.hello["arena"] and len(info.arena) <= 31
            assert ARENA_NAME.fullmatch(info.arena)
            assert c.arena.epoch == info.epoch
            assert serving_epoch(paths) == info.epoch and serving_pid(paths) == d.pid
            assert _mode(paths.runfile) == 0o600 and _mode(paths.pidfile) == 0o600
            assert not list(paths.runfile.parent.glob(".*.tmp")), "a temporary was left"
            names.add(info.arena)
        assert serving_epoch(paths) is None and serving_pid(paths) is None
        assert not paths.runfile.exists() and not paths.pidfile.exists()
    assert len(names) == 2, "each start must pick a new arena name"


@pytest.mark.timeout(60)
def test_a_reused_pid_does_not_make_a_dead_daemon_look_alive(models, isolated_env):
    blobs = models.blobs()
    paths = daemon_paths(blobs)
    with running_daemon(blobs, isolated_env, "--cache-gb", CACHE_GB) as d:
        epoch = serving_epoch(paths)
        assert epoch
        d.kill()
        # Its files stay behind; make them name a live process, as a reused pid would.
        info = json.loads(paths.runfile.read_text())
        paths.runfile.write_text(json.dumps({**info, "pid": os.getpid()}))
        paths.pidfile.write_text(str(os.getpid()))
        assert serving_epoch(paths) is None
        assert serving_pid(paths) is None
        assert shm_exists(d.arena)  # for the next start to remove (the harness does here)


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


# ---- private writes ---------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["temp", "target"])
def test_a_planted_symlink_is_never_followed_by_the_state_file(models, isolated_env, tmp_path,
                                                               planted):
    blobs = models.blobs()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: anyone may plant names here
    victim = tmp_path / "victim"
    victim.write_text("precious")
    state = shared / "hot.json"
    if planted == "temp":  # every temporary name a writer could predict
        for name in ("hot.json.tmp", "hot.tmp", ".hot.json.tmp"):
            (shared / name).symlink_to(victim)
    else:
        state.symlink_to(victim)
    with running_daemon(blobs, isolated_env, "--cache-gb", CACHE_GB,
                        "--state-file", state) as d:
        with RawClient(blobs) as c:
            c.fetch(0, [1, 2])
        assert d.stop() == 0, d.log_text()
    assert victim.read_text() == "precious"
    assert state.is_file() and not state.is_symlink(), "the state was not saved"
    assert _mode(state) == 0o600
    assert [0, 1] in json.loads(state.read_text())["hot"]
    if planted == "target":
        assert "ignoring unreadable state file" in d.log_text()


def test_private_writes_refuse_directories_others_can_tamper_with(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # writable by all and not sticky: our file could be swapped
    with pytest.raises(PermissionError, match="not sticky"):
        write_atomically(open_dir / "f.json", b"{}")
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, NOBODY, NOBODY)
        with pytest.raises(PermissionError, match="belongs to uid"):
            write_atomically(theirs / "f.json", b"{}")
    assert sorted(os.listdir(open_dir)) == []
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    write_atomically(sticky / "f.json", b"{}")
    assert (sticky / "f.json").read_bytes() == b"{}" and _mode(sticky / "f.json") == 0o600


# ---- --cache-gb and the geometry ----------------------------------------------------------------

@pytest.mark.timeout(90)
def test_cache_gb_is_validated_and_the_smallest_budget_named(models, isolated_env):
    blobs = models.blobs()
    for bad in ("nan", "inf", "-inf", "0", "-1"):
        refused = expertd_cli("start", "--blobs", blobs, f"--cache-gb={bad}", timeout=30)
        assert refused.returncode == 1, refused
        assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
        assert "finite number of GiB above 0" in refused.stderr
    small = expertd_cli("start", "--blobs", blobs, "--cache-gb", "0.0001", timeout=30)
    assert small.returncode == 1 and small.stderr.count("\n") == 1, small
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


@pytest.mark.timeout(120)
def test_a_failed_start_shows_only_its_own_error_and_leaves_nothing(models, isolated_env,
                                                                     tmp_path):
    blobs = models.blobs()
    paths = daemon_paths(blobs)
    pins = tmp_path / "pins.json"
    pins.write_text(json.dumps([[0, e] for e in range(9)]))  # more than the cache may pin
    first = expertd_cli("start", "--blobs", blobs, "--cache-gb", CACHE_GB,
                        "--pin-file", pins, timeout=30)
    assert first.returncode == 1
    assert "9 experts to pin" in first.stderr and "exited with status 1" in first.stderr
    assert f"log: {paths.log}" in first.stderr and "Traceback" not in first.stderr
    assert "start-up failed" in paths.log.read_text()

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


# ---- logs ---------------------------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_detached_daemon_logs_to_a_rotating_file(models, isolated_env):
    from expertd.connection import Connection

    blobs = models.blobs()
    paths = daemon_paths(blobs)
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", CACHE_GB)
        assert started.returncode == 0, started.stderr
        assert f"log: {paths.log}" in started.stdout
        status = expertd_cli("status", "--blobs", blobs)
        assert str(paths.log) in status.stdout
        assert "serving" in paths.log.read_text()
        assert paths.start_log.read_text() == "", "logs should not go to the start-up output"
        with open(paths.log, "ab") as f:  # bring it to its 5 MiB limit
            f.write((b"x" * 99 + b"\n") * (5 * 2**20 // 100 + 1))
        with Connection(blobs) as conn:
            conn.send_frames([b"not a request"])  # logged as a bad request
            wait_until(lambda: Path(f"{paths.log}.1").exists(), 10, "the log to rotate")
        assert Path(f"{paths.log}.1").stat().st_size >= 5 * 2**20
        wait_until(lambda: "bad request" in paths.log.read_text(), 10, "the new log's line")
        assert paths.log.stat().st_size < 2**20
        assert _mode(paths.log) == 0o600
        assert expertd_cli("stop", "--blobs", blobs).returncode == 0
    finally:
        kill_serving_daemon(blobs)


# ---- mount namespaces: a small /dev/shm, a squatted /tmp ----------------------------------------

@contextmanager
def mount_namespace(mounts: str):
    """A process (its pid yielded) holding a private mount namespace in which the shell
    commands ``mounts`` ran; skips the test where mount namespaces are not permitted."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("needs root on Linux to make a private mount namespace")
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        pytest.skip("needs unshare and nsenter (util-linux)")
    holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               f"{mounts} && echo ready && exec sleep 600"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    if holder.stdout.readline().strip() != "ready":
        holder.kill()
        _, err = holder.communicate()
        pytest.skip(f"cannot make a mount namespace here: {err.strip()}")
    try:
        yield holder.pid
    finally:
        holder.kill()
        holder.communicate()


def _in_namespace(pid: int, *args, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """``expertd ARGS`` run inside the mount namespace held by ``pid``."""
    return subprocess.run(["nsenter", "-t", str(pid), "-m", "--", sys.executable, "-m",
                           "expertd", *map(str, args)], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_an_arena_larger_than_shared_memory_fails_clearly_and_leaves_nothing(models,
                                                                             isolated_env):
    blobs = models.blobs(experts=64, hidden=256, moe_inter=512)  # 192 experts of 224 KiB
    paths = daemon_paths(blobs)
    env = {**os.environ, **isolated_env}
    with mount_namespace("mount -t tmpfs -o size=16m tmpfs /dev/shm") as ns:
        shm_dir = Path(f"/proc/{ns}/root/dev/shm")
        try:
            failed = _in_namespace(ns, "start", "--blobs", blobs, "--cache-gb", "0.03", env=env)
            assert failed.returncode == 1, failed
            err = failed.stderr
            assert re.search(r"needs 0\.0\d+ GiB but /dev/shm has only 0\.01\d GiB free", err), err
            assert "exited with status 1" in err and f"log: {paths.log}" in err, err
            assert "Traceback" not in err and "SIGBUS" not in err
            assert sorted(os.listdir(shm_dir)) == [], "a segment was left in /dev/shm"
            assert serving_pid(paths) is None, "a daemon process is still there"
            for path in (paths.socket, paths.runfile, paths.pidfile):
                assert not path.exists(), f"{path} was left"
            # Reserving past the tmpfs's size (the check skipped) is an error, not a SIGBUS.
            probe = subprocess.run(
                ["nsenter", "-t", str(ns), "-m", "--", sys.executable, "-c",
                 "import posix_ipc\n"
                 "from expertd.shm.layout import ArenaSpaceError, reserve\n"
                 "shm = posix_ipc.SharedMemory('/expertd-reserve-probe', posix_ipc.O_CREX)\n"
                 "try:\n"
                 "    reserve(shm.fd, 32 << 20, 'the probe')\n"
                 "except ArenaSpaceError as exc:\n"
                 "    print(exc)\n"
                 "finally:\n"
                 "    posix_ipc.unlink_shared_memory('/expertd-reserve-probe')\n"],
                capture_output=True, text=True, timeout=60)
            assert probe.returncode == 0, probe.stderr
            assert "could not reserve 0.031 GiB for the probe in /dev/shm" in probe.stdout
            # A cache that fits the small /dev/shm still starts there.
            ok = _in_namespace(ns, "start", "--blobs", blobs, "--cache-gb", "0.005", env=env)
            assert ok.returncode == 0, ok.stderr
            assert _in_namespace(ns, "stop", "--blobs", blobs, env=env).returncode == 0
            assert sorted(os.listdir(shm_dir)) == []
        finally:
            kill_serving_daemon(blobs)


@pytest.fixture
def outside_tmp():
    """An empty directory outside /tmp (removed afterwards)."""
    path = Path(tempfile.mkdtemp(prefix="xdkeep", dir="/var/tmp"))
    yield path
    path.rmdir()


def _private_tmp(keep: Path) -> str:
    """Shell commands giving the namespace an empty /tmp in which what this test run needs
    from the real /tmp (the checkout and the interpreter: a clone there, as CI may make) is
    bound back at the same paths, through ``keep``, an empty directory outside /tmp."""
    needed = {Path(__file__).resolve().parents[1], Path(sys.prefix).resolve(),
              Path(sys.base_prefix).resolve()}
    needed = sorted(p for p in needed if p.parts[:2] == ("/", "tmp"))
    cmds = [f"mount --bind /tmp {keep}", "mount -t tmpfs -o size=64m tmpfs /tmp"]
    for path in needed:
        cmds.append(f"mkdir -p {path} && mount --bind {keep}{str(path)[4:]} {path}")
    return " && ".join(cmds)


def _old_scheme_arena(blob_dir: str, run_dir: str) -> str:
    """The arena name earlier versions derived from the blob directory: predictable."""
    ident = hashlib.sha256(f"{blob_dir}\0{os.getuid()}\0{run_dir}".encode()).hexdigest()[:16]
    return f"/expertd-{ident}"


def _squat(path: Path) -> None:
    path.mkdir(mode=0o700)
    os.chown(path, NOBODY, NOBODY)


@pytest.mark.timeout(150)
def test_a_squatted_runtime_dir_and_arena_name_do_not_stop_start(models, tmp_path, outside_tmp):
    uid = os.getuid()
    with mount_namespace(_private_tmp(outside_tmp)) as ns:
        root_tmp = Path(f"/proc/{ns}/root/tmp")  # the namespace's own /tmp, seen from here
        shutil.copytree(models.blobs(), root_tmp / "blobs")
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        env["XDG_STATE_HOME"] = "/tmp/state"
        # Another user took the first name; the second is a symlink to a directory of ours.
        _squat(root_tmp / f"expertd-{uid}")
        (root_tmp / "decoy").mkdir(mode=0o700)
        (root_tmp / f"expertd-{uid}-1").symlink_to("/tmp/decoy")
        squatted = []
        for run_dir in (f"/tmp/expertd-{uid}", f"/tmp/expertd-{uid}-2"):
            name = _old_scheme_arena("/tmp/blobs", run_dir)
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
            os.fchown(shm.fd, NOBODY, NOBODY)
            shm.close_fd()
            squatted.append(name)
        ours = root_tmp / f"expertd-{uid}-2"
        try:
            started = _in_namespace(ns, "start", "--blobs", "/tmp/blobs", "--cache-gb",
                                    CACHE_GB, env=env)
            assert started.returncode == 0, started.stderr
            assert f"/tmp/expertd-{uid}-2/" in started.stdout
            assert os.listdir(root_tmp / "decoy") == [], "the symlinked directory was used"
            assert ours.is_dir() and not ours.is_symlink() and _mode(ours) == 0o700
            (run_file,) = ours.glob("*.run")
            arena = json.loads(run_file.read_text())["arena"]
            assert arena not in squatted and shm_exists(arena)
            status = _in_namespace(ns, "status", "--blobs", "/tmp/blobs", env=env)
            assert status.returncode == 0 and arena in _in_namespace(
                ns, "status", "--blobs", "/tmp/blobs", "--json", env=env).stdout
            stopped = _in_namespace(ns, "stop", "--blobs", "/tmp/blobs", env=env)
            assert stopped.returncode == 0, stopped.stderr
            assert not shm_exists(arena)

            # Every candidate taken: one clear line, no traceback.
            os.chown(ours, NOBODY, NOBODY)
            for i in range(3, 9):
                _squat(root_tmp / f"expertd-{uid}-{i}")
            refused = _in_namespace(ns, "start", "--blobs", "/tmp/blobs", "--cache-gb",
                                    CACHE_GB, env=env)
            assert refused.returncode == 1
            assert "set XDG_RUNTIME_DIR" in refused.stderr and "Traceback" not in refused.stderr
            assert refused.stderr.count("\n") == 1, refused.stderr
        finally:
            for run_file in root_tmp.glob(f"expertd-{uid}*/*.run"):
                _stop_pid_of(run_file)
            for name in squatted:
                unlink_arena(name)


def _stop_pid_of(run_file: Path) -> None:
    """Teardown: stop the daemon a run file names if its lock is still held, drop its arena."""
    info = json.loads(run_file.read_text())
    lock = run_file.with_suffix(".lock")
    from expertd.runfile import lock_held

    if lock_held(lock):
        os.kill(info["pid"], signal.SIGKILL)
        wait_until(lambda: not lock_held(lock), 10, "the daemon to die")
    unlink_arena(info["arena"])


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
    (["--cache-gb", CACHE_GB, "--workers", "100000"], "--workers must be between 1 and"),
    (["--cache-gb", CACHE_GB, "--pin-file", "/nonexistent/pins.json"], "cannot read the pin"),
    (["--cache-gb", CACHE_GB, "--pin-file", "{bad}"], "the pin file is not JSON"),
])
def test_start_refuses_careless_flags_in_one_line(models, isolated_env, tmp_path, flags, message):
    flags = [str(tmp_path / "bad.json") if f == "{bad}" else f for f in flags]
    (tmp_path / "bad.json").write_text("{not json")
    got = expertd_cli("start", "--blobs", models.blobs(), *flags, timeout=30)
    assert got.returncode == 1 and message in got.stderr, got.stderr
    assert "Traceback" not in got.stderr and len(got.stderr.strip().splitlines()) == 1
