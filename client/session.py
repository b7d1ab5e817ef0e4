"""A client's attachment to the daemon: socket, mapped arena, heartbeat, reconnection.

``fetch(layer, experts)`` is the per-layer hot path: a lock-free remap through the shared slot
table, one demand for whatever is missing, a drain of rows other clients are filling, a copy of
each segment into a staging buffer (GIL released, seqlock-checked), then MLX arrays.
"""

import logging
import os
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import zmq

from expertd import native
from expertd.connection import Connection
from expertd.errors import DaemonError, DaemonNotRunning
from expertd.manifest import Manifest
from expertd.paths import daemon_paths
from expertd.protocol import PROTOCOL_VERSION, ErrorCode, Op
from expertd.shm.layout import Arena

log = logging.getLogger("expertd.client")

MLX_DTYPES = {
    "BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32, "U32": mx.uint32, "U8": mx.uint8,
    "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16, "I32": mx.int32, "U64": mx.uint64,
    "I64": mx.int64, "BOOL": mx.bool_,
}
NP_STAGING = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
DRAIN_TIMEOUT = 5.0
POLL_SLICE = 0.2
REQUEST_TIMEOUT = 300.0  # a live daemon that does not answer for this long is stuck


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    return True


class DaemonDied(DaemonError):
    """The daemon this client was attached to is gone."""


class Session:
    """One client's connection to the expertd serving ``blob_dir``.

    Args:
        blob_dir: the blob directory; the daemon is found from it.
        reconnect_timeout: how long to wait for a restarted daemon after the old one died.
        max_group: most experts fetched at once (bounds the client's own expert memory).
    Raises:
        DaemonNotRunning: no daemon serves the directory (the message says how to start one).
        DaemonError: the daemon serves another blob directory or speaks another protocol.
    """

    def __init__(self, blob_dir, reconnect_timeout: float = 60.0, max_group: int | None = None):
        self.paths = daemon_paths(blob_dir)
        self.manifest = Manifest.load(self.paths.blob_dir)
        self.reconnect_timeout = reconnect_timeout
        self.requested_group = max_group or max(64, 4 * self.manifest.top_k)
        self.counters = dict(fast_hits=0, demanded=0, drained=0, retries=0, reconnects=0)
        self.conn = self.arena = self._heartbeat = None
        self.max_group = None
        self._bases: dict = {}
        self._segment_tables = [
            (np.array([seg.offset for seg in layer.segments], dtype=np.intp),
             np.array([seg.nbytes for seg in layer.segments], dtype=np.intp))
            for layer in self.manifest.layers]
        self._attach()

    # ---- attachment ------------------------------------------------------------------------

    def _attach(self) -> None:
        self._check_not_dead()
        conn = Connection(self.paths.blob_dir)
        try:
            hello = conn.request(Op.HELLO, {"version": PROTOCOL_VERSION, "client": conn.client_id,
                                            "pid": os.getpid()}, timeout=10.0)
        except DaemonError:
            conn.close()
            raise
        if hello["blob_dir"] != str(self.paths.blob_dir):
            conn.close()
            raise DaemonError(f"the daemon serves {hello['blob_dir']}, not {self.paths.blob_dir}")
        if hello["manifest"] != self.manifest.digest:
            conn.close()
            raise DaemonError(f"the daemon serves another version of {self.paths.blob_dir} "
                              "(converted again since it started?); restart it with: expertd stop "
                              f"--blobs {self.paths.blob_dir} && expertd start --blobs "
                              f"{self.paths.blob_dir}")
        arena = Arena.attach(hello["arena"])
        if arena.epoch != hello["epoch"]:
            arena.close()
            conn.close()
            raise DaemonError("the daemon's arena changed during attach; try again")
        self.conn, self.arena, self.hello = conn, arena, hello
        self.daemon_pid = hello["pid"]
        self.raw = arena.raw
        g = arena.geometry
        self._slot_of_offset, self._slots_offset = g.slot_of_offset, g.slots_offset
        self._rows_offset, self._stride, self._n_experts = g.rows_offset, g.stride, g.n_experts
        # Fixed at the first attach: the staging buffers are sized for it. A daemon restarted
        # with a smaller cache is served in chunks of what it leases at once.
        if self.max_group is None:
            # No layer needs more rows at once than it has experts.
            self.max_group = min(hello["max_demand"], self.requested_group,
                                 self.manifest.max_experts)
        self.demand_limit = hello["max_demand"]
        self._heartbeat = Heartbeat(self.paths.endpoint, conn.client_id,
                                    hello["heartbeat_interval"], self.daemon_pid)

    def _check_not_dead(self) -> None:
        """A daemon killed with SIGKILL leaves its socket and pid file: do not wait on them."""
        try:
            pid = int(self.paths.pidfile.read_text())
        except (OSError, ValueError):
            return  # no pid file: the connection decides
        if not process_alive(pid):
            blob = self.paths.blob_dir
            raise DaemonNotRunning(f"no expertd serves {blob}: the one that did (pid {pid}) is "
                                   f"gone (start one with: expertd start --blobs {blob})")

    def _detach(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.conn is not None:
            self.conn.close()
        # The old mapping stays valid until nothing references it; numpy views may outlive us.
        self.conn = self.arena = self._heartbeat = None

    def close(self) -> None:
        self._detach()

    def _reconnect(self, why: str) -> None:
        blob = self.paths.blob_dir
        print(f"expertd: {why}; waiting up to {self.reconnect_timeout:g} s for it to come back "
              f"(expertd start --blobs {blob})", file=sys.stderr, flush=True)
        self._detach()
        deadline = time.monotonic() + self.reconnect_timeout
        while True:
            try:
                self._attach()
                self.counters["reconnects"] += 1
                print(f"expertd: re-attached to the daemon serving {blob} (pid {self.daemon_pid})",
                      file=sys.stderr, flush=True)
                return
            except (DaemonNotRunning, DaemonError, OSError, ValueError) as exc:
                if time.monotonic() > deadline:
                    raise DaemonNotRunning(f"expertd serving {blob} is gone and did not come back "
                                           f"within {self.reconnect_timeout:g} s ({exc}); start "
                                           f"it with: expertd start --blobs {blob}") from None
                time.sleep(0.1)

    def _daemon_alive(self) -> bool:
        return process_alive(self.daemon_pid) and bool(self.arena.header["serving"][0])

    # ---- requests --------------------------------------------------------------------------

    def request(self, op: Op, body: dict) -> dict:
        """A request that survives a daemon restart: re-attaches and retries once it is back."""
        while True:
            try:
                return self._ask(op, body)
            except DaemonDied as exc:
                self._reconnect(str(exc))

    def _ask(self, op: Op, body: dict) -> dict:
        """One request to the daemon attached now; DaemonDied if it is gone."""
        return self._wait(self.conn.send(op, body))

    def _wait(self, rid: bytes) -> dict:
        deadline = time.monotonic() + REQUEST_TIMEOUT
        while True:
            try:
                return self.conn.wait(rid, POLL_SLICE)
            except DaemonError as exc:
                if exc.code == ErrorCode.SHUTTING_DOWN:
                    raise DaemonDied(f"expertd (pid {self.daemon_pid}) is shutting down") from None
                if exc.code == ErrorCode.NOT_HELLO:
                    # A daemon restarted before we noticed got this request on the old socket
                    # path (or ours timed out our heartbeat): attach again.
                    raise DaemonDied(f"expertd serving {self.paths.blob_dir} no longer knows "
                                     f"this client (restarted?)") from None
                if exc.code is not None:
                    raise
            if not self._daemon_alive():
                raise DaemonDied(f"expertd (pid {self.daemon_pid}) serving "
                                 f"{self.paths.blob_dir} died")
            if time.monotonic() > deadline:
                raise DaemonError(f"expertd (pid {self.daemon_pid}) is alive but has not "
                                  f"answered for {REQUEST_TIMEOUT:g} s")

    # ---- the hot path ----------------------------------------------------------------------

    def fetch(self, layer: int, experts: np.ndarray, dest: np.ndarray) -> np.ndarray:
        """Copy the rows of ``experts`` (distinct int32) of ``layer`` into ``dest``.

        ``dest`` is a uint8 array of at least :meth:`staging_bytes` bytes. Segment ``s`` of
        expert ``i`` lands at ``bases[s] + i * nbytes[s]``; returns ``bases``.
        """
        offsets, nbytes = self._segment_tables[layer]
        bases = self.bases(layer, len(experts))
        if self._heartbeat.lost:
            # The daemon died while every expert was a hit: leave its arena now, or this process
            # would keep a dead daemon's whole cache mapped.
            self._reconnect(f"expertd (pid {self.daemon_pid}) serving {self.paths.blob_dir} died")
        while True:
            try:
                # A daemon restarted with a smaller cache may lease fewer rows at once.
                limit = self.demand_limit
                if len(experts) <= limit:
                    self._fetch_chunk(layer, experts, dest, bases, offsets, nbytes)
                    return bases
                for start in range(0, len(experts), limit):
                    self._fetch_chunk(layer, experts[start:start + limit], dest,
                                      bases + start * nbytes, offsets, nbytes)
                return bases
            except DaemonDied as exc:
                self._reconnect(str(exc))

    def bases(self, layer: int, n: int) -> np.ndarray:
        """Where each segment of ``n`` experts starts in a destination (64-byte aligned)."""
        bases = self._bases.get((layer, n))
        if bases is None:
            sizes = (n * self._segment_tables[layer][1] + 63) // 64 * 64
            bases = np.zeros_like(sizes)
            np.cumsum(sizes[:-1], out=bases[1:])
            self._bases[(layer, n)] = bases
        return bases

    def _fetch_chunk(self, layer, experts, dest, bases, offsets, nbytes) -> None:
        n = len(experts)
        slots = np.empty(n, np.int32)
        versions = np.empty(n, np.uint64)
        filling = np.empty(n, np.int32)
        raw = self.raw
        missing = native.remap(raw, self._slot_of_offset, self._slots_offset, self._n_experts,
                               layer, experts, slots, versions, filling)
        if missing and (filling >= 0).any():
            self._drain(layer, experts, slots, versions, filling)
        lease = self._demand(layer, experts, slots, versions) if (slots < 0).any() else None
        while True:
            native.copy_segments(raw, self._rows_offset, self._stride, slots, offsets, nbytes,
                                 bases, dest)
            if native.validate(raw, self._slots_offset, slots, versions):
                break
            # A row changed while we copied: found without a lease and evicted, or our lease
            # lapsed (this process was silent past the client timeout). Lease them again.
            self.counters["retries"] += 1
            if lease is not None:
                self.conn.send(Op.RELEASE, {"lease": lease})
            lease = self._demand(layer, experts, slots, versions)
        if lease is None:
            # Rows found without the daemon are counted through the table for its LFU.
            native.bump_hits(raw, self._slots_offset, slots)
            self.counters["fast_hits"] += n
        else:
            self.conn.send(Op.RELEASE, {"lease": lease})

    def _demand(self, layer, experts, slots, versions) -> int:
        """One round trip for the whole group: the daemon leases what is resident (so filling
        the rest cannot evict it under us) and fills the rest in parallel."""
        # Not self.request: rows named by a restarted daemon belong to its new arena, so a
        # restart must unwind to fetch(), which starts over on the new arena.
        reply = self._ask(Op.DEMAND, {"layer": layer, "experts": experts.tolist()})
        slots[:] = reply["rows"]
        versions[:] = reply["versions"]
        self.counters["demanded"] += len(experts)
        return reply["lease"]

    def _drain(self, layer, experts, slots, versions, filling) -> None:
        idx = np.flatnonzero(filling >= 0)
        out_slots = np.empty(len(idx), np.int32)
        out_versions = np.empty(len(idx), np.uint64)
        native.drain(self.raw, self._slots_offset, layer, np.ascontiguousarray(experts[idx]),
                     np.ascontiguousarray(filling[idx]), out_slots, out_versions, DRAIN_TIMEOUT)
        ok = out_slots >= 0
        slots[idx[ok]] = out_slots[ok]
        versions[idx[ok]] = out_versions[ok]
        self.counters["drained"] += int(ok.sum())

    def staging_bytes(self) -> int:
        """Bytes a destination needs for ``max_group`` experts of any layer."""
        return max(self.max_group * layer.expert_bytes + 64 * len(layer.segments)
                   for layer in self.manifest.layers)

    def stats(self) -> dict:
        return self.request(Op.STATS, {})


class Heartbeat:
    """A thread with its own socket that tells the daemon this client is alive, and notices
    when the daemon is gone (``lost``), so that a client living on hits alone learns it too."""

    def __init__(self, endpoint: str, client_id: bytes, interval: float, daemon_pid: int):
        self.lost = False
        self._pid = daemon_pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(endpoint, client_id, interval),
                                        name="expertd-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, endpoint: str, client_id: bytes, interval: float) -> None:
        from expertd.protocol import request

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        n = 0
        try:
            while not self._stop.wait(interval):
                if not process_alive(self._pid):
                    self.lost = True
                    return
                n += 1
                sock.send_multipart(request(n.to_bytes(8, "little"), Op.HEARTBEAT,
                                            {"client": client_id}))
                while sock.poll(0):
                    sock.recv_multipart()
        finally:
            sock.close(linger=0)
            ctx.term()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
