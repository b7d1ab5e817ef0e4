"""A peer that speaks ZMTP 3.1 (the NULL mechanism) by hand over a Unix socket, to do what a
ZeroMQ DEALER never does: announce a frame past MAXMSGSIZE, hold a message half sent, stop
answering the daemon's pings, send bytes that are not ZMTP at all."""

import os
import socket
import struct

import msgpack

from expertd.paths import daemon_paths
from expertd.protocol import CLIENT_ID_BYTES

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
# signature, version 3.1, mechanism NULL, as-server 0, filler
GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00")
            + b"\x00" + b"\x00" * 31)


def frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    """One frame as ZMTP writes it (a long one past 255 bytes)."""
    flags = (MORE if more else 0) | (COMMAND if command else 0)
    if len(body) > 255:
        return bytes([flags | LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def message(frames: list) -> bytes:
    return b"".join(frame(f, more=i < len(frames) - 1) for i, f in enumerate(frames))


def header(size: int, more: bool = False) -> bytes:
    """A long frame's flags and length, announcing ``size`` bytes."""
    return bytes([(MORE if more else 0) | LONG]) + struct.pack(">Q", size)


def _ready(identity: bytes) -> bytes:
    body = b"\x05READY"
    for name, value in ((b"Socket-Type", b"DEALER"), (b"Identity", identity)):
        body += bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return frame(body, command=True)


class ZmtpPeer:
    """A raw connection to the daemon of ``blob_dir``; with ``handshake`` it greets as a
    DEALER of routing id ``identity`` (random by default) and reads the daemon's greeting."""

    def __init__(self, blob_dir, identity: bytes | None = None, handshake: bool = True,
                 timeout: float = 10.0):
        self.identity = identity or os.urandom(CLIENT_ID_BYTES)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(daemon_paths(blob_dir).socket))
        self._in = b""
        if handshake:
            self.sock.sendall(GREETING + _ready(self.identity))
            self._take(len(GREETING))
            self._frame()  # the daemon's READY

    def send(self, frames: list) -> None:
        self.send_raw(message(frames))

    def send_raw(self, data: bytes) -> None:
        """Send ``data``; a connection the daemon closes meanwhile is left for
        :meth:`closed` to see."""
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def recv(self) -> list:
        """The next message's frames (commands, the daemon's pings, skipped); waits on the
        socket's timeout."""
        frames = []
        while True:
            flags, body = self._frame()
            if flags & COMMAND:
                continue
            frames.append(body)
            if not flags & MORE:
                return frames

    def reply(self) -> tuple:
        """The next message as ``(request id, op, body)``."""
        rid, op, raw = self.recv()
        return rid, op, msgpack.unpackb(raw, raw=False)

    def closed(self) -> bool:
        """Whether the daemon closes the connection (reading, and dropping, what comes first);
        waits on the socket's timeout."""
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _take(self, n: int) -> bytes:
        while len(self._in) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            self._in += chunk
        data, self._in = self._in[:n], self._in[n:]
        return data

    def _frame(self) -> tuple:
        flags = self._take(1)[0]
        size = struct.unpack(">Q", self._take(8))[0] if flags & LONG else self._take(1)[0]
        return flags, self._take(size)
