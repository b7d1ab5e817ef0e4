"""Arena rows pulled by the device: a layer's missing experts come from the arena with no host wait.

A *puller* gives a streamed layer the rows its router chose, in one primitive:
:meth:`assemble` takes the router's ids and the pool's expert -> row table (both on the device)
and returns fresh arrays of one row per (token, slot) pair, hits copied from the pool and misses
read from the daemon's arena, plus a status per pair (``>= 0``: the pool row it came from;
``-1 - 2e``: expert ``e`` read from the arena (PULLED); ``-2 - 2e``: the arena had no ready row
for it (ABSENT), the pair's bytes are zeros and its step runs again). mlx-lm's ``gather_qmm``
/ ``gather_mm`` then run on those arrays with ids ``0..n-1``, so the layer costs one primitive
more than resident mlx-lm, whether or not it missed. A prompt's layer assembles a stack with a
row for every expert the same way (Session.assemble_rows: ids in place, -1 for a row nobody
reads), and mlx-lm's call runs on it with the router's own ids.

Backings, one per platform, behind that interface:

- :class:`CudaPuller`: the arena mapping is registered once per attach with ``cudaHostRegister``
  (NVIDIA's ``cuda-python``, the ``cuda`` extra: the maintained binding of the runtime MLX's CUDA
  backend links against, rather than ctypes declarations of our own), and an
  ``mx.fast.cuda_kernel`` reads the slot table and the rows through the registered pointer.
- :class:`MetalPuller`: the arena is adopted as an MLX array without a copy
  (``mx.asarray(..., copy=False)``, 16 KiB-aligned memory, MLX >= 0.32.4) and an
  ``mx.fast.metal_kernel`` does the same work. Its pulls of each layer are compared with a
  host copy, at the step's end (the check's wait) or in the prompt's call, until one with rows
  from the arena agrees; a mismatch replays the step and switches the process to the host
  path with one warning (:func:`verify_pull`).
- :class:`HostPuller`: the host copy (the native extension's or its pure-Python twin's
  seqlock-checked copy) after one wait for the router's ids: what the CPU runs, and what CI
  tests the rest of the path with.

What keeps a pulled row still while a device reads it is the step's epoch (arena_view.StepEpoch,
docs/ARCHITECTURE.md "Epochs"): the daemon refills no row evicted during a step before the step ends, and a
step held past the lease bound loses its epoch and is replayed. A device never waits for a row.
"""

import mlx.core as mx
import numpy as np

from expertd.choices import PULL_MODES  # noqa: F401 (its users' name)

from .backing import buffer_bytes, segment_bases
from .pull_kernels import (
    input_names,
    join_names,
    join_source,
    kernel_params,
    kernel_source,
    max_windows,
    metal_windows,
    output_names,
    vector_copy,
    window_starts,
)

# A pair's status: its pool row (>= 0), or for expert e: -1 - 2e read from the arena (pulled),
# -2 - 2e the arena had no ready row (absent: the step is replayed). One int32 array per layer
# tells the step's end everything, with no copy of the router's ids.
PULLED, ABSENT = 0, 1  # kinds of a negative status


def decode_status(status: np.ndarray) -> tuple:
    """``(rows, experts, kinds)`` of a status array: the pool row of each hit (-1 elsewhere),
    the expert of each miss (-1 for hits), and PULLED / ABSENT per miss (-1 for hits)."""
    status = np.asarray(status, np.int64)
    miss = status < 0
    code = -status - 1
    experts = np.where(miss, code // 2, -1)
    kinds = np.where(miss, code % 2, -1)
    return np.where(miss, -1, status), experts, kinds


def encode_miss(experts: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    return (-1 - 2 * experts.astype(np.int64) - kinds).astype(np.int32)


THREADS = 512  # threads per block (CUDA) / threadgroup (Metal)
# Blocks per row: each looks its row up over PCIe first, so few, large ones (on the H200,
# bench/pull_probe.py: 4 x 512 threads 36 GB/s, 128 x 256 8 GB/s, 512 x 256 1.3 GB/s).
CHUNKS = 4


class Puller:
    """What every backing shares: the view, the segment shapes, and the counters.

    Args:
        view: the :class:`~expertd.client.arena_view.ArenaView` of the attached arena.
        layers: per manifest layer, its segments as ``(mlx dtype, per-expert shape, nbytes)``.
    """

    name = "host"
    # assemble() is device operations alone, with no wait: it may be traced by mx.compile
    # (layer.py compiles a speculative call's pull and computation into one graph).
    traceable = False
    # Pulls are compared with the host copy until one with rows from the arena agrees, per
    # layer (verify_pull): a backing that nothing but a user's machine runs (Metal).
    verify_first = False
    # A kernel was built since the last pass that took its rows: that pass's time is mostly
    # the kernel's compilation, and the pull rate leaves it out (prompt_pull._pass).
    warming = False

    def __init__(self, view, layers: dict):
        self.view = view
        self.layers = layers
        self.counters = dict(rows_pulled=0, bytes_pulled=0, pull_s=0.0, timed_bytes=0)
        self.verified: set = set()  # layers whose pull agreed with the host copy

    def unverified(self, layer: int) -> bool:
        """``layer``'s pulls are still to be compared with the host copy."""
        return self.verify_first and layer not in self.verified

    def differs(self, layer: int, ids, pool, arrays, status) -> bool:
        """Where ``layer``'s pulls are still compared with the host copy, compare this one
        (:func:`verify_pull`): True if it differed; one that agreed with rows from the arena
        ends the comparing for the layer."""
        if not self.unverified(layer):
            return False
        same = verify_pull(self, layer, ids, pool, arrays, status)
        if same:
            self.verified.add(layer)
        return same is False

    def close(self) -> None:
        pass

    def _outputs(self, layer: int, n: int):
        segs = self.layers[layer]
        return [(n, *shape) for _, shape, _ in segs] + [(n,)], \
            [dtype for dtype, _, _ in segs] + [mx.int32]

    def timed(self, seconds: float, nbytes: int) -> None:
        """A pass that took its rows (prompt_pull.py) pulled ``nbytes`` in ``seconds``: counted
        in the pull rate, unless a kernel was built for it (its time is mostly the build)."""
        if self.warming:
            self.warming = False
        else:
            self.counters["pull_s"] += seconds
            self.counters["timed_bytes"] += nbytes

    @property
    def rate_known(self) -> bool:
        """A pass was timed (see :meth:`timed`): the pull rate is known."""
        return self.counters["timed_bytes"] > 0

    def join(self, parts: list):
        """A step's statuses (1-D int32 arrays, lazy) as one array, for its check to read in
        one transfer."""
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def count(self, layer: int, rows: int) -> int:
        """``rows`` of ``layer`` pulled: counted; their bytes."""
        nbytes = rows * sum(nb for _, _, nb in self.layers[layer])
        self.counters["rows_pulled"] += rows
        self.counters["bytes_pulled"] += nbytes
        return nbytes


class HostPuller(Puller):
    """The host copy: one wait for the ids, then the seqlock-checked copy of the missing rows
    (the native extension, or its pure-Python twin) joined with the pool's rows."""

    def assemble(self, layer: int, ids, pool):
        flat = np.array(ids).reshape(-1).astype(np.int64)  # the wait a device pull avoids
        wanted = flat >= 0  # a negative id: a row nobody reads, left unset
        rows = np.where(wanted, pool.row_of[np.maximum(flat, 0)], -1)
        status = np.where(wanted, rows, encode_miss(np.zeros_like(flat), np.ones_like(flat)))
        status = status.astype(np.int32)
        miss = (rows < 0) & wanted
        segs = self.layers[layer]
        pulled = [np.zeros((len(flat), nb), np.uint8) for _, _, nb in segs]
        if miss.any():
            want = np.unique(flat[miss]).astype(np.int32)
            got = self._copy(layer, want)
            for i in np.flatnonzero(miss).tolist():
                parts = got[int(np.searchsorted(want, flat[i]))]
                status[i] = encode_miss(flat[i:i + 1], np.array([parts is None]))[0]
                for s, part in enumerate(parts or ()):
                    pulled[s][i] = part
        base = mx.array(np.maximum(rows, 0).astype(np.int32))
        take = mx.array(miss)
        arrays = []
        for s, (dtype, shape, _) in enumerate(segs):
            mask = take.reshape((-1,) + (1,) * len(shape))
            rows_in = mx.array(pulled[s]).view(dtype).reshape((len(flat), *shape))
            arrays.append(mx.where(mask, rows_in, pool.arrays[s][base]))
        return arrays, mx.array(status)

    def _copy(self, layer: int, experts: np.ndarray) -> list:
        """Per expert, its segments' bytes (uint8 arrays) copied from a ready row that did not
        change meanwhile, or None."""
        return self._rows(layer, self.view.lookup(layer, experts))

    def _rows(self, layer: int, found, checked: bool = True) -> list:
        """The rows ``found`` by a lookup, copied (see :meth:`_copy`); without ``checked``,
        as a device kernel reads them: no seqlock check."""
        view = self.view
        _, nbytes = view.segment_table(layer)
        n = len(found.slots)
        bases = segment_bases(n, nbytes)
        host = np.zeros(buffer_bytes(n, nbytes), np.uint8)
        ok = found.slots >= 0
        if ok.any():
            at = np.flatnonzero(ok).astype(np.int32)
            rows = view.rows(layer, found.slots[at], found.versions[at])
            rows.copy(host, bases, at)
            if checked:  # a row rewritten while copied is not taken
                ok[at] = rows.intact()
        return [[host[b + i * nb:b + (i + 1) * nb] for b, nb in zip(bases.tolist(),
                                                                    nbytes.tolist())]
                if ok[i] else None for i in range(n)]


class _KernelPuller(Puller):
    """A device puller: one kernel per (segment count, copy width), shared by every layer."""

    windows = (0, 0)  # Metal's arena windows: (count, rows each); none for CUDA
    traceable = True

    def __init__(self, view, layers: dict):
        super().__init__(view, layers)
        self._kernels: dict = {}
        self._params: dict = {}
        self._vector: dict = {}

    def params(self, layer: int):
        p = self._params.get(layer)
        if p is None:
            p = self._params[layer] = mx.array(kernel_params(self.view, layer, self.base))
            self._vector[layer] = vector_copy(self.view, layer)
        return p

    def kernel(self, n_segments: int, vector: bool):
        key = (n_segments, vector)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = self.make_kernel(n_segments, vector)
            self.warming = True
        return k

    def _launch(self, layer: int, ids, table, sources: list, n: int):
        params = self.params(layer)
        segs = self.layers[layer]
        shapes, dtypes = self._outputs(layer, n)
        inputs = [ids, table, params, *sources] + self.extra_inputs()
        kernel = self.kernel(len(segs), self._vector[layer])
        out = kernel(inputs=inputs, output_shapes=shapes, output_dtypes=dtypes,
                     grid=(CHUNKS * THREADS, n, 1), threadgroup=(THREADS, 1, 1))
        return list(out[:-1]), out[-1]

    def extra_inputs(self) -> list:
        return []

    def make_kernel(self, n_segments: int, vector: bool):
        """The pull kernel in this puller's language (``name``: "cuda" or "metal")."""
        build = getattr(mx.fast, f"{self.name}_kernel")
        # Row-contiguous inputs: the kernel reads the router's ids in row order whatever
        # their shape or strides (MLX copies a strided slice first).
        count, per = self.windows
        return build(name=f"expertd_pull_{n_segments}_{int(vector)}_{count}x{per}",
                     input_names=input_names(n_segments, count),
                     output_names=output_names(n_segments),
                     source=kernel_source(self.name, n_segments, vector, self.windows),
                     ensure_row_contiguous=True)

    def assemble(self, layer: int, ids, pool):
        return self.pull(layer, ids, pool.pull_table(), pool.arrays)

    def pull(self, layer: int, ids, table, arrays: list):
        """:meth:`assemble` of the pool whose expert -> row table (pull_table) and arrays
        are given: what a compiled call traces with its inputs."""
        # No reshape of the ids (one MLX operation a layer less to build and encode): the
        # kernel reads them in row order (see make_kernel).
        return self._launch(layer, ids, table, arrays, ids.size)


class CudaPuller(_KernelPuller):
    """Pulls through the arena mapping registered with the CUDA runtime (cuda-python)."""

    name = "cuda"

    def __init__(self, view, layers: dict):
        from cuda.bindings import runtime as cudart

        self._rt = cudart
        raw = view.raw
        self._host = int(raw.ctypes.data)
        self._size = int(raw.nbytes)
        err, = cudart.cudaHostRegister(self._host, self._size,
                                       cudart.cudaHostRegisterMapped)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaHostRegister of the arena ({self._size} bytes) failed: "
                               f"{err}")
        err, device = cudart.cudaHostGetDevicePointer(self._host, 0)
        if err != cudart.cudaError_t.cudaSuccess:
            cudart.cudaHostUnregister(self._host)
            raise RuntimeError(f"cudaHostGetDevicePointer failed: {err}")
        self.base = int(device)
        super().__init__(view, layers)
        # One join kernel for any step of this model (NVRTC compiles it once): as wide as
        # its MoE layers; a step of fewer pulled layers passes pads, parts that end where
        # the last real one does, so that no thread reads them.
        self._join = None
        self._width = len(layers)
        self._ends: dict = {}  # the parts' sizes -> their running ends on the device

    def join(self, parts: list):
        """:meth:`Puller.join` in one kernel (pull_kernels.join_source): a node of the step's
        CUDA graph where ``mx.concatenate`` encodes a copy a part."""
        sizes = tuple(p.size for p in parts)
        total = sum(sizes)
        if len(parts) == 1 or len(parts) > self._width or not total or any(
                p.dtype != mx.int32 or p.ndim != 1 for p in parts):
            return super().join(parts)
        ends = self._ends.get(sizes)
        if ends is None:
            if len(self._ends) >= 64:  # a batch's sizes change as sequences come and go
                self._ends.clear()
            padded = sizes + (0,) * (self._width - len(parts))  # the pads end where all do
            ends = self._ends[sizes] = mx.array(np.cumsum(padded, dtype=np.int32))
        if self._join is None:
            self._join = mx.fast.cuda_kernel(
                name=f"expertd_join_{self._width}", input_names=join_names(self._width),
                output_names=["out"], source=join_source(self._width))
        pads = [parts[0]] * (self._width - len(parts))  # read by no thread (see ends)
        return self._join(inputs=[ends, *parts, *pads], output_shapes=[(total,)],
                          output_dtypes=[mx.int32], grid=(total, 1, 1),
                          threadgroup=(min(total, 256), 1, 1))[0]

    def close(self) -> None:
        if self._host:
            mx.synchronize()  # no kernel may still read the mapping
            self._rt.cudaHostUnregister(self._host)
            self._host = 0


class MetalPuller(_KernelPuller):
    """Pulls through the arena adopted as an MLX array (Apple Silicon's unified memory)."""

    name = "metal"
    base = 0
    verify_first = True

    def __init__(self, view, layers: dict):
        g = view.arena.geometry
        limit = int(mx.metal.device_info().get("max_buffer_length", 0))
        segments = max(len(segs) for segs in layers.values()) if layers else 0
        index, count, per = metal_windows(g, limit, max_windows(segments))
        raw = view.raw
        # Adopted, not copied: every piece starts 16 KiB-aligned (the mapping, its rows).
        starts = window_starts(g, count, per) + [g.total_size]
        self._arena = [mx.asarray(raw[:index], copy=False)] + [
            mx.asarray(raw[a:b], copy=False) for a, b in zip(starts, starts[1:])]
        self.windows = (count, per)
        super().__init__(view, layers)

    def extra_inputs(self) -> list:
        return self._arena


def verify_pull(puller, layer: int, ids, pool, arrays, status) -> bool | None:
    """Compare a pull of ``layer`` that ``puller`` made (``arrays`` and ``status``, evaluated,
    for the router's ``ids`` over ``pool``) with the host copy of the same rows, made now:
    False if the bytes of a pair differ (the caller decides: within a revoked epoch that is a
    torn read, else the device's fault); True if pairs the device read from the arena agreed;
    None if none could be compared (the layer's next pull is). An expert's bytes are the same
    from its pool row or its arena row, so a pair is compared wherever both sides have its
    bytes: one filled, refilled or taken into the pool between the two pulls is a race, not a
    fault."""
    want, want_status = HostPuller(puller.view, puller.layers).assemble(layer, ids, pool)
    experts = np.array(ids).reshape(-1)
    got = decode_status(np.array(status))[2]
    host = decode_status(np.array(want_status))[2]
    both = np.flatnonzero((experts >= 0) & (got != ABSENT) & (host != ABSENT))
    at = mx.array(both)
    # Bytes, not values: a NaN in a row equals itself here.
    if not all(bool(mx.array_equal(a[at].view(mx.uint8), b[at].view(mx.uint8)).item())
               for a, b in zip(arrays, want)):
        return False
    return True if (got[both] == PULLED).any() else None


def make_puller(mode: str, view, layers: dict):
    """The puller for ``mode`` (one of PULL_MODES) on this platform, or None for the per-layer
    host path. ``auto``: the device's own where it can read the arena (CUDA with cuda-python,
    Metal), else None; ``device``: the same, or an error saying why not."""
    if mode == "off":
        return None
    if mode == "host":
        return HostPuller(view, layers)
    why = None
    if mx.default_device() != mx.gpu:
        why = "MLX runs on the CPU"
    elif mx.metal.is_available():
        try:
            return MetalPuller(view, layers)
        except (RuntimeError, ValueError, TypeError) as exc:
            why = str(exc)
    else:
        try:
            return CudaPuller(view, layers)
        except ImportError:
            why = "cuda-python is not installed (pip install 'expertd[cuda]')"
        except RuntimeError as exc:
            why = str(exc)
    if mode == "device":
        raise RuntimeError(f"the device cannot pull from the arena: {why}")
    return None
