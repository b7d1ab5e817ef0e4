"""The daemon's end of the wire: one ZeroMQ ROUTER, owned by the serving thread, and what it
learns of its connections from a socket monitor.

The bounds ZeroMQ gives (see wire.py for what it cannot bound):
- MAXMSGSIZE = MAX_FRAME: a frame announced longer than any request's is never read, its
  connection closed;
- RCVHWM: RECV_HWM whole messages per connection wait here at most; then libzmq stops reading
  that connection;
- SNDHWM with ROUTER_MANDATORY: a peer that reads none of its replies has SEND_HWM of them
  queued at most; past that, and to a peer gone, a reply is dropped at once (never waited for).
  A run of STATS replies shares one body (:meth:`share`), however many peers leave theirs
  unread;
- ZMTP heartbeats: a connection silent for the client timeout is closed by libzmq.

Connections come and go in the monitor's events (ACCEPTED, DISCONNECTED, each with the
connection's descriptor; libzmq 4.3 has ROUTER_NOTIFY only in its draft API), and a message
says which descriptor it came from (SRCFD). A routing id is on the descriptor of its latest
message, and goes (``gone``) when that connection closes. The monitor is read after each batch
of messages and before they are placed: a message's sender was accepted before the message was
queued, so its ACCEPTED event is in by then, and any earlier DISCONNECTED of the same
descriptor (a closed connection's number reused) too. A sender whose connection closed before
its message was placed is gone once that message is handled.
"""

import os
import socket
import struct
import sys

import zmq
from zmq.utils.monitor import parse_monitor_message

from expertd.protocol import MAX_BODY, MAX_REQUEST_ID
from expertd.serving.stats import PeerCounters
from expertd.wire import context, endpoint

MAX_FRAME = max(MAX_BODY, MAX_REQUEST_ID)  # the largest frame of any request
RECV_HWM = 4  # a client has a few requests in flight (a prefetch and a demand, releases)
# Replies queued for a peer that reads none, beyond its own queue and the kernel's: a batch of
# a peer's requests (up to the loop's RECV_BATCH) is answered before libzmq's I/O thread writes
# any, and the room a pipe's reader frees is seen only every half of its mark.
SEND_HWM = 1000
BACKLOG = 256  # connections the kernel holds for the next accept
CLOSE_LINGER_MS = 100
KEEP_FRAMES = 3  # a request's frames; more are counted and dropped, never kept
BATCH_FRAMES = 1024  # frames read before a batch is dispatched (256 requests of 3, and ids)
MONITORED = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED
             | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_SOL_LOCAL, _LOCAL_PEERPID = 0, 2  # macOS <sys/un.h>: a unix socket's peer's pid


class Message:
    """One request as read: its first frames, and how many it had."""

    __slots__ = ("identity", "frames", "count")

    def __init__(self, identity: bytes, frames: list, count: int):
        self.identity, self.frames, self.count = identity, frames, count


class Peers:
    """The ROUTER bound at ``path`` (a socket file created 0600), and its connections.

    Extra descriptors (the fill pool's wake-up pipe) are watched with :meth:`watch`; one
    :meth:`poll` returns those that are ready and the requests read.

    Args:
        path: the socket file.
        heartbeat: seconds between ZMTP pings to each peer.
        silence: seconds a connection may stay silent before libzmq closes it.
    """

    def __init__(self, path: str, heartbeat: float, silence: float):
        ctx = context()
        self.gone: list = []  # routing ids whose connection closed since the server looked
        self.changes = 0  # connections opened or closed, for a cached STATS
        self.counters = PeerCounters()
        self._open: dict = {}  # descriptor -> whether its latest connection is open
        self._fd_of: dict = {}  # routing id -> descriptor of its latest message
        self._on_fd: dict = {}  # descriptor -> routing ids whose latest message came on it
        self._tags: dict = {}  # watched descriptor -> its tag
        self.router = router = ctx.socket(zmq.ROUTER)
        self.monitor = None
        try:
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            router.setsockopt(zmq.RCVHWM, RECV_HWM)
            router.setsockopt(zmq.SNDHWM, SEND_HWM)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # A client whose connection libzmq closed connects again with the same routing id,
            # maybe before its old pipe is gone: the new connection takes the id over.
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            router.setsockopt(zmq.BACKLOG, BACKLOG)
            # A ZAP domain makes libzmq refuse ZMTP 1.0 peers, whose first byte is a frame's
            # length (any bytes at all would parse as frames). No ZAP handler is bound, so
            # peers of the NULL mechanism, ours, pass.
            router.setsockopt(zmq.ZAP_DOMAIN, b"expertd")
            router.setsockopt(zmq.HEARTBEAT_IVL, round(heartbeat * 1000))
            router.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(silence * 1000))
            router.setsockopt(zmq.HEARTBEAT_TTL, round(silence * 1000))  # clients' bound on us
            try:
                router.setsockopt(zmq.IPC_FILTER_UID, os.getuid())
            except zmq.ZMQError:
                pass  # no peer credentials on this system: the 0700 directory stands alone
            # The monitor's pipe is unbounded (RCVHWM 0): libzmq's I/O thread never blocks or
            # drops an event on it, and the loop reads every event each turn.
            self.monitor = ctx.socket(zmq.PAIR)
            self.monitor.setsockopt(zmq.LINGER, 0)
            self.monitor.setsockopt(zmq.RCVHWM, 0)
            address = f"inproc://expertd-monitor-{id(self):x}"
            router.monitor(address, MONITORED)
            self.monitor.connect(address)
            old = os.umask(0o177)  # the socket file is created 0600 (libzmq binds here)
            try:
                router.bind(endpoint(path))
            finally:
                os.umask(old)
        except BaseException:
            self.close()
            raise
        self.poller = zmq.Poller()
        self.poller.register(router, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self._scratch = bytearray(64)  # frames past KEEP_FRAMES land here, cut short

    @property
    def count(self) -> int:
        """Connections open now."""
        return sum(self._open.values())

    def watch(self, fd: int, tag) -> None:
        self.poller.register(fd, zmq.POLLIN)
        self._tags[fd] = tag

    def poll(self, timeout: float, limit: int) -> tuple:
        """Wait up to ``timeout`` s; returns ``(watched tags ready, up to limit Messages)``."""
        ready = self.poller.poll(round(timeout * 1000))
        tags = [self._tags[fd] for fd, _ in ready if fd in self._tags]
        received = []
        router = self.router
        frames = 0
        # Requests are dispatched once the batch is read: a batch stops at BATCH_FRAMES too, so
        # that messages of many frames (each walked, ~2 us a frame) cannot hold a STATS back
        # for a whole batch of them.
        while len(received) < limit and frames < BATCH_FRAMES:
            try:
                first = router.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            received.append(self._rest(first))
            frames += 1 + received[-1][1].count
        self._read_monitor()  # every event before the messages just read is in now
        messages = []
        for fd, message in received:
            self._place(message.identity, fd)
            messages.append(message)
        return tags, messages

    def send(self, identity: bytes, frames: list) -> None:
        """Queue a reply; one to a peer that is gone or reads none is dropped (it times out
        and asks again)."""
        try:
            self.router.send_multipart([identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError:  # EHOSTUNREACH (gone) or EAGAIN (SEND_HWM unread)
            self.counters.replies_dropped += 1

    @staticmethod
    def share(body: bytes) -> zmq.Frame:
        """``body`` as a frame that many replies share: libzmq counts its references, so each
        reply queued costs a message header, not a copy."""
        return zmq.Frame(body, copy=True)

    def close(self) -> None:
        if self.monitor is not None:
            try:
                self.router.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
        # The last replies (SHUTDOWN's, the SHUTTING_DOWN errors) go out in the background for
        # this long, the context's term at exit waiting for them.
        self.router.close(linger=CLOSE_LINGER_MS)

    # ---- internals -----------------------------------------------------------------------

    def _rest(self, first: zmq.Frame) -> tuple:
        """The rest of the message whose routing id frame is ``first`` (a whole message is
        queued at once, so nothing here waits): ``(source descriptor, Message)``."""
        router = self.router
        frames, count, more = [], 0, first.more
        while more:
            count += 1
            if count <= KEEP_FRAMES:
                frame = router.recv(copy=False)
                frames.append(frame.bytes)
                more = frame.more
            else:
                router.recv_into(self._scratch)
                more = router.get(zmq.RCVMORE)
        return first.get(zmq.SRCFD), Message(first.bytes, frames, count)

    def _read_monitor(self) -> None:
        monitor = self.monitor
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, fd = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                if self._open.get(fd):
                    self._closed(fd)  # closed without an event (a pipe handed over)
                self._open[fd] = True
                self.changes += 1
                self.counters.peers_accepted += 1
            elif kind == zmq.EVENT_DISCONNECTED:
                if self._open.get(fd):
                    self._closed(fd)
            elif kind & HANDSHAKE_FAILED:
                self.counters.handshakes_failed += 1
            elif kind == zmq.EVENT_ACCEPT_FAILED:
                self.counters.accepts_failed += 1

    def peer_pid(self, identity: bytes) -> int | None:
        """The pid of the process at the other end of ``identity``'s connection, as the
        kernel says (SO_PEERCRED on Linux, LOCAL_PEERPID on macOS): what a client claims is
        only what it says. None where the platform or the connection cannot tell."""
        fd = self._fd_of.get(identity)
        if fd is None:
            return None
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sys.platform.startswith("linux"):
                    pid, _, _ = struct.unpack("3i", sock.getsockopt(
                        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
                elif sys.platform == "darwin":
                    pid = struct.unpack("i", sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERPID, 4))[0]
                else:
                    return None
        except OSError:
            return None
        return pid if pid > 0 else None

    def _closed(self, fd: int) -> None:
        self._open[fd] = False
        self.changes += 1
        self.counters.peers_closed += 1
        for identity in self._on_fd.pop(fd, ()):
            del self._fd_of[identity]
            self.gone.append(identity)

    def _place(self, identity: bytes, fd: int) -> None:
        """``identity``'s latest message came on ``fd``."""
        old = self._fd_of.get(identity)
        if old == fd:
            return
        if old is not None:
            self._on_fd[old].discard(identity)
        if self._open.get(fd, True):
            self._fd_of[identity] = fd
            self._on_fd.setdefault(fd, set()).add(identity)
        else:  # its connection closed before its message was placed
            self._fd_of.pop(identity, None)
            self.gone.append(identity)
