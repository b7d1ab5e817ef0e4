"""Probe: the pull kernel as a decode step meets it, by grid (CHUNKS blocks per pair).

    PYTHONSAFEPATH=1 python bench/pull_probe.py

Each of the model's layers assembles 8 pairs, ``m`` of them missing from a 32-row pool (pulled
from the registered arena), the rest pool hits; every layer's assemble runs under one
evaluation, as in a step. Prints the step's pull time (ms) by m and CHUNKS.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx
import numpy as np
from common import build_seconds, daemon, ensure_model, no_arguments
from gpu_pools import QWEN3_30B_SHAPES
from gpu_pull import _median_eval

from expertd.client import pull
from expertd.client.prompt_pull import Stack
from expertd.client.session import Session
from expertd.manifest import Manifest

POOL = 32


def _host_ms(make, repeat: int = 20) -> tuple:
    """Median ms of ``mx.async_eval`` (the host's encoding) and of the whole evaluation."""
    mx.eval(make())
    host, total = [], []
    for _ in range(repeat):
        out = make()
        t = time.perf_counter()
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        host.append(t1 - t)
        total.append(time.perf_counter() - t)
    return 1e3 * statistics.median(host), 1e3 * statistics.median(total)


def encode_costs(p, pools, layers) -> None:
    """What the host pays to encode a step's extra work, 12 layers of it, by shape: the pull
    kernel (one output per segment and a status), plain and compiled; a kernel copying the
    same bytes into one output, with the pull's inputs or two, and split back into the
    segments' arrays (compiled); and mx.take of the same rows per segment."""
    ids = mx.array(np.arange(8, dtype=np.int32))
    mx.eval(ids)
    first = pools[layers[0]].arrays[0]
    n_out = 8 * sum(a[0].size * a.itemsize for a in pools[layers[0]].arrays) // 4
    src = f"""
  for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < {n_out}LL;
       i += gridDim.x * blockDim.x)
    out0[i] = ((const unsigned int*)pool0)[i % {first.nbytes // 4}LL];"""
    one = mx.fast.cuda_kernel(name="probe_one", input_names=["ids", "pool0"],
                              output_names=["out0"], source=src)
    segs = p.layers[layers[0]]
    names = ["ids", "table", "params"] + [f"pool{i}" for i in range(len(segs))]
    wide = mx.fast.cuda_kernel(name="probe_wide", input_names=names, output_names=["out0"],
                               source=src)

    def wide_call(la, table, params, *arrays):
        return wide(inputs=[ids, table, params, *arrays], output_shapes=[(n_out,)],
                    output_dtypes=[mx.uint32], grid=(2048 * 512, 1, 1),
                    threadgroup=(512, 1, 1))[0]

    def split(out):  # one uint8 buffer, segment-major, back into the segments' arrays
        flat, at, parts = out.view(mx.uint8), 0, []
        for dtype, shape, nb in segs:
            parts.append(flat[at:at + 8 * nb].view(dtype).reshape((8, *shape)))
            at += 8 * nb
        return parts

    table = pools[layers[0]].pull_table()
    params = {la: p.params(la) for la in layers}
    compiled_pull = {la: mx.compile(lambda i, t, *a, la=la: p.pull(la, i, t, list(a)))
                     for la in layers}
    compiled_split = mx.compile(lambda t, q, *a: split(wide_call(0, t, q, *a)))
    cases = dict(
        pull=lambda: [p.assemble(la, ids, pools[la]) for la in layers],
        pull_compiled=lambda: [compiled_pull[la](ids, table, *pools[la].arrays)
                               for la in layers],
        one_output=lambda: [one(inputs=[ids, pools[la].arrays[0]],
                                output_shapes=[(n_out,)],
                                output_dtypes=[mx.uint32], grid=(2048 * 512, 1, 1),
                                threadgroup=(512, 1, 1)) for la in layers],
        one_output_all_inputs=lambda: [wide_call(la, table, params[la], *pools[la].arrays)
                                       for la in layers],
        one_output_split_compiled=lambda: [compiled_split(table, params[la], *pools[la].arrays)
                                           for la in layers],
        take=lambda: [[mx.take(a, ids, axis=0) for a in pools[la].arrays] for la in layers],
        take_one=lambda: [mx.take(pools[la].arrays[0], ids, axis=0) for la in layers],
    )
    for name, make in cases.items():
        build = 1e3 * build_seconds(make, 50)
        host, total = _host_ms(make)
        print(f"encode {name}: build {build:.3f} ms, async_eval {host:.3f} ms, whole "
              f"{total:.3f} ms ({len(layers)} layers)", flush=True)


def main() -> None:
    _, blob_dir = ensure_model("gpu-pools-qwen3-30b-shapes", QWEN3_30B_SHAPES)
    m = Manifest.load(blob_dir)
    with daemon(blob_dir, m.total_expert_bytes * 1.3 / 2**30 + 0.01):
        session = Session(blob_dir, pull="device")
        try:
            p = session.puller
            layers = [la.index for la in m.layers]
            n = m.layers[0].num_experts
            arena = np.arange(POOL, POOL + 8, dtype=np.int32)
            for layer in layers:
                session.demand_absent(layer, arena)
            row_of = np.full(n, -1, np.int32)
            row_of[:POOL] = np.arange(POOL)
            pools = {la: Stack([mx.zeros((POOL, *s), d) for d, s, _ in p.layers[la]], row_of)
                     for la in layers}
            mx.eval([s.arrays for s in pools.values()])
            encode_costs(p, pools, layers)
            for misses in (0, 1, 2):
                ids = mx.array(np.concatenate([arena[:misses],
                                               np.arange(8 - misses, dtype=np.int32)]))
                line = []
                for chunks in (4,):
                    pull.CHUNKS = chunks
                    t = 1e3 * _median_eval(lambda: [p.assemble(la, ids, pools[la])
                                                    for la in layers])
                    line.append(f"{chunks}: {t:.3f}")
                print(f"misses {misses}/8 a layer, {len(layers)} layers, ms by CHUNKS: "
                      + ", ".join(line), flush=True)
        finally:
            session.close()


if __name__ == "__main__":
    no_arguments(__doc__)
    main()
