"""The background copier: writes predicted rows into the next layer's pool while MLX computes.

One thread per process, fed one job at a time by the main thread. The copy itself runs in the
native extension with the GIL released, and ``mx.eval`` releases the GIL too, so the copy of
layer L+1's guessed rows overlaps the evaluation that computes layer L.
"""

import queue
import threading
import time


class CopyJob:
    """A copy handed to the copier; :meth:`wait` returns once it ran (or failed)."""

    __slots__ = ("run", "done", "error", "seconds")

    def __init__(self, run):
        self.run = run
        self.done = threading.Event()
        self.error = None
        self.seconds = 0.0

    def wait(self) -> bool:
        """Block until the copy ran; True if it succeeded."""
        self.done.wait()
        return self.error is None


class Copier:
    """A daemon thread that runs :class:`CopyJob` s in order."""

    def __init__(self):
        self._jobs = queue.SimpleQueue()
        self._thread = None
        self.busy_seconds = 0.0

    def submit(self, run) -> CopyJob:
        """Run ``run()`` on the copier thread; returns its job at once."""
        job = CopyJob(run)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="expertd-copier", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return job

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            started = time.perf_counter()
            try:
                job.run()
            except BaseException as exc:  # the main thread sees it as a failed copy
                job.error = exc
            job.seconds = time.perf_counter() - started
            self.busy_seconds += job.seconds
            job.done.set()
            job = None  # while idle, a finished copy must not keep a dropped model's session

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            if self._thread is not threading.current_thread():  # a finalizer may run on it
                self._thread.join(timeout=5.0)
            self._thread = None
