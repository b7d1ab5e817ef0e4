"""A client's attachment to the daemon: socket, mapped arena, heartbeat, reconnection.

The per-layer hot path (``fetch``, ``prestage``) is in rows.py; ``switch.py`` views the rows it
copies as MLX arrays.

No lease outlives its use, whatever interrupts the client: every lease the daemon grants is
recorded the moment its reply is read (with SIGINT held back for those few steps) and released
in a ``finally``; a demand whose waiter was interrupted keeps its request id, and its late reply
is released by whichever thread reads it next (the heartbeat thread when the client is idle).
"""

import logging
import os
import sys
import threading
import time

import numpy as np
import zmq

from expertd.client.heartbeat import Heartbeat
from expertd.client.rows import COPY_AHEAD_MIN_BYTES, DaemonDied, RowReader
from expertd.client.interrupts import HeldInterrupts
from expertd.config import GUESS_WIDTH
from expertd.connection import Connection
from expertd.errors import DaemonError, DaemonNotRunning, ProtocolError
from expertd.manifest import Manifest
from expertd.paths import daemon_paths
from expertd.protocol import PROTOCOL_VERSION, ErrorCode, Op, parse_reply, request
from expertd.runfile import serving_epoch
from expertd.shm.layout import Arena

log = logging.getLogger("expertd.client")

POLL_SLICE = 0.05  # how often a wait looks at the daemon's liveness and a held-back SIGINT
REQUEST_TIMEOUT = 300.0  # a daemon that heartbeats but never answers one request
GOODBYE_LINGER_MS = 200  # how long close() lets the goodbye reach the daemon


class Session(RowReader):
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
        self.counters = dict(fast_hits=0, demanded=0, drained=0, retries=0, reconnects=0,
                             late_leases=0, prefetch_asked=0, staged_used=0, staged_unused=0,
                             misses=0, prefetch_saved=0)
        # Where the main thread's time goes after each router sync (see switch.py).
        # prestage_s: the main thread's time preparing the next layer's guess (after the rows
        # are in place, so outside exposed_s).
        self.timing = dict(sync_s=0.0, exposed_s=0.0, copy_s=0.0, fill_wait_s=0.0,
                           copier_wait_s=0.0, prestage_s=0.0, layers=0)
        self.guessers: list = []  # predict.Guesser per MoE layer (set by the loader)
        self.copier = None  # copier.Copier (set by the loader)
        self.copy_ahead_bytes = COPY_AHEAD_MIN_BYTES  # see rows.COPY_AHEAD_MIN_BYTES
        self.guess_width = GUESS_WIDTH  # see client.predict
        self.timeline = None  # a list to record (layer, t0, t_sync, t_fetched, t_done) per call
        self.conn = self.arena = self._heartbeat = None
        self.max_group = None
        self._bases: dict = {}
        self._segment_tables = [
            (np.array([seg.offset for seg in layer.segments], dtype=np.intp),
             np.array([seg.nbytes for seg in layer.segments], dtype=np.intp))
            for layer in self.manifest.layers]
        # The socket is used by the calling thread, and by the heartbeat thread only while no
        # request is in progress (to release late leases); the lock hands it over between them.
        self._socket_lock = threading.RLock()
        self._demands: set = set()  # ids of demands sent whose reply has not been read
        self._leases: set = set()  # leases granted and not yet released
        self._next_rid = 0
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
        self.daemon_pid, self.epoch = hello["pid"], hello["epoch"]
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
        interval = hello["heartbeat_interval"]
        # The daemon forgets a client silent for client_timeout; the client gives the daemon as
        # long (and at least three heartbeats) before calling it stuck.
        self._heartbeat = Heartbeat(self.paths.endpoint, conn.client_id, hello["token"], interval,
                                    max(hello["client_timeout"], 3 * interval),
                                    self._daemon_alive, self._reap)

    def _check_not_dead(self) -> None:
        """A daemon killed with SIGKILL leaves its socket and run files: do not wait on them."""
        if serving_epoch(self.paths) is None:
            blob = self.paths.blob_dir
            raise DaemonNotRunning(f"no expertd serves {blob} (its lock is free): start one "
                                   f"with: expertd start --blobs {blob}")

    def _detach(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.conn is not None:
            self.conn.close()
        # Leases and demands belong to the daemon they were made with.
        self._demands.clear()
        self._leases.clear()
        # The old mapping stays valid until nothing references it; numpy views may outlive us.
        self.conn = self.arena = self._heartbeat = None

    def close(self) -> None:
        """Say goodbye (the daemon drops this client's leases and pins at once) and detach."""
        if self.copier is not None:
            self.copier.close()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.conn is not None:
            self._send_quietly(Op.GOODBYE, {})
            self.conn.sock.close(linger=GOODBYE_LINGER_MS)  # bounded: the daemon may be gone
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
        """The daemon we said hello to still holds the directory's lock (a pid reused by
        another process, or a new daemon, does not count) and still serves."""
        return serving_epoch(self.paths) == self.epoch and bool(self.arena.header["serving"][0])

    # ---- requests --------------------------------------------------------------------------

    def request(self, op: Op, body: dict) -> dict:
        """A request that survives a daemon restart: re-attaches and retries once it is back."""
        while True:
            try:
                return self._ask(op, body)
            except DaemonDied as exc:
                self._reconnect(str(exc))

    def _ask(self, op: Op, body: dict, held: HeldInterrupts | None = None) -> dict:
        """One request to the daemon attached now; DaemonDied if it is gone.

        SIGINT is held back (by ``held``, or here) except while waiting, where one that came is
        delivered every POLL_SLICE. A demand's lease is in ``self._leases`` when this returns.
        """
        if held is None:
            with HeldInterrupts() as held:
                return self._ask(op, body, held)
        with self._socket_lock:
            rid = self._new_rid()
            if op is Op.DEMAND:
                self._demands.add(rid)  # before the send: its reply is never unaccounted for
            self.conn.sock.send_multipart(request(rid, op, body))
            try:
                return self._wait(rid, held)
            except BaseException:
                if self._demands:
                    self._heartbeat.wake()  # to release the late lease as soon as it comes
                raise

    def _new_rid(self) -> bytes:
        self._next_rid += 1
        return b"s" + self._next_rid.to_bytes(8, "little")

    def _send_quietly(self, op: Op, body: dict) -> None:
        """Fire and forget (release, goodbye); never blocks on a daemon that is gone."""
        try:
            self.conn.sock.send_multipart(request(self._new_rid(), op, body), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the daemon is gone or flooded; its leases die with it or with our heartbeat

    def _release_leases(self) -> None:
        with self._socket_lock:
            while self._leases:
                lease = next(iter(self._leases))
                # Sent before it is forgotten: an interrupt in between means one more release
                # (which the daemon ignores), never one less.
                self._send_quietly(Op.RELEASE, {"lease": lease})
                self._leases.discard(lease)

    def _read_reply(self, rid: bytes | None):
        """Read one waiting reply; the body if it answers ``rid``, else None.

        Replies to interrupted demands have their lease released here. Call with the socket
        lock held and, in the main thread, SIGINT held back.
        """
        got, _, body = parse_reply(self.conn.sock.recv_multipart(zmq.NOBLOCK))
        if got in self._demands:
            self._demands.discard(got)
            if body.get("ok") and "lease" in body:
                if got == rid:
                    self._leases.add(body["lease"])
                else:
                    self.counters["late_leases"] += 1
                    self._send_quietly(Op.RELEASE, {"lease": body["lease"]})
        return body if got == rid else None

    def _reap(self) -> bool:
        """Heartbeat thread: while no request or fetch runs, release the leases of late replies
        to interrupted demands (and any lease an interrupted release left behind).

        Returns True while something is left to release.
        """
        if not (self._demands or self._leases) or not self._socket_lock.acquire(blocking=False):
            return bool(self._demands or self._leases)
        try:
            while self.conn.sock.poll(0):
                self._read_reply(None)
            self._release_leases()
            return bool(self._demands)
        except (zmq.ZMQError, ProtocolError):
            return False
        finally:
            self._socket_lock.release()

    def _wait(self, rid: bytes, held: HeldInterrupts) -> dict:
        deadline = time.monotonic() + REQUEST_TIMEOUT
        sock = self.conn.sock
        while True:
            if held.pending:
                held.deliver()  # KeyboardInterrupt: the demand, if any, stays recorded
            if sock.poll(int(POLL_SLICE * 1000)):
                while sock.poll(0):
                    body = self._read_reply(rid)
                    if body is not None:
                        return self._checked(body)
                continue
            if not self._daemon_alive():
                raise DaemonDied(f"expertd (pid {self.daemon_pid}) serving "
                                 f"{self.paths.blob_dir} died")
            if self._heartbeat.stuck:
                raise DaemonError(f"expertd (pid {self.daemon_pid}) serving "
                                  f"{self.paths.blob_dir} has answered no heartbeat for "
                                  f"{self._heartbeat.time_to_dead:g} s; restart it with: "
                                  f"expertd restart --blobs {self.paths.blob_dir}")
            if time.monotonic() > deadline:
                raise DaemonError(f"expertd (pid {self.daemon_pid}) is alive but has not "
                                  f"answered for {REQUEST_TIMEOUT:g} s")

    def _checked(self, body: dict) -> dict:
        if body.get("ok"):
            return body
        code = body.get("code")
        if code == ErrorCode.SHUTTING_DOWN:
            raise DaemonDied(f"expertd (pid {self.daemon_pid}) is shutting down")
        if code == ErrorCode.NOT_HELLO:
            # A daemon restarted before we noticed got this request on the old socket path
            # (or ours timed out our heartbeat): attach again.
            raise DaemonDied(f"expertd serving {self.paths.blob_dir} no longer knows this "
                             "client (restarted?)")
        raise DaemonError(str(body.get("error", "unknown error")), code)

    def staging_bytes(self) -> int:
        """Bytes a destination needs for ``max_group`` experts of any layer."""
        return max(self.max_group * layer.expert_bytes + 64 * len(layer.segments)
                   for layer in self.manifest.layers)

    def prediction(self) -> list:
        """Per MoE layer, how the guesses made for it went (None for a layer nobody guesses)."""
        return [None] + [g.guesses.summary() if g is not None else None
                         for g in self.guessers[:-1]]

    def usage(self) -> dict:
        """This client's own use of the cache so far: experts it used, how many of them had to
        be read from the disk for it (its misses), and the bytes read for it (its misses and
        the prefetches it asked for)."""
        c = self.counters
        used = c["fast_hits"] + c["staged_used"] + c["demanded"]
        prefetched = self.stats().get("client_prefetch_reads", 0)
        return dict(used=used, misses=c["misses"], hits=used - c["misses"],
                    hit_rate=(used - c["misses"]) / used if used else 0.0,
                    prefetch_reads=prefetched,
                    bytes_read=(c["misses"] + prefetched) * self.manifest.stride)

    def stats(self) -> dict:
        return self.request(Op.STATS, {})
