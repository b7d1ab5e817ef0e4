"""Probe: the pull kernel's rate by grid shape (CHUNKS blocks per row, THREADS per block).

    PYTHONSAFEPATH=1 python bench/pull_probe.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx
import numpy as np
from common import daemon, ensure_model
from gpu_pools import QWEN3_30B_SHAPES

from expertd.client import pull
from expertd.client.session import Session, Stack
from expertd.manifest import Manifest


def main() -> None:
    _, blob_dir = ensure_model("gpu-pools-qwen3-30b-shapes", QWEN3_30B_SHAPES)
    m = Manifest.load(blob_dir)
    with daemon(blob_dir, m.total_expert_bytes * 1.3 / 2**30 + 0.01):
        session = Session(blob_dir, pull="device")
        try:
            experts = np.arange(8, dtype=np.int32)
            session.demand_absent(0, experts)
            p = session.puller
            n = m.layers[0].num_experts
            empty = Stack([mx.zeros((1, *s), d) for d, s, _ in p.layers[0]],
                          np.full(n, -1, np.int32))
            ids = mx.array(experts)
            mx.eval(ids, empty.arrays)
            for chunks in (1, 2, 4, 8, 16):
                for threads in (512, 1024):
                    pull.CHUNKS, pull.THREADS = chunks, threads
                    mx.eval(p.assemble(0, ids, empty))
                    times = []
                    for _ in range(10):
                        out = p.assemble(0, ids, empty)
                        t = time.perf_counter()
                        mx.eval(out)
                        times.append(time.perf_counter() - t)
                    nbytes = sum(a.nbytes for a in out[0])
                    print(f"chunks {chunks} threads {threads}: "
                          f"{nbytes / statistics.median(times) / 1e9:.1f} GB/s", flush=True)
        finally:
            session.close()


if __name__ == "__main__":
    main()
