"""Make written bytes durable, on each platform expertd runs on (Linux, macOS)."""

import os

try:
    import fcntl
except ImportError:  # not a POSIX system
    fcntl = None


def durable_sync(fd: int) -> None:
    """Flush what was written to ``fd`` to stable storage, before anything that vouches for it
    (a row's present record, a rename) is written.

    macOS has no ``os.fdatasync`` (Python's documentation: "Availability: Unix, not macOS";
    cpython#83821 declined a fallback), and its ``fsync`` leaves the data in the drive's cache,
    which a power cut loses: ``fcntl(F_FULLFSYNC)`` is its durable flush (SQLite uses it too).
    A file system that refuses it (some network ones) gets ``fsync``. Elsewhere ``fdatasync``
    (the data, and only the metadata needed to read it back), else ``fsync``. Looked up at each
    call, not at import, so that what the platform lacks is never bound.

    Raises:
        OSError: the flush failed (the bytes may not be on the disk).
    """
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass
    getattr(os, "fdatasync", os.fsync)(fd)
