"""Where a layer's pool rows live, and how a row is written: two backings of one interface.

Each backing holds one MLX array per segment, of shape ``(rows, *segment shape)``: the arrays
mlx-lm's ``gather_qmm`` / ``gather_mm`` run on. ``write(rows, experts, read)`` puts
``experts`` into ``rows``; ``read(experts, dest, bases, positions)`` copies their bytes from the
daemon's arena (seqlock-checked) into a host buffer, segment ``s`` of position ``p`` at
``bases[s] + p * nbytes[s]``.

- :class:`HostRows` (unified memory: the CPU, Metal): one MLX buffer per layer that the host
  writes into directly, through a numpy view of it. A move is one memcpy from the arena; MLX
  runs no operation for it. The caller must not write a row that a computation not yet
  evaluated may read (:class:`~expertd.client.pool.ExpertPool` settles those first).
- :class:`DeviceRows` (a discrete GPU: CUDA): arrays in device memory, written by MLX's own
  scatter. The moved rows are copied into a host buffer, become one MLX array (one transfer a
  batch), and are scattered into the pool in place: MLX reuses the pool's buffer when nothing
  else holds it, so every computation reading the pool is evaluated before a write
  (``whole_array_writes``), or the scatter would copy the whole pool.

A third backing belongs here once clients can reclaim arena rows safely: on Apple Silicon MLX
adopts page-aligned host memory without a copy, so a pool's rows could be the arena's own.
"""

import mlx.core as mx
import numpy as np

ALIGN = 64  # bytes; every segment of a destination starts on this boundary


def segment_bases(rows: int, nbytes: np.ndarray) -> np.ndarray:
    """Where each segment of ``rows`` experts starts in one buffer, ``ALIGN``-aligned."""
    sizes = (rows * nbytes + ALIGN - 1) // ALIGN * ALIGN
    bases = np.zeros_like(sizes)
    np.cumsum(sizes[:-1], out=bases[1:])
    return bases


def buffer_bytes(rows: int, nbytes: np.ndarray) -> int:
    return int(segment_bases(rows, nbytes)[-1] + rows * nbytes[-1])


class HostRows:
    """Pool rows in one MLX buffer the host writes into (unified memory).

    Args:
        rows: rows of the pool.
        segments: per segment ``(mlx dtype, per-expert shape, nbytes)``.
    """

    whole_array_writes = False  # a write touches only its rows

    def __init__(self, rows: int, segments: list):
        self.rows = rows
        self.segment_specs = segments
        self.nbytes = np.array([nb for _, _, nb in segments], dtype=np.intp)
        self.bases = segment_bases(rows, self.nbytes)
        self.buffer = mx.zeros((buffer_bytes(rows, self.nbytes),), dtype=mx.uint8)
        mx.eval(self.buffer)
        self.host = np.array(self.buffer, copy=False)  # a writable view, not a copy
        if not (self.host.flags.writeable and self.host.flags.c_contiguous):
            raise RuntimeError("this MLX build does not expose array memory to numpy")
        # Slices, dtype views and reshapes of an evaluated contiguous buffer share its memory,
        # so these arrays show whatever the host last wrote.
        self.arrays = [self.buffer[b:b + rows * nb].view(dtype).reshape((rows, *shape))
                       for (dtype, shape, nb), b in zip(segments, self.bases.tolist())]
        mx.eval(self.arrays)
        self.nbytes_total = self.buffer.nbytes
        self.ahead_limit = rows

    def write(self, rows: np.ndarray, experts: np.ndarray, read) -> None:
        read(experts, self.host, self.bases, rows)

    def put(self, rows: np.ndarray, arrays: list) -> None:
        """Rows from arrays already on the device (one per segment, a row each): copied by
        the host into the shared buffer (the caller settled what reads ``rows``)."""
        mx.eval(arrays)
        for array, base, nb in zip(arrays, self.bases.tolist(), self.nbytes.tolist()):
            dst = self.host[base:base + self.rows * nb].reshape(self.rows, nb)
            dst[rows] = np.array(array.view(mx.uint8)).reshape(len(rows), nb)

    def staged_write(self, rows: np.ndarray, read):
        """The part of a write that may run on another thread (all of it, here), and what
        finishes it on the caller's (nothing)."""
        return (lambda: read(self.host, self.bases, rows)), None


class Stage(HostRows):
    """Rows for every expert of a layer shape, outside the pools (unified memory): a prompt's
    call computes on it in one piece. One per model and shape: the output computed on it
    last is evaluated before it is written again."""

    def __init__(self, rows: int, segments: list):
        super().__init__(rows, segments)
        self._reader = None

    def reading(self, output) -> None:
        self._reader = output

    def claim(self) -> None:
        """Before a write: the last computation on the stage is done (normally the router's
        sync of the next layer evaluated it already: nothing is waited for)."""
        if self._reader is not None:
            mx.eval(self._reader)
            self._reader = None

    def copy_from(self, pool: "HostRows", rows: np.ndarray, positions: np.ndarray) -> None:
        """Rows ``rows`` of ``pool`` (same shapes) into this stage's ``positions`` (the stage
        claimed, as Session.stage gives it out)."""
        for base, pbase, nb in zip(self.bases.tolist(), pool.bases.tolist(),
                                   self.nbytes.tolist()):
            dst = self.host[base:base + self.rows * nb].reshape(self.rows, nb)
            src = pool.host[pbase:pbase + pool.rows * nb].reshape(pool.rows, nb)
            dst[positions] = src[rows]


class Staging:
    """The host buffer the moves into a model's device pools go through, one move at a time
    (they run on the thread that runs the model, and each is copied into an MLX array before
    the next starts): one for all the layers, not one each, which on a 48-layer model of
    Qwen3-30B-A3B's shapes was gigabytes of host memory."""

    def __init__(self):
        self._buffer = np.empty(0, np.uint8)

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    def get(self, nbytes: int) -> np.ndarray:
        if self._buffer.nbytes < nbytes:
            self._buffer = np.empty(nbytes, np.uint8)
        return self._buffer[:nbytes]


class DeviceRows:
    """Pool rows in device memory, written in place by MLX's scatter (a discrete GPU).

    Args:
        rows: rows of the pool.
        segments: per segment ``(mlx dtype, per-expert shape, nbytes)``.
        batch: most rows moved in one transfer.
        staging: the host buffer moves go through, shared by the pools of one model.
    """

    whole_array_writes = True  # a scatter needs the whole array free to update it in place

    def __init__(self, rows: int, segments: list, batch: int, staging: Staging | None = None):
        self.rows = rows
        self.segments = segments
        self.nbytes = np.array([nb for _, _, nb in segments], dtype=np.intp)
        self.batch = max(1, min(rows, batch))
        self.arrays = [mx.zeros((rows, *shape), dtype=dtype) for dtype, shape, _ in segments]
        mx.eval(self.arrays)
        self.nbytes_total = sum(a.nbytes for a in self.arrays)
        self.staging = staging if staging is not None else Staging()
        # Rows written ahead have a buffer of their own (the copier thread fills it while
        # the model runs): one write ahead at a time per pool, committed (its bytes made an
        # MLX array) before the next starts.
        self.ahead_host = np.empty(buffer_bytes(self.batch, self.nbytes), np.uint8)
        self.ahead_limit = self.batch

    def write(self, rows: np.ndarray, experts: np.ndarray, read) -> None:
        host = self.staging.get(buffer_bytes(min(len(rows), self.batch), self.nbytes))
        for start in range(0, len(rows), self.batch):
            part = rows[start:start + self.batch]
            bases = segment_bases(len(part), self.nbytes)
            read(experts[start:start + self.batch], host, bases,
                 np.arange(len(part), dtype=np.int32))
            self._scatter(part, bases, host)

    def put(self, rows: np.ndarray, arrays: list) -> None:
        """Rows from arrays already on the device (one per segment, a row each), scattered in
        place (the caller evaluated whatever reads the pool: nothing holds it)."""
        at = mx.array(rows.astype(np.int32))
        for array, new in zip(self.arrays, arrays):
            array[at] = new

    def staged_write(self, rows: np.ndarray, read):
        """The host copy may run on another thread; the scatter is issued on the caller's
        (for the rows ``keep`` indexes). At most one batch."""
        bases = segment_bases(len(rows), self.nbytes)
        host = self.ahead_host
        positions = np.arange(len(rows), dtype=np.int32)
        return (lambda: read(host, bases, positions)), (lambda keep: self._scatter(
            rows[keep], *self._subset(host, bases, keep, len(rows))))

    def _subset(self, host, bases, keep, n):
        if len(keep) == n:
            return bases, host
        sub_bases = segment_bases(len(keep), self.nbytes)
        sub = np.empty(buffer_bytes(len(keep), self.nbytes), np.uint8)
        for s, nb in enumerate(self.nbytes.tolist()):
            src = host[bases[s]:bases[s] + n * nb].reshape(n, nb)
            sub[sub_bases[s]:sub_bases[s] + len(keep) * nb] = src[keep].ravel()
        return sub_bases, sub

    def read(self, experts: np.ndarray, read) -> list:
        """The rows of ``experts`` as arrays of their own, outside the pool: per segment, a
        list of ``(n, *shape)`` arrays, a batch each, moved as :meth:`write` moves them
        (``read`` as its)."""
        parts = [[] for _ in self.segments]
        for start in range(0, len(experts), self.batch):
            part = experts[start:start + self.batch]
            bases = segment_bases(len(part), self.nbytes)
            host = self.staging.get(buffer_bytes(len(part), self.nbytes))
            read(part, host, bases, np.arange(len(part), dtype=np.int32))
            for s, array in enumerate(self._moved(host, bases, len(part))):
                parts[s].append(array)
        return parts

    def _moved(self, host: np.ndarray, bases: np.ndarray, n: int) -> list:
        """``n`` rows staged in ``host`` (segments at ``bases``) on the device: one
        host-to-device transfer (a copy: ``host`` may be written again), an array a
        segment."""
        moved = mx.array(host[:int(bases[-1] + n * self.nbytes[-1])])
        return [moved[base:base + n * nb].view(dtype).reshape((n, *shape))
                for (dtype, shape, nb), base in zip(self.segments, bases.tolist())]

    def _scatter(self, rows: np.ndarray, bases: np.ndarray, host: np.ndarray) -> None:
        n = len(rows)
        if not n:
            return
        at = mx.array(rows.astype(np.int32))
        for array, new in zip(self.arrays, self._moved(host, bases, n)):
            # In place: the Python object keeps its identity, its buffer is reused by MLX.
            array[at] = new
