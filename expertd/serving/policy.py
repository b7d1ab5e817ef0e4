"""The arena's cache policy: LFU with decay and pins, as pure logic driven by events.

Frequencies are kept per key (layer, expert), not per row, so an expert that was evicted and
comes back keeps its history. A demand of layer L may also be held to per-layer quotas: layers
are visited in order, so when L demands, L's other experts wait a whole token and evicting among
them wastes least; quotas move to layers that miss keys they evicted lately (ghosts).

Which row holds which key is not kept here: the daemon's slot table is the one map of that, and
passes it in as ``row_keys`` (flat key per row, -1 for an empty row) to the calls that need it.
No I/O, threads or logging here: the daemon owns the locking.
"""

import math
import operator

import numpy as np

STATE_FORMAT = "expertd-policy"
STATE_VERSION = 1
# Decayed frequencies below this are flushed to zero: such keys are cold, and subnormal floats
# would slow every later pass over the array.
FREQUENCY_FLOOR = 1e-12


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


class LfuPolicy:
    """Chooses which arena rows to evict: empty rows, then the least frequently used keys.

    Args:
        n_rows: rows in the arena.
        n_layers: MoE layers; keys have ``0 <= layer < n_layers``.
        n_experts: experts per layer (the largest layer's count); ``0 <= expert < n_experts``.
        decay_interval: touches (sum of counts) after which every frequency is multiplied by
            ``decay_factor``; 0 means ``8 * n_rows``.
        decay_factor: in (0, 1]; 1 disables decay.
        layer_quotas: hold demands that name their layer to per-layer quotas (see
            :meth:`victims`); False ignores the layer.
        min_quota: no layer's quota is moved below this (the daemon passes the model's top_k).
        ghosts: recently evicted keys remembered per layer, to move quotas.
    Raises:
        ValueError: on any argument out of range.
    """

    def __init__(self, n_rows: int, n_layers: int, n_experts: int, *,
                 decay_interval: int = 0, decay_factor: float = 0.5,
                 layer_quotas: bool = True, min_quota: int = 1, ghosts: int = 8):
        self.n_rows = _positive_int("n_rows", n_rows)
        self.n_layers = _positive_int("n_layers", n_layers)
        self.n_experts = _positive_int("n_experts", n_experts)
        if not isinstance(layer_quotas, bool):
            raise ValueError(f"layer_quotas must be True or False, got {layer_quotas!r}")
        self.layer_quotas = layer_quotas
        self.min_quota = _positive_int("min_quota", min_quota)
        self.n_ghosts = _count("ghosts", ghosts)
        # Rows per layer, an even split to start with; they sum to n_rows and are not saved.
        base, extra = divmod(self.n_rows, self.n_layers)
        self.quotas = np.full(self.n_layers, base, dtype=np.int64)
        self.quotas[:extra] += 1
        # Per layer, its last evicted keys (flat), oldest first: a dict kept in insertion order.
        self._ghosts = [{} for _ in range(self.n_layers)]
        decay_interval = _count("decay_interval", decay_interval)
        if isinstance(decay_factor, bool) or not isinstance(decay_factor, (int, float, np.floating)):
            raise ValueError(f"decay_factor must be a number, got {decay_factor!r}")
        if not 0.0 < decay_factor <= 1.0:
            raise ValueError(f"decay_factor must be in (0, 1], got {decay_factor}")
        self.decay_interval = decay_interval or 8 * self.n_rows
        self.decay_factor = float(decay_factor)

        n_keys = self.n_layers * self.n_experts
        # Keys are stored flat as layer * n_experts + expert; -1 means "none".
        self._freq = np.zeros(n_keys, dtype=np.float64)
        self._last_used = np.zeros(n_keys, dtype=np.int64)  # logical clock, for ties
        self._explicit_pins = np.zeros(n_keys, dtype=bool)
        self._auto_pins = np.zeros(n_keys, dtype=bool)
        # Clients' pins, counted per key: two clients holding one key need two drops.
        self._holds = np.zeros(n_keys, dtype=np.int64)
        self._pinned = np.zeros(n_keys, dtype=bool)  # explicit | auto | held, kept in step
        self._clock = 0
        self._since_decay = 0

    # --- keys and rows ---

    def _flat(self, key) -> int:
        try:
            layer, expert = key
            layer, expert = operator.index(layer), operator.index(expert)
        except (TypeError, ValueError):
            raise ValueError(f"key must be a pair of integers (layer, expert), got {key!r}") from None
        if not (0 <= layer < self.n_layers and 0 <= expert < self.n_experts):
            raise ValueError(f"key ({layer}, {expert}) out of range "
                             f"(layers 0..{self.n_layers - 1}, experts 0..{self.n_experts - 1})")
        return layer * self.n_experts + expert

    def _key(self, flat: int) -> tuple[int, int]:
        return divmod(int(flat), self.n_experts)

    def _check_row_keys(self, row_keys) -> np.ndarray:
        """``row_keys`` as an int64 array, after checking its shape, dtype and range."""
        row_keys = np.asarray(row_keys)
        if row_keys.shape != (self.n_rows,) or row_keys.dtype.kind not in "iu":
            raise ValueError(f"row_keys must be an integer array of shape ({self.n_rows},), "
                             f"got {row_keys.dtype} {row_keys.shape}")
        if row_keys.size and (row_keys.min() < -1 or row_keys.max() >= self._freq.size):
            raise ValueError(f"row_keys out of range: each must be -1 (empty) or a flat key "
                             f"0..{self._freq.size - 1} (layer * n_experts + expert)")
        return row_keys.astype(np.int64, copy=False)

    # --- events ---

    def on_touched(self, key, count: int = 1) -> None:
        """``key`` was used ``count`` times, resident or not (client hits, demands, fills)."""
        flat = self._flat(key)
        count = _count("count", count)
        if count:
            self._touch(flat, count)

    def touch_many(self, layer: int, experts: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Vectorized ``on_touched`` for several experts of one layer; repeated experts add up.

        Args:
            layer: the MoE layer.
            experts: integer array of expert ids.
            counts: integer array of the same shape, non-negative; None means one use each.
        """
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise ValueError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} out of range (0..{self.n_layers - 1})")
        experts = np.asarray(experts).ravel()
        if experts.size == 0:
            return
        if experts.dtype.kind not in "iu":
            raise ValueError(f"experts must be an integer array, got dtype {experts.dtype}")
        if experts.min() < 0 or experts.max() >= self.n_experts:
            raise ValueError(f"experts out of range (0..{self.n_experts - 1})")
        experts = experts.astype(np.intp, copy=False)
        if counts is None:
            per_expert = np.bincount(experts, minlength=self.n_experts)
        else:
            counts = np.asarray(counts).ravel()
            if counts.shape != experts.shape or counts.dtype.kind not in "iu":
                raise ValueError("counts must be an integer array of the same length as experts")
            if counts.min() < 0:
                raise ValueError("counts must be non-negative")
            per_expert = np.bincount(experts, weights=counts, minlength=self.n_experts)
        used = np.flatnonzero(per_expert)
        if used.size == 0:
            return
        base = int(layer) * self.n_experts
        self._freq[base:base + self.n_experts] += per_expert
        # One clock tick per expert keeps recency a strict order among resident keys.
        self._last_used[base + used] = self._clock + 1 + np.arange(used.size)
        self._clock += int(used.size)
        self._add_touches(int(per_expert.sum()))

    def _touch(self, flat: int, count: int) -> None:
        self._freq[flat] += count
        self._clock += 1
        self._last_used[flat] = self._clock
        self._add_touches(count)

    def _add_touches(self, count: int) -> None:
        self._since_decay += count
        if self._since_decay >= self.decay_interval:
            steps, self._since_decay = divmod(self._since_decay, self.decay_interval)
            self._scale(self.decay_factor ** steps)

    def decay(self) -> None:
        """Multiply every frequency by ``decay_factor`` (also done every ``decay_interval`` touches)."""
        self._scale(self.decay_factor)

    def _scale(self, factor: float) -> None:
        self._freq *= factor
        self._freq[self._freq < FREQUENCY_FLOOR] = 0.0

    def frequency(self, key) -> float:
        """The decayed frequency of ``key``."""
        return float(self._freq[self._flat(key)])

    # --- pins ---

    def _repin(self, flat) -> None:
        """Recompute the combined pin flag of ``flat`` (a key, or a slice for all of them)."""
        held = self._holds[flat] > 0
        self._pinned[flat] = self._explicit_pins[flat] | self._auto_pins[flat] | held

    def pin(self, key) -> None:
        """Pin ``key`` explicitly (the pin file's kind, saved in :meth:`state`); it need not be
        resident yet. Pinned keys are never evicted."""
        flat = self._flat(key)
        self._explicit_pins[flat] = True
        self._pinned[flat] = True

    def unpin(self, key) -> None:
        """Drop an explicit pin; an automatic pin or a client's hold on the same key stays."""
        flat = self._flat(key)
        self._explicit_pins[flat] = False
        self._repin(flat)

    def hold(self, key) -> None:
        """A client pins ``key`` for as long as it lives: reference-counted, never saved.

        The daemon calls :meth:`drop` once per hold when the client unpins or goes away, so a
        vanished client's pins do not outlive it.
        """
        flat = self._flat(key)
        self._holds[flat] += 1
        self._pinned[flat] = True

    def drop(self, key) -> None:
        """Release one :meth:`hold` of ``key``.

        Raises:
            ValueError: if ``key`` is not held (a drop without its hold is a daemon bug).
        """
        flat = self._flat(key)
        if self._holds[flat] <= 0:
            raise ValueError(f"key {self._key(flat)} is not held: drop without a matching hold")
        self._holds[flat] -= 1
        self._repin(flat)

    def is_pinned(self, key) -> bool:
        """True if ``key`` is pinned explicitly, automatically or held by a client."""
        return bool(self._pinned[self._flat(key)])

    @property
    def pinned_keys(self) -> set:
        """Every pinned key: explicit, automatic or held."""
        return {self._key(flat) for flat in np.flatnonzero(self._pinned)}

    @property
    def n_explicit_pins(self) -> int:
        """Keys pinned with :meth:`pin` (not counting automatic pins or holds)."""
        return int(np.count_nonzero(self._explicit_pins))

    @property
    def n_pinned_keys(self) -> int:
        """Keys pinned explicitly or held by a client (what the daemon's pin cap counts)."""
        return int(np.count_nonzero(self._explicit_pins | (self._holds > 0)))

    def n_pinned_rows(self, row_keys: np.ndarray) -> int:
        """Resident rows whose key is pinned (any kind).

        Args:
            row_keys: the slot table's flat key per row, -1 for an empty row.
        """
        row_keys = self._check_row_keys(row_keys)
        return int(np.count_nonzero(self._pinned[row_keys[row_keys >= 0]]))

    def auto_pin(self, n: int, row_keys: np.ndarray) -> list[tuple[int, int]]:
        """Replace the automatic pins with the ``n`` hottest resident keys.

        Keys pinned explicitly are not candidates (they are protected already) and their pins are
        left alone; held keys are candidates, since a hold ends with its client. Keys with zero
        frequency are never auto-pinned.

        Args:
            n: how many keys to pin.
            row_keys: the slot table's flat key per row, -1 for an empty row.
        Returns:
            The auto-pinned keys, hottest first (fewer than ``n`` if not enough qualify).
        """
        n = _count("n", n)
        row_keys = self._check_row_keys(row_keys)
        self._auto_pins[:] = False
        resident = np.unique(row_keys[row_keys >= 0])
        candidates = resident[~self._explicit_pins[resident] & (self._freq[resident] > 0)]
        chosen = self._hottest(candidates, n)
        self._auto_pins[chosen] = True
        self._repin(slice(None))
        return [self._key(flat) for flat in chosen]

    # --- choices ---

    def _hottest(self, flats: np.ndarray, limit: int) -> np.ndarray:
        """Up to ``limit`` of ``flats``, by frequency then recency, highest first."""
        if limit == 0:
            return flats[:0]
        if limit < flats.size:
            freq = self._freq[flats]
            # Keep every key tied with the limit-th one, then let the sort break the tie.
            kth = np.partition(freq, flats.size - limit)[flats.size - limit]
            flats = flats[freq >= kth]
        order = np.lexsort((-self._last_used[flats], -self._freq[flats]))
        return flats[order[:limit]]

    def victims(self, n: int, eligible: np.ndarray, row_keys: np.ndarray,
                layer: int | None = None, missing=()) -> list[int]:
        """Up to ``n`` rows to evict, best first.

        Empty rows come first (lowest row first), then rows whose key has the lowest decayed
        frequency, ties broken by least recent fill or touch. Rows with ``eligible[row]`` False
        and rows holding a pinned key (explicit, automatic or held) are never returned.

        With ``layer`` (the demanding layer) and quotas on, the choice is narrowed, the rule
        above applying within each step: while ``layer`` holds fewer rows than its quota, it
        takes empty rows and rows of layers over their quota; then empty rows and its own rows;
        what those cannot give, any eligible row. Before that, each of ``missing`` that
        ``layer`` evicted lately moves one row of quota to ``layer`` from the layer whose
        weakest unpinned resident key is weakest (never below ``min_quota``).

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
        n = _count("n", n)
        eligible = np.asarray(eligible)
        if eligible.shape != (self.n_rows,) or eligible.dtype != np.bool_:
            raise ValueError(f"eligible must be a bool array of shape ({self.n_rows},), "
                             f"got {eligible.dtype} {eligible.shape}")
        row_keys = self._check_row_keys(row_keys)
        if layer is not None:
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
                raise ValueError(f"layer must be an integer, got {layer!r}")
            if not 0 <= layer < self.n_layers:
                raise ValueError(f"layer {layer} out of range (0..{self.n_layers - 1})")
            layer = int(layer)
            missing = [self._flat((layer, e)) for e in missing]
        if n == 0:
            return []
        if layer is None or not self.layer_quotas:
            chosen = self._lfu_victims(n, eligible, row_keys)
        else:
            chosen = self._quota_victims(n, eligible, row_keys, layer, missing)
        if self.layer_quotas and self.n_ghosts:
            self._remember_evicted(row_keys[chosen].tolist())
        return chosen

    def _remember_evicted(self, flats: list) -> None:
        """Each evicted key becomes the newest ghost of its layer; the oldest beyond
        ``n_ghosts`` are forgotten."""
        for flat in flats:
            if flat >= 0:
                ghosts = self._ghosts[flat // self.n_experts]
                ghosts.pop(flat, None)
                ghosts[flat] = True
                if len(ghosts) > self.n_ghosts:
                    del ghosts[next(iter(ghosts))]

    def _quota_victims(self, n: int, eligible: np.ndarray, row_keys: np.ndarray, layer: int,
                       missing: list) -> list[int]:
        row_layer = row_keys // self.n_experts  # -1 for empty rows
        resident = row_keys >= 0
        for flat in missing:
            if self._ghosts[layer].pop(flat, False):
                self._move_quota(layer, row_keys, row_layer, resident)
        held = np.bincount(row_layer[resident], minlength=self.n_layers)
        # Up to its quota the layer grows into empty rows and rows of layers over theirs;
        # beyond it, it replaces its own keys.
        room = int(self.quotas[layer] - held[layer])
        chosen = []
        if room > 0:
            over = resident & (held > self.quotas)[np.where(resident, row_layer, 0)]
            chosen = self._lfu_victims(min(n, room), eligible & (~resident | over), row_keys)
        for allowed in (~resident | (row_layer == layer), eligible):
            if len(chosen) < n:  # the last pass: pins or leases left too few, any eligible row
                allowed = eligible & allowed
                allowed[chosen] = False
                chosen += self._lfu_victims(n - len(chosen), allowed, row_keys)
        return chosen

    def _move_quota(self, layer: int, row_keys: np.ndarray, row_layer: np.ndarray,
                    resident: np.ndarray) -> None:
        """One row of quota to ``layer`` from the layer whose weakest unpinned key is weakest."""
        candidates = resident.copy()
        candidates[resident] = ~self._pinned[row_keys[resident]]
        weakest = np.full(self.n_layers, np.inf)
        np.minimum.at(weakest, row_layer[candidates], self._freq[row_keys[candidates]])
        weakest[layer] = np.inf
        weakest[self.quotas <= self.min_quota] = np.inf
        donor = int(np.argmin(weakest))
        if np.isfinite(weakest[donor]):
            self.quotas[donor] -= 1
            self.quotas[layer] += 1

    def _lfu_victims(self, n: int, eligible: np.ndarray, row_keys: np.ndarray) -> list[int]:
        """The plain rule: empty eligible rows, then unpinned rows by (frequency, recency)."""
        empty = np.flatnonzero(eligible & (row_keys < 0))
        if empty.size >= n:
            return empty[:n].tolist()
        need = n - empty.size
        rows = np.flatnonzero(eligible & (row_keys >= 0))
        keys = row_keys[rows]
        unpinned = ~self._pinned[keys]
        rows, keys = rows[unpinned], keys[unpinned]
        if rows.size > need:
            freq = self._freq[keys]
            kth = np.partition(freq, need - 1)[need - 1]
            below = np.flatnonzero(freq < kth)
            tied = np.flatnonzero(freq == kth)
            n_tied = need - below.size
            if tied.size > n_tied:
                tied = tied[np.argpartition(self._last_used[keys[tied]], n_tied - 1)[:n_tied]]
            chosen = np.concatenate((below, tied))
            rows, keys = rows[chosen], keys[chosen]
        order = np.lexsort((self._last_used[keys], self._freq[keys]))
        return empty.tolist() + rows[order].tolist()

    def hot_keys(self, limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` keys with nonzero frequency, highest first (for the warm-restart file)."""
        limit = _count("limit", limit)
        chosen = self._hottest(np.flatnonzero(self._freq > 0), limit)
        return [self._key(flat) for flat in chosen]

    # --- persistence ---

    def state(self) -> dict:
        """A JSON-serialisable snapshot of the nonzero frequencies and the explicit pins
        (automatic pins and clients' holds are not saved)."""
        hot = self._hottest(np.flatnonzero(self._freq > 0), self._freq.size)
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "frequencies": [[*self._key(flat), float(self._freq[flat])] for flat in hot],
            "pins": [list(self._key(flat)) for flat in np.flatnonzero(self._explicit_pins)],
        }

    def load_state(self, d: dict) -> None:
        """Replace the frequencies and explicit pins with those of a ``state()`` snapshot.

        Entries whose layer or expert is out of range (e.g. another model) are ignored; automatic
        pins and clients' holds are left as they are. The order of the entries ranks equal frequencies.

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
        freq = np.zeros_like(self._freq)
        loaded = []
        for entry in frequencies:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise ValueError(f"bad frequency entry {entry!r}: expected [layer, expert, value]")
            layer, expert, value = entry
            flat = self._state_key(layer, expert)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"bad frequency entry {entry!r}: value must be finite and >= 0")
            if flat is not None:
                freq[flat] = value
                loaded.append(flat)
        explicit = np.zeros_like(self._explicit_pins)
        for entry in pins:
            if not (isinstance(entry, list) and len(entry) == 2):
                raise ValueError(f"bad pin entry {entry!r}: expected [layer, expert]")
            flat = self._state_key(*entry)
            if flat is not None:
                explicit[flat] = True
        self._freq = freq
        # state() lists ties most recent first; negative ticks keep that order, older than any event.
        self._last_used[loaded] = -1 - np.arange(len(loaded))
        self._explicit_pins = explicit
        self._repin(slice(None))

    def _state_key(self, layer, expert) -> int | None:
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (layer, expert)):
            raise ValueError(f"bad key [{layer!r}, {expert!r}]: layer and expert must be integers")
        if 0 <= layer < self.n_layers and 0 <= expert < self.n_experts:
            return layer * self.n_experts + expert
        return None

    @classmethod
    def from_state(cls, d: dict, n_rows: int, n_layers: int, n_experts: int, **options) -> "LfuPolicy":
        """A new policy with the given shape (``options`` as for the constructor), loaded from ``d``."""
        policy = cls(n_rows, n_layers, n_experts, **options)
        policy.load_state(d)
        return policy
