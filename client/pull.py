"""Arena rows pulled by the device: a layer's missing experts come from the arena with no host wait.

A *puller* gives a streamed layer the rows its router chose, in one primitive:
:meth:`assemble` takes the router's ids and the pool's expert -> row table (both on the device)
and returns fresh arrays of one row per (token, slot) pair, hits copied from the pool and misses
read from the daemon's arena, plus a status per pair (``>= 0``: the pool row it came from;
``-1 - 2e``: expert ``e`` read from the arena (PULLED); ``-2 - 2e``: the arena had no ready row
for it (ABSENT), the pair's bytes are garbage and its step runs again). mlx-lm's ``gather_qmm``
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

What keeps a pulled row still while a device reads it is the step's epoch (:class:`StepEpoch`,
docs/ARCHITECTURE.md "Epochs"): the daemon refills no row evicted during a step before the step ends, and a
step held past the lease bound loses its epoch and is replayed. A device never waits for a row.
"""

import mlx.core as mx
import numpy as np

from expertd import native
from expertd.choices import PULL_MODES  # noqa: F401 (its users' name)
from expertd.shm.layout import EPOCH_DTYPE, SLOT_DTYPE, SlotState

from .backing import buffer_bytes, segment_bases

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

U64 = 2**64 - 1

# Parameters every kernel reads from one int64 array (index -> meaning); the segments' offsets
# within a row and sizes follow, two per segment.
P_LAYER, P_EXPERTS, P_SLOT_OF, P_SLOTS, P_ROWS, P_STRIDE, P_BASE, P_N_ROWS = range(8)
N_FIXED = 8

_SLOT_VERSION = SLOT_DTYPE.fields["version"][1]
_SLOT_LAYER = SLOT_DTYPE.fields["layer"][1]
_SLOT_EXPERT = SLOT_DTYPE.fields["expert"][1]
_SLOT_STATE = SLOT_DTYPE.fields["state"][1]


class StepEpoch:
    """This client's record in the arena's epoch table: the step it is in.

    Args:
        raw: the arena mapping (uint8 array).
        offset: where the record starts (``epochs_offset + slot * EPOCH_DTYPE.itemsize``).
    """

    def __init__(self, raw: np.ndarray, offset: int):
        self._raw, self._step_at = raw, offset + EPOCH_DTYPE.fields["step"][1]
        self._lost_at = offset + EPOCH_DTYPE.fields["lost"][1]
        self._pid_at = offset + EPOCH_DTYPE.fields["pid"][1]
        # What the record holds while it is ours: the pid the daemon wrote when it gave it
        # out (before the hello's reply) and the last step published in it.
        self._pid = native.read_u64(raw, self._pid_at)
        self._published = self.step = native.read_u64(raw, self._step_at)
        if self.step & 1:  # a record given out mid-step (never by a daemon that zeroes it)
            self.step = (self.step + 1) & U64
        self.disowned = False  # the record stopped being ours (see :meth:`owned`)

    @property
    def inside(self) -> bool:
        return bool(self.step & 1)

    def owned(self) -> bool:
        """The record is still this client's. A client forgotten by the daemon (stopped longer
        than the client timeout) finds its record zeroed or given to another client: the daemon
        protects none of its reads, and it must not write the record any more."""
        return (not self.disowned and native.read_u64(self._raw, self._pid_at) == self._pid != 0
                and native.read_u64(self._raw, self._step_at) == self._published)

    def _publish(self, step: int) -> None:
        native.publish_u64(self._raw, self._step_at, step)
        self._published = step

    def begin(self) -> None:
        """Enter a step: published (and fenced) before any read of the slot table. A record
        that is no longer ours is left alone; the step's end then says it was lost."""
        if not self.step & 1:
            self.step = (self.step + 1) & U64  # a hostile 2**64 - 1 wraps, as the record does
            if self.owned():
                self._publish(self.step)
            else:
                self.disowned = True

    def end(self) -> bool:
        """Leave the step, after every read of it is done. True if the daemon revoked it or
        stopped protecting it (its record went free or to another client meanwhile): the
        step's rows may have been refilled while read, and it must be replayed."""
        return self.check(self.step, more=False)

    def check(self, launched: int, more: bool) -> bool:
        """A step launched while the record showed ``launched`` is done (every read of it).
        With ``more``, another step is still in flight (a pipelining client): the record
        advances by two and stays odd, which tells the daemon this one is done (see
        expertd.serving.epochs); else it leaves the step (even). True if that step was lost:
        the daemon gave up on a step it showed at or after ``launched`` (the loss covers
        every step then in flight), or the record is no longer ours."""
        if not self.step & 1:
            return False
        gave_up = native.read_u64(self._raw, self._lost_at)
        lost = bool(gave_up & 1) and (gave_up - launched) & U64 <= (self.step - launched) & U64
        self.step = (self.step + (2 if more else 1)) & U64
        if self.owned():
            self._publish(self.step)
        else:
            self.disowned, lost = True, True
        return lost


def kernel_params(view, layer: int, base: int) -> np.ndarray:
    """The int64 parameters a pull kernel reads for ``layer`` of the arena ``view`` mapped at
    ``base`` (a device address, or 0 where the arena is an input array of its own)."""
    g = view.arena.geometry
    offsets, nbytes = view.segment_table(layer)
    fixed = [layer, g.n_experts, g.slot_of_offset, g.slots_offset, g.rows_offset, g.stride, base,
             g.total_rows]
    pairs = np.stack([offsets, nbytes], axis=1).ravel()
    return np.concatenate([np.array(fixed, np.int64), pairs.astype(np.int64)])


def vector_copy(view, layer: int) -> bool:
    """16-byte loads are safe for ``layer``: every segment's offset and size is a multiple of
    16 (rows start 16 KiB-aligned, MLX buffers at least 16-aligned)."""
    offsets, nbytes = view.segment_table(layer)
    return bool(((offsets % 16) == 0).all() and ((nbytes % 16) == 0).all())


def _lookup_source(kind: str) -> str:
    """Resolve one pair (``p``) to its source: a pool row, an arena slot, or nothing; the
    first thread of each block, on either kernel language. ``kind`` names the shared int."""
    return f"""
    I64 e = (I64)ids[p];
    I64 nexp = params[{P_EXPERTS}];
    int row = (e >= 0 && e < nexp) ? table[e] : -1;
    {kind}[0] = 2;
    {kind}[1] = row;
    if (row >= 0) {{
      {kind}[0] = 0;
    }} else if (e >= 0 && e < nexp) {{
      I64 layer = params[{P_LAYER}];
      int slot = ((ARENA int*)(arena + params[{P_SLOT_OF}]))[layer * nexp + e];
      if (slot >= 0 && slot < params[{P_N_ROWS}]) {{  // out of range: a client's scribble
        ARENA unsigned char* rec = arena + params[{P_SLOTS}] + (I64)slot * {SLOT_DTYPE.itemsize};
        U64 version = *((ARENA U64*)(rec + {_SLOT_VERSION}));
        int rl = *((ARENA int*)(rec + {_SLOT_LAYER}));
        int rx = *((ARENA int*)(rec + {_SLOT_EXPERT}));
        unsigned int st = *((ARENA unsigned int*)(rec + {_SLOT_STATE}));
        if (!(version & (U64)1) && rl == (int)layer && rx == (int)e && st == {int(SlotState.READY)}u) {{
          {kind}[0] = 1;
          {kind}[1] = slot;
        }}
      }}
    }}
    if (chunk == 0) {{
      int code = (e >= 0 && e < nexp) ? (int)e : 0;
      status[p] = {kind}[0] == 0 ? row : ({kind}[0] == 1 ? -1 - 2 * code : -2 - 2 * code);
    }}"""


def _copy_source(n_segments: int, vector: bool, unit: str, row: str) -> str:
    """Copy each segment of the resolved row into the outputs (grid-strided over the row's
    blocks); hits from the pool, misses from the arena (``row``: where arena row ``where``
    starts)."""
    width = 16 if vector else 1
    lines = []
    for s in range(n_segments):
        lines.append(f"""
    {{
      I64 nb = params[{N_FIXED} + 2 * {s} + 1];
      I64 off = params[{N_FIXED} + 2 * {s}];
      SRC unsigned char* src = from_pool
          ? ((SRC unsigned char*)pool{s}) + where * nb
          : {row} + off;
      DST unsigned char* dst = ((DST unsigned char*)out{s}) + (I64)p * nb;
      I64 units = nb / {width};
      SRC {unit}* from = (SRC {unit}*)src;
      DST {unit}* to = (DST {unit}*)dst;
      I64 i = first;
      for (; i + 3 * step < units; i += 4 * step) {{  // four loads in flight per thread
        {unit} a = from[i], b = from[i + step], c = from[i + 2 * step], d = from[i + 3 * step];
        to[i] = a; to[i + step] = b; to[i + 2 * step] = c; to[i + 3 * step] = d;
      }}
      for (; i < units; i += step) {{
        to[i] = from[i];
      }}
    }}""")
    return "".join(lines)


# What the two kernel languages spell differently; the pull kernel's body is one text.
_LANGUAGES = {
    "cuda": dict(
        ARENA="volatile const", SRC="const", DST="", I64="long long", U64="unsigned long long",
        bytes="unsigned char", group="blockIdx", shared="__shared__ long long",
        arena=f"const unsigned char* arena = (const unsigned char*)(uintptr_t)params[{P_BASE}]",
        thread="threadIdx.x", barrier="__syncthreads()", width="blockDim.x",
        groups="gridDim.x", kind="long long*"),
    "metal": dict(
        ARENA="device const", SRC="device const", DST="device", I64="long",
        U64="unsigned long", bytes="uchar", group="threadgroup_position_in_grid",
        shared="threadgroup long",
        arena="device const unsigned char* arena = (device const unsigned char*)arena_index",
        thread="thread_position_in_threadgroup.x",
        barrier="threadgroup_barrier(mem_flags::mem_threadgroup)",
        width="threads_per_threadgroup.x", groups="threadgroups_per_grid.x",
        kind="threadgroup long*"),
}


def _row_source(language: str, windows: tuple) -> str:
    """Where arena row ``where`` starts. CUDA: in the one registered mapping. Metal: in the
    window of ``windows`` = ``(count, rows each)`` holding it (the arena is adopted as buffers
    of at most Metal's largest length: see :func:`metal_windows`)."""
    stride = f"params[{P_STRIDE}]"
    if language == "cuda":
        return f"arena + params[{P_ROWS}] + where * {stride}"
    count, per = windows
    row = f"(SRC unsigned char*)arena_rows{count - 1} + (where - {(count - 1) * per}) * {stride}"
    for w in range(count - 2, -1, -1):
        row = (f"(where < {(w + 1) * per} ? (SRC unsigned char*)arena_rows{w} + (where - "
               f"{w * per}) * {stride} : {row})")
    return row


def _kernel_source(language: str, n_segments: int, vector: bool,
                   windows: tuple = (1, 0)) -> str:
    """The pull kernel's body in ``language`` (mx.fast's kernel builders write its signature):
    each block's first thread resolves its pair, then the block copies its share of the row.
    ``windows``: Metal's arena windows (see :func:`_row_source`)."""
    t = _LANGUAGES[language]
    defines = "".join(f"  #define {m} {t[m]}".rstrip() + "\n"
                      for m in ("ARENA", "SRC", "DST", "I64", "U64"))
    return f"""
{defines}  const int p = {t["group"]}.y;
  const int chunk = {t["group"]}.x;
  {t["shared"]} found[2];
  {t["arena"]};
  if ({t["thread"]} == 0) {{
    {t["kind"]} kind = found;
{_lookup_source("kind")}
  }}
  {t["barrier"]};
  if (found[0] == 2) return;
  const bool from_pool = found[0] == 0;
  const I64 where = found[1];
  const I64 first = (I64)chunk * {t["width"]} + {t["thread"]};
  const I64 step = (I64){t["groups"]} * {t["width"]};
{_copy_source(n_segments, vector, "uint4" if vector else t["bytes"],
              _row_source(language, windows))}
"""


def cuda_source(n_segments: int, vector: bool) -> str:
    """The body of the CUDA pull kernel (``mx.fast.cuda_kernel`` writes its signature)."""
    return _kernel_source("cuda", n_segments, vector)


def metal_source(n_segments: int, vector: bool, windows: tuple = (1, 0)) -> str:
    """The body of the Metal pull kernel (``mx.fast.metal_kernel`` writes its signature), for
    the arena adopted as ``windows`` (see :func:`metal_windows`)."""
    return _kernel_source("metal", n_segments, vector, windows)


def input_names(n_segments: int, windows: int = 0) -> list:
    """The pull kernel's inputs; ``windows``: Metal's arena buffers (its index, then that many
    windows of rows), 0 for CUDA (the arena is read by its registered address)."""
    names = ["ids", "table", "params"] + [f"pool{s}" for s in range(n_segments)]
    if windows:
        names += ["arena_index"] + [f"arena_rows{w}" for w in range(windows)]
    return names


# Metal binds at most 31 buffers to a kernel. A pull's own: the ids, the table, the params,
# a pool's segments and as many outputs, the statuses and the arena's index, 5 + 2 x segments;
# its rows' windows take the rest.
METAL_BUFFERS = 31


def max_windows(n_segments: int) -> int:
    """The most windows of arena rows a Metal pull kernel of ``n_segments`` can bind."""
    return METAL_BUFFERS - 5 - 2 * n_segments


def metal_windows(geometry, limit: int, most: int) -> tuple:
    """The arena as Metal buffers of at most ``limit`` bytes (its largest): the index (the
    header and slot tables, everything before the rows), then windows of whole rows, each
    16 KiB-aligned since rows are, ``most`` at most (see :func:`max_windows`).
    ``(index bytes, windows, rows a window)``.

    Raises:
        RuntimeError: if the index or one row exceeds ``limit``, or the rows need more than
            ``most`` windows (the caller keeps the host copy, saying why).
    """
    g = geometry
    if g.rows_offset > limit or g.stride > limit:
        raise RuntimeError(f"Metal's largest buffer ({limit} bytes) is smaller than the "
                           f"arena's slot tables ({g.rows_offset}) or one row ({g.stride})")
    per = min(g.total_rows, limit // g.stride)
    count = -(-g.total_rows // per)
    if count > most:
        raise RuntimeError(f"the arena's rows ({g.total_rows * g.stride} bytes) need "
                           f"{count} Metal buffers of at most {limit} bytes; a pull kernel "
                           f"binds {max(most, 0)} beside its own")
    return g.rows_offset, count, per


def window_starts(geometry, count: int, per: int) -> list:
    """Where each of ``count`` windows of ``per`` rows starts in the arena (see
    :func:`metal_windows`); the last runs to the arena's end."""
    return [geometry.rows_offset + w * per * geometry.stride for w in range(count)]


def output_names(n_segments: int) -> list:
    return [f"out{s}" for s in range(n_segments)] + ["status"]


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
                     source=_kernel_source(self.name, n_segments, vector, self.windows),
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
