"""Cold fill: the daemon's fill GB/s ÷ raw aligned O_DIRECT random reads of the same blob files.

Same block size (one expert row, ``stride`` bytes) and the same number of threads. Raw reads and
daemon fills alternate round by round. O_DIRECT keeps the page cache out of both.
"""

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common import daemon, ensure_model


def raw_direct_read(blob_dir, threads: int, seed: int) -> float:
    """GB/s of reading every expert row once, in random order, with ``threads`` threads."""
    from expertd.blobstore import open_blob
    from expertd.manifest import Manifest

    manifest = Manifest.load(blob_dir)
    stride = manifest.stride
    fds = [open_blob(blob_dir / layer.file, direct=True) for layer in manifest.layers]
    jobs = [(li, e) for li, layer in enumerate(manifest.layers) for e in range(layer.num_experts)]
    np.random.default_rng(seed).shuffle(jobs)
    buffers = [mmap.mmap(-1, stride) for _ in range(threads)]
    chunks = [jobs[i::threads] for i in range(threads)]

    def worker(i):
        buf = buffers[i]
        for li, e in chunks[i]:
            os.preadv(fds[li], [buf], e * stride)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    elapsed = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return len(jobs) * stride / elapsed / 1e9


def fio_direct_read(blob_dir, threads: int, seconds: int = 3) -> float | None:
    """GB/s of fio's random O_DIRECT reads of the blob files (same block size and threads),
    or None where fio is not installed."""
    import json
    import shutil
    import subprocess

    from expertd.manifest import Manifest

    if shutil.which("fio") is None:
        return None
    manifest = Manifest.load(blob_dir)
    files = ":".join(str(blob_dir / layer.file) for layer in manifest.layers)
    out = subprocess.run(["fio", "--name=expertd", f"--filename={files}", "--rw=randread",
                          f"--bs={manifest.stride}", "--direct=1", "--ioengine=psync",
                          f"--numjobs={threads}", "--time_based", f"--runtime={seconds}",
                          "--group_reporting", "--output-format=json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)["jobs"][0]["read"]["bw_bytes"] / 1e9


def daemon_fill(blob_dir, threads: int, seed: int, verify: bool) -> dict:
    """Demand every expert once from a cold daemon, all layers' demands in flight at once.

    GB/s by the client's wall clock and by the daemon's own busy time.
    """
    import os

    from expertd.connection import Connection
    from expertd.manifest import Manifest
    from expertd.protocol import Op, parse_reply

    manifest = Manifest.load(blob_dir)
    flags = ["--workers", str(threads), "--io", "direct"] + ["--verify", "always" if verify else "never"]
    with daemon(blob_dir, manifest.total_expert_bytes * 1.2 / 2**30 + 0.01, *flags):
        with Connection(blob_dir) as conn:
            hello = conn.request(Op.HELLO, {"version": 1, "client": conn.client_id,
                                            "pid": os.getpid()})
            rng = np.random.default_rng(seed)
            t0 = time.perf_counter()
            pending = []
            for li in rng.permutation(len(manifest.layers)):
                experts = rng.permutation(manifest.layers[li].num_experts)
                for start in range(0, len(experts), hello["max_demand"]):
                    group = experts[start:start + hello["max_demand"]].tolist()
                    pending.append(conn.send(Op.DEMAND, {"layer": int(li), "experts": group}))
            waiting = set(pending)
            while waiting:  # replies come in completion order, not request order
                if not conn.sock.poll(120_000):
                    raise RuntimeError("the daemon stopped answering")
                rid, _, body = parse_reply(conn.sock.recv_multipart())
                if rid in waiting and body.get("ok"):
                    waiting.discard(rid)
                    conn.send(Op.RELEASE, {"lease": body["lease"]})
                elif rid in waiting:
                    raise RuntimeError(f"demand failed: {body.get('error')}")
            elapsed = time.perf_counter() - t0
            s = conn.request(Op.STATS)
    return dict(wall_gbps=s["bytes_read"] / elapsed / 1e9, daemon_gbps=s["fill_gbps"])


def run(name: str, spec: dict, rounds: int = 3, threads: int = 8) -> dict:
    _, blob_dir = ensure_model(name, spec)
    raw, fio, fills, fills_noverify = [], [], [], []
    for r in range(rounds):
        raw.append(raw_direct_read(blob_dir, threads, r))
        fio.append(fio_direct_read(blob_dir, threads))
        fills.append(daemon_fill(blob_dir, threads, r, verify=True))
        fills_noverify.append(daemon_fill(blob_dir, threads, r, verify=False))
    fio_gbps = float(np.median(fio)) if None not in fio else None
    # fio is the reference where installed, else our own threaded O_DIRECT reader.
    raw_gbps = fio_gbps or float(np.median(raw))
    wall = float(np.median([f["wall_gbps"] for f in fills]))
    wall_nv = float(np.median([f["wall_gbps"] for f in fills_noverify]))
    return dict(name=name, threads=threads, raw_gbps=raw_gbps, fio_gbps=fio_gbps,
                python_raw_gbps=float(np.median(raw)), fill_gbps=wall,
                fill_daemon_gbps=float(np.median([f["daemon_gbps"] for f in fills])),
                fill_noverify_gbps=wall_nv, ratio=wall / raw_gbps,
                ratio_noverify=wall_nv / raw_gbps, verify_cost=1 - wall / wall_nv,
                raw_rounds=raw, fill_rounds=[f["wall_gbps"] for f in fills])


if __name__ == "__main__":
    import argparse
    import json

    from common import QWEN3_30B_LIKE

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    print(json.dumps(run("qwen3-30b-like", QWEN3_30B_LIKE, args.rounds, args.threads), indent=1))
