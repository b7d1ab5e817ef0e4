"""The wire under the protocol: frames in length-prefixed messages over a Unix stream socket.

A connection opens with a greeting, ``MAGIC`` and the peer's 16-byte routing id (a ROUTER's
identity, as in ZeroMQ). Each message is then a little-endian u32 payload length and the
payload: its frames, each a u32 length and its bytes.

Why not ZeroMQ: a ROUTER socket assembles a multipart message whole, in memory, before the
daemon sees any of it (MAXMSGSIZE bounds one frame, RCVHWM counts messages), and it cannot
refuse a peer. One hostile local client took the daemon past a gigabyte that way. Here the
daemon reads each peer itself (see peers.py): it knows a message's length from its first four
bytes, so no peer ever holds more than one bounded message of the daemon's memory.

This module has the format and the client's end of a connection (:class:`Channel`).
"""

import selectors
import socket
import struct
import sys
import time

from .errors import DaemonError

MAGIC = b"XPD\x01"  # the last byte is the wire's version
IDENTITY_BYTES = 16
GREETING_BYTES = len(MAGIC) + IDENTITY_BYTES
LENGTH = struct.Struct("<I")
MAX_REPLY = 64 << 20  # a daemon's reply (STATS of a very large model is well under this)
READ_CHUNK = 256 << 10
QUIET_OUTBOX = 1 << 20  # a fire-and-forget message is dropped past this much unsent
CONNECT_SPIN = 0.5
SEND_WAIT = 10.0  # a daemon that reads nothing for this long is stuck, or stopped


class ConnectionLost(DaemonError):
    """The daemon closed the connection, or it broke."""


def encode(frames) -> bytes:
    """One message: the payload's length, then each frame's length and bytes."""
    parts = [b""]
    for frame in frames:
        parts.append(LENGTH.pack(len(frame)))
        parts.append(bytes(frame))
    parts[0] = LENGTH.pack(sum(map(len, parts)))
    return b"".join(parts)


def decode(payload, keep: int) -> tuple:
    """A message's frames -> ``(the first keep frames, how many it has)``. The count is -1
    when the lengths do not tile the payload, and keep + 1 for any number past ``keep``: the
    rest is not looked at (a message of 16,000 empty frames costs what one of four does)."""
    view = memoryview(payload)
    frames, count, at = [], 0, 0
    while at < len(view):
        if count == keep:
            return frames, keep + 1
        if len(view) - at < LENGTH.size:
            return frames, -1
        (n,) = LENGTH.unpack_from(view, at)
        at += LENGTH.size
        if n > len(view) - at:
            return frames, -1
        frames.append(bytes(view[at:at + n]))
        count += 1
        at += n
    return frames, count


def send_some(sock: socket.socket, queued: bytearray) -> None:
    """Write what the socket takes now of ``queued`` (which keeps the rest).

    Raises:
        OSError: the connection broke (EPIPE, ECONNRESET).
    """
    try:
        while queued:
            del queued[:sock.send(queued)]
    except BlockingIOError:
        pass


def message_length(buffer) -> int | None:
    """The payload length a buffer's message header gives, or None while it is incomplete."""
    if len(buffer) < LENGTH.size:
        return None
    return LENGTH.unpack_from(buffer)[0]


def _connect(sock: socket.socket, path: str, timeout: float) -> None:
    """Connect without blocking, trying again while the daemon's backlog is full for up to
    ``timeout`` s: Linux says EAGAIN then and offers nothing to wait on; macOS says
    ECONNREFUSED, as for a socket nobody listens on, so there it is tried for half a second.

    The first CONNECT_SPIN s try again at once (yielding the CPU): a flood refills a backlog
    as soon as the daemon empties it, and a client that sleeps comes back to a full one."""
    sock.setblocking(False)
    start = time.monotonic()
    pause = 0.0
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + pause > start + timeout:
                raise TimeoutError(f"the daemon at {path} accepted no connection within "
                                   f"{timeout:g} s") from None
        except ConnectionRefusedError:
            if sys.platform != "darwin" or time.monotonic() + pause > start + min(timeout, 0.5):
                raise
        time.sleep(pause)
        if time.monotonic() - start > CONNECT_SPIN:
            pause = min(max(2 * pause, 0.001), 0.01)


class Channel:
    """The client's end of one connection: frames out and in, never blocking past a timeout.

    One thread uses a channel at a time (the owner hands it over with a lock).

    Raises:
        FileNotFoundError, ConnectionRefusedError: no daemon listens at ``path``.
    """

    def __init__(self, path: str, identity: bytes, connect_timeout: float = 5.0):
        if len(identity) != IDENTITY_BYTES:
            raise ValueError(f"a routing id is {IDENTITY_BYTES} bytes, not {len(identity)}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _connect(sock, path, connect_timeout)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ)
        self._writing = False
        self._out = bytearray(MAGIC + identity)
        self._in = bytearray()
        self.lost: str | None = None
        self._flush()

    def send(self, frames, quiet: bool = False, wait: bool = True) -> bool:
        """Queue one message and write it, waiting up to SEND_WAIT s for the daemon to take
        it (what it has not taken by then is written by the next send or poll).

        With ``quiet`` nothing waits, and the message is dropped (False) when the daemon has
        left a megabyte unread: it is flooded or gone. ``wait=False`` writes only what the
        socket takes now."""
        if quiet and len(self._out) > QUIET_OUTBOX:
            return False
        self._check()
        self._out += encode(frames)
        self._flush()
        if self._out and wait and not quiet:
            self.drain(SEND_WAIT)
        return True

    @property
    def unsent(self) -> int:
        """Bytes queued that the daemon has not taken yet."""
        return len(self._out)

    def poll(self, timeout: float) -> bool:
        """Whether a whole message has come, waiting up to ``timeout`` s for one (and writing
        what is queued meanwhile).

        Raises:
            ConnectionLost: the daemon closed the connection.
        """
        deadline = time.monotonic() + timeout
        while not self._whole():
            self._check()
            left = max(0.0, deadline - time.monotonic())
            if not self._pump(left) and left == 0:
                return False
        return True

    def recv(self) -> list:
        """The frames of the message :meth:`poll` found (call it first)."""
        n = message_length(self._in)
        frames, count = decode(memoryview(self._in)[LENGTH.size:LENGTH.size + n], 1 << 30)
        del self._in[:LENGTH.size + n]
        if count < 0:
            self._lose("the daemon sent a malformed message")
            self._check()
        return frames

    def drain(self, timeout: float) -> None:
        """Write what is queued, waiting up to ``timeout`` s for room."""
        deadline = time.monotonic() + timeout
        while self._out and self.lost is None and self.sock.fileno() >= 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._pump(left)  # replies read meanwhile wait for poll()

    def close(self) -> None:
        """Idempotent: unsent messages are dropped (nobody waits for them any more)."""
        self._out.clear()
        if self.sock.fileno() >= 0:
            self._selector.close()
            self.sock.close()

    # ---- internals -----------------------------------------------------------------------

    def _pump(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s to write what is queued or read what came; whether
        anything happened."""
        events = self._selector.select(timeout)
        for _, mask in events:
            if mask & selectors.EVENT_WRITE:
                self._flush()
            if mask & selectors.EVENT_READ:
                self._read()
        return bool(events)

    def _whole(self) -> bool:
        n = message_length(self._in)
        return n is not None and len(self._in) >= LENGTH.size + n

    def _check(self) -> None:
        if self.lost is not None:
            raise ConnectionLost(self.lost)

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            self._out.clear()

    def _flush(self) -> None:
        try:
            send_some(self.sock, self._out)
        except OSError as exc:  # EPIPE, ECONNRESET: the daemon is gone
            self._lose(f"the connection to expertd broke ({exc.strerror or exc})")
        writing = bool(self._out) and self.lost is None
        if writing != self._writing and self.sock.fileno() >= 0:
            self._writing = writing
            self._selector.modify(self.sock, selectors.EVENT_READ
                                  | (selectors.EVENT_WRITE if writing else 0))

    def _read(self) -> None:
        try:
            chunk = self.sock.recv(READ_CHUNK)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lose(f"the connection to expertd broke ({exc.strerror or exc})")
            return
        if not chunk:
            self._lose("expertd closed the connection")
            return
        self._in += chunk
        n = message_length(self._in)
        if n is not None and n > MAX_REPLY:
            self._lose(f"expertd sent a message of {n} bytes (at most {MAX_REPLY})")
