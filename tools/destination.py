"""Writing a blob directory safely: one run at a time, and whole or not at all.

A lock file next to the destination keeps two runs from writing it at once; the output is
written under a temporary name and renamed, with the directory entries fsync'd.
"""

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from expertd.errors import ConvertError
from expertd.paths import missing_parent
from expertd.runfile import read_private, take_lock


def check_destination(blob_dir: Path) -> None:
    """Refuse a destination that exists or whose parent is not a directory (before any work).

    Raises:
        FileExistsError, ConvertError.
    """
    if blob_dir.exists():
        raise FileExistsError(f"{blob_dir} already exists; remove it or choose another path")
    if missing_parent(blob_dir):
        raise ConvertError(missing_parent(blob_dir))


def write_blob_dir(blob_dir: Path, write_into):
    """Run ``write_into(tmp)`` under the destination lock, then rename ``tmp`` to ``blob_dir``.

    ``write_into`` fills the temporary directory and returns the manifest; it is saved there
    last. A leftover temporary directory from an interrupted run is removed first, and the
    partial output of a failed run is removed too.

    Returns:
        The manifest.
    Raises:
        FileExistsError: ``blob_dir`` exists.
        ConvertError: another run writes it, the disk is full, or it cannot be written.
    """
    try:
        with destination_lock(blob_dir):
            # Checked again under the lock: a run that held it may just have finished.
            if blob_dir.exists():
                raise FileExistsError(f"{blob_dir} already exists; remove it or choose "
                                      "another path")
            tmp = blob_dir.parent / f".{blob_dir.name}.partial"
            if tmp.exists():  # left by a run that died: no live run can own it, we hold the lock
                shutil.rmtree(tmp)
            tmp.mkdir()
            try:
                manifest = write_into(tmp)
                manifest.save(tmp / "manifest.json")
                fsync_dir(tmp)
                os.rename(tmp, blob_dir)
                fsync_dir(blob_dir.parent)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return manifest
    except OSError as exc:
        if isinstance(exc, FileExistsError) and not exc.filename:
            raise
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConvertError(f"{blob_dir}: no space left on the device, the disk is full; "
                               "the partial output was removed: free some space and re-run "
                               "expertd convert") from None
        where = exc.filename or blob_dir
        raise ConvertError(f"{where}: {exc.strerror or exc} (while writing {blob_dir})") from None


@contextmanager
def destination_lock(blob_dir: Path):
    """Hold ``.NAME.lock`` next to ``blob_dir`` (flock), or fail at once if another run does.

    The lock file holds the owner's pid, for the message. It is removed while still locked;
    a run that opened it just before checks, once locked, that it locked the file still there.
    """
    path = blob_dir.parent / f".{blob_dir.name}.lock"
    fd = take_lock(path)  # flock, and a check that it locked the file still at the name
    if fd is None:
        raise ConvertError(f"another expertd convert is writing {blob_dir} (pid "
                           f"{_lock_owner(path)}); wait for it to finish or choose another path")
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the pid is only for the message, the run reports the real error
        yield
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # removed by hand: nothing to clean
        os.close(fd)


def _lock_owner(path: Path) -> str:
    try:
        text = read_private(path, 32).decode().strip()
    except (OSError, UnicodeDecodeError):
        return "unknown"
    return text if text.isdigit() else "unknown"


def pwrite_all(fd: int, data, offset: int, path: Path) -> None:
    """``os.pwrite`` until every byte is written: a short write is retried, and a write
    that makes no progress (or the ENOSPC that usually follows a short one) is an error."""
    view = memoryview(data)
    done = 0
    while done < view.nbytes:
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise ConvertError(f"{path}: wrote {done} of {view.nbytes} bytes at offset {offset}")
        done += n


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
