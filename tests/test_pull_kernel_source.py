"""The CUDA and Metal pull kernels' own text, run on this CPU: each body is compiled as C with a
few definitions for what its language provides (block and thread indices, shared memory, the
barrier, ``uint4``), and its blocks and threads run one after another. The barrier's place lets
threads run in order: thread 0 resolves the pair before any other thread reads it.

It reads a copy of a live daemon's arena (the kernel's arena base is a parameter), so slot
records can be spoiled in the ways a kernel must refuse: a row being written (odd version),
another layer's or expert's record, a row not READY, a slot number out of the arena's range.
Rows it takes must equal the host copy's (the production twin), statuses the host's codes.
"""

import ctypes
import shutil
import subprocess
import sysconfig

import mlx.core as mx
import numpy as np
import pytest
from client_helpers import ROWS_ALL, client_flags, routed_model
from harness import Daemon

from expertd.client.pull import CHUNKS, HostPuller, decode_status
from expertd.client.pull_kernels import (
    N_FIXED,
    P_BASE,
    cuda_source,
    input_names,
    join_names,
    join_source,
    kernel_params,
    metal_source,
    metal_windows,
    window_starts,
)
from expertd.client.session import Session
from expertd.shm.layout import SLOT_DTYPE, SlotState

# What CUDA and Metal give a kernel body, for a C compiler. Blocks and threads are the
# harness's loop variables; "shared" memory is static (blocks run one after another).
PRELUDE = """
#include <stdint.h>
#include <stdbool.h>
typedef struct { unsigned int x, y, z, w; } uint4;
typedef struct { unsigned int x, y, z; } dim3_t;
typedef unsigned char uchar;
static dim3_t blockIdx, threadIdx, blockDim, gridDim;
static dim3_t threadgroup_position_in_grid, thread_position_in_threadgroup,
    threads_per_threadgroup, threadgroups_per_grid;
#define __shared__ static
#define __syncthreads()
#define threadgroup static
#define threadgroup_barrier(flags)
#define device
"""

HARNESS = """
static void body(const int32_t* ids, const int32_t* table, const int64_t* params, {pools},
                 {arena}{outs}, int32_t* status) {{
{source}
}}

void run(const int32_t* ids, const int32_t* table, const int64_t* params, void** pools,
         void** arena, void** outs, int32_t* status, int n, int chunks, int threads) {{
  for (int p = 0; p < n; p++) {{
    for (int c = 0; c < chunks; c++) {{
      dim3_t group = {{(unsigned)c, (unsigned)p, 0}}, size = {{(unsigned)threads, 1, 1}},
             grid = {{(unsigned)chunks, (unsigned)n, 1}};
      blockIdx = threadgroup_position_in_grid = group;
      blockDim = threads_per_threadgroup = size;
      gridDim = threadgroups_per_grid = grid;
      for (int t = 0; t < threads; t++) {{
        dim3_t me = {{(unsigned)t, 0, 0}};
        threadIdx = thread_position_in_threadgroup = me;
        body(ids, table, params, {pool_args}, {arena_args}{out_args}, status);
      }}
    }}
  }}
}}
"""

THREADS = 8  # a few threads a block (the device's 512 only make the loop longer)
LAYER = 1
JUNK = 0xCD  # what a fresh output buffer holds, in these tests


def compiler() -> str:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    found = shutil.which(cc) or shutil.which("cc")
    if found is None:  # the native suite builds the Cython extension: CI has one
        pytest.skip("no C compiler on this machine")
    return found


def build(tmp_path, language: str, n_segments: int, vector: bool, windows: tuple = (1, 0)):
    """The ``run`` entry of the kernel body of ``language``, compiled as C; its inputs in the
    order and names of the kernel's own (input_names)."""
    if language == "cuda":
        source, count = cuda_source(n_segments, vector), 0
    else:
        source, count = metal_source(n_segments, vector, windows), windows[0]
    segments = range(n_segments)
    arena = input_names(n_segments, count)[3 + n_segments:]
    text = PRELUDE + HARNESS.format(
        pools=", ".join(f"const uchar* pool{s}" for s in segments),
        arena="".join(f"const uchar* {name}, " for name in arena),
        outs=", ".join(f"uchar* out{s}" for s in segments),
        pool_args=", ".join(f"(const uchar*)pools[{s}]" for s in segments),
        arena_args="".join(f"(const uchar*)arena[{i}], " for i in range(len(arena))),
        out_args=", ".join(f"(uchar*)outs[{s}]" for s in segments), source=source)
    return compiled(tmp_path, f"{language}_{n_segments}_{int(vector)}_{count}", text)


def compiled(tmp_path, name: str, text: str):
    """The ``run`` entry of the C ``text``, compiled as a shared library under ``tmp_path``."""
    (tmp_path / f"{name}.c").write_text(text)
    done = subprocess.run([compiler(), "-std=gnu11", "-O1", "-shared", "-fPIC", "-w", "-o",
                           str(tmp_path / f"{name}.so"), str(tmp_path / f"{name}.c")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    run = ctypes.CDLL(str(tmp_path / f"{name}.so")).run
    run.restype = None
    return run


def launch(run, ids, table, params, pools, nbytes, arena: list):
    """One pull: outputs (filled with JUNK first, as a fresh buffer may hold anything: rows a
    kernel leaves alone show) and statuses. ``arena``: the addresses of Metal's arena inputs
    (none for CUDA)."""
    n = len(ids)
    outs = [np.full((n, nb), JUNK, np.uint8) for nb in nbytes]
    status = np.full(n, 12345, np.int32)
    ptr = ctypes.c_void_p
    pool_ptrs = (ptr * len(pools))(*[p.ctypes.data for p in pools])
    arena_ptrs = (ptr * max(1, len(arena)))(*arena)
    out_ptrs = (ptr * len(outs))(*[o.ctypes.data for o in outs])
    run(ptr(ids.ctypes.data), ptr(table.ctypes.data), ptr(params.ctypes.data), pool_ptrs,
        arena_ptrs, out_ptrs, ptr(status.ctypes.data), ctypes.c_int(n), ctypes.c_int(CHUNKS),
        ctypes.c_int(THREADS))
    return outs, status


@pytest.fixture(scope="module")
def live_arena(models, module_env, tmp_path_factory):
    """A daemon's arena holding every expert of layer 1, copied (the copy is what the kernels
    read and what each case copies again and spoils), with the view's segment table and the
    host copy's rows; one for the module's cases."""
    _, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    state = tmp_path_factory.mktemp("live-arena") / "s.json"
    with Daemon(blob_dir, module_env, *client_flags(blob_dir, ROWS_ALL, state)):
        session = Session(blob_dir, pull="host")
        try:
            n_experts = session.manifest.layers[LAYER].num_experts
            session.demand_absent(LAYER, np.arange(n_experts, dtype=np.int32))
            view = session.view
            offsets, nbytes = view.segment_table(LAYER)
            segs = {LAYER: [(mx.uint8, (int(nb),), int(nb)) for nb in nbytes.tolist()]}
            # The production twin's rows of every expert (seqlock-checked), the reference.
            host_rows = HostPuller(view, segs)._copy(LAYER, np.arange(n_experts, dtype=np.int32))
            assert all(r is not None for r in host_rows), "the arena holds every expert"
            arena = np.array(view.raw)  # a copy: nothing spoilt reaches the daemon
            params = kernel_params(view, LAYER, 0)  # the arena's base: set per kernel
            g = view.arena.geometry
            slot_of = view.arena.slot_of[LAYER * g.n_experts:(LAYER + 1) * g.n_experts]
            slots = set(slot_of[:n_experts].tolist())  # where the layer's rows sit
        finally:
            session.close()
    yield dict(arena=arena, params=params, nbytes=nbytes.tolist(), offsets=offsets,
               host_rows=host_rows, n_experts=n_experts, geometry=g, slots=slots)


def spoil(arena: np.ndarray, geometry) -> dict:
    """Spoil six experts' slot records in ``arena`` (a copy); the expert -> what was done."""
    n_experts = geometry.n_experts  # the slot index's stride
    slot_of = arena[geometry.slot_of_offset:geometry.slot_of_offset
                    + 4 * geometry.n_layers * n_experts].view("<i4")
    slots = arena[geometry.slots_offset:geometry.slots_offset
                  + SLOT_DTYPE.itemsize * geometry.total_rows].view(SLOT_DTYPE)
    done = {}

    def record(e):
        return slots[slot_of[LAYER * n_experts + e]:][:1]

    record(2)["version"] += 1  # being rewritten: odd
    done[2] = "odd version"
    record(3)["layer"] = LAYER + 1
    done[3] = "another layer's record"
    record(4)["expert"] = 5
    done[4] = "another expert's record"
    record(6)["state"] = int(SlotState.FILLING)
    done[6] = "not READY"
    # A client's scribble: a slot number past the arena's rows. A record that would pass sits
    # where that slot's would be (the slot table's padding), and a row of bytes where its row
    # would be (the copy is one row longer): only the range check refuses it.
    end = geometry.slots_offset + SLOT_DTYPE.itemsize * geometry.total_rows
    assert geometry.rows_offset - end >= SLOT_DTYPE.itemsize, "no padding after the slot table"
    past = arena[end:end + SLOT_DTYPE.itemsize].view(SLOT_DTYPE)
    past["version"], past["layer"], past["expert"], past["state"] = 2, LAYER, 7, SlotState.READY
    slot_of[LAYER * n_experts + 7] = geometry.total_rows
    done[7] = "slot out of range"
    slot_of[LAYER * n_experts + 8] = -1
    done[8] = "not in the arena"
    return done


# CUDA; Metal with the arena's rows in one window, and in windows of 5 rows (a big arena on a
# Mac: here layer 1's experts then sit in several windows, at their edges too).
KERNELS = [("cuda", None), ("metal", None), ("metal", 5)]


@pytest.mark.parametrize("language,per", KERNELS, ids=["cuda", "metal-1", "metal-5"])
@pytest.mark.parametrize("vector", [True, False])
def test_the_pull_kernels_take_ready_rows_and_refuse_every_other(live_arena, tmp_path, language,
                                                                 per, vector):
    a = live_arena
    g = a["geometry"]
    assert len(a["arena"]) == g.rows_offset + g.stride * g.total_rows
    arena = np.concatenate([a["arena"], np.full(g.stride, 7, np.uint8)])  # a row past the end
    spoilt = spoil(arena, g)
    nbytes = a["nbytes"]
    if vector:
        assert all(nb % 16 == 0 for nb in nbytes) and (a["offsets"] % 16 == 0).all()
    if language == "metal":  # the arena as Metal adopts it: its index, windows of rows
        per = per or g.total_rows
        count = -(-g.total_rows // per)
        if per == g.total_rows:  # what MetalPuller computes for a limit past the arena
            assert metal_windows(g, g.total_size, 1) == (g.rows_offset, 1, per)
        run = build(tmp_path, language, len(nbytes), vector, (count, per))
    else:
        run = build(tmp_path, language, len(nbytes), vector)

    kept = []

    def pieces(arena):
        """Metal's inputs, each a buffer of its own as Metal's are: the index (followed by
        junk, where the rows were: a kernel reading rows through it reads junk), then each
        window of rows (a kernel reading past its window would read another's)."""
        if language == "cuda":
            return []
        index = np.concatenate([arena[:g.rows_offset],
                                np.full(len(arena) - g.rows_offset, 0xAB, np.uint8)])
        starts = window_starts(g, count, per) + [len(arena)]
        windows = [arena[x:y].copy() for x, y in zip(starts, starts[1:])]
        kept.extend([index, *windows])
        return [index.ctypes.data] + [w.ctypes.data for w in windows]

    # Metal reads the arena as inputs (base 0 in its parameters); CUDA by its address.
    params = based(a["params"], arena, language)
    assert params[N_FIXED + 1::2].tolist() == nbytes
    # A pool of 3 rows holding experts 10, 11, 12 (rows 2, 0, 1), with their own bytes.
    rng = np.random.default_rng(0)
    pools = [rng.integers(0, 256, (3, nb), dtype=np.uint8) for nb in nbytes]
    table = np.full(a["n_experts"], -1, np.int32)
    table[[10, 11, 12]] = [2, 0, 1]
    # Every kind of pair: pool hits, arena rows, the spoilt, ids out of range, repeats.
    ids = np.array([10, 0, 2, 3, 1, 4, 6, 7, 8, 11, 13, -1, a["n_experts"], 15, 12, 0],
                   np.int32)
    outs, status = launch(run, ids, table, params, pools, nbytes, pieces(arena))
    rows, experts, kinds = decode_status(status)
    for i, e in enumerate(ids.tolist()):
        got = [o[i] for o in outs]
        if 0 <= e < a["n_experts"] and table[e] >= 0:  # a hit: the pool's row, its number
            assert rows[i] == table[e]
            assert all((g == p[table[e]]).all() for g, p in zip(got, pools)), e
        elif e in spoilt:  # absent: flagged, its rows zeros (the layers after route on them)
            assert status[i] == -2 - 2 * e, (e, spoilt[e])
            assert not any(g.any() for g in got), (e, spoilt[e])
        elif not 0 <= e < a["n_experts"]:  # a row nobody reads: flagged, left alone
            assert status[i] == -2, e
            assert all((g == JUNK).all() for g in got), e
        else:  # pulled: the arena's row, as the host copy read it
            assert status[i] == -1 - 2 * e and experts[i] == e
            assert all((g == h).all() for g, h in zip(got, a["host_rows"][e])), e
    # The same pull through the unspoilt copy takes the spoilt experts' rows: the refusals
    # above were the spoilt records'.
    clean, status = launch(run, ids, table, based(a["params"], a["arena"], language), pools,
                           nbytes, pieces(a["arena"]))
    for i, e in enumerate(ids.tolist()):
        if e in spoilt:
            assert status[i] == -1 - 2 * e, (e, spoilt[e])
            assert all((g[i] == h).all() for g, h in zip(clean, a["host_rows"][e]))
    # Every expert of the layer from the arena (an empty pool): each row the host copy's,
    # wherever its slot sits (in several windows, and at their edges, for Metal's of 5 rows).
    everyone = np.arange(a["n_experts"], dtype=np.int32)
    clean, status = launch(run, everyone, np.full(a["n_experts"], -1, np.int32),
                           based(a["params"], a["arena"], language), pools, nbytes,
                           pieces(a["arena"]))
    assert (status == -1 - 2 * everyone).all(), status
    for e in everyone.tolist():
        assert all((o[e] == h).all() for o, h in zip(clean, a["host_rows"][e])), e
    if language == "metal" and per < g.total_rows:
        slots = a["slots"]
        assert len({s // per for s in slots}) >= 3, slots  # several windows read
        edges = {w for w in {s // per for s in slots} if {w * per, w * per + per - 1} <= slots}
        assert edges, f"no window read at both its edges: {sorted(slots)}"


def based(params: np.ndarray, arena: np.ndarray, language: str) -> np.ndarray:
    """``params`` for a kernel reading ``arena``: CUDA by its address (the base parameter),
    Metal as an input of its own (base 0)."""
    params = params.copy()
    params[P_BASE] = arena.ctypes.data if language == "cuda" else 0
    return params


JOIN = """
static void body(const int32_t* ends, {parts}, int32_t* out) {{
{source}
}}

void run(const int32_t* ends, const int32_t** parts, int32_t* out, int blocks, int threads) {{
  for (int b = 0; b < blocks; b++) {{
    blockIdx.x = b;
    blockDim.x = threads;
    for (int t = 0; t < threads; t++) {{
      threadIdx.x = t;
      body(ends, {part_args}, out);
    }}
  }}
}}
"""


# A decode's twelve layers; a batch's uneven parts; a part of none between others; a step of
# fewer pulled layers than the kernel's width, padded (CudaPuller.join: the pads end where the
# last part does).
@pytest.mark.parametrize("sizes", [(8,) * 12, (3, 1, 7), (24, 8, 1, 16), (3, 0, 5), (6, 2, 0, 0),
                                   (5,)])
def test_the_join_kernel_concatenates_a_steps_statuses(tmp_path, sizes):
    """CudaPuller.join's kernel (one node of a step's CUDA graph where mx.concatenate encodes a
    copy a part) gives np.concatenate's array, run with more threads than elements (the
    grid is rounded up to whole blocks) and touching nothing past the end."""
    n = len(sizes)
    assert join_names(n) == ["ends"] + [f"part{j}" for j in range(n)]
    text = PRELUDE + JOIN.format(parts=", ".join(f"const int32_t* part{j}" for j in range(n)),
                                 part_args=", ".join(f"parts[{j}]" for j in range(n)),
                                 source=join_source(n))
    run = compiled(tmp_path, "join", text)
    rng = np.random.default_rng(len(sizes))
    parts = [rng.integers(-300, 300, size, dtype=np.int32) for size in sizes]
    ends = np.cumsum(sizes, dtype=np.int32)
    total = int(ends[-1])
    out = np.full(total + 5, 99999, np.int32)  # five past the end: never written
    threads = 4
    ptr = ctypes.c_void_p
    part_ptrs = (ptr * n)(*[p.ctypes.data for p in parts])
    run(ptr(ends.ctypes.data), part_ptrs, ptr(out.ctypes.data),
        ctypes.c_int(-(-total // threads) + 1), ctypes.c_int(threads))
    assert (out[:total] == np.concatenate(parts)).all()
    assert (out[total:] == 99999).all()
