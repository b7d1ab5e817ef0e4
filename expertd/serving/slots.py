"""The slot table: the one map of which arena row holds which expert.

It lives in the shared arena, where clients read it without the daemon (``slot_of`` and the slot
records); only the daemon's serving thread writes it, through this class. A row is rewritten
inside a seqlock write (odd version while it changes), so a client that copied it can tell.
"""

import numpy as np

from expertd import native
from expertd.shm.layout import SlotState

# Uses harvested from one row at once, at most: a client adds one a use, so more (or fewer
# than none: a counter moved back) is a write no client of ours makes, and is ignored.
MAX_HARVEST = 1 << 40


class SlotTable:
    """Every row of the arena (LFU cache rows and prefetch side rows alike) and the experts they
    hold; which row plays which role is the side-row book's business (``expertd.serving.side``).

    The daemon decides from its own copy of the table (which row holds which expert, and in
    what state) and publishes every change to the arena's; it reads nothing back from the
    arena but the clients' use counters (``hits``), whose deltas it bounds. A client can write
    the whole arena (its mapping is read-write, for the hits and its epoch record), so what a
    buggy or hostile client writes there misleads clients, never the daemon: no bad key, row
    number or state in the arena can stop it, wedge it or make it fail a request.

    Args:
        arena: the daemon's :class:`~expertd.shm.layout.Arena`.
    """

    def __init__(self, arena):
        g = arena.geometry
        self.n_rows = g.total_rows
        self.n_experts = g.n_experts
        self._raw = arena.raw
        self._slots_offset = g.slots_offset
        self.records = arena.slots  # the published table (clients read it)
        self._published_slot_of = arena.slot_of.reshape(g.n_layers, g.n_experts)
        # The daemon's own copy, which only this class writes.
        self._layer = np.full(self.n_rows, -1, np.int64)
        self._expert = np.full(self.n_rows, -1, np.int64)
        self._state = np.full(self.n_rows, int(SlotState.EMPTY), np.uint32)
        self._slot_of = np.full((g.n_layers, g.n_experts), -1, np.int64)
        # Clients add to ``hits`` lock-free; what was harvested last is kept per row, so a row's
        # uses are credited to the expert it held when it was used.
        self._harvested = np.zeros(self.n_rows, dtype=np.uint64)

    def lookup(self, layer: int, expert: int) -> tuple:
        """``(row, state)`` of the row holding (layer, expert), or ``(-1, EMPTY)``."""
        row = int(self._slot_of[layer, expert])
        if row >= 0:
            return row, int(self._state[row])
        return -1, SlotState.EMPTY

    def key(self, row: int) -> tuple | None:
        """The (layer, expert) a row holds or is being filled with; None if it is empty."""
        if self._state[row] == SlotState.EMPTY:
            return None
        return int(self._layer[row]), int(self._expert[row])

    def row_keys(self) -> np.ndarray:
        """Flat key ``layer * n_experts + expert`` of every row, -1 where empty."""
        keys = self._layer * self.n_experts + self._expert
        keys[self._state == SlotState.EMPTY] = -1
        return keys

    def states(self, rows=slice(None)) -> np.ndarray:
        """The state of ``rows`` (all by default), a SlotState value each."""
        return self._state[rows]

    def filling(self) -> np.ndarray:
        """Bool per row: a fill is in flight."""
        return self._state == SlotState.FILLING

    def versions(self, rows) -> list:
        return [int(v) for v in self.records["version"][rows]]

    def rows_used(self, among: np.ndarray | None = None) -> int:
        """Rows that hold (or are being filled with) an expert; only ``among`` (bool per row)."""
        used = self._state != SlotState.EMPTY
        return int(np.count_nonzero(used if among is None else used & among))

    def begin_fill(self, row: int, layer: int, expert: int) -> tuple | None:
        """Give ``row`` to (layer, expert), state FILLING, inside a seqlock write.

        Returns:
            ``(old_key, hits)``: the key the row held and its uses not harvested yet, or None.
        """
        evicted = None
        if self._state[row] != SlotState.EMPTY:
            old = int(self._layer[row]), int(self._expert[row])
            self._unmap(row, *old)
            evicted = (old, self._harvest_row(row))
        native.begin_write(self._raw, self._slots_offset, row)
        self._set(row, layer, expert, SlotState.FILLING)
        self._slot_of[layer, expert] = self._published_slot_of[layer, expert] = row
        return evicted

    def end_fill(self, row: int, ok: bool) -> None:
        """The fill of ``row`` is over: READY, or EMPTY (and unmapped) if it failed."""
        if ok:
            self._set(row, int(self._layer[row]), int(self._expert[row]), SlotState.READY)
        else:
            self._unmap(row, int(self._layer[row]), int(self._expert[row]))
            self._set(row, -1, -1, SlotState.EMPTY)
        native.end_write(self._raw, self._slots_offset, row)

    def _set(self, row: int, layer: int, expert: int, state: SlotState) -> None:
        """Our copy of ``row``, and the arena's (inside the caller's seqlock write)."""
        self._layer[row], self._expert[row], self._state[row] = layer, expert, state
        rec = self.records[row:row + 1]
        rec["layer"], rec["expert"], rec["state"] = layer, expert, state

    def _unmap(self, row: int, layer: int, expert: int) -> None:
        if self._slot_of[layer, expert] == row:
            self._slot_of[layer, expert] = self._published_slot_of[layer, expert] = -1

    def _deltas(self, rows) -> np.ndarray:
        """Uses of ``rows`` since their last harvest (int64), now harvested; a delta out of
        [0, MAX_HARVEST] is a counter no client of ours wrote: 0, the counter taken as it is."""
        hits = self.records["hits"][rows].copy()
        delta = (hits - self._harvested[rows]).view(np.int64)
        self._harvested[rows] = hits
        return np.where((delta >= 0) & (delta <= MAX_HARVEST), delta, 0)

    def _harvest_row(self, row: int) -> int:
        return int(self._deltas(np.array([row]))[0])

    def harvest(self, rows: np.ndarray | None = None) -> tuple:
        """Uses of READY rows since the last harvest: ``(rows, counts)``, both arrays.

        Args:
            rows: harvest only these rows (int array), e.g. the side rows before a prefetch.
        """
        rows = np.arange(self.n_rows) if rows is None else rows
        delta = self._deltas(rows)
        used = (delta != 0) & (self._state[rows] == SlotState.READY)
        return rows[used], delta[used]
