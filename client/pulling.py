"""A session's puller: who reads a step's missing rows from the arena (pull.py), made anew at
each attach over the arena attached, and its counts kept across attaches."""

import threading

from expertd import native
from expertd.choices import PULL_MODES, check_choice
from expertd.shm.layout import EPOCH_DTYPE

from .arena_view import StepEpoch
from .dtypes import MLX_DTYPES
from .pull import make_puller


class Pulling:
    """The puller and the step's epoch record of the attach now (both None where steps copy
    rows on the host), and the rows, bytes and seconds of the pullers before it.

    Args:
        mode: one of ``pull.PULL_MODES`` (see :class:`~expertd.client.session.Session`).
        manifest: the blob directory's manifest (the layers' segment shapes).
    Raises:
        ValueError: ``mode`` is not one of them.
    """

    def __init__(self, mode: str, manifest):
        self.mode = check_choice("pull", mode, PULL_MODES)
        self.puller = self.step_epoch = None
        self._layers = {
            layer.index: [(MLX_DTYPES[seg.dtype], tuple(seg.shape), seg.nbytes)
                          for seg in layer.segments] for layer in manifest.layers}
        self._before = dict(rows_pulled=0, bytes_pulled=0, pull_s=0.0, timed_bytes=0)
        self._lock = threading.Lock()  # the puller's swap against counters()' reads

    def attach(self, view, slot: int) -> None:
        """Make the puller over ``view`` with the epoch record ``slot`` the hello gave: none
        without a record (the daemon gives out EPOCH_SLOTS), the per-layer host path then."""
        if self.mode == "off" or slot is None or slot < 0:
            return
        if not native.STEP_RECORDS_FENCED:  # the pure twin, on a CPU that reorders (arm64)
            return
        puller = make_puller(self.mode, view, self._layers)
        if puller is None:
            return
        g = view.arena.geometry
        try:
            self.step_epoch = StepEpoch(view.raw, g.epochs_offset + slot * EPOCH_DTYPE.itemsize)
        except BaseException:
            puller.close()
            raise
        self.puller = puller

    def close(self) -> None:
        """Close the puller (at a detach); its counts are kept."""
        with self._lock:  # a /metrics scrape (another thread) sees the counts whole
            puller, self.puller, self.step_epoch = self.puller, None, None
            if puller is not None:
                for key in self._before:
                    self._before[key] += puller.counters[key]
        if puller is not None:
            puller.close()

    def stop(self) -> None:
        """Pull no more in this process (the device's pull differed from the host copy)."""
        self.mode = "off"
        self.close()

    def count(self, layer: int, rows: int) -> None:
        """``rows`` of ``layer`` were pulled in a step (known from its statuses)."""
        if self.puller is not None:
            self.puller.count(layer, rows)

    def counters(self) -> dict:
        """Rows and bytes pulled from the arena (every attach so far), and the seconds the
        timed pulls (a prompt's) took."""
        with self._lock:
            now = self.puller.counters if self.puller is not None else {}
            return {k: v + now.get(k, 0) for k, v in self._before.items()}
