"""A prompt's layer's rows pulled from the arena: one stack with a row for every expert.

A prompt's MoE call routes to many of its layer's experts, so it computes on a *stack*: one row
per expert at the expert's own index (the pool's hits copied on the device, the misses pulled
from the arena), and mlx-lm's call runs on it with the router's own ids, exactly as resident.

Two routes build it. A speculative prompt (step.py: the model call waits for nothing, checked at
its end) builds it on the device from the router's ids (layer.StreamedLayer's stacked call).
Where a prompt waits in each layer (speculation off, an arena that lacked rows, Metal's first
pulls, a cache that cannot be trimmed back), :func:`assemble` builds it after the layer's router
has chosen, here.
"""

import time

import mlx.core as mx
import numpy as np

from expertd.errors import DaemonError
from expertd.retry import RetryPolicy

from .pull import ABSENT, decode_status

# A pass whose epoch was revoked or that found rows absent (evicted between the read and the
# pull) is tried again; after four, the caller takes the host path.
PASS_AGAIN = RetryPolicy(attempts=4)


class Stack:
    """Rows already assembled on the device, as a pull's source (``row_of`` as a pool's)."""

    def __init__(self, arrays: list, row_of: np.ndarray):
        self.arrays, self.row_of = arrays, row_of

    def pull_table(self):
        return mx.array(self.row_of)


def assemble(session, layer: int, experts: np.ndarray, pool):
    """A stack of every expert of ``layer`` (one row each, at its own index) in which the
    rows of ``experts`` (distinct int32) hold their bytes: those in ``pool`` copied from
    it, the rest pulled from the arena inside an epoch once the daemon has read them, as
    many at a time as it leases at once (each later pass copies the stack so far on the
    device). The call computes on it exactly as resident mlx-lm does (the same shapes,
    the same ids); the other rows are never read. Waits for the pulls, not for the
    computation. None if the device's pull differed from the host copy (pull.verify_pull:
    the puller is dropped), or if four pulls in a row lost their epoch or found rows
    absent (an epoch on probation, evictions all the while): the caller takes the host
    path, whose leased reads need no epoch. ``session``: the client session (its puller
    and epoch record, both of the attach, its demands and its counters)."""
    present = pool.row_of[experts] >= 0
    missing = experts[~present]
    # Expert e's row is row e; -1: not wanted (yet). Each pass adds its chunk, and its
    # stack's table is what it holds so far.
    want = np.full(session.manifest.layers[layer].num_experts, -1, np.int32)
    want[experts[present]] = experts[present]
    source = pool
    limit = session.demand_limit
    chunks = [missing[i:i + limit] for i in range(0, len(missing), limit)] or [missing]
    for chunk in chunks:
        want[chunk] = chunk
        arrays = _pass(session, layer, chunk, want, source)
        if arrays is None:
            return None
        source = Stack(arrays, want.copy())
    return source.arrays


def _pass(session, layer: int, chunk: np.ndarray, want: np.ndarray, source) -> list:
    wanted = np.flatnonzero(want >= 0)
    for _ in PASS_AGAIN.tries():
        if len(chunk):  # else every row comes from the source: no arena read, no epoch
            session.demand_absent(layer, chunk)
        puller, epoch = session.puller, session.step_epoch
        if puller is None:
            raise DaemonError("the device stopped pulling from the arena")
        started = time.perf_counter()
        if len(chunk):
            epoch.begin()
        try:
            arrays, status = puller.assemble(layer, mx.array(want), source)
            mx.eval(arrays, status)
            took = time.perf_counter() - started
            # Compared while the epoch holds its rows.
            drifted = puller.differs(layer, want, source, arrays, status)
        finally:
            lost = epoch.end()
        if drifted and not lost:  # a revoked epoch's rows may have been refilled: retried
            session.drop_puller(layer)
            return None
        kinds = decode_status(np.array(status)[wanted])[2]
        if not lost and not (kinds == ABSENT).any():
            # The pull rate: passes that took their rows, less the comparison with the host
            # copy (and a kernel's first: Puller.timed).
            puller.timed(took, puller.count(layer, len(chunk)))
            return arrays
        session.counters["retries"] += 1  # evicted between the read and the pull: again
    return None
