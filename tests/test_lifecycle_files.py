"""The daemon's own files, against real daemons: the run file and epoch, private writes that
never follow a planted symlink, rotating logs, names no other user can take, an arena larger
than shared memory.

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
from contextlib import contextmanager
from pathlib import Path

import posix_ipc
import pytest
from harness import TINY_CACHE_GB as CACHE_GB  # 10 rows of the tiny model
from harness import (
    RawClient,
    expertd_cli,
    kill_serving_daemon,
    running_daemon,
    shm_exists,
    wait_until,
)

from expertd.cli.lifecycle import serving_pid
from expertd.paths import daemon_paths
from expertd.runfile import ARENA_NAME, read_run_info, serving_epoch, write_atomically
from expertd.shm.layout import unlink_arena

NOBODY = 65534


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


def test_a_killed_daemons_arena_is_named_by_status_and_removed_by_stop(models, isolated_env):
    """SIGKILL leaves the whole arena in shared memory: status says where and how big, in
    text and JSON, and how to remove it; stop removes it and the run files; then neither
    finds anything."""
    blobs = models.blobs()
    paths = daemon_paths(blobs)
    with running_daemon(blobs, isolated_env, "--cache-gb", CACHE_GB) as d:
        size = posix_ipc.SharedMemory(d.arena).size
        d.kill()
        text = expertd_cli("status", "--blobs", blobs)
        assert text.returncode != 0
        path = f"/dev/shm/{d.arena.lstrip('/')}"
        assert f"its arena {path} " in text.stderr and "//" not in text.stderr, text.stderr
        assert f"expertd stop --blobs {paths.blob_dir}" in text.stderr
        left = json.loads(expertd_cli("status", "--blobs", blobs, "--json").stdout)[0]["leftover"]
        assert left["arena"] == d.arena and left["bytes"] == size and left["pid"] == d.pid
        assert left["path"] == path and os.path.exists(path)
        assert left["blob_dir"] == str(paths.blob_dir)
        # Without --blobs too (every daemon of this user): named, with the command.
        every = expertd_cli("status")
        assert every.returncode == 3 and f"its arena {path} " in every.stderr, every.stderr
        assert f"expertd stop --blobs {paths.blob_dir}" in every.stderr
        listed = expertd_cli("status", "--json")
        assert listed.returncode == 3 and json.loads(listed.stdout) == [
            {"running": False, "socket": str(paths.socket), "blob_dir": str(paths.blob_dir),
             "log": str(paths.log), "leftover": left}]
        stopped = expertd_cli("stop", "--blobs", blobs)
        assert stopped.returncode == 0 and f"arena {d.arena}" in stopped.stdout, stopped.stdout
        assert not shm_exists(d.arena) and not paths.runfile.exists()
        again, = json.loads(expertd_cli("status", "--blobs", blobs, "--json").stdout)
        assert again["leftover"] is None
        assert "nothing to stop" in expertd_cli("stop", "--blobs", blobs).stdout


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
            # The names before ours come free (the other user removed them): clients keep
            # finding the daemon in its own directory, not in a new one at the first name.
            (root_tmp / f"expertd-{uid}").rmdir()
            (root_tmp / f"expertd-{uid}-1").unlink()
            status = _in_namespace(ns, "status", "--blobs", "/tmp/blobs", "--json", env=env)
            assert status.returncode == 0 and arena in status.stdout, status.stderr
            assert not (root_tmp / f"expertd-{uid}").exists()
            _squat(root_tmp / f"expertd-{uid}")
            _squat(root_tmp / f"expertd-{uid}-1")
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


def test_runtime_dir_ignores_an_xdg_runtime_dir_that_is_relative_or_open_to_others(
        tmp_path, monkeypatch, caplog):
    """The XDG spec's rules for XDG_RUNTIME_DIR: an absolute path (a daemon runs from /, its
    clients from anywhere: a relative one would part them) to a directory of this user's that
    nobody else may write to (another user could rename our directory in it and plant
    theirs). One that breaks them is ignored, with a warning saying why."""
    from expertd.paths import _xdg_runtime_dir

    good = tmp_path / "run"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(good))
    assert _xdg_runtime_dir() == good and _mode(good) == 0o700  # created, private
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o1777)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    for value, why in ((str(open_dir), "writable by other users"),
                       ("run", "not an absolute path"),
                       (str(tmp_path / "a-file" / "run"), "cannot be made")):
        monkeypatch.setenv("XDG_RUNTIME_DIR", value)
        caplog.clear()
        assert _xdg_runtime_dir() is None
        assert why in caplog.text and "ignores it" in caplog.text
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, NOBODY, NOBODY)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(theirs))
        assert _xdg_runtime_dir() is None and "not a directory of yours" in caplog.text


def test_daemon_environment_keeps_relative_python_path_entries_meaning_the_same(tmp_path,
                                                                              monkeypatch):
    from expertd.cli.service_plan import daemon_environment

    monkeypatch.chdir(tmp_path)
    env = daemon_environment({"PYTHONPATH": os.pathsep.join(["lib", "/abs", ""]), "X": "1"})
    assert env == {"PYTHONPATH": os.pathsep.join([str(tmp_path / "lib"), "/abs",
                                                  str(tmp_path)]), "X": "1"}
    assert daemon_environment({"X": "1"}) == {"X": "1"}


@pytest.mark.timeout(120)
def test_a_start_from_a_directory_others_write_runs_expertd_not_a_planted_package(
        models, isolated_env, tmp_path):
    """``expertd start`` relaunches itself as ``python -m expertd``, and ``-m`` puts the
    working directory first on sys.path: started from a directory another user can write to,
    the daemon imported an ``expertd`` package planted there, running that user's code as
    ours. The daemon runs from / instead, its paths made absolute first (a relative --blobs
    still names the same directory)."""
    blobs = models.blobs()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp
    planted = shared / "expertd"
    planted.mkdir()
    ran = tmp_path / "planted-code-ran"
    (planted / "__init__.py").write_text("")
    (planted / "__main__.py").write_text(f"open({str(ran)!r}, 'w').write('yes')\n")
    # The console script's interpreter: nothing from the working directory on sys.path (-I;
    # the environment's XDG variables still apply).
    entry = [sys.executable, "-I", "-c",
             "import sys; from expertd.cli.main import main; sys.exit(main())"]
    env = {**os.environ, **isolated_env}
    try:
        started = subprocess.run([*entry, "start", "--blobs", os.path.relpath(blobs, shared),
                                  "--cache-gb", CACHE_GB], cwd=shared, env=env,
                                 capture_output=True, text=True, timeout=90)
        assert not ran.exists(), "the planted package ran"
        assert started.returncode == 0, started.stderr
        pid = serving_pid(daemon_paths(blobs))
        assert pid is not None and os.readlink(f"/proc/{pid}/cwd") == "/"
    finally:
        expertd_cli("stop", "--blobs", blobs)
