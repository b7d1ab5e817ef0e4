"""Per-layer quotas: a strategy any policy can narrow its victims with.

Layers are visited in order, so when layer L demands, L's other experts wait a whole token:
evicting among them wastes least. Each layer gets a quota of rows (an even split to start with,
not saved); a demand of L under its quota grows into empty rows and rows of layers over theirs,
one at its quota replaces its own keys. Quotas move to layers that miss keys they evicted lately
(ghosts), from the layer whose weakest resident key is weakest by the policy's own measure.
"""

import numpy as np

from expertd.serving.policy.keys import KeySpace, non_negative_int, positive_int


class LayerQuotas:
    """Rows per layer, and each layer's last evicted keys.

    Args:
        n_rows: rows in the arena; the quotas sum to it.
        keys: the key space.
        min_quota: no quota is moved below this (the daemon passes the model's top_k).
        ghosts: evicted keys remembered per layer; 0 keeps the quotas where they start.
    Raises:
        ValueError: on an argument out of range.
    """

    def __init__(self, n_rows: int, keys: KeySpace, min_quota: int = 1, ghosts: int = 8):
        self.keys = keys
        self.min_quota = positive_int("min_quota", min_quota)
        self.n_ghosts = non_negative_int("ghosts", ghosts)
        base, extra = divmod(n_rows, keys.n_layers)
        self.rows = np.full(keys.n_layers, base, dtype=np.int64)
        self.rows[:extra] += 1
        # Per layer, its last evicted keys (flat), oldest first: a dict kept in insertion order.
        self._ghosts = [{} for _ in range(keys.n_layers)]

    def victims(self, policy, n: int, eligible: np.ndarray, row_keys: np.ndarray, layer: int,
                missing: list) -> list[int]:
        """Up to ``n`` rows for a demand of ``layer``, each step by ``policy.plain_victims``:
        while the layer holds fewer rows than its quota, empty rows and rows of layers over
        theirs; then empty rows and its own; what those cannot give, any eligible row.

        Before that, each of ``missing`` (flat keys) that the layer evicted lately moves one row
        of quota to it.
        """
        n_experts = self.keys.n_experts
        row_layer = row_keys // n_experts  # -1 for empty rows
        resident = row_keys >= 0
        for flat in missing:
            if self._ghosts[layer].pop(flat, False):
                self._move_quota(policy, layer, row_keys, row_layer, resident)
        held = np.bincount(row_layer[resident], minlength=self.keys.n_layers)
        room = int(self.rows[layer] - held[layer])
        chosen = []
        if room > 0:
            over = resident & (held > self.rows)[np.where(resident, row_layer, 0)]
            chosen = policy.plain_victims(min(n, room), eligible & (~resident | over), row_keys)
        for allowed in (~resident | (row_layer == layer), eligible):
            if len(chosen) < n:  # the last pass: pins or leases left too few, any eligible row
                allowed = eligible & allowed
                allowed[chosen] = False
                chosen += policy.plain_victims(n - len(chosen), allowed, row_keys)
        return chosen

    def _move_quota(self, policy, layer: int, row_keys: np.ndarray, row_layer: np.ndarray,
                    resident: np.ndarray) -> None:
        """One row of quota to ``layer`` from the layer whose weakest unpinned key is weakest."""
        candidates = resident.copy()
        candidates[resident] = ~policy.pins.pinned[row_keys[resident]]
        weakest = np.full(self.keys.n_layers, np.inf)
        np.minimum.at(weakest, row_layer[candidates], policy.strength(row_keys[candidates]))
        weakest[layer] = np.inf
        weakest[self.rows <= self.min_quota] = np.inf
        donor = int(np.argmin(weakest))
        if np.isfinite(weakest[donor]):
            self.rows[donor] -= 1
            self.rows[layer] += 1

    def remember(self, flats) -> None:
        """Evicted keys (-1 for an empty row): each becomes the newest ghost of its layer, the
        oldest beyond ``ghosts`` are forgotten."""
        if not self.n_ghosts:
            return
        for flat in flats:
            if flat >= 0:
                ghosts = self._ghosts[flat // self.keys.n_experts]
                ghosts.pop(flat, None)
                ghosts[flat] = True
                if len(ghosts) > self.n_ghosts:
                    del ghosts[next(iter(ghosts))]
