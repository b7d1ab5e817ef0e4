"""Replacement policies of bench/policies.py's study that the daemon does not ship, written
against its interface (``expertd.serving.policy.CachePolicy``), so the study drives them exactly
as the daemon's cache drives its own."""

from collections import OrderedDict

import numpy as np

from expertd.serving.policy import CachePolicy, LfuPolicy


class ArcPolicy(CachePolicy):
    """Adaptive Replacement Cache (Megiddo & Modha): recency list T1, frequency list T2, and
    ghost lists B1/B2 of evicted keys that steer the target size ``p`` of T1. Needs the missing
    keys of each demand (run it layered); keeps no saved state."""

    name = "arc"

    def __init__(self, n_rows, n_layers, n_experts, **options):
        super().__init__(n_rows, n_layers, n_experts, layer_quotas=False, **options)
        self.t1, self.t2, self.b1, self.b2 = (OrderedDict() for _ in range(4))
        self.p = 0.0
        self.fresh = set()  # filled and not touched since: that touch is the fill's own use

    def victims(self, n, eligible, row_keys, layer=None, missing=()):
        c = self.n_rows
        for expert in missing:  # adapt p on ghost hits before choosing victims
            key = layer * self.n_experts + expert
            if key in self.b1:
                self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
            elif key in self.b2:
                self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
        return super().victims(n, eligible, row_keys, layer, missing)

    def on_filled(self, key, used):
        flat = self.keys.flat(key)
        self.fresh.add(flat)
        if flat in self.b1 or flat in self.b2:
            self.b1.pop(flat, None)
            self.b2.pop(flat, None)
            self.t2[flat] = None  # seen recently enough to be remembered: frequency list
        else:
            self.t1[flat] = None

    def on_evicted(self, key, uses):
        flat = self.keys.flat(key)
        if flat in self.t1:
            del self.t1[flat]
            self.b1[flat] = None
        else:
            del self.t2[flat]
            self.b2[flat] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.n_rows:
                ghosts.popitem(last=False)

    def on_touched(self, key, count=1):
        flat = self.keys.flat(key)
        if flat in self.fresh:
            self.fresh.discard(flat)
        elif flat in self.t1:
            del self.t1[flat]
            self.t2[flat] = None
        elif flat in self.t2:
            self.t2.move_to_end(flat)

    def coldest(self, flats, need):
        position = {flat: i for i, flat in enumerate(flats.tolist())}
        t1 = [k for k in self.t1 if k in position]
        t2 = [k for k in self.t2 if k in position]
        chosen, i1, i2 = [], 0, 0
        for _ in range(min(need, len(t1) + len(t2))):
            # Evict from T1 while it is over its target, else from T2 (either if the other is empty).
            if i1 < len(t1) and (len(self.t1) - i1 > self.p or i2 == len(t2)):
                chosen.append(t1[i1])
                i1 += 1
            else:
                chosen.append(t2[i2])
                i2 += 1
        return np.array([position[k] for k in chosen], dtype=np.intp)

    def hottest(self, flats, limit):
        order = [*reversed(self.t2), *reversed(self.t1)]
        wanted = set(flats.tolist())
        return np.array([k for k in order if k in wanted][:limit], dtype=np.int64)

    def strength(self, flats):
        rank = {k: i for i, k in enumerate([*self.t1, *self.t2])}
        return np.array([rank.get(k, -1) for k in flats.tolist()], dtype=np.float64)

    def load_strength(self, flats, values):
        raise NotImplementedError("ArcPolicy keeps no saved state")


class NextUsePolicy(LfuPolicy):
    """LRFU's score read as a rate, plus the known layer order: an online guess of Belady.

    The frequencies halve every ``half_life`` tokens (a decay every token). A key used with
    probability p per token has a steady score of p / (1 - 2^(-1/h)), so p ≈ score * (1 -
    2^(-1/h)). Its next use is expected (1 - p) / p tokens after its layer's next visit, and the
    layers are visited in order: at layer L, layer L+1 comes next and L itself (its experts not in
    this demand) comes last. Evict the key whose expected next use is furthest. Run it layered.
    """

    name = "next-use"

    def __init__(self, n_rows, n_layers, n_experts, *, top_k: int, half_life: float):
        super().__init__(n_rows, n_layers, n_experts, layer_quotas=False,
                         **token_decay(n_layers, top_k, half_life))
        self.scale = 1.0 - 2.0 ** (-1.0 / half_life)
        self.layer_now = 0

    def victims(self, n, eligible, row_keys, layer=None, missing=()):
        if layer is not None:
            self.layer_now = layer
        return super().victims(n, eligible, row_keys, layer, missing)

    def coldest(self, flats, need):
        p = np.minimum(1.0, self.scale * self.strength(flats))
        offset = ((flats // self.n_experts - self.layer_now - 1) % self.n_layers + 1) / self.n_layers
        return np.argsort(-(offset + (1.0 - p) / np.maximum(p, 1e-12)), kind="stable")[:need]


def token_decay(n_layers: int, top_k: int, half_life: float) -> dict:
    """LfuPolicy options for LRFU's decay: every frequency halves every ``half_life`` tokens,
    a step every token (each token touches ``n_layers * top_k`` keys)."""
    return dict(decay_interval=n_layers * top_k, decay_factor=2.0 ** (-1.0 / half_life))
