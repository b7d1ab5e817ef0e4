"""A client's requests to one daemon: the socket, request ids, demands and their leases.

No lease outlives its use, whatever interrupts the client: every lease the daemon grants is
recorded the moment its reply is read (with SIGINT held back for those few steps) and released
in a ``finally``; a demand whose waiter was interrupted keeps its request id, and its late reply
is released by whichever thread reads it next (the heartbeat thread when the client is idle).
"""

import threading

import numpy as np

from expertd.client.interrupts import HeldInterrupts
from expertd.errors import DaemonDied, DaemonError, NoReply, ProtocolError
from expertd.protocol import Op, request
from expertd.wire import DaemonUnreachable

REQUEST_TIMEOUT = 300.0  # a daemon that heartbeats but never answers one request

__all__ = ["DaemonDied", "Requester"]


class Requester:
    """Requests over one connection (``conn``), every one waited for by ``conn.wait``.

    The socket is used by the calling thread, and by the heartbeat thread only while no request
    is in progress (to release late leases: :meth:`reap`); ``lock`` hands it over between them.

    Args:
        conn: the :class:`~expertd.connection.Connection` its hello goes through.
        blob_dir: the directory the daemon serves (for messages).
        alive: callable, True while the daemon that said hello still serves.
        silent: callable, the seconds the daemon has answered no heartbeat for once that is
            past its time-to-dead, else None.
        counters: the session's counters (``demanded``, ``misses``, ``prefetch_saved``,
            ``late_leases``, ``prefetch_asked``).
    """

    def __init__(self, conn, blob_dir, alive, silent, counters: dict):
        self.conn, self.blob_dir = conn, blob_dir
        self.alive, self.silent = alive, silent
        self.counters = counters
        # Set when something is left to release: the thread that runs reap() (the heartbeat's)
        # waits on it, so that a late lease goes back as soon as it comes.
        self.reap_soon = threading.Event()
        self.lock = threading.RLock()
        # Ids of demands sent whose reply has not been read: None for :meth:`ask`'s, the
        # experts asked for :meth:`demand_all`'s (counted and released whenever read).
        self.demands: dict = {}
        self.leases: set = set()  # leases granted and not yet released
        self.most_at_once = 0  # the most demands sent and awaiting their replies together

    # ---- requests ------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The daemon's, once its hello answered."""
        return self.conn.daemon_pid

    def hello(self, body: dict, timeout: float) -> dict:
        """Say hello (the first request on the socket, and again to tell the daemon new pool
        bytes); the connection knows the daemon's pid from its reply on."""
        return self.ask(Op.HELLO, body, timeout=timeout)

    def ask(self, op: Op, body: dict, held: HeldInterrupts | None = None,
            timeout: float = REQUEST_TIMEOUT) -> dict:
        """One request; DaemonDied if the daemon is gone, DaemonError if it answers with an
        error or not within ``timeout`` s.

        SIGINT is held back (by ``held``, or here) except while waiting, where one that came is
        delivered every connection.POLL_SLICE. A demand's lease is in ``leases`` when this returns.
        """
        if held is None:
            with HeldInterrupts() as held:
                return self.ask(op, body, held, timeout)
        with self.lock:
            rid = self.conn.next_rid()
            return self._exchange({rid: (op, body)}, held, timeout,
                                  lambda got, reply: self._read_reply(got, reply, rid))[rid]

    def demand(self, layer: int, experts: np.ndarray, held: HeldInterrupts) -> tuple:
        """One round trip for a group: the daemon leases what is resident (so filling the rest
        cannot evict it under us) and fills the rest in parallel. The lease is in ``leases`` on
        return.

        Returns:
            ``(slots, versions)`` of the leased rows, one per expert.
        """
        reply = self.ask(Op.DEMAND, {"layer": layer, "experts": experts.tolist()}, held)
        self._count_demand(len(experts), reply)
        return (np.asarray(reply["rows"], dtype=np.int32),
                np.asarray(reply["versions"], dtype=np.uint64))

    def demand_all(self, groups: list, held: HeldInterrupts) -> None:
        """Have the daemon read the rows of ``groups`` (``(layer, experts)`` each, every one
        within the daemon's demand limit) into its arena: the demands go out together and
        their replies are read as they come, so the daemon's pread pool reads every group's
        rows at once, not one layer's few rows a round trip. Each lease is released as its
        reply is read: none is kept, so a small arena never waits on leases of our own
        (what was read is found through the slot table, under a step's epoch)."""
        with self.lock:
            asked = {self.conn.next_rid(): (Op.DEMAND, {"layer": layer,
                                                        "experts": experts.tolist()})
                     for layer, experts in groups}
            # Read now or late (after another's error ended the wait), each reply is booked
            # as a demand and its lease released.
            self._exchange(asked, held, REQUEST_TIMEOUT,
                           lambda got, reply: self._read_reply(got, reply, None), wave=True)

    def _count_demand(self, experts: int, reply: dict) -> None:
        self.counters["demanded"] += experts
        self.counters["misses"] += reply.get("misses", 0)
        self.counters["prefetch_saved"] += reply.get("saved", 0)

    def _exchange(self, asked: dict, held: HeldInterrupts, timeout: float, on_reply,
                  wave: bool = False) -> dict:
        """Send ``asked`` (``{request id: (op, body)}``) and wait for every reply (the lock
        held): their bodies by request id; ``on_reply`` books each reply read. A demand is
        recorded before it is sent, so its reply is never unaccounted for; one whose wait ends
        early (an interrupt, an error) is released when its late reply comes; with ``wave``
        (:meth:`demand_all`) every demand's reply is counted and released whenever read."""
        try:
            for rid, (op, body) in asked.items():
                if op is Op.DEMAND:
                    # Before the send: its reply is never unaccounted for.
                    self.demands[rid] = len(body["experts"]) if wave else None
                self.conn.send_frames(request(rid, op, body))
            self.most_at_once = max(self.most_at_once, len(self.demands))
            if held.pending:
                held.deliver()  # KeyboardInterrupt: the demands, if any, stay recorded
            return self.conn.wait_all(asked, timeout, lambda: self._idle(held), on_reply)
        except DaemonUnreachable as exc:
            raise self._died(exc) from None
        except NoReply:
            raise DaemonError(f"{self._daemon} serving {self.blob_dir} holds its lock but "
                              f"has not answered for {timeout:g} s (stopped, or stuck?); "
                              f"restart it with: expertd restart --blobs {self.blob_dir}"
                              ) from None
        except BaseException:
            if self.demands:
                self.reap_soon.set()  # to release the late lease as soon as it comes
            raise

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
            if self.leases:
                self.reap_soon.set()

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
                got, _, body = self.conn.recv()
                self._read_reply(got, body, None)
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

    def _read_reply(self, got: bytes, body: dict, rid: bytes | None) -> None:
        """Book a reply read (``got``'s ``body``) while waiting for ``rid``: the lease of a
        demand's reply is recorded when it answers ``rid``, else (a late reply to an
        interrupted demand) released; a reply to :meth:`demand_all`, now or late, is counted as
        a demand and its lease released. Call with the lock held and, in the main thread,
        SIGINT held back.
        """
        if got in self.demands:
            experts = self.demands[got]
            if experts is not None:
                if body.get("ok"):
                    self._count_demand(experts, body)
                    if "lease" in body:
                        self.send_quietly(Op.RELEASE, {"lease": body["lease"]})
                del self.demands[got]  # after the counts: none pending means all counted
                return
            del self.demands[got]
            if body.get("ok") and "lease" in body:
                if got == rid:
                    self.leases.add(body["lease"])
                else:
                    self.counters["late_leases"] += 1
                    self.send_quietly(Op.RELEASE, {"lease": body["lease"]})

    @property
    def _daemon(self) -> str:
        return self.conn.daemon

    def _idle(self, held: HeldInterrupts) -> None:
        """Between a wait's slices: deliver a held-back SIGINT, and end the wait on a daemon
        gone or silent."""
        if held.pending:
            held.deliver()  # KeyboardInterrupt: the demand, if any, stays recorded
        if not self.alive():
            raise DaemonDied(f"{self._daemon} serving {self.blob_dir} died")
        silent = self.silent()
        if silent is not None:
            # As a daemon gone: the session waits (up to its reconnect timeout) for one to
            # answer again, this one resumed (a SIGSTOP, a stall) or a new one. Raised as
            # an error, it killed serve's generation thread for good.
            raise DaemonDied(f"{self._daemon} serving {self.blob_dir} has answered no "
                             f"heartbeat for {silent:g} s")

    def _died(self, lost: DaemonUnreachable) -> DaemonDied:
        if not self.alive():
            return DaemonDied(f"{self._daemon} serving {self.blob_dir} died")
        return DaemonDied(f"{self._daemon} serving {self.blob_dir} is alive but "
                          f"unreachable ({lost})")
