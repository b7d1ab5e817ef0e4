"""The slot table: the one map of which arena row holds which expert.

It lives in the shared arena, where clients read it without the daemon (``slot_of`` and the slot
records); only the daemon's serving thread writes it, through this class. A row is rewritten
inside a seqlock write (odd version while it changes), so a client that copied it can tell.
"""

import numpy as np

from expertd import native
from expertd.shm.layout import SlotState


class SlotTable:
    """Every row of the arena (LFU cache rows and prefetch side rows alike) and the experts they
    hold; which row plays which role is the side-row book's business (``expertd.serving.side``).

    Args:
        arena: the daemon's :class:`~expertd.shm.layout.Arena`.
    """

    def __init__(self, arena):
        g = arena.geometry
        self.n_rows = g.total_rows
        self.n_experts = g.n_experts
        self._raw = arena.raw
        self._slots_offset = g.slots_offset
        self.records = arena.slots
        self.slot_of = arena.slot_of.reshape(g.n_layers, g.n_experts)
        # Clients add to ``hits`` lock-free; what was harvested last is kept per row, so a row's
        # uses are credited to the expert it held when it was used.
        self._harvested = np.zeros(self.n_rows, dtype=np.uint64)

    def lookup(self, layer: int, expert: int) -> tuple:
        """``(row, state)`` of the row holding (layer, expert), or ``(-1, EMPTY)``."""
        row = int(self.slot_of[layer, expert])
        if row >= 0:
            rec = self.records[row]
            if rec["layer"] == layer and rec["expert"] == expert:
                return row, int(rec["state"])
        return -1, SlotState.EMPTY

    def key(self, row: int) -> tuple | None:
        """The (layer, expert) a row holds or is being filled with; None if it is empty."""
        rec = self.records[row]
        if rec["state"] == SlotState.EMPTY:
            return None
        return int(rec["layer"]), int(rec["expert"])

    def row_keys(self) -> np.ndarray:
        """Flat key ``layer * n_experts + expert`` of every row, -1 where empty."""
        recs = self.records[:self.n_rows]
        keys = recs["layer"].astype(np.int64) * self.n_experts + recs["expert"]
        keys[recs["state"] == SlotState.EMPTY] = -1
        return keys

    def filling(self) -> np.ndarray:
        """Bool per row: a fill is in flight."""
        return self.records["state"][:self.n_rows] == SlotState.FILLING

    def versions(self, rows) -> list:
        return [int(v) for v in self.records["version"][rows]]

    def rows_used(self, among: np.ndarray | None = None) -> int:
        """Rows that hold (or are being filled with) an expert; only ``among`` (bool per row)."""
        used = self.records["state"][:self.n_rows] != SlotState.EMPTY
        return int(np.count_nonzero(used if among is None else used & among))

    def begin_fill(self, row: int, layer: int, expert: int) -> tuple | None:
        """Give ``row`` to (layer, expert), state FILLING, inside a seqlock write.

        Returns:
            ``(old_key, hits)``: the key the row held and its uses not harvested yet, or None.
        """
        rec = self.records[row:row + 1]
        evicted = None
        if rec["state"][0] != SlotState.EMPTY:
            old_layer, old_expert = int(rec["layer"][0]), int(rec["expert"][0])
            if self.slot_of[old_layer, old_expert] == row:
                self.slot_of[old_layer, old_expert] = -1
            evicted = ((old_layer, old_expert), self._harvest_row(row))
        native.begin_write(self._raw, self._slots_offset, row)
        rec["layer"], rec["expert"], rec["state"] = layer, expert, SlotState.FILLING
        self.slot_of[layer, expert] = row
        return evicted

    def end_fill(self, row: int, ok: bool) -> None:
        """The fill of ``row`` is over: READY, or EMPTY (and unmapped) if it failed."""
        rec = self.records[row:row + 1]
        if ok:
            rec["state"] = SlotState.READY
        else:
            layer, expert = int(rec["layer"][0]), int(rec["expert"][0])
            if self.slot_of[layer, expert] == row:
                self.slot_of[layer, expert] = -1
            rec["layer"], rec["expert"], rec["state"] = -1, -1, SlotState.EMPTY
        native.end_write(self._raw, self._slots_offset, row)

    def _harvest_row(self, row: int) -> int:
        hits = self.records["hits"][row]
        delta = int(hits - self._harvested[row])
        self._harvested[row] = hits
        return delta

    def harvest(self, rows: np.ndarray | None = None) -> tuple:
        """Uses of READY rows since the last harvest: ``(rows, counts)``, both arrays.

        Args:
            rows: harvest only these rows (int array), e.g. the side rows before a prefetch.
        """
        if rows is not None:
            hits = self.records["hits"][rows]
            delta = hits - self._harvested[rows]
            self._harvested[rows] = hits
            used = (delta != 0) & (self.records["state"][rows] == SlotState.READY)
            return rows[used], delta[used]
        hits = self.records["hits"][:self.n_rows].copy()
        delta = hits - self._harvested
        self._harvested = hits
        rows = np.flatnonzero(delta)
        ready = self.records["state"][rows] == SlotState.READY
        return rows[ready], delta[rows[ready]]
