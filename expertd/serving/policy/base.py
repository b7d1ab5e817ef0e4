"""What a cache policy is told and asked: the events of the arena's rows, and the victims.

The cache tells a policy what happens to keys (layer, expert): filled into a row, used, evicted
from one. It asks which rows to evict: empty ones first, then the rows of the keys the policy
ranks coldest, never a pinned key's (the pin book's) nor an ineligible row (leased, filling, a
side row). Per-layer quotas (quotas.py) may narrow the choice for a demand that names its layer.
Which row holds which key is not kept here: the slot table is the one map of that, passed in as
``row_keys`` (flat key per row, -1 for an empty row). No I/O, threads or logging: the daemon
owns the locking. Arguments are checked where they enter: sizes in the constructor, saved
states in :meth:`load_state`, keys on each event; the slot table's arrays, on each eviction, for
their shape only (its key range is the table's own invariant).
"""

import abc
import math

import numpy as np

from expertd.serving.policy.keys import KeySpace, non_negative_int, positive_int
from expertd.serving.policy.pins import PinBook, check_row_keys
from expertd.serving.policy.quotas import LayerQuotas

STATE_FORMAT = "expertd-policy"
STATE_VERSION = 1


class CachePolicy(abc.ABC):
    """The interface, and what every policy shares: keys, pins, quotas, the saved state.

    A policy ranks keys: :meth:`coldest` (to evict), :meth:`hottest` (to pin, to warm a
    restarted daemon with) and :meth:`strength` (to compare layers' weakest keys), and keeps
    what it ranks by up to date through the events.

    Args:
        n_rows: rows in the arena.
        n_layers: MoE layers; keys have ``0 <= layer < n_layers``.
        n_experts: experts per layer (the largest layer's count); ``0 <= expert < n_experts``.
        pins: the pin book to respect; None: a book of its own, without a cap.
        layer_quotas: hold demands that name their layer to per-layer quotas (see
            :meth:`victims`); False ignores the layer.
        min_quota: no layer's quota is moved below this (the daemon passes the model's top_k).
        ghosts: recently evicted keys remembered per layer, to move quotas.
    Raises:
        ValueError: on any argument out of range.
    """

    name = ""  # its name in POLICIES

    def __init__(self, n_rows: int, n_layers: int, n_experts: int, *,
                 pins: PinBook | None = None, layer_quotas: bool = True, min_quota: int = 1,
                 ghosts: int = 8):
        self.n_rows = positive_int("n_rows", n_rows)
        self.keys = KeySpace(n_layers, n_experts)
        self.n_layers, self.n_experts = self.keys.n_layers, self.keys.n_experts
        if not isinstance(layer_quotas, bool):
            raise ValueError(f"layer_quotas must be True or False, got {layer_quotas!r}")
        self.quotas = LayerQuotas(self.n_rows, self.keys, min_quota, ghosts) if layer_quotas else None
        if pins is None:
            pins = PinBook(self.keys, self.n_rows)
        elif pins.keys.size != self.keys.size or pins.n_rows != self.n_rows:
            raise ValueError("the pin book must span the policy's keys and rows")
        self.pins = pins

    # ---- events ----------------------------------------------------------------------------

    @abc.abstractmethod
    def on_touched(self, key, count: int = 1) -> None:
        """``key`` was used ``count`` times, resident or not (client hits, demands, fills)."""

    def on_filled(self, key, used: bool) -> None:
        """A row starts to be filled with ``key``; ``used``: the fill is a use (a demand's or a
        background fill), not a prefetch's guess, which counts once something uses it."""
        if used:
            self.on_touched(key)

    def on_evicted(self, key, uses: int) -> None:
        """``key`` left its row for another key; ``uses``: its uses the table counted and
        nobody harvested yet (they belong to the old key)."""
        if uses:
            self.on_touched(key, uses)

    # ---- ranking ---------------------------------------------------------------------------

    @abc.abstractmethod
    def coldest(self, flats: np.ndarray, need: int) -> np.ndarray:
        """Positions in ``flats`` (distinct flat keys) of up to ``need`` of them, the first to
        evict first."""

    @abc.abstractmethod
    def hottest(self, flats: np.ndarray, limit: int) -> np.ndarray:
        """Up to ``limit`` of ``flats``, hottest first; keys the policy knows no use of are
        left out."""

    @abc.abstractmethod
    def strength(self, flats: np.ndarray) -> np.ndarray:
        """A float per key, lower for keys sooner evicted (what :meth:`state` saves)."""

    @abc.abstractmethod
    def load_strength(self, flats: np.ndarray, values: np.ndarray) -> None:
        """Replace what the policy ranks by with a saved state's ``strength``, hottest first."""

    # ---- choices ---------------------------------------------------------------------------

    def victims(self, n: int, eligible: np.ndarray, row_keys: np.ndarray,
                layer: int | None = None, missing=()) -> list[int]:
        """Up to ``n`` rows to evict, best first.

        Empty rows come first (lowest row first), then rows in the order of :meth:`coldest`.
        Rows with ``eligible[row]`` False and rows holding a pinned key are never returned.
        With ``layer`` (the demanding layer) and quotas on, the quotas narrow the choice (see
        :meth:`LayerQuotas.victims`), the rule above applying within each step.

        Args:
            n: how many rows are wanted.
            eligible: bool array of ``n_rows``; the daemon clears leased and filling rows.
            row_keys: the slot table's flat key per row, -1 for an empty row.
            layer: the layer of the demand these rows are for; None (background fills,
                promotions of side rows) ignores quotas.
            missing: experts of ``layer`` the demand will fill into the returned rows.
        Returns:
            Distinct row numbers, fewer than ``n`` if not enough rows qualify.
        """
        n = non_negative_int("n", n)
        eligible = np.asarray(eligible)
        if eligible.shape != (self.n_rows,) or eligible.dtype != np.bool_:
            raise ValueError(f"eligible must be a bool array of shape ({self.n_rows},), "
                             f"got {eligible.dtype} {eligible.shape}")
        row_keys = check_row_keys(row_keys, self.n_rows, self.keys.size, full=False)
        if layer is not None:
            layer = self.keys.layer(layer)
            missing = [self.keys.flat((layer, e)) for e in missing]
        if n == 0:
            return []
        if layer is None or self.quotas is None:
            chosen = self.plain_victims(n, eligible, row_keys)
        else:
            chosen = self.quotas.victims(self, n, eligible, row_keys, layer, missing)
        if self.quotas is not None:
            self.quotas.remember(row_keys[chosen].tolist())
        return chosen

    def plain_victims(self, n: int, eligible: np.ndarray, row_keys: np.ndarray) -> list[int]:
        """The plain rule: empty eligible rows, then the coldest unpinned keys' rows."""
        empty = np.flatnonzero(eligible & (row_keys < 0))
        if empty.size >= n:
            return empty[:n].tolist()
        rows = np.flatnonzero(eligible & (row_keys >= 0))
        rows = rows[~self.pins.pinned[row_keys[rows]]]
        return empty.tolist() + rows[self.coldest(row_keys[rows], n - empty.size)].tolist()

    def hot_keys(self, limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` keys, hottest first (for the warm-restart file)."""
        limit = non_negative_int("limit", limit)
        return self.keys.keys(self.hottest(np.arange(self.keys.size), limit))

    # ---- persistence -----------------------------------------------------------------------

    def state(self) -> dict:
        """A JSON-serialisable snapshot: every key the policy knows a use of, hottest first,
        with its :meth:`strength`, and the explicit pins (automatic pins, clients' holds and
        quotas are not saved)."""
        hot = self.hottest(np.arange(self.keys.size), self.keys.size)
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "frequencies": [[*self.keys.key(flat), value]
                            for flat, value in zip(hot.tolist(), self.strength(hot).tolist())],
            "pins": self.pins.explicit_state(),
        }

    def load_state(self, d: dict) -> None:
        """Replace the ranking and the explicit pins with those of a ``state()`` snapshot.

        Entries whose layer or expert is out of range (e.g. another model) are ignored; automatic
        pins and clients' holds are left as they are. The order of the entries ranks equal values.

        Raises:
            ValueError: if the snapshot is malformed; nothing is changed then.
        """
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT:
            raise ValueError(f"not an {STATE_FORMAT} state")
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported policy state version {d.get('version')!r}, "
                             f"expected {STATE_VERSION}")
        frequencies, pins = d.get("frequencies"), d.get("pins")
        if not isinstance(frequencies, list) or not isinstance(pins, list):
            raise ValueError("policy state needs 'frequencies' and 'pins' lists")
        flats, values = [], []
        for entry in frequencies:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise ValueError(f"bad frequency entry {entry!r}: expected [layer, expert, value]")
            layer, expert, value = entry
            flat = self.keys.saved_key(layer, expert)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"bad frequency entry {entry!r}: value must be finite and >= 0")
            if flat is not None:
                flats.append(flat)
                values.append(value)
        explicit = self.pins.parse_state(pins)
        self.load_strength(np.array(flats, dtype=np.int64), np.array(values, dtype=np.float64))
        self.pins.load_explicit(explicit)
