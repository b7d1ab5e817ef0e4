"""The daemon's end of the wire: one listening Unix socket and every peer on it, each held to
a bounded share of the daemon's memory.

What bounds it (see wire.py for the format):
- a peer's inbox holds at most one message, and a message's length is known from its first
  four bytes: one longer than any request is refused before a byte of it is kept;
- a peer is read only while its message is incomplete, so a flood waits in its sender's kernel
  buffers, not here;
- a reply its peer does not read stays at most OUTBOX_LIMIT here before the peer is dropped;
- at most ``max_peers`` connections; past that (or out of descriptors), a new one replaces the
  oldest peer that is not a client's (the server marks those: a hello, or a heartbeat of a
  known client), so a flood of connections cannot lock ``expertd status`` out. Clients are
  at most MAX_CLIENTS, two connections each, so RESERVED_PEERS always stay for the rest.

Worst case: max_peers x (MAX_REQUEST + READ_MIN + OUTBOX_LIMIT + a reply), about 60 MB at the
defaults, whatever the peers send.
"""

import errno
import os
import selectors
import socket
import time
from collections import deque
from dataclasses import dataclass, field

from expertd.protocol import MAX_BODY, MAX_REQUEST_ID
from expertd.serving.stats import PeerCounters
from expertd.wire import GREETING_BYTES, LENGTH, MAGIC, decode, encode, message_length, send_some

# The largest request: a body at its limit, the longest request id, the op, three lengths.
MAX_REQUEST = MAX_BODY + MAX_REQUEST_ID + 1 + 3 * LENGTH.size
READ_MIN = 4096  # read at least this much at once (many small requests, few system calls)
OUTBOX_LIMIT = 64 << 10  # unsent replies a peer may leave before it is dropped
MAX_PEERS = 256
RESERVED_PEERS = 64  # never a client's: for status, and for new clients' hellos
MAX_CLIENTS = (MAX_PEERS - RESERVED_PEERS) // 2  # a client has its own and its heartbeat's
PER_PEER_ROUND = 8  # messages taken from one peer before the others get their turn
ACCEPT_ROUND = 256  # the whole backlog: a client waits behind at most one round of a flood
ACCEPT_PAUSE = 0.1  # out of descriptors: stop accepting this long
KEEP_FRAMES = 3  # a request's frames; more are counted, never copied


@dataclass(eq=False)
class Peer:
    sock: socket.socket
    identity: bytes | None = None  # from the greeting
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    trusted: bool = False  # said hello, or heartbeats for a known client
    writing: bool = False  # the selector watches it for room to write
    queued: bool = False  # in Peers._ready


@dataclass(frozen=True)
class Message:
    """One request as read: its first frames, and how many it had (-1: their lengths did not
    tile the message)."""

    identity: bytes
    frames: list
    count: int


class Peers:
    """The listening socket at ``path`` (created 0600) and its peers.

    Extra descriptors (the fill pool's wake-up pipe) are watched with :meth:`watch`; one
    :meth:`poll` returns those that are ready and the requests read.
    """

    def __init__(self, path: str, max_peers: int = MAX_PEERS):
        self.max_peers = max_peers
        self.gone: list = []  # routing ids of the peers closed since the server last looked
        self.changes = 0  # peers opened or closed, for a cached STATS
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is created 0600
        try:
            self.listener.bind(path)
        except BaseException:
            self.listener.close()
            raise
        finally:
            os.umask(old)
        self.listener.listen(ACCEPT_ROUND)
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, self)
        self._peers: dict = {}  # fileno -> Peer, oldest first
        self._named: dict = {}  # routing id -> Peer
        self._ready: deque = deque()  # peers with a whole message still in their inbox
        self._accept_again = 0.0
        self.counters = PeerCounters()

    @property
    def count(self) -> int:
        return len(self._peers)

    def watch(self, fd: int, tag) -> None:
        self.selector.register(fd, selectors.EVENT_READ, tag)

    def poll(self, timeout: float, limit: int) -> tuple:
        """Wait up to ``timeout`` s; returns ``(watched tags ready, up to limit Messages)``."""
        now = time.monotonic()
        if self._accept_again and now >= self._accept_again:
            self._accept_again = 0.0
            self.selector.register(self.listener, selectors.EVENT_READ, self)
        tags, messages = [], []
        for key, mask in self.selector.select(0 if self._ready else timeout):
            data = key.data
            if data is self:
                self._accept()
            elif isinstance(data, Peer):
                if mask & selectors.EVENT_WRITE:
                    self._flush(data)
                if mask & selectors.EVENT_READ and data.sock.fileno() >= 0:
                    self._read(data)
            else:
                tags.append(data)
        for _ in range(len(self._ready)):
            if len(messages) >= limit:
                break
            peer = self._ready.popleft()
            peer.queued = peer.sock.fileno() >= 0 and self._take(peer, messages, limit)
            if peer.queued:
                self._ready.append(peer)
        return tags, messages

    def send(self, identity: bytes, frames: list) -> None:
        """Queue a reply; one to a peer that is gone is dropped (it times out and retries)."""
        peer = self._named.get(identity)
        if peer is None:
            return
        if peer.outbox and len(peer.outbox) > OUTBOX_LIMIT:
            self._drop(peer)  # it does not read its replies
            return
        peer.outbox += encode(frames)
        self._flush(peer)

    def trust(self, identity: bytes, trusted: bool = True) -> None:
        """The peer is a client's (or no longer): while it is, no new connection replaces it."""
        peer = self._named.get(identity)
        if peer is not None:
            peer.trusted = trusted

    def close_peer(self, identity: bytes) -> None:
        """Close the connection of ``identity`` (its client is forgotten)."""
        peer = self._named.get(identity)
        if peer is not None:
            self._drop(peer, counted=False)

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self._drop(peer, counted=False)
        self.selector.close()
        self.listener.close()

    # ---- internals -----------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(ACCEPT_ROUND):
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return  # ECONNABORTED and the like: that peer is gone already
                if self._replace_one():
                    continue  # a descriptor is free again
                self.selector.unregister(self.listener)
                self._accept_again = time.monotonic() + ACCEPT_PAUSE
                return
            if len(self._peers) >= self.max_peers and not self._replace_one():
                sock.close()
                self.counters.peers_refused += 1
                continue
            sock.setblocking(False)
            self.changes += 1
            peer = Peer(sock)
            self._peers[sock.fileno()] = peer
            self.selector.register(sock, selectors.EVENT_READ, peer)
            # A client sends its greeting and request as it connects: read them now, before a
            # flood of newer connections could replace this one.
            self._read(peer)

    def _replace_one(self) -> bool:
        """Close the oldest peer that is neither a client's nor about to be answered."""
        victim = next((p for p in self._peers.values() if not p.trusted and not p.queued), None)
        if victim is None:
            return False
        self._drop(victim, counted=False)
        self.counters.peers_replaced += 1
        return True

    def _read(self, peer: Peer) -> None:
        """Read what completes the greeting or the message in progress, no more than a
        READ_MIN past it; then take whole messages."""
        if peer.identity is None:
            need = GREETING_BYTES - len(peer.inbox)
        else:
            n = message_length(peer.inbox)
            if n is not None and n > MAX_REQUEST:
                self._drop(peer)  # longer than any request: none of it is read
                return
            need = LENGTH.size - len(peer.inbox) if n is None else LENGTH.size + n - len(peer.inbox)
        if need <= 0:
            return  # a whole message waits its turn in _ready
        try:
            chunk = peer.sock.recv(max(need, READ_MIN))
        except BlockingIOError:
            return
        except OSError:
            self._drop(peer, counted=False)
            return
        if not chunk:
            self._drop(peer, counted=False)
            return
        peer.inbox += chunk
        if peer.identity is None:
            if len(peer.inbox) < GREETING_BYTES:
                return
            if peer.inbox[:len(MAGIC)] != MAGIC:
                self._drop(peer)  # not one of ours (or another wire version)
                return
            identity = bytes(peer.inbox[len(MAGIC):GREETING_BYTES])
            if identity in self._named:
                self._drop(peer)  # the routing id is taken: replies must reach one peer
                return
            del peer.inbox[:GREETING_BYTES]
            peer.identity = identity
            self._named[identity] = peer
        if not peer.queued:
            peer.queued = True
            self._ready.append(peer)

    def _take(self, peer: Peer, messages: list, limit: int) -> bool:
        """Move up to PER_PEER_ROUND whole messages of ``peer`` into ``messages``; whether a
        whole one is left."""
        for _ in range(PER_PEER_ROUND):
            n = message_length(peer.inbox)
            if n is None:
                return False
            if n > MAX_REQUEST:
                self._drop(peer)  # longer than any request: none of it is read
                return False
            if len(peer.inbox) < LENGTH.size + n:
                return False
            if len(messages) >= limit:
                return True
            frames, count = decode(memoryview(peer.inbox)[LENGTH.size:LENGTH.size + n],
                                   KEEP_FRAMES)
            del peer.inbox[:LENGTH.size + n]
            messages.append(Message(peer.identity, frames, count))
        n = message_length(peer.inbox)
        return n is not None and len(peer.inbox) >= LENGTH.size + n

    def _flush(self, peer: Peer) -> None:
        try:
            send_some(peer.sock, peer.outbox)
        except OSError:
            self._drop(peer, counted=False)
            return
        writing = bool(peer.outbox)
        if writing != peer.writing:
            peer.writing = writing
            self.selector.modify(peer.sock, selectors.EVENT_READ
                                 | (selectors.EVENT_WRITE if writing else 0), peer)

    def _drop(self, peer: Peer, counted: bool = True) -> None:
        """Close a peer: one that broke the wire's rules (``counted``), or one that left."""
        if peer.sock.fileno() < 0:
            return
        self.counters.peers_dropped += counted
        self.changes += 1
        self._peers.pop(peer.sock.fileno(), None)
        if peer.identity is not None and self._named.get(peer.identity) is peer:
            del self._named[peer.identity]
            self.gone.append(peer.identity)
        self.selector.unregister(peer.sock)
        peer.sock.close()
        peer.inbox = peer.outbox = bytearray()

