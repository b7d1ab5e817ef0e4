"""Where a daemon lives: runtime directory, socket, lock, shared-memory name, state file.

Everything derives from the blob directory's real path and the user id, so a client finds the
daemon from the blob directory alone and two users never share anything.
"""

import hashlib
import os
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MAX_SOCKET_PATH = 103  # macOS sockaddr_un holds 104 bytes including the terminating NUL
MAX_SHM_NAME = 31  # macOS PSHMNAMLEN


def runtime_dir() -> Path:
    """The per-user 0700 directory for sockets and locks (created if missing).

    Raises:
        PermissionError: if it exists but belongs to someone else or is open to others.
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        path = Path(xdg) / "expertd"
    else:
        base = tempfile.gettempdir() if sys.platform == "darwin" else "/tmp"
        path = Path(base) / f"expertd-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory owned by you")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def state_dir() -> Path:
    """The per-user 0700 directory for state files that outlive a daemon (hot sets, pins)."""
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    path = base / "expertd"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class DaemonPaths:
    blob_dir: Path
    ident: str
    socket: Path
    lock: Path
    pidfile: Path
    log: Path
    shm_name: str
    state_file: Path

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket}"


def daemon_paths(blob_dir) -> DaemonPaths:
    """The paths of the daemon serving ``blob_dir`` (which need not be running)."""
    real = Path(blob_dir).resolve()
    run = runtime_dir()
    # The runtime directory is part of the name: daemons in two runtime directories (which
    # cannot see each other's sockets) must not take each other's arenas for stale ones.
    ident = hashlib.sha256(f"{real}\0{os.getuid()}\0{run}".encode()).hexdigest()[:16]
    socket = run / f"{ident}.sock"
    if len(str(socket).encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path {socket} is longer than {MAX_SOCKET_PATH} bytes; "
                         "set XDG_RUNTIME_DIR to a shorter directory")
    shm_name = f"/expertd-{ident}"
    assert len(shm_name) <= MAX_SHM_NAME
    return DaemonPaths(real, ident, socket, run / f"{ident}.lock", run / f"{ident}.pid",
                       run / f"{ident}.log", shm_name, state_dir() / f"{ident}.json")
