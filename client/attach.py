"""A client's attachment to the daemon: hello, arena view, requester, heartbeat, puller, and
reconnection, written once (:meth:`Attachment._across_restarts`): a daemon that dies or restarts
is waited for and attached again, and the call starts over on the new arena.

The attachment composes parts that each own their state: an :class:`ArenaView` (the mapped
arena), a :class:`Requester` (the one request engine on the socket, hello included), a
:class:`Heartbeat` (a thread with a socket of its own) and a :class:`Pulling` (the puller of
each attach). The parts call no one back: the requester and the heartbeat learn what they need
(the daemon's liveness, the counters to report) through callables given at construction.
"""

import logging
import os
import sys
import time
import weakref

import numpy as np

from expertd.connection import Connection
from expertd.errors import BlobStoreError, DaemonDied, DaemonError, DaemonNotRunning
from expertd.manifest import Manifest, blob_dir_problem
from expertd.paths import daemon_paths
from expertd.protocol import PROTOCOL_VERSION, Op
from expertd.retry import RetryPolicy
from expertd.runfile import elsewhere, serving_epoch

from .arena_view import ArenaView
from .counters import heartbeat_report, new_step_counters
from .heartbeat import Heartbeat
from .interrupts import HeldInterrupts
from .links import Links, weak_method
from .pulling import Pulling
from .requester import Requester

HELLO_TIMEOUT = 10.0  # a daemon that holds its lock but does not answer a hello (stopped)
# Waiting for a daemon to come back: tries a tenth of a second apart, up to reconnect_timeout.
REATTACH = RetryPolicy(pause=0.1)

log = logging.getLogger("expertd")


def check_served(paths) -> None:
    """Raise DaemonNotRunning unless a daemon holds the lock of ``paths``' blob directory (one
    killed with SIGKILL leaves its socket and run files: nothing should wait on them)."""
    if serving_epoch(paths) is None:
        blob = paths.blob_dir
        problem = blob_dir_problem(blob)
        if problem is not None:  # not a daemon to start: a directory to make first
            raise BlobStoreError(problem)
        raise DaemonNotRunning(elsewhere(paths) or f"no expertd serves {blob} (its lock is "
                               f"free): start one with: expertd start --blobs {blob}")


def notice(line: str) -> None:
    """Say ``line`` on stderr, on a line of its own: on a terminal, a reply being streamed to
    it may have left the cursor mid-line, so the line starts on the next one."""
    sys.stderr.write(("\n" if sys.stderr.isatty() else "") + line + "\n")
    sys.stderr.flush()


class Attachment:
    """One client's attachment to the expertd serving ``blob_dir``, attached on construction.

    Args:
        blob_dir: the blob directory; the daemon is found from it.
        reconnect_timeout: how long to wait for a restarted daemon after the old one died.
        max_group: most experts moved from the arena at once (default: 64 or 4 x top-k,
            within what the daemon leases at once).
        pull: who reads a layer's missing rows from the arena during a step (see
            :class:`~expertd.client.session.Session`).
        counters: the client's counters (client/counters.py), which requests count into and
            heartbeats report.
    Raises:
        DaemonNotRunning: no daemon serves the directory (the message says how to start one).
        DaemonError: the daemon serves another blob directory or speaks another protocol.
    """

    def __init__(self, blob_dir, reconnect_timeout: float, max_group: int | None, pull: str,
                 counters: dict):
        # The socket and the threads, held apart from the attachment: a model dropped without
        # close() (or left at exit) still has them shut, in order, by the finalizer.
        self._links = Links()
        weakref.finalize(self, self._links.close)
        self.paths = daemon_paths(blob_dir)
        self.manifest = Manifest.load(self.paths.blob_dir)
        self.reconnect_timeout = reconnect_timeout
        self.requested_group = max_group or max(64, 4 * self.manifest.top_k)
        self.counters = counters
        self.step_counters = new_step_counters()  # the steps' (see report_steps)
        self.pool_bytes = 0  # the client's expert memory: its pools (see announce_pools)
        self.conn = self.view = self.requester = self._heartbeat = None
        self.epoch = None  # the attached daemon's (kept across a detach: see unanswered)
        self.pulling = Pulling(pull, self.manifest)  # its puller made at each attach
        self.max_group = None
        self.closed = False
        self._segment_tables = [
            (np.array([seg.offset for seg in layer.segments], dtype=np.intp),
             np.array([seg.nbytes for seg in layer.segments], dtype=np.intp))
            for layer in self.manifest.layers]
        self._attach()
        puller = self.pulling.puller
        log.debug("attached to expertd pid %d serving %s: puller %s", self.daemon_pid,
                  self.paths.blob_dir, puller.name if puller is not None else "none")

    # ---- attaching -------------------------------------------------------------------------

    def _attach(self, hello_timeout: float = HELLO_TIMEOUT) -> None:
        """Say hello and map the arena. Nothing of a failed or interrupted attach stays
        open, and the attachment changes only once every part is ready."""
        check_served(self.paths)
        conn = Connection(self.paths.blob_dir, at_exit=False)  # the finalizer shuts it
        view = heartbeat = None
        attached = False
        # The one request engine on this socket, hello included. Until attached, the daemon
        # counts as alive while it holds the directory's lock. Its callables hold this weakly.
        requester = Requester(conn, self.paths.blob_dir,
                              weak_method(self, "_requester_alive", False),
                              weak_method(self, "_silence", None), self.counters)
        try:
            hello = requester.hello(self._hello_body(conn.client_id), timeout=hello_timeout)
            if hello["blob_dir"] != str(self.paths.blob_dir):
                raise DaemonError(f"the daemon serves {hello['blob_dir']}, not "
                                  f"{self.paths.blob_dir}")
            if hello["manifest"] != self.manifest.digest:
                raise DaemonError(f"the daemon serves another version of {self.paths.blob_dir} "
                                  "(converted again since it started?); restart it with: expertd "
                                  f"stop --blobs {self.paths.blob_dir} && expertd start --blobs "
                                  f"{self.paths.blob_dir}")
            view = ArenaView(hello["arena"], self._segment_tables)
            if view.epoch != hello["epoch"]:
                raise DaemonError("the daemon's arena changed during attach; try again")
            # The puller before anything of the attachment changes, and before the heartbeat
            # thread starts (registering a large arena with CUDA may take longer than a
            # heartbeat interval, and the heartbeat takes an attachment not yet set for a
            # daemon lost): one that cannot be made (``pull="device"`` where the device
            # cannot read the arena) leaves nothing set.
            self.pulling.attach(view, hello.get("epoch_slot", -1))
            interval = hello["heartbeat_interval"]
            # The daemon forgets a client silent for client_timeout; the client gives the daemon
            # as long (and at least three heartbeats) before calling it stuck. The thread holds
            # this attachment weakly, so that dropping the model drops it. Its first look at the
            # daemon's liveness comes an interval later, once the attachment below is set.
            # Between beats it releases the requester's late leases.
            heartbeat = Heartbeat(str(self.paths.socket), conn.client_id, hello["token"], interval,
                                  max(hello["client_timeout"], 3 * interval),
                                  weak_method(self, "_daemon_alive", False),
                                  weak_method(self, "_heartbeat_report", {}),
                                  requester.reap, requester.reap_soon)
            with HeldInterrupts():  # attached all at once: a SIGINT comes after
                self._links.conn, self._links.heartbeat = conn, heartbeat
                self.conn, self.view, self.hello = conn, view, hello
                self.daemon_pid, self.epoch = hello["pid"], hello["epoch"]
                self.requester, self._heartbeat = requester, heartbeat
                # Fixed at the first attach: the read buffers are sized for it. A daemon
                # restarted with a smaller cache is read from in chunks of what it leases at
                # once. No layer needs more rows at once than it has experts.
                if self.max_group is None:
                    self.max_group = min(hello["max_demand"], self.requested_group,
                                         self.manifest.max_experts)
                self.demand_limit = hello["max_demand"]
                attached = True
        except BaseException:
            if not attached:
                self.pulling.close()
                if heartbeat is not None:
                    heartbeat.stop()
                if view is not None:
                    view.close()
                conn.close()  # the daemon forgets a client whose connection closed
            raise

    def drop_puller(self, layer: int) -> None:
        """Stop pulling for the rest of this process: the device's pull of ``layer`` differed
        from the host copy (pull.verify_pull). Says so in one line."""
        puller = self.pulling.puller
        name = puller.name if puller is not None else "device"
        notice(f"expertd: the {name} pull of layer {layer} differs from the host copy; this "
               "process copies rows on the host from now on")
        self.pulling.stop()

    def announce_pools(self, pool_bytes: int) -> None:
        """Tell the daemon this client's expert memory (its pools' ``pool_bytes``), for
        status: a second hello, which keeps the client's token, leases and pins."""
        self.pool_bytes = pool_bytes
        self.check_alive()
        self._across_restarts(lambda: self.requester.hello(
            self._hello_body(self.conn.client_id), HELLO_TIMEOUT))

    def _hello_body(self, client_id: bytes) -> dict:
        return {"version": PROTOCOL_VERSION, "client": client_id, "pid": os.getpid(),
                "pool_bytes": self.pool_bytes}

    def _detach(self) -> None:
        # Detached first: should an interrupt cut what follows short, the next call still
        # attaches again (closing twice is harmless). The old mapping stays valid until nothing
        # references it: a copy ahead in flight may still read it.
        self.pulling.close()
        self.conn = self.view = self._heartbeat = None
        self._links.detach(goodbye=False)
        if self.requester is not None:
            self.requester.forget()

    def close(self) -> None:
        """Say goodbye (the daemon drops this client's leases and pins at once) and detach."""
        self.closed = True
        self._links.close()
        self._detach()

    # ---- reconnecting ----------------------------------------------------------------------

    def _across_restarts(self, call):
        """``call()``, run again on a new attachment after each daemon death (see
        :meth:`_reconnect`, which raises when none comes back in time), until it returns."""
        while True:
            try:
                return call()
            except DaemonDied as exc:
                self._reconnect(str(exc))

    def _reconnect(self, why: str) -> None:
        """Detach, then wait up to reconnect_timeout for a daemon to attach to (saying ``why``
        once it has to wait). A wait that fails or is interrupted leaves the session detached:
        the next call waits again."""
        blob = self.paths.blob_dir
        self._detach()
        deadline = time.monotonic() + self.reconnect_timeout
        for attempt in REATTACH.tries():
            try:
                # A daemon that holds its lock but does not answer (stopped) is asked no longer
                # than the wait has left.
                self._attach(min(HELLO_TIMEOUT, max(0.1, deadline - time.monotonic())))
                self.counters["reconnects"] += 1
                notice(f"expertd: re-attached to the daemon serving {blob} "
                       f"(pid {self.daemon_pid})")
                return
            except (DaemonNotRunning, DaemonError, OSError, ValueError) as exc:
                held = serving_epoch(self.paths) is not None  # alive, not answering
                if time.monotonic() > deadline:
                    if held:
                        raise DaemonNotRunning(
                            f"{why}, and it did not answer within {self.reconnect_timeout:g} s "
                            f"(stopped, or stuck?); restart it with: expertd restart --blobs "
                            f"{blob}") from None
                    gone = (f"expertd serving {blob} is gone and did not come back within "
                            f"{self.reconnect_timeout:g} s")
                    if isinstance(exc, DaemonNotRunning):
                        raise DaemonNotRunning(f"{gone}; start it with: expertd start --blobs "
                                               f"{blob}") from None
                    raise DaemonNotRunning(f"{gone}: {exc}") from None
                if attempt == 0:
                    hint = (f"expertd restart --blobs {blob} if it is stuck" if held else
                            f"expertd start --blobs {blob}")
                    notice(f"expertd: {why}; waiting up to {self.reconnect_timeout:g} s for it "
                           f"to answer again ({hint})")

    def check_alive(self) -> None:
        """Attach again now if detached (an earlier wait for the daemon failed or was
        interrupted) or if the heartbeat saw the daemon die (while every expert was in the
        pools, nothing else would notice, and this process would keep its arena mapped).
        Every use of the view, connection or requester comes after this.

        Raises:
            DaemonNotRunning: no daemon came back within reconnect_timeout.
            DaemonError: the session was closed.
        """
        step_epoch = self.pulling.step_epoch
        if self.view is None:
            if self.closed:
                raise DaemonError("this model's expertd session is closed; load the model again")
            self._reconnect(f"expertd serving {self.paths.blob_dir} is gone")
        elif self._heartbeat is not None and self._heartbeat.lost:
            self._reconnect(f"expertd (pid {self.daemon_pid}) serving {self.paths.blob_dir} died")
        elif step_epoch is not None and not step_epoch.inside and not step_epoch.owned():
            # Forgotten (stopped longer than the client timeout): the epoch record is free or
            # another client's, so no step would be protected. A pulling step sends no request
            # that would tell us; say hello again before the next one.
            self._reconnect(f"expertd (pid {self.daemon_pid}) forgot this client")

    def unanswered(self) -> bool:
        """The daemon this session attached to still holds its lock but does not answer: no
        heartbeat answered for the time-to-dead, or the session detached to wait for it
        (a new daemon holding the lock is not this one: it answers the next attach)."""
        heartbeat = self._heartbeat
        if heartbeat is not None:
            return heartbeat.stuck
        return (self.conn is None and self.epoch is not None
                and serving_epoch(self.paths) == self.epoch)

    # ---- what the parts are told, by callables ---------------------------------------------

    def _requester_alive(self) -> bool:
        """The daemon a request waits on lives: the attached one (see _daemon_alive), or,
        during a hello, whichever holds the directory's lock."""
        if self.view is None:
            return serving_epoch(self.paths) is not None
        return self._daemon_alive()

    def _daemon_alive(self) -> bool:
        """The daemon we said hello to still holds the directory's lock (a pid reused by
        another process, or a new daemon, does not count) and still serves."""
        view = self.view
        return serving_epoch(self.paths) == self.epoch and view is not None and view.serving

    def _silence(self) -> float | None:
        """The heartbeat's time-to-dead once the daemon has answered no heartbeat for it."""
        heartbeat = self._heartbeat
        return heartbeat.time_to_dead if heartbeat is not None and heartbeat.stuck else None

    def report_steps(self, counters: dict) -> None:
        """Carry the steps' ``counters`` (step.Steps owns them; see counters.STEP_COUNTERS) in
        the heartbeats, for the daemon's status."""
        self.step_counters = counters

    def _heartbeat_report(self) -> dict:
        return heartbeat_report(self.step_counters, self.pulling.counters())

    # ---- requests --------------------------------------------------------------------------

    def request(self, op: Op, body: dict) -> dict:
        """A request that survives a daemon restart: re-attaches and retries once it is back."""
        self.check_alive()
        return self._across_restarts(lambda: self.requester.ask(op, body))

    def stats(self) -> dict:
        return self.request(Op.STATS, {})
