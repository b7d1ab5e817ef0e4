"""The pread pool: workers read experts from the blob files straight into arena rows."""

import os
import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .blobstore import BlobStore
from .errors import ChecksumError
from .protocol import ErrorCode


class FillPool:
    """Fills rows in parallel; completions come back through :meth:`completions`.

    ``wake_fd`` becomes readable whenever a fill completes, so the serving loop can poll it
    next to its ZeroMQ socket.
    """

    def __init__(self, store: BlobStore, arena, workers: int, verify: str):
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.store = store
        self.arena = arena
        self.verify = verify
        # With verify="first": experts whose bytes were checked once. The blob files do not
        # change under a running daemon, so a checked expert reads back the same (the SSD's
        # own ECC covers transient errors); later fills skip the hash.
        self._checked = [np.zeros(layer.num_experts, dtype=bool) for layer in store.layers]
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="expertd-fill")
        self._done = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def submit(self, row: int, layer: int, expert: int) -> None:
        self._pool.submit(self._fill, row, layer, expert)

    def _fill(self, row: int, layer: int, expert: int) -> None:
        error = None
        try:
            view = self.arena.row(row)
            self.store.read_into(layer, expert, view)
            if self.verify == "always" or (self.verify == "first"
                                           and not self._checked[layer][expert]):
                self.store.verify(layer, expert, view)
                self._checked[layer][expert] = True
        except ChecksumError as exc:
            error = (ErrorCode.CHECKSUM, str(exc))
        except Exception as exc:  # a fill must always complete, or its waiters hang
            error = (ErrorCode.IO, f"reading layer {layer} expert {expert}: {exc}")
        self._done.put((row, layer, expert, error))
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

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

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)
        os.close(self._wake_r)
        os.close(self._wake_w)
