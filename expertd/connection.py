"""A request/reply connection to the daemon serving a blob directory (one thread owns it): a
ZeroMQ DEALER (wire.py) whose routing id is the client id. Its :meth:`Connection.wait` is the
one place a reply is waited for and an error reply is turned into an exception."""

import os
import time
import weakref

from .errors import DaemonDied, DaemonError, DaemonNotRunning, NoReply
from .paths import daemon_paths
from .protocol import CLIENT_ID_BYTES, ErrorCode, Op, parse_reply, request
from .runfile import elsewhere
from .wire import Channel, endpoint

POLL_SLICE = 0.05  # how often a wait with an ``on_idle`` hook calls it while no reply comes


class Connection:
    """A connection to the expertd of ``blob_dir`` (or at ``socket``, a socket path).

    Raises:
        DaemonNotRunning: if no daemon's socket exists for the directory (ZeroMQ connects in
            the background: a stale socket file shows as requests that time out).
    """

    def __init__(self, blob_dir=None, client_id: bytes | None = None, socket=None,
                 at_exit: bool = True):
        paths = None
        if socket is not None:
            path, what = str(socket), socket
        else:
            paths = daemon_paths(blob_dir)
            path, what = str(paths.socket), paths.blob_dir
        self.endpoint = endpoint(path)
        self.serves = what  # for messages: the blob directory (or the socket) it reaches
        self.daemon_pid = None  # known from the daemon's answer to a hello (for messages)
        self.client_id = client_id or os.urandom(CLIENT_ID_BYTES)
        try:
            self.channel = Channel(path, self.client_id)
        except FileNotFoundError:
            raise DaemonNotRunning((paths and elsewhere(paths))
                                   or f"no expertd serves {what} (start one with: "
                                   f"expertd start --blobs {what})") from None
        # Closed here, by close() or by the finalizer when the connection is dropped or the
        # process exits. An owner that shuts the connection itself at exit (a session: after
        # its heartbeat, with a goodbye) asks for at_exit=False; finalizers run newest first.
        self._finalizer = weakref.finalize(self, self.channel.close)
        self._finalizer.atexit = at_exit
        self._counter = 0
        self.stray_errors = 0

    def next_rid(self) -> bytes:
        """A request id not used before on this connection (every request on it takes one
        from here, so a late reply is never taken for another request's)."""
        self._counter += 1
        return self._counter.to_bytes(8, "little")

    def send(self, op: Op, body: dict) -> bytes:
        """Fire and forget; returns the request id.

        Raises:
            DaemonUnreachable: the daemon took no message for wire.SEND_WAIT s.
        """
        rid = self.next_rid()
        self.channel.send(request(rid, op, body))
        return rid

    def send_frames(self, frames: list, wait: bool = True) -> bool:
        """Send raw frames (tests and tools that speak the protocol themselves); with
        ``wait=False`` the message is dropped (False) when the daemon has left a queue's worth
        unread."""
        return self.channel.send(frames, quiet=not wait)

    def send_quietly(self, op: Op, body: dict) -> bool:
        """Fire and forget without ever blocking on a daemon that is gone or flooded: whether
        the message was queued."""
        try:
            return self.channel.send(request(self.next_rid(), op, body), quiet=True)
        except DaemonError:
            return False

    def poll(self, timeout: float) -> bool:
        """Whether a reply is there to :meth:`recv`, waiting up to ``timeout`` s."""
        return self.channel.poll(timeout)

    def recv(self) -> tuple:
        """The reply :meth:`poll` found: ``(request id, op, body)``."""
        return parse_reply(self.channel.recv())

    def request(self, op: Op, body: dict | None = None, timeout: float = 10.0) -> dict:
        """Send one request and wait for its reply.

        Raises:
            DaemonError: on an error reply (``.code`` set), when no reply comes in time or the
                connection is lost.
        """
        rid = self.send(op, body or {})
        return self.wait(rid, timeout)

    @property
    def daemon(self) -> str:
        """The daemon, for messages: with its pid once a hello answered."""
        return f"expertd (pid {self.daemon_pid})" if self.daemon_pid is not None else "expertd"

    def wait(self, rid: bytes, timeout: float, on_idle=None, on_reply=None) -> dict:
        """Wait for the reply to ``rid`` and return its body; replies to other requests (late
        ones, errors of fire-and-forget messages) are read and passed over.

        Args:
            rid: the request id :meth:`send` returned.
            timeout: seconds to wait for the reply.
            on_idle: called after each POLL_SLICE s without a reply; it ends the wait by
                raising (a daemon found gone, a held-back SIGINT delivered).
            on_reply: called with ``(request id, body)`` for every reply read, ``rid``'s
                included, before it is returned or raised (a lease is recorded there).
        Raises:
            DaemonDied: the daemon is shutting down, or no longer knows this client (it timed
                the client out or restarted); ``code`` set.
            DaemonError: any other error reply (``code`` set).
            NoReply: no reply within ``timeout`` s.
        """
        return self.wait_all((rid,), timeout, on_idle, on_reply)[rid]

    def wait_all(self, rids, timeout: float, on_idle=None, on_reply=None) -> dict:
        """Wait for the replies to every one of ``rids`` (requests sent together, answered in
        any order) and return their bodies by request id, as :meth:`wait` does for one. The
        first error reply among them raises at once; the replies still to come are read later
        as any late reply is (``on_reply`` sees each). ``timeout`` bounds the whole wait."""
        waiting = set(rids)
        bodies = {}
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            if self.poll(min(left, POLL_SLICE) if on_idle is not None else left):
                while self.poll(0):
                    got, op, body = self.recv()
                    if on_reply is not None:
                        on_reply(got, body)
                    if got in waiting:
                        bodies[got] = self._checked(op, body)
                        waiting.discard(got)
                        if not waiting:
                            return bodies
                    else:
                        self.stray_errors += not body.get("ok", False)
                continue
            if on_idle is not None:
                on_idle()
            if time.monotonic() >= deadline:
                raise NoReply(f"{self.daemon} ({self.endpoint}) did not answer within "
                              f"{timeout:g} s")

    def _checked(self, op: int, body: dict) -> dict:
        """A reply's body, or the exception its error code means."""
        if body.get("ok", False):
            if op == Op.HELLO and "pid" in body:
                self.daemon_pid = body["pid"]
            return body
        code = body.get("code")
        if code == ErrorCode.SHUTTING_DOWN:
            raise DaemonDied(f"{self.daemon} is shutting down", code)
        if code == ErrorCode.NOT_HELLO:
            raise DaemonDied(f"expertd serving {self.serves} no longer knows this client "
                             "(restarted?)", code)
        raise DaemonError(str(body.get("error", "unknown error")), code)

    def close(self, linger: float = 0.0) -> None:
        """Close the socket; what is queued still goes out for up to ``linger`` s, in the
        background. Idempotent."""
        if self._finalizer.detach() is not None:
            self.channel.close(linger)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
