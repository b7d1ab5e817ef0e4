"""A streamed model's expertd side, built by the loader in one piece once its parts exist.

The loader makes the daemon session first (it attaches, and the pools are sized within what
it leases), then the streamed layers with their pools and guessers, then the steps over them.
:class:`Runtime` holds them together from then on and is what ``model.expertd_session`` is:
the model's reports (pool counters, guesses, this client's use of the cache) are its own, and it
passes on the few things of the session a model's user reads (counters, stats, closing); the
rest is reached as ``session`` (no attribute is forwarded by name).
"""

from collections import ChainMap

from .pool import POOL_COUNTERS


class Runtime:
    """The session, streamed layers, guessers and steps of one loaded model.

    Args:
        session: the :class:`~expertd.client.session.Session` attached to the daemon.
        layers: the model's :class:`~expertd.client.layer.StreamedLayer` s, in order.
        steps: the :class:`~expertd.client.step.Steps` over them.
        guessers: per MoE layer, its :class:`~expertd.client.predict.Guesser` of the next
            layer's experts, or None.
    """

    def __init__(self, session, layers: list, steps, guessers: list):
        self.session, self.layers, self.steps = session, list(layers), steps
        self.guessers = list(guessers)
        self.pools = [layer.pool for layer in self.layers]

    # What a user of the model reads of its daemon session; the rest is ``session``'s own.

    @property
    def counters(self):
        """The steps' counters and the session's, as one live mapping (see counters.py)."""
        return ChainMap(self.steps.counters, self.session.counters)

    @property
    def timing(self):
        """Where the time goes: the steps' and the session's layer calls', as one mapping."""
        return ChainMap(self.steps.timing, self.session.timing)

    @property
    def manifest(self):
        return self.session.manifest

    @property
    def paths(self):
        return self.session.paths

    @property
    def puller(self):
        """The device's or the host's puller, or None (the per-layer host path)."""
        return self.session.puller

    @property
    def step_epoch(self):
        return self.session.step_epoch

    @property
    def pool_bytes(self) -> int:
        return self.session.pool_bytes

    def pull_counters(self) -> dict:
        return self.session.pull_counters()

    def stats(self) -> dict:
        """The daemon's STATS, as this client sees them."""
        return self.session.stats()

    def demand_absent(self, layer: int, experts) -> None:
        self.session.demand_absent(layer, experts)

    def close(self) -> None:
        """Say goodbye to the daemon (the model computes no more streamed layers)."""
        self.session.close()

    def pool_counters(self) -> dict:
        """The pools' counters summed over the layers."""
        return {key: sum(pool.counters[key] for pool in self.pools) for key in POOL_COUNTERS}

    def all_counters(self) -> dict:
        """The session's counters and its pools' (``pool_hits``: routed experts found in a
        pool; ``pool_moved``: moved in when routed; ``ahead``: written ahead of their layer,
        ``ahead_used`` / ``ahead_unused`` of those; ``settled``: computations evaluated early
        so that their rows could be rewritten)."""
        pools = self.pool_counters()
        pulled = self.session.pull_counters()
        # A prompt's rows staged outside the pool were copied from the arena as moved ones are.
        return {**self.session.counters, **self.steps.counters, "pool_hits": pools["hits"],
                "pool_moved": pools["moved"] + pools["staged"],
                "pulled_rows": pulled["rows_pulled"], "pulled_bytes": pulled["bytes_pulled"],
                "pull_s": pulled["pull_s"], "pull_timed_bytes": pulled["timed_bytes"],
                **{k: pools[k] for k in ("ahead", "ahead_used", "ahead_unused", "settled")}}

    def prediction(self) -> list:
        """Per MoE layer, how the guesses made for it went (None for a layer nobody guesses)."""
        return [None] + [g.guesses.summary() if g is not None else None
                         for g in self.guessers[:-1]]

    def usage(self) -> dict:
        """This client's own use of the cache so far: experts it used (from its pools or the
        arena), how many of them had to be read from the disk for it (its misses), and the
        bytes read for it (its misses and the prefetches it asked for)."""
        c = self.session.counters
        pools = self.pool_counters()
        used = pools["hits"] + pools["moved"] + pools["staged"] + pools["pulled"]
        prefetched = self.session.stats().get("client_prefetch_reads", 0)
        return dict(used=used, misses=c["misses"], hits=used - c["misses"],
                    hit_rate=(used - c["misses"]) / used if used else 0.0,
                    prefetch_reads=prefetched, pool_bytes=self.session.pool_bytes,
                    moved=pools["moved"] + pools["staged"],
                    bytes_read=(c["misses"] + prefetched) * self.session.manifest.stride)
