"""The pull kernels' text and parameters: one source for CUDA and Metal (pull.py launches them).

A kernel looks each wanted expert up in the arena's slot table (a ready row whose version did
not move), then copies its segments from the arena row, or from the pool's row for a hit, into
the output arrays, and writes each pair's status (see pull.py). The text is built per
(language, segment count, copy width, Metal's arena windows), since ``mx.fast.cuda_kernel`` /
``metal_kernel`` compile one source a name.
"""

import numpy as np

from expertd.shm.layout import SLOT_DTYPE, SlotState

# Parameters every kernel reads from one int64 array (index -> meaning); the segments' offsets
# within a row and sizes follow, two per segment.
P_LAYER, P_EXPERTS, P_SLOT_OF, P_SLOTS, P_ROWS, P_STRIDE, P_BASE, P_N_ROWS = range(8)
N_FIXED = 8

_SLOT_VERSION = SLOT_DTYPE.fields["version"][1]
_SLOT_LAYER = SLOT_DTYPE.fields["layer"][1]
_SLOT_EXPERT = SLOT_DTYPE.fields["expert"][1]
_SLOT_STATE = SLOT_DTYPE.fields["state"][1]


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
      {kind}[0] = 3;  // absent, unless a ready row is found below
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


def _zero_source(n_segments: int) -> str:
    """Zero each segment of an absent pair's output row (grid-strided over the row's blocks):
    the step computes on zeros, as on the host copy's, not on what the output's memory held.
    A layer's output for that pair then lacks one expert's share and stays finite, and the
    layers after it route near where the replay will (fewer distinct experts pulled), where
    uninitialised bytes (NaN, huge values) would send them anywhere. The step is replayed
    either way; its check demands none of those later layers' experts (step_check.py)."""
    return "".join(f"""
    {{
      I64 nb = params[{N_FIXED} + 2 * {s} + 1];
      DST unsigned char* dst = ((DST unsigned char*)out{s}) + (I64)p * nb;
      for (I64 i = first; i < nb; i += step) {{
        dst[i] = 0;
      }}
    }}""" for s in range(n_segments))


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


def kernel_source(language: str, n_segments: int, vector: bool,
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
  if (found[0] == 2) return;  // an id out of range (a stack's row nobody reads): left alone
  const I64 first = (I64)chunk * {t["width"]} + {t["thread"]};
  const I64 step = (I64){t["groups"]} * {t["width"]};
  if (found[0] == 3) {{  // absent from the arena: zeros
{_zero_source(n_segments)}
    return;
  }}
  const bool from_pool = found[0] == 0;
  const I64 where = found[1];
{_copy_source(n_segments, vector, "uint4" if vector else t["bytes"],
              _row_source(language, windows))}
"""


def cuda_source(n_segments: int, vector: bool) -> str:
    """The body of the CUDA pull kernel (``mx.fast.cuda_kernel`` writes its signature)."""
    return kernel_source("cuda", n_segments, vector)


def metal_source(n_segments: int, vector: bool, windows: tuple = (1, 0)) -> str:
    """The body of the Metal pull kernel (``mx.fast.metal_kernel`` writes its signature), for
    the arena adopted as ``windows`` (see :func:`metal_windows`)."""
    return kernel_source("metal", n_segments, vector, windows)


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


def join_source(parts: int) -> str:
    """The body of the CUDA kernel that joins a step's ``parts`` statuses (int32 inputs
    ``part0``.., ``ends`` their running ends) into ``out``, a thread an element. What
    ``mx.concatenate`` does with a copy a part, each a node of the step's CUDA graph that MLX
    encodes on the host (a decode step's host time is the bound on a GPU: bench/RESULTS.md),
    in one node."""
    lines = ["  const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);",  # past the end: none
             "  if (i < ends[0]) out[i] = part0[i];"]
    lines += [f"  else if (i < ends[{j}]) out[i] = part{j}[i - ends[{j - 1}]];"
              for j in range(1, parts)]
    return "\n".join(lines) + "\n"


def join_names(parts: int) -> list:
    """The join kernel's inputs (see :func:`join_source`)."""
    return ["ends"] + [f"part{j}" for j in range(parts)]
