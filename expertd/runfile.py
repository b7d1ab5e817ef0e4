"""What a daemon leaves in the runtime directory: writing it safely, reading it, clearing it.

The run file ``<ident>.run`` (JSON ``{pid, arena, epoch, ready}``) is the only place the random
arena name is published. It sits in the 0700 runtime directory, so only the user can read it.
The lock ``<ident>.lock`` is flock-ed by the daemon for its whole life: a lock dies with its
process, so "the lock is free" means "no daemon", whatever pid files say and whoever reuses the
pid. Whoever holds the lock may treat every other file of that ident as stale.

One job, over 400 lines: the runtime directory's files.
"""

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .shm.layout import SHM_DIR, unlink_arena

log = logging.getLogger("expertd")

ARENA_NAME = re.compile(r"/expertd-[0-9a-f]{8,22}")
# Files of one daemon, by suffix after "<ident>."; rotated logs are "log.1", "log.2", ...
_DAEMON_FILE = re.compile(r"([0-9a-f]{16})\.(sock|run|pid|lock|err|log(?:\.\d+)?)")
# A dead daemon's log is kept this long, so that its crash can still be read the same day.
LOG_KEEP_SECONDS = 24 * 3600


@dataclass(frozen=True)
class RunInfo:
    """What a daemon publishes about itself once it holds the lock."""

    pid: int
    arena: str  # the shared-memory name, random per start
    epoch: int  # random per start, also in the arena header; never 0
    ready: bool  # False while the server is still being built
    blob_dir: str | None = None  # what it serves (for status to name a killed one's leftover)
    flags: list | None = None  # its start flags (options.start_flags), which restart keeps
    service: str | None = None  # the launchd agent or systemd unit that runs it (its name)


def new_arena_name() -> str:
    """A fresh unguessable shared-memory name: 31 characters, macOS's limit (PSHMNAMLEN)."""
    return "/expertd-" + secrets.token_hex(11)


def new_epoch() -> int:
    """A fresh random epoch in [1, 2**63)."""
    return (int.from_bytes(os.urandom(8), "little") >> 1) or 1


def check_private_dir(directory: Path) -> None:
    """Refuse to write into a directory where another user could swap or plant files.

    Ours (or root's), and if others can write to it, sticky (like /tmp): there nobody can
    rename or delete our files, and O_EXCL temporaries make planted names harmless.

    Raises:
        PermissionError: naming the directory, if it is not safe to write into.
    """
    info = os.stat(directory)
    if info.st_uid not in (os.getuid(), 0):
        raise PermissionError(f"{directory} belongs to uid {info.st_uid}, not to you; "
                              "choose a directory of yours")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise PermissionError(f"{directory} is writable by other users and not sticky; "
                              "choose a directory of yours")


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600) so that readers see the old or the new file whole.

    The temporary has a random name and is created with O_EXCL | O_NOFOLLOW: a symlink planted
    at any name in the directory is never followed. A symlink at ``path`` itself is replaced,
    not followed (rename works on names).

    Raises:
        PermissionError: if the directory is not the user's own (see check_private_dir).
        OSError: if the file cannot be written.
    """
    path = Path(path)
    check_private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def read_private(path: Path, limit: int = 1 << 20) -> bytes:
    """Read a small regular file of ours without following a symlink at its name.

    Opened non-blocking, so a FIFO planted at the name cannot hang the reader.

    Raises:
        OSError: if it is missing, a symlink (ELOOP), not a regular file, another user's
            (PermissionError), or unreadable.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_uid != os.getuid():
            raise PermissionError(errno.EPERM, f"owned by uid {info.st_uid}, not by you",
                                  str(path))
        return f.read(limit)


def write_last_flags(paths, flags: list) -> None:
    """Keep the start ``flags`` of the daemon of ``paths`` past its life (``restart`` of a
    stopped daemon starts it with them, as ``pg_ctl`` keeps a server's options). A state
    directory that cannot hold them is warned of."""
    try:
        write_atomically(paths.last_flags, json.dumps(flags).encode())
    except OSError as exc:
        log.warning("cannot keep the start flags in %s (%s)", paths.last_flags,
                    exc.strerror or exc)


def read_last_flags(paths) -> list | None:
    """The start flags the daemon of ``paths`` last ran with, or None (never started here, or
    the file is not ours or not a list of words)."""
    try:
        flags = json.loads(read_private(paths.last_flags))
    except (OSError, ValueError):
        return None
    return flags if _words(flags) else None


def _words(value) -> bool:
    """``value`` is a list of strings (start flags, as a JSON file holds them)."""
    return isinstance(value, list) and all(isinstance(f, str) for f in value)


def write_run_info(paths, info: RunInfo) -> None:
    write_atomically(paths.runfile, json.dumps(info.__dict__).encode())


def read_run_info(paths) -> RunInfo | None:
    """The run file of the daemon of ``paths``, or None if there is none or it is unreadable.

    It may be a dead daemon's: ask :func:`serving_epoch` whether one holds the lock.
    """
    return read_run_file(paths.runfile)


def read_run_file(runfile: Path) -> RunInfo | None:
    """The run file ``runfile`` (see :func:`read_run_info`)."""
    try:
        data = json.loads(read_private(runfile))
        info = RunInfo(data["pid"], data["arena"], data["epoch"], data["ready"],
                       data.get("blob_dir"), data.get("flags"), data.get("service"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if (type(info.pid) is not int or type(info.epoch) is not int or type(info.ready) is not bool
            or not isinstance(info.arena, str) or not ARENA_NAME.fullmatch(info.arena)
            or not isinstance(info.blob_dir, (str, type(None)))
            or not isinstance(info.service, (str, type(None)))
            or not (info.flags is None or _words(info.flags))):
        return None
    return info


def lock_held(lock: Path) -> bool:
    """True if a process holds ``lock`` exclusively now (a daemon, or a clean-up in progress).

    The probe takes a shared lock for an instant, so concurrent probes never disturb each
    other; a starting daemon retries for a moment (see :func:`take_lock`).
    """
    try:  # non-blocking: a FIFO planted at the name cannot hang the probe
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # missing, or not ours to open: nobody serves through it
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False  # not a lock file: nobody serves through it
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def serving_epoch(paths) -> int | None:
    """The epoch of the daemon that holds the directory's lock right now.

    Returns:
        None if no process holds the lock (the daemon is dead, whatever its pid now names);
        0 if the lock is held but the daemon has not published a ready run file yet;
        else the epoch, which changes with every start.
    """
    if not lock_held(paths.lock):
        return None
    info = read_run_info(paths)
    if info is None or not info.ready:
        return 0
    try:
        pid = int(read_private(paths.pidfile))
    except (OSError, ValueError):
        return 0
    # A dead daemon's run file, read in the instant before its successor removes it.
    return info.epoch if pid == info.pid else 0


def take_lock(lock: Path, patience: float = 0.0) -> int | None:
    """Open (creating, 0600) and flock ``lock`` exclusively; the fd, or None if it is held.

    Retries for ``patience`` seconds, since probes hold it for an instant. Checks that the
    locked file is still the one at the name: a clean-up may have unlinked it meanwhile.

    Raises:
        OSError: if the name cannot be opened or created, or is not a regular file.
    """
    deadline = time.monotonic() + patience
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device planted at the name
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", str(lock))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
            continue
        try:
            now = os.stat(lock, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # unlinked under us: lock the new file instead


UNCLAIMED = -1  # claim_blobs: the state directory could not hold the claim; served without


def claim_blobs(paths, patience: float = 0.0) -> int | None:
    """Take the blob directory's claim (``paths.claim``, in the state directory) for this
    process's life, recording its pid and runtime directory; the fd, or None if another daemon
    holds it (see :func:`claimant`), or UNCLAIMED where the state directory cannot hold it
    (read-only, full, a planted file: warned, and the daemon serves as it did before claims).

    The runtime lock alone keeps one daemon per runtime directory; a launchd or systemd
    service and a shell can see two (XDG_RUNTIME_DIR set in one only), and their clients would
    never meet one daemon's cache. The state directory does not move with XDG_RUNTIME_DIR.
    The claim's name holds the host's name: a home shared by several machines (NFS, a volume
    of several containers) has one claim per machine, as each has its own shared memory.
    """
    try:
        fd = take_lock(paths.claim, patience)
    except OSError as exc:
        log.warning("cannot claim %s in %s (%s): another runtime directory's daemon for it "
                    "would not be refused", paths.blob_dir, paths.claim.parent,
                    exc.strerror or exc)
        return UNCLAIMED
    if fd is not None:
        record = {"pid": os.getpid(), "runtime": str(paths.lock.parent),
                  "blob_dir": str(paths.blob_dir), "host": os.uname().nodename}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        except OSError:  # a full disk: the lock is the claim, the record only names it
            pass
    return fd


def release_claim(paths, fd: int) -> None:
    """Give back :func:`claim_blobs`' claim (UNCLAIMED: none), its file removed while still
    held (see :func:`take_lock`)."""
    if fd == UNCLAIMED:
        return
    try:
        _unlink(paths.claim)
    finally:
        os.close(fd)


def _claim_record(claim: Path) -> dict | None:
    """The record of a held claim (see :func:`claim_blobs`): ``{"pid", "runtime", "blob_dir",
    "host"}``, or None where it is being written or is another version's."""
    try:
        record = json.loads(read_private(claim))
        return {"pid": int(record["pid"]), "runtime": str(record["runtime"]),
                "blob_dir": str(record["blob_dir"]), "host": str(record["host"])}
    except (OSError, ValueError, TypeError, KeyError):
        return None


def claimant(paths) -> dict | None:
    """``{"pid", "runtime"}`` of a daemon serving ``paths.blob_dir`` from another runtime
    directory than ``paths``'; None if none holds the claim, or it is this directory's own
    (pid None, runtime None where its record cannot be read)."""
    if not lock_held(paths.claim):
        return None
    record = _claim_record(paths.claim) or {"pid": None, "runtime": None}
    if record["runtime"] == str(paths.lock.parent):
        return None
    return {"pid": record["pid"], "runtime": record["runtime"]}


def claims_elsewhere(state: Path, run: Path) -> list:
    """``{"pid", "runtime", "blob_dir"}`` of every daemon of this user and machine that holds
    a claim in the state directory ``state`` from another runtime directory than ``run``
    (status without --blobs names them: this runtime directory cannot see them). Claims of
    other machines (a home shared by several) are not this machine's to name."""
    found = []
    for claim in sorted(state.glob("*.serving")):
        record = _claim_record(claim) if lock_held(claim) else None
        if record is None or record.pop("host") != os.uname().nodename:
            continue  # free, being written, another version's, or another machine's
        if record["runtime"] != str(run):
            found.append(record)
    return found


def elsewhere(paths) -> str:
    """A sentence on the daemon serving ``paths.blob_dir`` from another runtime directory, and
    how to reach it; "" if there is none."""
    return elsewhere_text(paths, claimant(paths))


def claimant_runtime(other: dict | None) -> Path | None:
    """The runtime directory of a :func:`claimant` record, None where it does not say."""
    return Path(other["runtime"]) if other and other["runtime"] else None


def elsewhere_text(paths, other: dict | None) -> str:
    """:func:`elsewhere` of a :func:`claimant` record already read (``other``)."""
    if other is None:
        return ""
    runtime = other["runtime"]
    if runtime is None:  # its record is being written, or unreadable
        return (f"an expertd serves {paths.blob_dir} from another runtime directory than this "
                f"one ({paths.lock.parent}); run with XDG_RUNTIME_DIR as it has it to reach it")
    run = Path(runtime)
    reach = (f"XDG_RUNTIME_DIR={run.parent}" if run.name == "expertd"
             else "XDG_RUNTIME_DIR unset")
    return (f"an expertd (pid {other['pid']}) serves {paths.blob_dir} from the runtime "
            f"directory {runtime}, not this one ({paths.lock.parent}); run with {reach} to "
            "reach it")


def leftover(runfile: Path, socket: Path) -> dict | None:
    """What a daemon killed without its clean-up left, named by its ``runfile`` and
    ``socket`` (its arena holds its whole ``--cache-gb`` of memory until removed): ``{"arena",
    "path", "bytes", "pid", "socket", "blob_dir"}`` (``blob_dir`` None where its run file
    does not say), or None. Only meaningful while nobody holds the lock (see
    :func:`lock_held`)."""
    import posix_ipc

    info = read_run_file(runfile)
    if info is None:
        return None
    try:
        shm = posix_ipc.SharedMemory(info.arena)
    except (posix_ipc.Error, OSError):  # gone (or another user's: not ours to report)
        return None
    try:
        size = os.fstat(shm.fd).st_size
    except OSError:
        return None
    finally:
        shm.close_fd()
    path = f"{SHM_DIR}/{info.arena.lstrip('/')}" if os.path.isdir(SHM_DIR) else info.arena
    return {"arena": info.arena, "path": path, "bytes": size, "pid": info.pid,
            "socket": str(socket) if socket.exists() else None,
            "blob_dir": info.blob_dir}


def remove_leftovers(paths, everything: bool = False) -> list:
    """Remove what a dead daemon left: its arena (named by its run file), socket, run file,
    pid file; with ``everything``, also its start log, its lock, and its logs unless one was
    written in the last LOG_KEEP_SECONDS.

    Only call this while holding the lock of ``paths`` (see :func:`take_lock`).

    Returns:
        Descriptions of what was removed, for the log.
    """
    removed = []
    info = read_run_info(paths)
    if info is not None and unlink_arena(info.arena):
        removed.append(f"arena {info.arena}")
    if _unlink(paths.socket):
        removed.append(f"socket {paths.socket}")
    _unlink(paths.runfile)
    _unlink(paths.pidfile)
    if everything:
        _unlink(paths.start_log)
        logs = sorted(paths.log.parent.glob(paths.log.name + "*"))
        cutoff = time.time() - LOG_KEEP_SECONDS
        if all(_mtime(p) < cutoff for p in logs):
            for p in logs:
                _unlink(p)
        _unlink(paths.lock)  # last, while still held: see take_lock
    return removed


def sweep_runtime_dir(run_dir: Path, skip: str = "") -> int:
    """Remove the files of every daemon in ``run_dir`` that no process serves any more.

    Daemons that hold their lock are left alone, as is the ident ``skip`` (the caller's).

    Returns:
        How many dead daemons' files were removed.
    """
    idents = {m.group(1) for m in map(_DAEMON_FILE.fullmatch, os.listdir(run_dir)) if m}
    swept = 0
    for ident in sorted(idents - {skip}):
        paths = _ident_paths(run_dir, ident)
        fd = take_lock(paths.lock)
        if fd is None:
            continue  # alive
        try:
            removed = remove_leftovers(paths, everything=True)
            swept += 1
            if removed:
                log.info("removed %s left by a dead expertd", ", ".join(removed))
        finally:
            os.close(fd)
    return swept


@dataclass(frozen=True)
class _IdentPaths:
    """The runtime files of one ident, as remove_leftovers needs them."""

    lock: Path
    pidfile: Path
    runfile: Path
    socket: Path
    log: Path
    start_log: Path


def _ident_paths(run_dir: Path, ident: str) -> _IdentPaths:
    return _IdentPaths(*(run_dir / f"{ident}.{s}" for s in ("lock", "pid", "run", "sock", "log",
                                                              "err")))


def _mtime(path: Path) -> float:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.EPERM):
            return False
        raise
