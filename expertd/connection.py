"""A request/reply connection to the daemon serving a blob directory (one thread owns it)."""

import os
import time
import weakref

import zmq

from .errors import DaemonError, DaemonNotRunning
from .paths import daemon_paths
from .protocol import CLIENT_ID_BYTES, Op, parse_reply, request


class Connection:
    """A DEALER socket to the expertd of ``blob_dir`` (or at ``socket``, a socket path).

    Raises:
        DaemonNotRunning: if no daemon socket exists for the directory.
    """

    def __init__(self, blob_dir=None, client_id: bytes | None = None, socket=None,
                 at_exit: bool = True):
        if socket is not None:
            self.endpoint = f"ipc://{socket}"
            exists = os.path.exists(socket)
            what = socket
        else:
            paths = daemon_paths(blob_dir)
            self.endpoint, exists, what = paths.endpoint, paths.socket.exists(), paths.blob_dir
        if not exists:
            raise DaemonNotRunning(f"no expertd serves {what} (start one with: "
                                   f"expertd start --blobs {what})")
        self.client_id = client_id or os.urandom(CLIENT_ID_BYTES)
        # The context and its one socket are shut here, by close() or by the finalizer when the
        # connection is dropped or the process exits: never by the garbage collector, whose
        # Context.__del__ can wait for ever on a socket of the same garbage not yet closed.
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self._finalizer = weakref.finalize(self, _shut, self.sock, self.ctx, 0)
        # An owner that shuts the connection itself at exit (a session: after its heartbeat,
        # with a goodbye) asks for at_exit=False; finalizers run newest first at exit.
        self._finalizer.atexit = at_exit
        self.sock.setsockopt(zmq.LINGER, 0)  # a request nobody waits for any more is worthless
        self.sock.setsockopt(zmq.ROUTING_ID, self.client_id)
        self.sock.connect(self.endpoint)
        self._counter = 0
        self.stray_errors = 0

    def _rid(self) -> bytes:
        self._counter += 1
        return self._counter.to_bytes(8, "little")

    def send(self, op: Op, body: dict) -> bytes:
        """Fire and forget; returns the request id."""
        rid = self._rid()
        self.sock.send_multipart(request(rid, op, body))
        return rid

    def send_quietly(self, op: Op, body: dict, rid: bytes | None = None) -> bool:
        """Fire and forget without ever blocking on a daemon that is gone or flooded: whether
        the message was queued."""
        try:
            self.sock.send_multipart(request(rid or self._rid(), op, body), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def request(self, op: Op, body: dict | None = None, timeout: float = 10.0) -> dict:
        """Send one request and wait for its reply.

        Raises:
            DaemonError: on an error reply (``.code`` set) or when no reply comes in time.
        """
        rid = self.send(op, body or {})
        return self.wait(rid, timeout)

    def wait(self, rid: bytes, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                if time.monotonic() >= deadline:
                    raise DaemonError(f"expertd ({self.endpoint}) did not answer within "
                                      f"{timeout:g} s")
                continue
            got_rid, _, body = parse_reply(self.sock.recv_multipart())
            if got_rid != rid:
                # A late reply, or the error answer to a fire-and-forget message.
                self.stray_errors += not body.get("ok", False)
                continue
            if not body.get("ok", False):
                raise DaemonError(str(body.get("error", "unknown error")), body.get("code"))
            return body

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket, letting what is queued out for up to ``linger_ms``, then the
        context (which waits for nothing else: it has no other socket). Idempotent."""
        if self._finalizer.detach() is not None:
            _shut(self.sock, self.ctx, linger_ms)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shut(sock, ctx, linger_ms: int) -> None:
    """The socket first: term() waits for every socket of its context to be closed."""
    sock.close(linger=linger_ms)
    ctx.term()
