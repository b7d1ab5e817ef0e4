"""The wire under the protocol: ZeroMQ over an ``ipc://`` socket in the user's 0700 runtime
directory. The daemon has one ROUTER (serving/peers.py); each client socket is a DEALER whose
routing id is its client id. Frames are ``[request_id, op, body]`` (protocol.py).

What ZeroMQ bounds, as the daemon sets it up (serving/peers.py):
- ``MAXMSGSIZE`` at the largest request frame: libzmq reads a frame's length and closes a
  connection that announces more, before it allocates any of it;
- ``RCVHWM``: whole messages queued per connection before libzmq stops reading it (the rest
  waits in the sender's queue and the kernel's buffers);
- ``SNDHWM`` with ``ROUTER_MANDATORY``: a reply to a peer that reads nothing is refused at
  once (and dropped) rather than queued without end or blocking the loop;
- ZMTP heartbeats (``HEARTBEAT_IVL`` / ``_TIMEOUT`` / ``_TTL``): libzmq closes a connection
  that stays silent, a stopped or vanished peer's;
- ``IPC_FILTER_UID`` (where the kernel says who connects) beside the directory's mode.

What it cannot bound (README, security): a message of many frames, each under MAXMSGSIZE, is
assembled whole in the daemon's memory before any of it is delivered; and every connection is
accepted (libzmq aborts its process when accept() meets the descriptor limit, so the daemon
raises that limit as far as it may). Both need a process of the daemon's own user.

This module has the process's one context and the client's end (:class:`Channel`).
"""

import os
import threading
import weakref

import zmq

from .errors import DaemonError

MAX_REPLY = 64 << 20  # a daemon's reply frame (STATS of a very large model is well under this)
CLIENT_SNDHWM = 1000  # messages a client queues for a daemon that reads none
SEND_WAIT = 10.0  # a daemon that takes no message for this long is stuck, or stopped
MAX_SOCKETS = 4096  # per process: a flood bench or test opens many at once


class DaemonUnreachable(DaemonError):
    """The daemon took no message for SEND_WAIT s (stopped, flooded or gone)."""


class _Context:
    """The process's one ZeroMQ context, made on first use (again in a forked child, which
    must not touch its parent's), and destroyed with linger 0 at exit."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ctx = None
        self.pid = 0

    def get(self) -> zmq.Context:
        with self.lock:
            if self.ctx is None or self.pid != os.getpid():
                self.ctx = zmq.Context()
                self.ctx.setsockopt(zmq.LINGER, 0)
                self.ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
                self.pid = os.getpid()
            return self.ctx

    def close(self) -> None:
        """Close every socket left (linger 0) and terminate: nothing waits on a peer that
        is gone, so this never hangs."""
        with self.lock:
            ctx, self.ctx = self.ctx, None
            if ctx is not None and self.pid == os.getpid():
                ctx.destroy(linger=0)


_CONTEXT = _Context()
# Made at import, so older than every socket owner's finalizer: finalizers run newest first at
# exit, and this one runs after those that close their sockets themselves (a goodbye first).
weakref.finalize(_CONTEXT, _CONTEXT.close)


def context() -> zmq.Context:
    """The process's ZeroMQ context."""
    return _CONTEXT.get()


def endpoint(path) -> str:
    return f"ipc://{path}"


class Channel:
    """The client's end of one connection: a DEALER whose routing id is ``identity``.

    ZeroMQ connects (and connects again) in the background; a socket file that is missing means
    no daemon. One thread uses a channel at a time (its owner hands it over with a lock).

    Raises:
        FileNotFoundError: no daemon's socket at ``path``.
    """

    def __init__(self, path: str, identity: bytes):
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        sock = context().socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)  # a request nobody waits for any more is worthless
            sock.setsockopt(zmq.ROUTING_ID, identity)
            sock.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
            sock.setsockopt(zmq.SNDTIMEO, int(SEND_WAIT * 1000))
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY)
            sock.connect(endpoint(path))
        except BaseException:
            sock.close(linger=0)
            raise
        self.sock = sock

    def send(self, frames, quiet: bool = False) -> bool:
        """Queue one message, waiting up to SEND_WAIT s for room. With ``quiet`` nothing
        waits: the message is dropped (False) when the daemon has left CLIENT_SNDHWM unread.

        Raises:
            DaemonUnreachable: no room within SEND_WAIT s.
        """
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK if quiet else 0)
        except zmq.Again:
            if quiet:
                return False
            raise DaemonUnreachable(f"expertd took no message for {SEND_WAIT:g} s") from None
        return True

    def poll(self, timeout: float) -> bool:
        """Whether a message has come, waiting up to ``timeout`` s for one."""
        return bool(self.sock.poll(max(0, round(timeout * 1000)), zmq.POLLIN))

    def recv(self) -> list:
        """The frames of the message :meth:`poll` found (call it first)."""
        return self.sock.recv_multipart(zmq.NOBLOCK)

    def close(self, linger: float = 0.0) -> None:
        """Idempotent. What is queued still goes out for up to ``linger`` s, in the background
        (the context's I/O thread), never holding the caller."""
        if not self.sock.closed:
            self.sock.close(linger=round(linger * 1000))
