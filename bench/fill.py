"""Cold fill: the daemon's fill GB/s ÷ raw aligned O_DIRECT random reads of the same blob files.

Same block size (one expert row, ``stride`` bytes), the same number of threads and the same
access pattern (every expert once, in a random order over all layers). Raw reads and daemon
fills, with every fill's checksum verified and without, alternate round by round; O_DIRECT keeps
the page cache out of all of them. Also measured: the pread pool alone (no daemon), the CPU
seconds each run spends per GB read (what checksums cost, even where a loaded machine's wall
clock hides it), and xxh3's own speed on rows of this stride.

    python bench/fill.py [--rounds N]       (or, to update RESULTS.md: python bench/run.py --only fill)
"""

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from common import daemon, ensure_model


def shuffled_experts(layers, seed: int) -> list:
    """Every ``(layer, expert)`` once, in a random order over all layers (the same per seed)."""
    jobs = [(li, e) for li, layer in enumerate(layers) for e in range(layer.num_experts)]
    np.random.default_rng(seed).shuffle(jobs)
    return jobs


def raw_direct_read(blob_dir, threads: int, seed: int) -> float:
    """GB/s of reading every expert row once, in random order, with ``threads`` threads."""
    from expertd.blobstore import open_blob
    from expertd.manifest import Manifest

    manifest = Manifest.load(blob_dir)
    stride = manifest.stride
    fds = [open_blob(blob_dir / layer.file, direct=True) for layer in manifest.layers]
    jobs = shuffled_experts(manifest.layers, seed)
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


def pool_fill(blob_dir, threads: int, seed: int, verify: str) -> tuple:
    """The daemon's pread pool alone (no daemon, no socket) filling every expert once into rows
    of anonymous memory, all fills queued at once: ``(GB/s, CPU seconds per GB)``.

    CPU time per GB (all threads of this process) is the cost of checksums that a loaded,
    shared machine's wall clock hides in its noise."""
    import select

    from expertd.blobstore import BlobStore
    from expertd.serving.preads import FillPool

    store = BlobStore(blob_dir, direct=True)

    class Rows:
        memory = mmap.mmap(-1, store.stride * threads * 4)

        def row(self, i):
            return memoryview(self.memory)[i * store.stride:(i + 1) * store.stride]

    jobs = shuffled_experts(store.layers, seed)
    pool = FillPool(store, Rows(), threads, verify)
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        for i, (li, e) in enumerate(jobs):
            pool.submit(i % (threads * 4), li, e)
        done = 0
        while done < len(jobs):
            select.select([pool.wake_fd], [], [], 60)
            for *_, error in pool.completions():
                if error is not None:
                    raise RuntimeError(error[1])
                done += 1
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        pool.close()
        store.close()
    gigabytes = len(jobs) * store.stride / 1e9
    return gigabytes / elapsed, cpu / gigabytes


def hash_rate(stride: int, threads: int, rows: int = 96) -> float:
    """xxh3 GB/s over ``rows`` rows of ``stride`` bytes, more than the CPU caches hold (a row
    just read with O_DIRECT is in memory, not in cache), split over ``threads`` threads."""
    import threading

    import xxhash

    memory = np.random.default_rng(0).integers(0, 255, stride * rows, dtype=np.uint8)
    view = memoryview(memory)

    def worker(i):
        for r in range(i, rows, threads):
            xxhash.xxh3_64_intdigest(view[r * stride:(r + 1) * stride])

    best = 0.0
    for _ in range(3):
        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        best = max(best, rows * stride / (time.perf_counter() - t0) / 1e9)
    return best


def filesystem_type(path) -> str:
    """The file system type of ``path`` (``stat -f``): O_DIRECT needs a real disk, not tmpfs."""
    import subprocess

    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                          text=True).stdout.strip() or "unknown"


def daemon_fill(blob_dir, threads: int, seed: int, verify: bool) -> dict:
    """Demand every expert once from a cold daemon, one expert per demand, in a random order
    over all layers (as the raw readers read), a window of demands in flight.

    GB/s by the client's wall clock and by the daemon's own busy time.
    """
    from expertd.connection import Connection
    from expertd.manifest import Manifest
    from expertd.protocol import PROTOCOL_VERSION, Op

    manifest = Manifest.load(blob_dir)
    jobs = shuffled_experts(manifest.layers, seed)
    flags = ["--workers", str(threads), "--io", "direct", "--verify",
             "always" if verify else "never"]
    with daemon(blob_dir, manifest.total_expert_bytes * 1.2 / 2**30 + 0.01, *flags) as pid:
        with Connection(blob_dir) as conn:
            hello = conn.request(Op.HELLO, {"version": PROTOCOL_VERSION, "client": conn.client_id,
                                            "pid": os.getpid()})
            # Enough demands in flight to keep every worker busy, within this client's lease cap.
            window = min(4 * threads, hello["client_cap"])
            cpu0 = cpu_seconds(pid)
            t0 = time.perf_counter()
            waiting, sent, done = set(), 0, 0
            while done < len(jobs):
                while sent < len(jobs) and len(waiting) < window:
                    li, e = jobs[sent]
                    waiting.add(conn.send(Op.DEMAND, {"layer": int(li), "experts": [int(e)]}))
                    sent += 1
                if not conn.poll(120.0):
                    raise RuntimeError("the daemon stopped answering")
                rid, _, body = conn.recv()
                if rid not in waiting:
                    continue  # a reply to a RELEASE
                if not body.get("ok"):
                    raise RuntimeError(f"demand failed: {body.get('error')}")
                waiting.discard(rid)
                done += 1
                conn.send(Op.RELEASE, {"lease": body["lease"]})
            elapsed = time.perf_counter() - t0
            cpu = cpu_seconds(pid) - cpu0
            s = conn.request(Op.STATS)
    if s.get("io", "direct") != "direct":
        raise RuntimeError(f"the daemon read {blob_dir} through the page cache ({s['io']})")
    return dict(wall_gbps=s["bytes_read"] / elapsed / 1e9, daemon_gbps=s["fill_gbps"],
                cpu_per_gb=cpu / (s["bytes_read"] / 1e9))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all threads (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(name: str, spec: dict, rounds: int = 9, threads: int = 8) -> dict:
    import xxhash

    from expertd.manifest import Manifest

    _, blob_dir = ensure_model(name, spec)
    fs = filesystem_type(blob_dir)
    if fs in ("tmpfs", "ramfs"):
        raise RuntimeError(f"{blob_dir} is on {fs}: O_DIRECT reads need a disk; set the "
                           "benchmark's output directory on one")
    stride = Manifest.load(blob_dir).stride
    # python-xxhash releases the GIL for inputs above this size (4.1 and later), else never.
    gil_minsize = getattr(xxhash._xxhash, "_GIL_MINSIZE", None)
    raw, fio, fills, fills_noverify, pool, pool_noverify = [], [], [], [], [], []
    for r in range(rounds):
        raw.append(raw_direct_read(blob_dir, threads, r))
        # Alternate which run goes first, so neither always follows the same reads.
        for verify in (("always", "never") if r % 2 == 0 else ("never", "always")):
            (pool if verify == "always" else pool_noverify).append(
                pool_fill(blob_dir, threads, r, verify))
        fio.append(fio_direct_read(blob_dir, threads))
        for verify in ((True, False) if r % 2 == 0 else (False, True)):
            (fills if verify else fills_noverify).append(daemon_fill(blob_dir, threads, r, verify))
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
                raw_rounds=raw, fill_rounds=[f["wall_gbps"] for f in fills],
                fill_noverify_rounds=[f["wall_gbps"] for f in fills_noverify],
                fill_cpu_per_gb=float(np.median([f["cpu_per_gb"] for f in fills])),
                fill_noverify_cpu_per_gb=float(np.median([f["cpu_per_gb"] for f in fills_noverify])),
                fio_rounds=fio, stride=stride, filesystem=fs,
                pool_gbps=float(np.median([p[0] for p in pool])),
                pool_noverify_gbps=float(np.median([p[0] for p in pool_noverify])),
                pool_cpu_per_gb=float(np.median([p[1] for p in pool])),
                pool_noverify_cpu_per_gb=float(np.median([p[1] for p in pool_noverify])),
                pool_rounds=[p[0] for p in pool], pool_noverify_rounds=[p[0] for p in pool_noverify],
                hash_gbps=hash_rate(stride, 1), hash_gbps_2threads=hash_rate(stride, 2),
                xxhash_version=xxhash.VERSION,
                hash_releases_gil=gil_minsize is not None and stride > gil_minsize)


if __name__ == "__main__":
    import argparse
    import json

    from common import QWEN3_30B_LIKE

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    print(json.dumps(run("qwen3-30b-like", QWEN3_30B_LIKE, args.rounds, args.threads), indent=1))
