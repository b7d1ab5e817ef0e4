"""Where a daemon lives: runtime directory, socket, lock, pid and run files, log, state file.

Everything derives from the blob directory's real path and the user id, so a client finds the
daemon from the blob directory alone and two users never share anything. The shared-memory
arena's name is random per start and is published only through the run file (see runfile.py),
so another user can neither predict nor squat it.
"""

import errno
import hashlib
import logging
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import DaemonError

log = logging.getLogger("expertd")

MAX_SOCKET_PATH = 103  # macOS sockaddr_un holds 104 bytes including the terminating NUL
# Fallbacks tried after /tmp/expertd-<uid> when another user owns it: /tmp/expertd-<uid>-1, ...
RUNTIME_FALLBACKS = 8


def _claim_dir(path: Path) -> bool:
    """Make ``path`` a real directory of ours with mode 0700, creating it if missing.

    Returns:
        True if it is ours now; False if it exists but is someone else's or not a directory.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except PermissionError:
        return False
    return _ours(path, private=True)


def _ours(path: Path, private: bool = False) -> bool:
    """``path`` is a real directory (not a symlink) that this user owns; with ``private`` it
    is made 0700. False if it is missing, someone else's, or not a directory."""
    try:
        # O_NOFOLLOW | O_DIRECTORY: a symlink or a file planted at the name is refused, and the
        # checks below apply to what we opened, not to whatever the name points to later.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            return False
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        if private and stat.S_IMODE(info.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        return True
    finally:
        os.close(fd)


def _xdg_runtime_dir() -> Path | None:
    """``$XDG_RUNTIME_DIR`` if it can hold our sockets safely, else None (with a warning where
    it is set). The XDG spec's rules: an absolute path (a relative one is ignored: a daemon runs
    from ``/``, its clients from anywhere), a directory of this user's that no one else may
    write to (another user could otherwise rename our directory in it and plant theirs). A
    missing one is created, 0700."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if not xdg:
        return None
    path = Path(xdg)
    why = None
    if not path.is_absolute():
        why = "is not an absolute path"
    else:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:  # a file at the name, a parent we may not write
            why = f"cannot be made ({exc.strerror})"
        else:
            if not _ours(path):
                why = "is not a directory of yours"
            elif os.stat(path).st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                why = "is writable by other users"
    if why is None:
        return path
    if xdg not in _WARNED:  # once a process, though every path asks
        _WARNED.add(xdg)
        log.warning("XDG_RUNTIME_DIR=%s %s; expertd ignores it (as the XDG spec asks) and "
                    "keeps its sockets in /tmp", xdg, why)
    return None


_WARNED: set = set()  # XDG_RUNTIME_DIR values warned of


def runtime_dir() -> Path:
    """The per-user 0700 directory for sockets, locks, run files and logs (created if missing).

    ``$XDG_RUNTIME_DIR/expertd`` when XDG_RUNTIME_DIR is set and safe (see
    :func:`_xdg_runtime_dir`). Otherwise ``/tmp/expertd-<uid>`` (macOS: in the per-user
    temporary directory); if another user took that name first, one of ``expertd-<uid>-1``,
    ``-2``, ...: the first that is already ours, else the first that can be created. Daemons
    and clients follow the same rule, so they meet in the same directory, and a daemon's
    directory stays the one its clients find when names before it come free later (another
    user's squat removed).

    Raises:
        DaemonError: if every candidate belongs to someone else (set XDG_RUNTIME_DIR).
    """
    xdg = _xdg_runtime_dir()
    if xdg is not None:
        path = xdg / "expertd"
        if _claim_dir(path):
            return path
        raise DaemonError(f"{path} is not a directory of yours; remove it, or point "
                          "XDG_RUNTIME_DIR at a private directory of yours")
    base = Path(tempfile.gettempdir() if sys.platform == "darwin" else "/tmp")
    first = base / f"expertd-{os.getuid()}"
    names = [first] + [first.with_name(f"{first.name}-{i}")
                       for i in range(1, RUNTIME_FALLBACKS + 1)]
    for path in [p for p in names if _ours(p)] + names:
        if _claim_dir(path):
            return path
    raise DaemonError(f"{first} and its {RUNTIME_FALLBACKS} fallbacks ({first.name}-1 ... "
                      f"-{RUNTIME_FALLBACKS}) belong to other users or cannot be created; set "
                      "XDG_RUNTIME_DIR to a private directory of yours (mode 0700), e.g. export "
                      "XDG_RUNTIME_DIR=$HOME/.run, for the daemon and its clients alike")


def state_dir() -> Path:
    """The per-user 0700 directory for state files that outlive a daemon (hot sets, pins).

    Raises:
        DaemonError: if it exists but is not a directory of ours.
    """
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and not Path(xdg).is_absolute():  # the XDG spec: ignored (a daemon runs from /)
        log.warning("XDG_STATE_HOME=%s is not an absolute path; expertd ignores it", xdg)
        xdg = None
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    path = base / "expertd"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _claim_dir(path):
        raise DaemonError(f"{path} is not a directory of yours; remove it or set XDG_STATE_HOME")
    return path


@dataclass(frozen=True)
class DaemonPaths:
    """The files of the daemon serving one blob directory (see runfile.py for the run file)."""

    blob_dir: Path
    ident: str
    socket: Path
    lock: Path  # flock-ed by the daemon for its whole life
    pidfile: Path
    runfile: Path  # JSON {pid, arena, epoch, ready}: how clients and `start` find the arena
    log: Path  # the daemon's rotating log when started detached
    start_log: Path  # the detached child's stderr of the latest start only
    state_file: Path
    # flock-ed by the daemon for its whole life, like ``lock``, but in the state directory,
    # which does not move with XDG_RUNTIME_DIR: one blob directory has one daemon per user
    # even where a service and a shell see two runtime directories (see runfile.claim_blobs).
    claim: Path
    last_flags: Path  # the start flags it last ran with (JSON), kept after it stops: restart

    @property
    def endpoint(self) -> str:
        """The daemon's ZeroMQ endpoint, as status shows it."""
        return f"ipc://{self.socket}"


def daemon_paths(blob_dir, run: Path | None = None) -> DaemonPaths:
    """The paths of the daemon serving ``blob_dir`` (which need not be running), in this
    process's runtime directory or in ``run`` (another one's, named by a claim).

    Raises:
        DaemonError: if no runtime directory of ours can be found (see :func:`runtime_dir`).
        ValueError: if the socket path would be too long for a unix socket.
    """
    real = Path(blob_dir).expanduser().resolve()
    run = runtime_dir() if run is None else Path(run)
    # The runtime directory is part of the name: daemons in two runtime directories (which
    # cannot see each other's sockets) must not take each other's files for stale ones.
    ident = hashlib.sha256(f"{real}\0{os.getuid()}\0{run}".encode()).hexdigest()[:16]
    socket = run / f"{ident}.sock"
    # The claim (runfile.claim_blobs): per machine, since shared memory is.
    serving = hashlib.sha256(f"{real}\0{os.getuid()}\0{os.uname().nodename}".encode()
                             ).hexdigest()[:16]
    if len(str(socket).encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path {socket} is longer than {MAX_SOCKET_PATH} bytes; "
                         "set XDG_RUNTIME_DIR to a shorter directory")
    state = state_dir()
    return DaemonPaths(real, ident, socket, run / f"{ident}.lock", run / f"{ident}.pid",
                       run / f"{ident}.run", run / f"{ident}.log", run / f"{ident}.err",
                       state / f"{ident}.json", state / f"{serving}.serving",
                       state / f"{ident}.flags")


def missing_parent(path: Path) -> str | None:
    """Why ``path`` cannot be created, when its directory does not exist; else None. Writers
    refuse it rather than create directories: a typo in a path must not make a tree."""
    if path.parent.is_dir():
        return None
    return (f"{path.parent}: no such directory (the parent of {path}); create it first or "
            "choose another path")
