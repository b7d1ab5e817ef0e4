"""The client registry: who said hello, and when each was last heard from.

A client is alive while it is heard from (any request, or a heartbeat carrying the token its
hello got) within ``time_to_dead`` seconds; then it is dead, whatever its pid says (a reused
pid cannot keep a dead client's leases alive).
"""

import hmac
import os
from dataclasses import dataclass

from expertd.protocol import HEARTBEAT_COUNTS, HEARTBEAT_TOKEN_BYTES
from expertd.serving.stats import ClientStats

# Clients known at once: each holds an epoch record, leases and clean-up work; past this a
# hello is refused as busy (a loop of hellos from one user cannot grow the registry).
MAX_CLIENTS = 96


# The counts a heartbeat reports beside steps and host waits (protocol.Heartbeat's), at zero.
OTHER_COUNTS = dict.fromkeys(HEARTBEAT_COUNTS[2:], 0)


@dataclass(eq=False)
class Client:
    identity: bytes  # the routing id of its request socket
    pid: int
    token: bytes  # what its heartbeat socket must show
    last_seen: float
    prefetch_reads: int = 0  # experts read ahead because it asked (its share of bytes read)
    pool_bytes: int = 0  # its own expert memory, as its hello said
    steps: int = 0  # its forward steps and the host waits in them, as its heartbeat said
    host_waits: int = 0
    counts: dict | None = None  # the rest of its heartbeat's counts (replays, rows pulled)


class ClientRegistry:
    """Clients by routing id.

    Args:
        time_to_dead: seconds without a word after which a client is dead.
        max_clients: most clients known at once (each costs the daemon memory and clean-up).
    """

    def __init__(self, time_to_dead: float, max_clients: int = 1024):
        if not time_to_dead > 0:
            raise ValueError("time_to_dead must be positive")
        self.time_to_dead = time_to_dead
        self.max_clients = max_clients
        self._clients: dict = {}

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._clients

    def get(self, identity: bytes) -> Client | None:
        return self._clients.get(identity)

    def of_process(self, pid: int) -> int:
        """How many clients process ``pid`` has attached."""
        return sum(c.pid == pid for c in self._clients.values())

    def hello(self, identity: bytes, pid: int, now: float, pool_bytes: int = 0) -> Client | None:
        """Register a client (a second hello keeps its token, and the daemon its pins); None if
        full."""
        client = self._clients.get(identity)
        if client is None:
            if len(self._clients) >= self.max_clients:
                return None
            client = Client(identity, pid, os.urandom(HEARTBEAT_TOKEN_BYTES), now)
            self._clients[identity] = client
        client.pid, client.last_seen, client.pool_bytes = pid, now, pool_bytes
        return client

    def stats(self) -> ClientStats:
        """How many clients, and per client its pid, its own expert memory and its host waits
        (for status)."""
        return ClientStats(len(self._clients), [
            {"pid": c.pid, "pool_bytes": c.pool_bytes, "steps": c.steps,
             "host_waits": c.host_waits, **OTHER_COUNTS, **(c.counts or {})}
            for c in self._clients.values()])  # every key, before a heartbeat too

    def seen(self, identity: bytes, now: float) -> Client | None:
        """A request from ``identity``: it is alive. None if it never said hello."""
        client = self._clients.get(identity)
        if client is not None:
            client.last_seen = now
        return client

    def heartbeat(self, identity: bytes, token: bytes, now: float, steps: int = 0,
                  host_waits: int = 0, **counts: int) -> bool:
        """A heartbeat naming ``identity``; counts only with that client's token."""
        client = self._clients.get(identity)
        if client is None or not hmac.compare_digest(client.token, token):
            return False
        client.last_seen, client.steps, client.host_waits = now, steps, host_waits
        client.counts = counts or None
        return True

    def remove(self, identity: bytes) -> Client | None:
        return self._clients.pop(identity, None)

    def dead(self, now: float) -> list:
        """Clients not heard from within ``time_to_dead``, removed from the registry."""
        gone = [c for c in self._clients.values() if now - c.last_seen > self.time_to_dead]
        for client in gone:
            del self._clients[client.identity]
        return gone
