"""Every fill is checked by default: a corrupt refill is refused by name and never served; and
the pread pool shuts down without writing to a descriptor it no longer owns."""

import mmap
import os
import re
import sys
import threading

import pytest
from harness import TINY_CACHE_GB, InProcessDaemon, RawClient, expected_bytes, wait_until

from expertd.blobstore import BlobStore
from expertd.errors import DaemonError
from expertd.manifest import Manifest
from expertd.protocol import ErrorCode, Op
from expertd.serving.preads import FillPool

LAYER, EXPERT = 1, 5


def flip_byte(blob_dir, layer: int, expert: int, at: int = 100) -> None:
    """Invert one byte of an expert's row in its blob file, as a failing disk would."""
    manifest = Manifest.load(blob_dir)
    with open(blob_dir / manifest.layers[layer].file, "r+b") as f:
        f.seek(expert * manifest.stride + at)
        byte = f.read(1)[0]
        f.seek(expert * manifest.stride + at)
        f.write(bytes([byte ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())  # the daemon reads with O_DIRECT: the bytes must be on the disk



def assert_names_the_corruption(message: str, blob_dir, layer: int, expert: int) -> None:
    path = blob_dir / Manifest.load(blob_dir).layers[layer].file
    assert re.search(rf"\blayer {layer} expert {expert}\b", message), message
    assert str(path) in message, message
    assert "expertd convert" in message, message


# ---- against the serving loop, default flags ------------------------------------------------------

@pytest.mark.timeout(120)
def test_every_refill_of_a_corrupted_expert_is_refused_and_never_served(blob_dir, isolated_env):
    want = expected_bytes(blob_dir)
    with InProcessDaemon(blob_dir, "--cache-gb", TINY_CACHE_GB) as d, RawClient(blob_dir) as c:
        assert c.request(Op.STATS)["verify"] == "always"
        assert c.fetch(LAYER, [EXPERT]) == [want[(LAYER, EXPERT)]]  # the first fill is sound
        flip_byte(blob_dir, LAYER, EXPERT)
        for attempt in range(1, 4):
            c.evict(LAYER, EXPERT)
            with pytest.raises(DaemonError) as err:
                c.demand(LAYER, [EXPERT - 1, EXPERT])
            assert err.value.code == ErrorCode.CHECKSUM, str(err.value)
            assert_names_the_corruption(str(err.value), blob_dir, LAYER, EXPERT)
            assert c.slot(LAYER, EXPERT)[0] == -1, "the corrupt row is still in the table"
            stats = c.request(Op.STATS)
            assert stats["fill_errors"] == attempt and stats["leases"] == 0
        # The sound experts around it are served, with their exact bytes.
        for key in [(LAYER, EXPERT - 1), (LAYER, EXPERT + 1), (0, EXPERT)]:
            assert c.fetch(key[0], [key[1]]) == [want[key]]
        assert d.poll() is None


def _generate(blob_dir, env: dict):
    import subprocess

    return subprocess.run([sys.executable, "-m", "expertd", "generate", "--blobs", str(blob_dir),
                           "--prompt", "the quick brown fox", "--max-tokens", "6"],
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                          env={**os.environ, **env})


@pytest.mark.timeout(400)
def test_generate_fails_with_the_checksum_error_instead_of_wrong_text(blob_dir, isolated_env):
    with InProcessDaemon(blob_dir, "--cache-gb", TINY_CACHE_GB):
        good = _generate(blob_dir, isolated_env)
        assert good.returncode == 0, good.stderr
        # Every expert row corrupt: the cache (10 rows) cannot hold one token's experts of all
        # three layers, so the next run must refill some of them.
        manifest = Manifest.load(blob_dir)
        for layer in manifest.layers:
            for expert in range(layer.num_experts):
                flip_byte(blob_dir, layer.index, expert)
        bad = _generate(blob_dir, isolated_env)
    assert bad.returncode != 0, bad.stdout
    assert "checksum mismatch" in bad.stderr and "expertd convert" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr, bad.stderr
    text = good.stdout.rsplit("[expertd]", 1)[0].strip()
    assert text.startswith(bad.stdout.strip()), (bad.stdout, good.stdout)
    # No rule printed above the error with nothing under it: it goes out with the first text.
    assert bad.stdout.strip() != "=" * 10, bad.stdout


# ---- the pool on its own: real blob files, rows in anonymous memory ----------------------------

class GatedRows:
    """Rows in anonymous memory whose lookup waits for ``gate``: holds workers in mid-fill."""

    def __init__(self, rows: int, stride: int):
        self.stride = stride
        self.memory = mmap.mmap(-1, rows * stride)
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)
        self.calls = 0
        self._lock = threading.Lock()

    def row(self, i: int) -> memoryview:
        with self._lock:
            self.calls += 1
        self.entered.release()
        self.gate.wait(30)
        return memoryview(self.memory)[i * self.stride:(i + 1) * self.stride]


def fill_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("expertd-fill")]


def collect(pool: FillPool, count: int) -> dict:
    """Wait for ``count`` completions; {(layer, expert): error or None}."""
    import select

    done = {}
    while len(done) < count:
        if not select.select([pool.wake_fd], [], [], 20)[0]:
            raise AssertionError(f"{len(done)} of {count} fills completed")
        for _, layer, expert, error in pool.completions():
            done[(layer, expert)] = error
    return done


@pytest.mark.timeout(60)
def test_pool_refuses_each_corrupt_refill_and_fills_the_rest(blob_dir):
    want = expected_bytes(blob_dir)
    flip_byte(blob_dir, LAYER, EXPERT)
    store = BlobStore(blob_dir)
    rows = GatedRows(2, store.stride)
    rows.gate.set()
    pool = FillPool(store, rows, workers=4, verify="always")
    try:
        for _ in range(3):
            pool.submit(0, LAYER, EXPERT)
            pool.submit(1, LAYER, EXPERT + 1)
            done = collect(pool, 2)
            code, message = done[(LAYER, EXPERT)]
            assert code == ErrorCode.CHECKSUM
            assert_names_the_corruption(message, blob_dir, LAYER, EXPERT)
            assert done[(LAYER, EXPERT + 1)] is None
            got = bytes(rows.memory[store.stride:store.stride + len(want[(LAYER, EXPERT + 1)])])
            assert got == want[(LAYER, EXPERT + 1)]
    finally:
        assert pool.close(timeout=10)
        store.close()


@pytest.mark.timeout(60)
def test_pool_close_never_writes_to_a_descriptor_it_gave_back(blob_dir):
    store = BlobStore(blob_dir)
    rows = GatedRows(3, store.stride)
    pool = FillPool(store, rows, workers=2, verify="always")
    wake_r, wake_w = pool.wake_fd, pool._wake_w
    for row in range(3):
        pool.submit(row, 0, row)
    for _ in range(2):  # both workers are inside a fill; the third fill is queued
        assert rows.entered.acquire(timeout=10)
    assert pool.close(timeout=0.2) is False  # the reads are held: the deadline passes
    # Take descriptors until the pool's old numbers are reused, as any later open would.
    pipes = []
    while wake_w not in {fd for p in pipes for fd in p} and len(pipes) < 64:
        pipes.append(os.pipe())
    assert wake_r in {fd for p in pipes for fd in p} and wake_w in {fd for p in pipes for fd in p}
    for r, _ in pipes:
        os.set_blocking(r, False)
    try:
        rows.gate.set()  # the held reads finish after close
        wait_until(lambda: not fill_threads(), 10, "the fill workers to exit")
        for r, _ in pipes:
            with pytest.raises(BlockingIOError):
                os.read(r, 64)  # nothing was written into the reused descriptors
        assert rows.calls == 2, "a fill queued before close still ran"
    finally:
        for p in pipes:
            for fd in p:
                os.close(fd)
        store.close()


@pytest.mark.timeout(60)
def test_pool_close_waits_for_running_reads_and_then_refuses_fills(blob_dir):
    store = BlobStore(blob_dir)
    rows = GatedRows(2, store.stride)
    pool = FillPool(store, rows, workers=2, verify="always")
    pool.submit(0, 0, 0)
    pool.submit(1, 0, 1)
    for _ in range(2):
        assert rows.entered.acquire(timeout=10)
    opener = threading.Timer(0.2, rows.gate.set)
    opener.start()
    try:
        assert pool.close(timeout=20) is True  # returned only once both reads had finished
        wait_until(lambda: not fill_threads(), 10, "the fill workers to exit")
        with pytest.raises(RuntimeError, match="closed"):
            pool.submit(0, 0, 2)
    finally:
        opener.join()
        store.close()
