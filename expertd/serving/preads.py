"""The pread pool: workers read experts from the blob files straight into arena rows and check them.

Each worker reads a row and hashes it itself, so one row's checksum runs while the other
workers' reads are in flight. ``os.preadv`` releases the GIL, and so does python-xxhash (4.1 and
later) for inputs over 64 KiB, so eight workers hash in parallel rather than in turn.

In a lazy directory (``expertd convert --lazy``) a fill whose row has not arrived yet goes to
the remote workers (remote.py) first, and comes back to these workers once it is on the disk.
"""

import os
import queue
import threading
import time
from collections import deque

import numpy as np

from expertd.blobstore import BlobStore
from expertd.errors import ChecksumError
from expertd.manifest import reconvert
from expertd.protocol import ErrorCode
from expertd.remote import FetchSettings, RangeReader, remote_headers
from expertd.rowfetch import RowFetcher
from expertd.serving.remote import RemoteFills

VERIFY_MODES = ("always", "first", "never")


class FillPool:
    """Fills rows in parallel; completions come back through :meth:`completions`.

    ``wake_fd`` becomes readable whenever a fill completes, so the serving loop can poll it
    next to its peers. :meth:`submit`, :meth:`expedite`, :meth:`completions` and
    :meth:`close` belong to the serving thread; only the workers run in other threads. Urgent
    fills (demands) always start before queued non-urgent ones (prefetches).

    Args:
        store: the opened blob directory the rows are read from.
        arena: the shared-memory arena; ``arena.row(i)`` is row ``i``'s writable view.
        workers: number of reader threads (at least 1).
        verify: "always" checks every fill against the manifest's checksum, "first" only an
            expert's first fill, "never" none.
        fetch: how a lazy directory's absent rows are fetched (default: FetchSettings()).
    Raises:
        ValueError: ``workers`` below 1 or an unknown ``verify`` mode.
    """

    def __init__(self, store: BlobStore, arena, workers: int, verify: str,
                 fetch: FetchSettings | None = None):
        if workers < 1:
            raise ValueError("workers must be at least 1")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
        self.store = store
        self.arena = arena
        self.verify = verify
        # With verify="first": experts whose bytes were checked once.
        self._checked = [np.zeros(layer.num_experts, dtype=bool) for layer in store.layers]
        # Two queues of jobs under the lock, and one token per job: a worker takes a token,
        # then the oldest urgent job, else the oldest prefetch job.
        self._urgent: deque = deque()
        self._later: deque = deque()
        self._tokens = queue.SimpleQueue()
        self._done = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # The lock guards the job queues, _closed, _busy and every write to the pipe: once close() has set
        # _closed under it, no worker touches the pipe or starts a read into the arena again.
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self._closed = False
        self._accepting = True
        # A lazy directory's: (layer, expert) -> [(row, urgent)] of fills waiting for the row.
        self._remote_rows: dict = {}
        self.remote = None
        if store.lazy:
            fetch = fetch or FetchSettings()
            fetcher = RowFetcher(store.dir, store.manifest, store.records,
                                 RangeReader(fetch, remote_headers(store.manifest.remote)))
            self.remote = RemoteFills(fetcher, self._fetched, fetch.connections, fetch.coalesce)
        # Daemon threads: a read stuck in the kernel must not keep the process from exiting.
        self._threads = [threading.Thread(target=self._work, name=f"expertd-fill-{i}",
                                          daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def submit(self, row: int, layer: int, expert: int, urgent: bool = True) -> None:
        """Queue a fill of ``row`` with ``expert`` of ``layer``, FIFO within its priority.

        Args:
            urgent: True for a demand's fill, False for a prefetch's (started only when no
                urgent fill waits).
        Raises:
            RuntimeError: the pool is closed.
        """
        if not self._accepting:
            raise RuntimeError("the fill pool is closed; no fill can start")
        if self.remote is not None and not self.store.present(layer, expert):
            with self._lock:
                self._remote_rows.setdefault((layer, expert), []).append((row, urgent))
            self.remote.request(layer, expert, urgent)
            return
        with self._lock:
            (self._urgent if urgent else self._later).append((row, layer, expert))
        self._tokens.put(True)

    def _fetched(self, layer: int, expert: int, error: str | None) -> None:
        """A remote worker's answer: the row is on the disk (read it as any other), or not."""
        with self._lock:
            if self._closed:
                return
            waiting = self._remote_rows.pop((layer, expert), [])
            for row, urgent in waiting:
                if error is None:
                    (self._urgent if urgent else self._later).append((row, layer, expert))
                else:
                    self._done.put((row, layer, expert, (ErrorCode.IO, error)))
            if error is not None and waiting:
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:
                    pass  # the pipe is full of wake-ups already
        if error is None:
            for _ in waiting:
                self._tokens.put(True)

    def arrivals(self) -> int:
        """A lazy directory's rows marked present by another process since the last call
        (see RemoteFills.arrivals); 0 otherwise."""
        return 0 if self.remote is None else self.remote.arrivals()

    def withdrawn(self, layer: int | None = None) -> list:
        """A lazy directory's rows marked absent since the last call (a shard failed its
        sha256): ``[(layer, expert)]`` whose copies in the arena must not be served on (see
        RemoteFills.withdrawn; ``layer``: look at that layer's records only). For the
        serving thread."""
        return [] if self.remote is None else self.remote.withdrawn(layer)

    def remote_stats(self) -> dict:
        """A lazy directory's counters, as ``{"remote": {rows_present, bytes_fetched, ...}}``
        (one key: the STATS map's size is bounded); empty otherwise."""
        if self.remote is None:
            return {}
        fetcher, records = self.remote.fetcher, self.store.records
        return {"remote": dict(source=self.store.manifest.remote.source,
                               rows_present=records.count(),
                               rows_total=sum(layer.num_experts for layer in self.store.layers),
                               pending=self.remote.pending(), **fetcher.counters,
                               **self.remote.counters,
                               fetch_retries=fetcher.reader.counters["retries"])}

    def expedite(self, row: int) -> bool:
        """Make the queued non-urgent fill of ``row`` urgent (a demand now waits on it).

        Returns:
            True if it was still queued; False if it runs already or is unknown.
        """
        with self._lock:
            for job in self._later:
                if job[0] == row:
                    self._later.remove(job)
                    self._urgent.append(job)
                    return True
            key = next((k for k, waiting in self._remote_rows.items()
                        if (row, False) in waiting), None)
            if key is None:
                return False
            waiting = self._remote_rows[key]
            waiting[waiting.index((row, False))] = (row, True)
        self.remote.expedite(*key)
        return True

    def _work(self) -> None:
        while True:
            if self._tokens.get() is None:
                return
            with self._lock:
                if self._closed:
                    return  # the arena may be unmapped already: do not read into it
                if self._urgent:
                    job = self._urgent.popleft()
                elif self._later:
                    job = self._later.popleft()
                else:
                    continue  # its job was dropped by close()
                self._busy += 1
            row, layer, expert = job
            error = self._fill(row, layer, expert)
            with self._lock:
                self._busy -= 1
                if not self._closed:
                    self._done.put((row, layer, expert, error))
                    try:
                        os.write(self._wake_w, b"\0")
                    except BlockingIOError:
                        pass  # the pipe is full of wake-ups already
                if self._busy == 0:
                    self._idle.notify_all()

    def _fill(self, row: int, layer: int, expert: int):
        """Read and (per ``verify``) check one row; None, or ``(ErrorCode, message)``."""
        try:
            view = self.arena.row(row)
            self.store.read_into(layer, expert, view)
            if self.verify == "always" or (self.verify == "first"
                                           and not self._checked[layer][expert]):
                self.store.verify(layer, expert, view)
                self._checked[layer][expert] = True
            return None
        except ChecksumError as exc:
            return ErrorCode.CHECKSUM, (f"{exc}; the blob directory is corrupt, "
                                        f"{reconvert(self.store.dir)}")
        except Exception as exc:  # a fill must always complete, or its waiters hang
            return ErrorCode.IO, (f"reading layer {layer} expert {expert} from "
                                  f"{self.store.dir / self.store.layers[layer].file}: {exc}")

    def completions(self) -> list:
        """Every fill finished since the last call: ``[(row, layer, expert, error|None)]``."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the pool: refuse new fills, drop queued ones, wait up to ``timeout`` s for the
        running reads, then close the wake-up pipe.

        Fills finished but not yet collected, and those still running at the deadline, are
        never reported. Call it from the serving thread, after the last :meth:`completions`;
        a second call only reports whether reads remain.

        Returns:
            True if no worker is reading any more, so the blob files and the arena can be
            closed; False if a read is still stuck in the kernel (leave both open then).
        """
        if not self._accepting:
            with self._lock:
                return self._busy == 0  # closed before: only say whether reads remain
        self._accepting = False
        if self.remote is not None:
            self.remote.close(timeout=min(timeout, 1.0))
        with self._lock:
            self._urgent.clear()
            self._later.clear()
        for _ in self._threads:
            self._tokens.put(None)
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._busy and self._idle.wait(max(0.0, deadline - time.monotonic())):
                pass
            idle = self._busy == 0
            # Under the lock: a worker still reading will see _closed and never write to the
            # pipe, so its descriptors cannot be reused under it.
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
        return idle
