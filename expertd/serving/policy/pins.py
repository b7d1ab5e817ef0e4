"""The pin book: keys no policy evicts, and why each one is pinned.

Three kinds, kept apart so that ending one never ends another:
- explicit pins, for good: the pin file's (saved with the policy's state);
- automatic pins: the hottest resident keys (``--auto-pin N``), replaced each time they are
  chosen again;
- holds: a client's PIN, while the client lives; counted per client, so two clients holding
  one key both let go before it is unpinned, and a client that goes lets go of all of its own.
Explicit pins and holds together stay under ``cap`` (more would leave demands too few rows, and
they would wait for ever); automatic pins take the room that is left.

Pure logic, like the other books: keys are checked here, row keys come from the slot table.
"""

import numpy as np

from expertd.serving.policy.keys import KeySpace, non_negative_int


def check_row_keys(row_keys, n_rows: int, n_keys: int, full: bool = True) -> np.ndarray:
    """The slot table's flat key per row (-1 for an empty row) as an int64 array.

    Args:
        full: also check that every entry is a key or -1 (a pass over the array).
    Raises:
        ValueError: on the wrong shape or dtype, or (``full``) an entry out of range.
    """
    row_keys = np.asarray(row_keys)
    if row_keys.shape != (n_rows,) or row_keys.dtype.kind not in "iu":
        raise ValueError(f"row_keys must be an integer array of shape ({n_rows},), "
                         f"got {row_keys.dtype} {row_keys.shape}")
    if full and row_keys.size and (row_keys.min() < -1 or row_keys.max() >= n_keys):
        raise ValueError(f"row_keys out of range: each must be -1 (empty) or a flat key "
                         f"0..{n_keys - 1} (layer * n_experts + expert)")
    return row_keys.astype(np.int64, copy=False)


class PinBook:
    """Pinned keys of every kind, and the combined mask a policy reads.

    Args:
        keys: the key space.
        n_rows: rows in the arena (the length of a slot table's row keys).
        cap: most keys pinned explicitly or held, all clients together; None: no cap.
    """

    def __init__(self, keys: KeySpace, n_rows: int, cap: int | None = None):
        self.keys = keys
        self.n_rows = n_rows
        self.cap = cap
        self.pinned = np.zeros(keys.size, dtype=bool)  # any kind: what a policy never evicts
        self._explicit = np.zeros(keys.size, dtype=bool)
        self._auto = np.zeros(keys.size, dtype=bool)
        self._holds = np.zeros(keys.size, dtype=np.int64)  # clients holding each key
        self._held_by: dict = {}  # owner -> flat keys it holds

    def _repin(self, flat) -> None:
        """Recompute the combined flag of ``flat`` (a key, or a slice for all of them)."""
        self.pinned[flat] = self._explicit[flat] | self._auto[flat] | (self._holds[flat] > 0)

    # ---- questions ------------------------------------------------------------------------

    def is_pinned(self, key) -> bool:
        return bool(self.pinned[self.keys.flat(key)])

    @property
    def pinned_keys(self) -> set:
        """Every pinned key, of any kind."""
        return set(self.keys.keys(np.flatnonzero(self.pinned)))

    @property
    def n_capped(self) -> int:
        """Keys pinned explicitly or held: what ``cap`` bounds."""
        return int(np.count_nonzero(self._explicit | (self._holds > 0)))

    def n_pinned_rows(self, row_keys: np.ndarray) -> int:
        """Resident rows whose key is pinned (any kind).

        Args:
            row_keys: the slot table's flat key per row, -1 for an empty row.
        """
        row_keys = check_row_keys(row_keys, self.n_rows, self.keys.size)
        return int(np.count_nonzero(self.pinned[row_keys[row_keys >= 0]]))

    # ---- the pin file ----------------------------------------------------------------------

    def set_explicit(self, keys) -> None:
        """Pin ``keys`` for good, in place of the explicit pins before; they need not be
        resident. Automatic pins and holds stay as they are."""
        flats = [self.keys.flat(key) for key in keys]
        self._explicit[:] = False
        self._explicit[flats] = True
        self._repin(slice(None))

    def explicit_state(self) -> list:
        """The explicit pins as ``[layer, expert]`` lists, for a saved state."""
        return [list(key) for key in self.keys.keys(np.flatnonzero(self._explicit))]

    def parse_state(self, entries: list) -> np.ndarray:
        """The explicit pins of a saved state, as a mask for :meth:`load_explicit`; entries
        out of range (another model's) are ignored.

        Raises:
            ValueError: on a malformed entry.
        """
        explicit = np.zeros_like(self._explicit)
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2):
                raise ValueError(f"bad pin entry {entry!r}: expected [layer, expert]")
            flat = self.keys.saved_key(*entry)
            if flat is not None:
                explicit[flat] = True
        return explicit

    def load_explicit(self, mask: np.ndarray) -> None:
        self._explicit = mask
        self._repin(slice(None))

    # ---- clients ---------------------------------------------------------------------------

    def hold(self, owner: bytes, keys) -> list | None:
        """``owner`` pins ``keys`` for as long as it lives.

        Returns:
            The keys it did not hold yet (now held), in order; None if they would take the
            pins past ``cap`` (nothing is held then).
        """
        mine = self._held_by.get(owner, set())
        new = {flat: key for key in keys if (flat := self.keys.flat(key)) not in mine}
        # Keys the cap does not count yet: an auto-pin alone is not counted, and holding
        # one makes it count.
        uncounted = sum(not (self._explicit[flat] or self._holds[flat]) for flat in new)
        if self.cap is not None and self.n_capped + uncounted > self.cap:
            return None
        if new:
            mine = self._held_by.setdefault(owner, mine)
        for flat in new:
            self._holds[flat] += 1
            self.pinned[flat] = True
            mine.add(flat)
        return list(new.values())

    def release(self, owner: bytes, keys) -> None:
        """``owner`` lets go of those of ``keys`` it holds (the others are left alone)."""
        mine = self._held_by.get(owner, set())
        for flat in {self.keys.flat(key) for key in keys} & mine:
            mine.discard(flat)
            self._holds[flat] -= 1
            self._repin(flat)
        if not mine:
            self._held_by.pop(owner, None)

    def forget(self, owner: bytes) -> None:
        """``owner`` went away: every key it held is let go."""
        for flat in self._held_by.pop(owner, ()):
            self._holds[flat] -= 1
            self._repin(flat)

    # ---- automatic pins --------------------------------------------------------------------

    def auto_pin(self, n: int, row_keys: np.ndarray, hottest) -> list:
        """Replace the automatic pins with the ``n`` hottest resident keys, fewer if ``cap``
        leaves less room.

        Explicit pins are no candidates (they are protected already) and are left alone; held
        keys are, since a hold ends with its client.

        Args:
            row_keys: the slot table's flat key per row, -1 for an empty row.
            hottest: the policy's ranking, ``hottest(flat_keys, limit)``, hottest first.
        Returns:
            The keys pinned, hottest first.
        """
        n = non_negative_int("n", n)
        if self.cap is not None:
            n = max(0, min(n, self.cap - self.n_capped))
        row_keys = check_row_keys(row_keys, self.n_rows, self.keys.size)
        self._auto[:] = False
        resident = np.unique(row_keys[row_keys >= 0])
        chosen = hottest(resident[~self._explicit[resident]], n)
        self._auto[chosen] = True
        self._repin(slice(None))
        return self.keys.keys(chosen)
