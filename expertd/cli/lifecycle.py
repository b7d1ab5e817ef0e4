"""Daemon lifecycle: one daemon per blob directory, stale clean-up, detach, stop, status."""

import dataclasses
import logging
import logging.handlers
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from expertd.cli.service_plan import DAEMON_CWD, SERVICE_VARIABLE, daemon_environment
from expertd.connection import Connection
from expertd.errors import DaemonError, DaemonNotRunning
from expertd.paths import daemon_paths, runtime_dir
from expertd.protocol import Op
from expertd.runfile import (
    UNCLAIMED,
    RunInfo,
    claim_blobs,
    elsewhere,
    lock_held,
    new_arena_name,
    new_epoch,
    read_private,
    release_claim,
    remove_leftovers,
    sweep_runtime_dir,
    take_lock,
    write_atomically,
    write_last_flags,
    write_run_info,
)
from expertd.shm.layout import unlink_arena

log = logging.getLogger("expertd")

LOG_MAX_BYTES = 5 * 2**20
LOG_BACKUPS = 3
# How long a starting daemon waits for the lock: probes (serving_pid, serving_epoch) hold it
# for an instant and must not make it give up.
LOCK_PATIENCE = 1.0


def serving_pid(paths) -> int | None:
    """The pid of the daemon holding the directory's lock; None if nobody holds it, -1 if it
    is held but the pid file is not written yet."""
    if not lock_held(paths.lock):
        return None
    try:
        return int(read_private(paths.pidfile))
    except (OSError, ValueError):
        return -1


def _log_to_file(path: Path) -> None:
    """Send every log record to a rotating file (5 MB x 3) instead of stderr."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # e.g. ~/Library/Logs/expertd
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_MAX_BYTES,
                                                   backupCount=LOG_BACKUPS)
    handler.setFormatter(logging.Formatter("%(asctime)s expertd %(levelname)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through run_foreground's clean-up


def _raise_fd_limit() -> None:
    """Let the daemon hold as many descriptors as it may: its connections (libzmq accepts
    every one, and aborts the process when accept() meets this limit), its blob files and its
    pipes (macOS starts a process at 256)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if sys.platform == "darwin":
        want = min(want, 10240)  # OPEN_MAX: macOS refuses more for the soft limit
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass  # keep the soft limit we have


def run_foreground(config, state_file: Path | None = None, log_file: Path | None = None,
                   flags: list | None = None) -> int:
    """Serve until SIGTERM/SIGINT or a shutdown request. Returns the exit status.

    Args:
        log_file: log to this rotating file instead of stderr (detached daemons, launchd).
        flags: the start flags it was given (options.start_flags), published in the run file
            for ``expertd restart`` to keep.
    Raises:
        DaemonError: if a daemon already serves the directory, or start-up fails.
    """
    from expertd.serving.server import ExpertServer

    os.umask(0o077)  # every file the daemon creates is the user's only
    _raise_fd_limit()
    paths = daemon_paths(config.blob_dir)
    if log_file:
        _log_to_file(Path(log_file))
    lock = take_lock(paths.lock, LOCK_PATIENCE)
    if lock is None:
        raise DaemonError(f"an expertd (pid {serving_pid(paths)}) already serves "
                          f"{paths.blob_dir}")
    try:
        claim = claim_blobs(paths, LOCK_PATIENCE)
        there = elsewhere(paths) if claim is None else ""
        if there:
            raise DaemonError(_refusal(there))
    except BaseException:
        os.close(lock)
        raise
    if claim is None:  # held from a runtime directory of the same name: one we cannot reach
        log.warning("%s is claimed by a daemon this one cannot see (another mount namespace "
                    "with the same paths?); serving it here too", paths.blob_dir)
        claim = UNCLAIMED
    arena, epoch = new_arena_name(), new_epoch()
    server = None
    # Until the server can stop itself, a signal unwinds through the clean-up below.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    try:
        # We hold the lock, so whatever is left belongs to a daemon that died.
        for what in remove_leftovers(paths):
            log.warning("removed a stale %s left by a daemon that died", what)
        sweep_runtime_dir(paths.lock.parent, skip=paths.ident)
        write_atomically(paths.pidfile, str(os.getpid()).encode())
        # Written before the arena exists, so that a start killed half-way is cleaned up by
        # the next one; marked ready once the server answers.
        # The service that runs it, if one does: its unit or agent sets SERVICE_VARIABLE.
        service = os.environ.get(SERVICE_VARIABLE) or None
        info = RunInfo(os.getpid(), arena, epoch, False, str(paths.blob_dir), flags, service)
        write_run_info(paths, info)
        server = ExpertServer(config, paths, state_file or paths.state_file, arena, epoch)
        write_run_info(paths, dataclasses.replace(info, ready=True))
        if flags is not None and service is None:  # serving: flags that work (a service's
            write_last_flags(paths, flags)  # are its unit's, restarted by its manager)
        signal.signal(signal.SIGTERM, server.request_stop)
        signal.signal(signal.SIGINT, server.request_stop)
        server.serve()
        return 0
    except Exception as exc:
        if server is None and log_file:  # stderr shows it too; the log keeps it
            log.error("start-up failed: %s", exc)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if server is None:  # start-up failed: leave nothing behind
            unlink_arena(arena)
        remove_leftovers(paths)
        release_claim(paths, claim)
        os.close(lock)


def _refusal(there: str) -> str:
    """Why a second daemon may not serve a blob directory that another runtime directory's
    serves (``there``: runfile.elsewhere's sentence)."""
    return (f"{there}. One blob directory has one daemon, so that every client shares its "
            "cache: use that one, or stop it first")


def start_detached(blob_dir, argv: list, log_file: Path | None = None,
                   timeout: float = 60.0) -> dict:
    """Start ``expertd start --foreground`` in a new session; return its stats once it answers.

    The child logs to ``log_file`` (rotated; default ``paths.log``); its stderr goes to
    ``paths.start_log``, emptied at each start, so that a failure shows this run's error and
    nothing older.

    Raises:
        DaemonError: if one already serves the directory, or the new one fails to come up
            (with its error output, exit status or signal, and the log's path).
    """
    paths = daemon_paths(blob_dir)
    log_file = Path(log_file or paths.log)
    pid = serving_pid(paths)
    if pid is not None:
        raise DaemonError(f"an expertd (pid {pid}) already serves {paths.blob_dir}")
    there = elsewhere(paths)
    if there:
        raise DaemonError(_refusal(there))
    fd = os.open(paths.start_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as errors:
        proc = subprocess.Popen([sys.executable, "-m", "expertd", *argv, "--foreground",
                                 "--log-file", str(log_file)],
                                stdin=subprocess.DEVNULL, stdout=errors, stderr=errors,
                                start_new_session=True, close_fds=True, cwd=DAEMON_CWD,
                                env=daemon_environment(os.environ))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _clean_after(paths)
            raise DaemonError(_startup_failure(paths, proc.returncode, log_file))
        if paths.socket.exists():
            try:
                with Connection(blob_dir) as conn:
                    stats = conn.request(Op.STATS, timeout=1.0)
            except DaemonError:
                stats = None
            if stats is not None and stats["pid"] == proc.pid:
                return stats
            if stats is not None:
                # Another start won the race for the directory; ours would serve once it stops.
                _end_child(proc)
                raise DaemonError(f"an expertd (pid {stats['pid']}) already serves "
                                  f"{paths.blob_dir} (started at the same time as this one)")
        time.sleep(0.05)
    _end_child(proc)
    _clean_after(paths)
    raise DaemonError(f"expertd did not answer within {timeout:g} s and was stopped; "
                      f"see {log_file}")


def _end_child(proc) -> None:
    """SIGTERM a child that did not come up, then SIGKILL, each step bounded."""
    proc.terminate()
    try:
        proc.wait(10.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5.0)


def _startup_failure(paths, status: int, log_file: Path) -> str:
    """One message: how the child ended, what it wrote to stderr in this run, the log path."""
    if status < 0:
        try:
            how = f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            how = f"was killed by signal {-status}"
    else:
        how = f"exited with status {status}"
    try:
        lines = read_private(paths.start_log).decode(errors="replace").strip().splitlines()
    except OSError:
        lines = []
    shown = "\n  ".join(lines[-20:]) if lines else "(it wrote no error message)"
    return f"expertd {how} during start-up:\n  {shown}\n  log: {log_file}"


def _clean_after(paths) -> None:
    """Remove what a daemon that died (or was killed) left, if nobody took the lock since."""
    for what in _remove_dead_at(paths):
        log.info("removed the %s the failed daemon left", what)


def remove_dead(blob_dir) -> list:
    """Remove what a daemon killed without its clean-up left for ``blob_dir`` (its arena,
    socket and run files), if no daemon serves it: descriptions of what went."""
    return _remove_dead_at(daemon_paths(blob_dir))


def _remove_dead_at(paths) -> list:
    fd = take_lock(paths.lock, LOCK_PATIENCE)
    if fd is None:
        return []  # a daemon serves it (or starts): nothing is a leftover
    try:
        return remove_leftovers(paths)
    finally:
        os.close(fd)


def stop(blob_dir, timeout: float = 10.0) -> int:
    """SIGTERM the daemon of ``blob_dir`` and wait for it; SIGKILL and clean up past ``timeout``.

    Returns:
        The stopped daemon's pid.
    Raises:
        DaemonNotRunning: if none serves the directory.
        DaemonError: if the lock is held but no pid can be found to signal, or one serves the
            directory from another runtime directory.
    """
    paths = daemon_paths(blob_dir)
    pid = serving_pid(paths)
    deadline = time.monotonic() + 1.0
    while pid == -1 and time.monotonic() < deadline:  # a daemon writing its pid file right now
        time.sleep(0.02)
        pid = serving_pid(paths)
    if pid is None:
        there = elsewhere(paths)
        if there:  # one serves it, out of this runtime directory's reach: not "nothing to stop"
            removed = _remove_dead_at(paths)  # what a killed one left here goes all the same
            also = f"; removed what a killed one left here: {', '.join(removed)}" if removed else ""
            raise DaemonError(f"{there}; nothing was stopped{also}")
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
            _clean_after(paths)
    return pid


def _wait_gone(paths, timeout: float) -> bool:
    """True once nobody holds the directory's lock, False if ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while lock_held(paths.lock):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def list_sockets() -> list:
    """Socket paths of every daemon of this user (answering or not)."""
    return sorted(runtime_dir().glob("*.sock"))
