"""A client's requests to one daemon: the socket, request ids, demands and their leases.

No lease outlives its use, whatever interrupts the client: every lease the daemon grants is
recorded the moment its reply is read (with SIGINT held back for those few steps) and released
in a ``finally``; a demand whose waiter was interrupted keeps its request id, and its late reply
is released by whichever thread reads it next (the heartbeat thread when the client is idle).
"""

import threading
import time

import numpy as np

from expertd.client.interrupts import HeldInterrupts
from expertd.errors import DaemonError, ProtocolError
from expertd.protocol import ErrorCode, Op, request
from expertd.wire import DaemonUnreachable

POLL_SLICE = 0.05  # how often a wait looks at the daemon's liveness and a held-back SIGINT
REQUEST_TIMEOUT = 300.0  # a daemon that heartbeats but never answers one request


class DaemonDied(DaemonError):
    """The daemon this client was attached to is gone."""


class Requester:
    """Requests over one connection (``conn``) to the daemon of ``pid``.

    The socket is used by the calling thread, and by the heartbeat thread only while no request
    is in progress (to release late leases); ``lock`` hands it over between them.

    Args:
        conn: the :class:`~expertd.connection.Connection` its hello went through.
        pid: the daemon's pid (for messages).
        blob_dir: the directory it serves (for messages).
        alive: callable, True while the daemon that said hello still serves.
        counters: the session's counters (``demanded``, ``misses``, ``prefetch_saved``,
            ``late_leases``, ``prefetch_asked``).
    """

    def __init__(self, conn, blob_dir, alive, counters: dict):
        self.conn, self.blob_dir = conn, blob_dir
        self.pid = None  # the daemon's, once its hello answered (see hello())
        self.alive = alive
        self.counters = counters
        self.heartbeat = None  # set once the heartbeat thread runs (it needs reap())
        self.lock = threading.RLock()
        self.demands: set = set()  # ids of demands sent whose reply has not been read
        self.leases: set = set()  # leases granted and not yet released

    # ---- requests ------------------------------------------------------------------------

    def hello(self, body: dict, timeout: float) -> dict:
        """Say hello (the first request on the socket, and again to tell the daemon new pool
        bytes); the daemon's pid is known from its reply on."""
        reply = self.ask(Op.HELLO, body, timeout=timeout)
        self.pid = reply["pid"]
        return reply

    def ask(self, op: Op, body: dict, held: HeldInterrupts | None = None,
            timeout: float = REQUEST_TIMEOUT) -> dict:
        """One request; DaemonDied if the daemon is gone, DaemonError if it answers with an
        error or not within ``timeout`` s.

        SIGINT is held back (by ``held``, or here) except while waiting, where one that came is
        delivered every POLL_SLICE. A demand's lease is in ``leases`` when this returns.
        """
        if held is None:
            with HeldInterrupts() as held:
                return self.ask(op, body, held, timeout)
        with self.lock:
            rid = self.conn.next_rid()
            if op is Op.DEMAND:
                self.demands.add(rid)  # before the send: its reply is never unaccounted for
            try:
                self.conn.send_frames(request(rid, op, body))
                return self._wait(rid, held, timeout)
            except DaemonUnreachable as exc:
                raise self._died(exc) from None
            except BaseException:
                if self.demands and self.heartbeat is not None:
                    self.heartbeat.wake()  # to release the late lease as soon as it comes
                raise

    def demand(self, layer: int, experts: np.ndarray, held: HeldInterrupts) -> tuple:
        """One round trip for a group: the daemon leases what is resident (so filling the rest
        cannot evict it under us) and fills the rest in parallel. The lease is in ``leases`` on
        return.

        Returns:
            ``(slots, versions)`` of the leased rows, one per expert.
        """
        reply = self.ask(Op.DEMAND, {"layer": layer, "experts": experts.tolist()}, held)
        self.counters["demanded"] += len(experts)
        self.counters["misses"] += reply.get("misses", 0)
        self.counters["prefetch_saved"] += reply.get("saved", 0)
        return (np.asarray(reply["rows"], dtype=np.int32),
                np.asarray(reply["versions"], dtype=np.uint64))

    def prefetch(self, layer: int, experts: np.ndarray, core: int, claim: np.ndarray) -> None:
        """Ask the daemon to read ``experts`` (best first; the first ``core`` are the next
        router's likely top-k) into side rows, and to keep those of ``claim`` there. Skipped
        while the heartbeat thread has the socket; never waits."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            body = {"layer": layer, "experts": experts.tolist(), "core": core}
            if len(claim):
                body["claim"] = claim.tolist()
            self.send_quietly(Op.PREFETCH, body)
            self.counters["prefetch_asked"] += len(experts)
        finally:
            self.lock.release()

    def send_quietly(self, op: Op, body: dict) -> None:
        """Fire and forget (release, prefetch); never blocks on a daemon that is gone or
        flooded: its leases die with it or with our heartbeat."""
        self.conn.send_quietly(op, body)

    def release_leases(self) -> None:
        with self.lock:
            while self.leases:
                lease = next(iter(self.leases))
                # Sent before it is forgotten: an interrupt in between means one more release
                # (which the daemon ignores), never one less.
                self.send_quietly(Op.RELEASE, {"lease": lease})
                self.leases.discard(lease)

    def release_all(self) -> None:
        """Release what is leased, a second SIGINT held back too; should one fall just before,
        the heartbeat thread releases what is left."""
        if not self.leases:
            return
        try:
            with HeldInterrupts():
                self.release_leases()
        finally:
            if self.leases and self.heartbeat is not None:
                self.heartbeat.wake()

    def reap(self) -> bool:
        """Heartbeat thread: while no request or read runs, release the leases of late replies
        to interrupted demands (and any lease an interrupted release left behind).

        Returns True while something is left to release.
        """
        pending = self.demands or self.leases
        if not pending or not self.lock.acquire(blocking=False):
            return bool(pending)
        try:
            while self.conn.poll(0):
                self._read_reply(None)
            self.release_leases()
            return bool(self.demands)
        except (DaemonError, ProtocolError):  # the connection is lost: so are its leases
            return False
        finally:
            self.lock.release()

    def forget(self) -> None:
        """Leases and demands belong to the daemon they were made with."""
        self.demands.clear()
        self.leases.clear()

    # ---- internals -----------------------------------------------------------------------

    def _read_reply(self, rid: bytes | None):
        """Read one waiting reply; the body if it answers ``rid``, else None.

        Replies to interrupted demands have their lease released here. Call with the lock held
        and, in the main thread, SIGINT held back.
        """
        got, _, body = self.conn.recv()
        if got in self.demands:
            self.demands.discard(got)
            if body.get("ok") and "lease" in body:
                if got == rid:
                    self.leases.add(body["lease"])
                else:
                    self.counters["late_leases"] += 1
                    self.send_quietly(Op.RELEASE, {"lease": body["lease"]})
        return body if got == rid else None

    @property
    def _daemon(self) -> str:
        return f"expertd (pid {self.pid})" if self.pid is not None else "expertd"

    def _wait(self, rid: bytes, held: HeldInterrupts, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        conn = self.conn
        while True:
            if held.pending:
                held.deliver()  # KeyboardInterrupt: the demand, if any, stays recorded
            if conn.poll(POLL_SLICE):
                while conn.poll(0):
                    body = self._read_reply(rid)
                    if body is not None:
                        return self._checked(body)
                continue
            if not self.alive():
                raise DaemonDied(f"{self._daemon} serving {self.blob_dir} died")
            if self.heartbeat is not None and self.heartbeat.stuck:
                # As a daemon gone: the session waits (up to its reconnect timeout) for one to
                # answer again, this one resumed (a SIGSTOP, a stall) or a new one. Raised as
                # an error, it killed serve's generation thread for good.
                raise DaemonDied(f"{self._daemon} serving {self.blob_dir} has answered no "
                                 f"heartbeat for {self.heartbeat.time_to_dead:g} s")
            if time.monotonic() > deadline:
                raise DaemonError(f"{self._daemon} serving {self.blob_dir} holds its lock but "
                                  f"has not answered for {timeout:g} s (stopped, or stuck?); "
                                  f"restart it with: expertd restart --blobs {self.blob_dir}")

    def _died(self, lost: DaemonUnreachable) -> DaemonDied:
        if not self.alive():
            return DaemonDied(f"{self._daemon} serving {self.blob_dir} died")
        return DaemonDied(f"{self._daemon} serving {self.blob_dir} is alive but "
                          f"unreachable ({lost})")

    def _checked(self, body: dict) -> dict:
        if body.get("ok"):
            return body
        code = body.get("code")
        if code == ErrorCode.SHUTTING_DOWN:
            raise DaemonDied(f"{self._daemon} is shutting down")
        if code == ErrorCode.NOT_HELLO:
            # The daemon timed this client out (it was stopped, or its heartbeat starved):
            # attach again.
            raise DaemonDied(f"expertd serving {self.blob_dir} no longer knows this client "
                             "(restarted?)")
        raise DaemonError(str(body.get("error", "unknown error")), code)
