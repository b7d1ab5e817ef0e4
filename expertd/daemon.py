"""Daemon lifecycle: one daemon per blob directory, stale clean-up, detach, stop, status."""

import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .connection import Connection
from .errors import DaemonError, DaemonNotRunning
from .paths import daemon_paths
from .protocol import Op
from .shm.layout import unlink_arena

log = logging.getLogger("expertd")


def serving_pid(paths) -> int | None:
    """The pid of the daemon holding the directory's lock, or None if nobody holds it."""
    try:
        fd = os.open(paths.lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return int(paths.pidfile.read_text())
        except (OSError, ValueError):
            return -1
    finally:
        os.close(fd)
    return None


def _take_lock(fd: int, patience: float = 0.5) -> bool:
    """Take the directory's lock; retry briefly, since ``serving_pid`` probes hold it for an
    instant and must not make a starting daemon give up."""
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def run_foreground(config, state_file: Path | None = None) -> int:
    """Serve until SIGTERM/SIGINT or a shutdown request. Returns the exit status."""
    from .server import ExpertServer

    paths = daemon_paths(config.blob_dir)
    lock = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    if not _take_lock(lock):
        os.close(lock)
        pid = serving_pid(paths)
        raise DaemonError(f"an expertd (pid {pid}) already serves {paths.blob_dir}")
    server = None
    try:
        # We hold the lock, so whatever is left belongs to a daemon that died.
        if unlink_arena(paths.shm_name):
            log.warning("removed a stale arena %s left by a daemon that died", paths.shm_name)
        if paths.socket.exists():
            paths.socket.unlink()
            log.warning("removed a stale socket %s", paths.socket)
        fd = os.open(paths.pidfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        server = ExpertServer(config, paths, state_file or paths.state_file)
        signal.signal(signal.SIGTERM, server.request_stop)
        signal.signal(signal.SIGINT, server.request_stop)
        server.serve()
        return 0
    finally:
        if server is None:  # start-up failed: leave nothing behind
            unlink_arena(paths.shm_name)
            if paths.socket.exists():
                paths.socket.unlink()
        try:
            paths.pidfile.unlink()
        except FileNotFoundError:
            pass
        os.close(lock)


def start_detached(blob_dir, argv: list, timeout: float = 60.0) -> dict:
    """Start ``expertd start --foreground`` in a new session; return its stats once it answers.

    Raises:
        DaemonError: if one already serves the directory, or the new one fails to come up.
    """
    paths = daemon_paths(blob_dir)
    pid = serving_pid(paths)
    if pid is not None:
        raise DaemonError(f"an expertd (pid {pid}) already serves {paths.blob_dir}")
    with os.fdopen(os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as logfile:
        proc = subprocess.Popen([sys.executable, "-m", "expertd", *argv, "--foreground"],
                                stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = paths.log.read_text(errors="replace").strip().splitlines()[-5:]
            raise DaemonError("expertd exited during start-up:\n  " + "\n  ".join(tail))
        if paths.socket.exists():
            try:
                with Connection(blob_dir) as conn:
                    return conn.request(Op.STATS, timeout=1.0)
            except DaemonError:
                pass
        time.sleep(0.05)
    proc.terminate()
    raise DaemonError(f"expertd did not answer within {timeout:g} s; see {paths.log}")


def stop(blob_dir, timeout: float = 10.0) -> int:
    """SIGTERM the daemon of ``blob_dir`` and wait for it; SIGKILL and clean up past ``timeout``.

    Returns:
        The stopped daemon's pid.
    Raises:
        DaemonNotRunning: if none serves the directory.
        DaemonError: if the lock is held but no pid can be found to signal.
    """
    paths = daemon_paths(blob_dir)
    pid = serving_pid(paths)
    deadline = time.monotonic() + 1.0
    while pid == -1 and time.monotonic() < deadline:  # a daemon writing its pid file right now
        time.sleep(0.02)
        pid = serving_pid(paths)
    if pid is None:
        raise DaemonNotRunning(f"no expertd serves {paths.blob_dir}")
    if pid < 0:
        raise DaemonError(f"an expertd holds {paths.lock} but {paths.pidfile} names no pid")
    os.kill(pid, signal.SIGTERM)
    if not _wait_gone(paths, timeout):
        log.warning("expertd pid %d did not stop within %g s; killing it", pid, timeout)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if _wait_gone(paths, 5.0):
            # Only now that nobody holds the lock is what it left behind surely stale.
            unlink_arena(paths.shm_name)
            if paths.socket.exists():
                paths.socket.unlink()
    return pid


def _wait_gone(paths, timeout: float) -> bool:
    """True once nobody holds the directory's lock, False if ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while serving_pid(paths) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def list_sockets() -> list:
    """Socket paths of every daemon of this user (answering or not)."""
    from .paths import runtime_dir

    return sorted(runtime_dir().glob("*.sock"))
