"""What the PREFETCH attack tests share (``test_prefetch_attack_*``): a PREFETCH answered in
order, STATS once quiet, and the invariants of a quiet daemon's arena."""

import numpy as np

from expertd.protocol import Op
from expertd.shm.layout import SlotState

from .core import wait_until
from .raw import RawClient


def prefetch(c: RawClient, layer: int, experts) -> dict:
    """A PREFETCH, then the STATS that follow it (a peer is served in order)."""
    c.conn.send(Op.PREFETCH, {"layer": int(layer), "experts": [int(e) for e in experts]})
    return c.request(Op.STATS)


def quiet(c: RawClient, timeout: float = 10.0) -> dict:
    """STATS once no fill is in flight."""
    return wait_until(lambda: (s := c.request(Op.STATS))["in_flight"] == 0 and s, timeout,
                      "the fills to end")


def check_arena(c: RawClient, stats: dict) -> None:
    """What must hold of a quiet daemon: fixed role counts, one row per expert, every
    non-empty row mapped and ready."""
    g = c.arena.geometry
    recs = c.arena.slots[:g.total_rows]
    assert stats["side_rows"] == 2 * g.side_rows and stats["arena_rows"] == g.cache_rows
    assert 0 <= stats["side_rows_used"] <= stats["side_rows"], stats
    assert 0 <= stats["rows_used"] <= stats["arena_rows"], stats
    used = np.flatnonzero(recs["state"] != SlotState.EMPTY)
    assert stats["rows_used"] + stats["side_rows_used"] == len(used), stats
    keys = [(int(recs[r]["layer"]), int(recs[r]["expert"])) for r in used]
    assert len(set(keys)) == len(keys), f"an expert in two rows: {keys}"
    for row, key in zip(used.tolist(), keys):
        assert int(recs[row]["state"]) == SlotState.READY and int(recs[row]["version"]) % 2 == 0
        assert c.slot(*key)[0] == row, f"row {row} holds {key} but the table maps it elsewhere"
