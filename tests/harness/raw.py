"""A protocol-level client of the daemon: the requests as the wire carries them, and the arena
the hello names, mapped."""

import os
from pathlib import Path

from expertd.connection import Connection
from expertd.manifest import Manifest
from expertd.protocol import PROTOCOL_VERSION, Op
from expertd.shm.layout import Arena, SlotState

from .core import SEEN_ARENAS, validate


class RawClient:
    """A protocol-level client: HELLO, DEMAND, RELEASE, and the arena the hello names, mapped."""

    def __init__(self, blob_dir):
        self.blob_dir = Path(blob_dir)
        self.manifest = Manifest.load(self.blob_dir)
        self.conn = Connection(blob_dir)
        self.hello = self.request(Op.HELLO, {"version": PROTOCOL_VERSION,
                                              "client": self.conn.client_id, "pid": os.getpid()})
        SEEN_ARENAS.add(self.hello["arena"])
        self.arena = Arena.attach(self.hello["arena"])
        self.raw = self.arena.raw
        self.slots_offset = self.arena.geometry.slots_offset

    def request(self, op: Op, body: dict | None = None, timeout: float = 10.0) -> dict:
        return self.conn.request(op, body, timeout=timeout)

    def demand(self, layer: int, experts, timeout: float = 20.0) -> dict:
        return self.request(Op.DEMAND, {"layer": int(layer), "experts": [int(e) for e in experts]},
                            timeout=timeout)

    def release(self, lease: int) -> None:
        self.conn.send(Op.RELEASE, {"lease": lease})

    def heartbeat(self) -> dict:
        return self.request(Op.HEARTBEAT, {"client": self.conn.client_id,
                                           "token": self.hello["token"]})

    def row_bytes(self, row: int, layer: int) -> bytes:
        return bytes(self.arena.row(row)[:self.manifest.layers[layer].expert_bytes])

    def fetch(self, layer: int, experts) -> list:
        """Demand, copy the rows, check their seqlock versions, release; the experts' bytes."""
        reply = self.demand(layer, experts)
        try:
            got = [self.row_bytes(row, layer) for row in reply["rows"]]
            if not validate(self.raw, self.slots_offset, reply["rows"], reply["versions"]):
                raise AssertionError(f"a leased row of layer {layer} changed while it was copied")
            return got
        finally:
            self.release(reply["lease"])

    def fill_cache(self, layer: int) -> None:
        """Demand experts 0, 1, ... of ``layer`` until every LFU cache row holds one. While a
        cache row is empty, the daemon moves prefetched rows into it rather than rewrite
        them, so tests of the side rows' own turnover start from a full cache."""
        rows = self.hello["cache_rows"]
        for start in range(0, rows, 2):
            self.fetch(layer, range(start, min(start + 2, rows)))

    def evict(self, layer: int, expert: int, untouched=()) -> None:
        """Fetch every other expert, of every layer, until (layer, expert) has left the cache
        (the policy's per-layer quotas may make a layer evict its own experts first). The
        (layer, expert) keys in ``untouched`` are never fetched."""
        step = self.hello["max_demand"]
        skip = {(layer, expert), *untouched}
        for _ in range(4):
            for other in self.manifest.layers:
                keys = [e for e in range(other.num_experts) if (other.index, e) not in skip]
                for start in range(0, len(keys), step):
                    self.fetch(other.index, keys[start:start + step])
            if self.slot(layer, expert)[0] < 0:
                return
        raise AssertionError(f"layer {layer} expert {expert} stayed in the cache")

    def slot(self, layer: int, expert: int) -> tuple:
        """(row, state, version) of a key as the shared table shows it; row -1 if absent."""
        g = self.arena.geometry
        row = int(self.arena.slot_of[layer * g.n_experts + expert])
        if row < 0:
            return -1, SlotState.EMPTY, 0
        rec = self.arena.slots[row]
        if int(rec["layer"]) != layer or int(rec["expert"]) != expert:
            return -1, SlotState.EMPTY, 0
        return row, int(rec["state"]), int(rec["version"])

    def close(self) -> None:
        self.raw = None
        self.arena.close()
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

