"""What every kind of test shares: limits, the poll helper, shared-memory probes, STATS, the
exact bytes of a blob directory.

Every arena name a daemon reports (its stats, its hello, an in-process server's start) is
recorded in ``SEEN_ARENAS``; conftest checks at the end of the session that none is left.
"""

import os
import time

import numpy as np
import posix_ipc

from expertd import native
from expertd.blobstore import BlobStore
from expertd.connection import Connection
from expertd.errors import DaemonError
from expertd.protocol import Op
from expertd.shm.layout import Arena

START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
# Row counts that --cache-gb gives with the session's tiny model (stride 16 KiB, 48 experts).
TINY_CACHE_GB = "0.0003"  # 10 rows: demands of 4 (top_k), one client holds at most 4
SMALL_CACHE_GB = "0.0015"  # 64 rows, capped at the 48 experts of the model

# Every arena name a daemon reported to this test process (stats or hello).
SEEN_ARENAS: set = set()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until it returns something true; that value.

    Raises:
        AssertionError: naming ``what`` when ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def shm_exists(name: str) -> bool:
    """Whether the POSIX shared-memory segment ``name`` exists (asked through posix_ipc, so
    the same tests run where ``/dev/shm`` does not exist: macOS)."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except posix_ipc.ExistentialError:
        return False
    except posix_ipc.PermissionsError:
        return True  # someone else's: it exists all the same
    shm.close_fd()
    return True


def arena_owner(name: str) -> int | None:
    """The pid an existing arena's header names as its daemon; None if there is no arena."""
    try:
        arena = Arena.attach(name)
    except (posix_ipc.Error, OSError, ValueError):
        return None
    try:
        return arena.pid
    finally:
        arena.close()


def shm_mode(name: str) -> int:
    """The permission bits of the shared-memory segment ``name``."""
    shm = posix_ipc.SharedMemory(name, read_only=True)
    try:
        return os.fstat(shm.fd).st_mode & 0o777
    finally:
        shm.close_fd()


def query_stats(blob_dir, timeout: float = 5.0) -> dict:
    """The STATS reply of the daemon serving ``blob_dir`` (its arena name recorded)."""
    with Connection(blob_dir) as conn:
        stats = conn.request(Op.STATS, timeout=timeout)
    SEEN_ARENAS.add(stats["arena"])
    return stats


def try_stats(blob_dir, timeout: float = 1.0) -> dict | None:
    """The daemon's stats, or None if none answers."""
    try:
        return query_stats(blob_dir, timeout)
    except DaemonError:
        return None


def validate(raw, slots_offset: int, rows, versions) -> bool:
    """The seqlock check of leased rows, by whichever implementation this process runs."""
    return native.validate(raw, slots_offset, np.asarray(rows, np.int32),
                           np.asarray(versions, np.uint64))


def expected_bytes(blob_dir) -> dict:
    """{(layer, expert): exact bytes} read straight from the blob files."""
    store = BlobStore(blob_dir)
    try:
        return {(layer.index, e): store.read_expert(layer.index, e)
                for layer in store.layers for e in range(layer.num_experts)}
    finally:
        store.close()


class Served:
    """What a test asks of any daemon it started (a process or in this one): a context that
    closes it, checking its teardown only when the test passed, and its STATS."""

    blob_dir = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        # A failing test's own error says more than a teardown complaint would.
        self.close(check=exc_type is None)

    def stats(self, timeout: float = 5.0) -> dict:
        return query_stats(self.blob_dir, timeout)

