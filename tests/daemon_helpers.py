"""Real expertd processes and raw protocol clients for the daemon tests (no mocks).

``running_daemon`` starts ``python -m expertd start --foreground`` as a child process and stops
it with SIGTERM, then SIGKILL, each step bounded. ``RawClient`` speaks the wire protocol with
nothing but :class:`expertd.connection.Connection` and the shared arena.

Run as a script, this module is a client process for the multi-process tests:
``python daemon_helpers.py leased|lockfree|hold BLOB_DIR ...`` (see ``main``).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from expertd import native
from expertd.blobstore import BlobStore
from expertd.connection import Connection
from expertd.errors import DaemonError
from expertd.manifest import Manifest
from expertd.paths import daemon_paths
from expertd.protocol import PROTOCOL_VERSION, Op
from expertd.shm.layout import Arena, SlotState

START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
# Row counts that --cache-gb gives with the session's tiny model (stride 16 KiB, 48 experts).
TINY_CACHE_GB = "0.00028"  # 9 rows
SMALL_CACHE_GB = "0.0015"  # 64 rows, capped at the 48 experts of the model
HELPER = Path(__file__).resolve()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until it returns something true; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def query_stats(blob_dir, timeout: float = 5.0) -> dict:
    with Connection(blob_dir) as conn:
        return conn.request(Op.STATS, timeout=timeout)


def try_stats(blob_dir, timeout: float = 1.0) -> dict | None:
    """The daemon's stats, or None if none answers."""
    try:
        return query_stats(blob_dir, timeout)
    except DaemonError:
        return None


def shm_file(blob_dir) -> Path:
    """Where Linux shows the daemon's POSIX shared-memory segment."""
    return Path("/dev/shm") / daemon_paths(blob_dir).shm_name.lstrip("/")


def expertd_cli(*args, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run the ``expertd`` command line in a child process (environment inherited)."""
    return subprocess.run([sys.executable, "-m", "expertd", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


class Daemon(NamedTuple):
    proc: subprocess.Popen
    blob_dir: Path
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def stop_process(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, wait (bounded), SIGKILL if it is still there."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5.0)


@contextmanager
def running_daemon(blob_dir, env: dict, *flags, log: Path | None = None):
    """A real ``expertd start --foreground`` process serving ``blob_dir``; yields a Daemon.

    Args:
        env: the XDG_RUNTIME_DIR / XDG_STATE_HOME of the test (the ``isolated_env`` fixture).
        flags: extra ``expertd start`` flags, e.g. ``"--cache-gb", "0.00028"``.
        log: file for the daemon's output (default: in the runtime directory).
    """
    blob_dir = Path(blob_dir)
    log = Path(log or Path(env["XDG_RUNTIME_DIR"]) / f"daemon-{time.monotonic_ns()}.log")
    cmd = [sys.executable, "-m", "expertd", "start", "--blobs", str(blob_dir), "--foreground",
           *map(str, flags)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)
    daemon = Daemon(proc, blob_dir, log)
    try:
        wait_until(lambda: proc.poll() is not None or try_stats(blob_dir), START_TIMEOUT,
                   f"expertd to answer STATS for {blob_dir}")
        if proc.poll() is not None:
            raise AssertionError(f"expertd exited with {proc.returncode} during start-up:\n"
                                 f"{daemon.log_text()}")
        yield daemon
    finally:
        stop_process(proc)


def kill_serving_daemon(blob_dir) -> None:
    """Teardown for daemons started detached by the CLI: stop whatever still serves the dir."""
    from expertd.daemon import serving_pid

    paths = daemon_paths(blob_dir)
    pid = serving_pid(paths)
    if pid is None or pid <= 0:
        return
    os.kill(pid, signal.SIGTERM)
    try:
        wait_until(lambda: serving_pid(paths) is None, STOP_TIMEOUT, "the detached expertd to stop")
    except AssertionError:
        os.kill(pid, signal.SIGKILL)


class RawClient:
    """A protocol-level client: HELLO, DEMAND, RELEASE, and the daemon's arena mapped."""

    def __init__(self, blob_dir):
        self.blob_dir = Path(blob_dir)
        self.manifest = Manifest.load(self.blob_dir)
        self.conn = Connection(blob_dir)
        self.hello = self.request(Op.HELLO, {"version": PROTOCOL_VERSION,
                                              "client": self.conn.client_id, "pid": os.getpid()})
        self.arena = Arena.attach(daemon_paths(blob_dir).shm_name)
        self.raw = self.arena.raw
        self.slots_offset = self.arena.geometry.slots_offset

    def request(self, op: Op, body: dict | None = None, timeout: float = 10.0) -> dict:
        return self.conn.request(op, body, timeout=timeout)

    def demand(self, layer: int, experts, timeout: float = 20.0) -> dict:
        return self.request(Op.DEMAND, {"layer": int(layer), "experts": [int(e) for e in experts]},
                            timeout=timeout)

    def release(self, lease: int) -> None:
        self.conn.send(Op.RELEASE, {"lease": lease})

    def heartbeat(self) -> dict:
        return self.request(Op.HEARTBEAT, {"client": self.conn.client_id})

    def row_bytes(self, row: int, layer: int) -> bytes:
        return bytes(self.arena.row(row)[:self.manifest.layers[layer].expert_bytes])

    def fetch(self, layer: int, experts) -> list:
        """Demand, copy the rows, check their seqlock versions, release; the experts' bytes."""
        reply = self.demand(layer, experts)
        try:
            got = [self.row_bytes(row, layer) for row in reply["rows"]]
            if not validate(self.raw, self.slots_offset, reply["rows"], reply["versions"]):
                raise AssertionError(f"a leased row of layer {layer} changed while it was copied")
            return got
        finally:
            self.release(reply["lease"])

    def slot(self, layer: int, expert: int) -> tuple:
        """(row, state, version) of a key as the shared table shows it; row -1 if absent."""
        g = self.arena.geometry
        row = int(self.arena.slot_of[layer * g.n_experts + expert])
        if row < 0:
            return -1, SlotState.EMPTY, 0
        rec = self.arena.slots[row]
        if int(rec["layer"]) != layer or int(rec["expert"]) != expert:
            return -1, SlotState.EMPTY, 0
        return row, int(rec["state"]), int(rec["version"])

    def close(self) -> None:
        self.raw = None
        self.arena.close()
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def validate(raw, slots_offset: int, rows, versions) -> bool:
    return native.validate(raw, slots_offset, np.asarray(rows, np.int32),
                           np.asarray(versions, np.uint64))


def expected_bytes(blob_dir) -> dict:
    """{(layer, expert): exact bytes} read straight from the blob files."""
    store = BlobStore(blob_dir)
    try:
        return {(layer.index, e): store.read_expert(layer.index, e)
                for layer in store.layers for e in range(layer.num_experts)}
    finally:
        store.close()


# ---- client processes ------------------------------------------------------------------------

def _checksum_ok(manifest: Manifest, layer: int, expert: int, data) -> bool:
    info = manifest.layers[layer]
    return xxhash.xxh3_64_intdigest(data[:info.expert_bytes]) == info.checksums[expert]


def leased_worker(blob_dir: str, iterations: int, seed: int) -> dict:
    """Demand random groups of 2-4 experts; every copied row must pass the seqlock and checksum."""
    rng = random.Random(seed)
    with RawClient(blob_dir) as client:
        m = client.manifest
        verified, errors = 0, []
        for _ in range(iterations):
            layer = rng.randrange(len(m.layers))
            experts = rng.sample(range(m.layers[layer].num_experts), rng.randint(2, 4))
            reply = client.demand(layer, experts)
            copies = [bytes(client.arena.row(row)) for row in reply["rows"]]
            if not validate(client.raw, client.slots_offset, reply["rows"], reply["versions"]):
                errors.append(f"leased rows {reply['rows']} changed during the copy")
            for e, data in zip(experts, copies):
                if _checksum_ok(m, layer, e, data):
                    verified += 1
                else:
                    errors.append(f"layer {layer} expert {e}: wrong bytes in a leased row")
            client.release(reply["lease"])
        return {"iterations": iterations, "verified": verified, "errors": errors[:20]}


def lockfree_worker(blob_dir: str, stop_file: str, seed: int, max_seconds: float) -> dict:
    """Read rows without the daemon (remap, copy, validate) until ``stop_file`` appears.

    A copy whose seqlock check fails is discarded; every accepted copy must hold the right bytes.
    """
    rng = random.Random(seed)
    m = Manifest.load(Path(blob_dir))
    arena = Arena.attach(daemon_paths(blob_dir).shm_name)
    g = arena.geometry
    raw = arena.raw
    accepted = discarded = lookups = 0
    errors = []
    deadline = time.monotonic() + max_seconds
    stride = g.stride
    while True:
        if lookups % 64 == 0 and (os.path.exists(stop_file) or time.monotonic() > deadline):
            break
        lookups += 1
        layer = rng.randrange(len(m.layers))
        experts = np.array(sorted(rng.sample(range(m.layers[layer].num_experts), 4)), np.int32)
        slots = np.empty(4, np.int32)
        versions = np.empty(4, np.uint64)
        filling = np.empty(4, np.int32)
        native.remap(raw, g.slot_of_offset, g.slots_offset, g.n_experts, layer, experts, slots,
                     versions, filling)
        found = slots >= 0
        if not found.any():
            continue
        rows, vers, keys = slots[found], versions[found], experts[found]
        dest = np.empty((len(rows), stride), np.uint8)
        whole_row = np.array([0], np.intp), np.array([stride], np.intp), np.array([0], np.intp)
        native.copy_segments(raw, g.rows_offset, stride, np.ascontiguousarray(rows), *whole_row,
                             dest.reshape(-1))
        if not native.validate(raw, g.slots_offset, np.ascontiguousarray(rows),
                               np.ascontiguousarray(vers)):
            discarded += len(rows)
            continue
        for e, data in zip(keys, dest):
            if _checksum_ok(m, layer, int(e), data.tobytes()):
                accepted += 1
            else:
                errors.append(f"layer {layer} expert {int(e)}: accepted a row with wrong bytes")
    raw = None
    arena.close()
    return {"accepted": accepted, "discarded": discarded, "lookups": lookups,
            "errors": errors[:20]}


def hold_worker(blob_dir: str, layer: int, experts: str, wait_reply: bool) -> None:
    """Demand ``experts`` of ``layer``, print READY, then heartbeat forever (until killed).

    With ``wait_reply`` false the demand is sent and never read: the process is killed with the
    request still in the daemon (queued or leased).
    """
    with RawClient(blob_dir) as client:
        body = {"layer": layer, "experts": [int(e) for e in experts.split(",")]}
        if wait_reply:
            lease = client.request(Op.DEMAND, body, timeout=20.0)["lease"]
        else:
            client.conn.send(Op.DEMAND, body)
            lease = None
        print(json.dumps({"ready": True, "lease": lease}), flush=True)
        interval = client.hello["heartbeat_interval"]
        while True:
            client.heartbeat()
            time.sleep(interval)  # the heartbeat period the daemon asked for


def read_json_line(proc: subprocess.Popen, timeout: float) -> dict:
    """The next line a client process prints, parsed; fails after ``timeout`` s."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"client pid {proc.pid} printed nothing within {timeout:g} s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"client pid {proc.pid} exited ({proc.wait()}): {proc.stderr.read()}")
    return json.loads(line)


def spawn_client(*args) -> subprocess.Popen:
    """This module as a client process; see ``main``."""
    return subprocess.Popen([sys.executable, str(HELPER), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def main(argv: list) -> int:
    mode, blob_dir, *rest = argv
    if mode == "leased":
        result = leased_worker(blob_dir, int(rest[0]), int(rest[1]))
    elif mode == "lockfree":
        result = lockfree_worker(blob_dir, rest[0], int(rest[1]), float(rest[2]))
    elif mode == "hold":
        hold_worker(blob_dir, int(rest[0]), rest[1], rest[2] == "wait")
        return 0
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(result), flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
