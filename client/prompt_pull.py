"""A prompt's layer's rows pulled from the arena: one stack with a row for every expert.

A prompt's MoE call routes to most of its layer's experts, so it computes on a *stack*: one row
per expert at the expert's own index (the pool's hits copied on the device, the misses pulled
from the arena inside an epoch), and mlx-lm's call runs on it with the router's own ids, exactly
as resident. :meth:`PromptPulls.assemble` builds one after the layer's router has chosen.

Ahead: a call that routes at least AHEAD_PAIRS pairs per expert (a prompt long enough to route
nearly every expert) launches, once its own computation is launched, the pull of the next
layer's experts missing from that layer's pool, on a stream of its own inside an epoch. The pull
runs on the device while this layer computes, and the next layer's call, after its router's
wait, finds its stack assembled: it pulls only what the stack lacks (an expert the arena did
not hold, or every pulled row when the epoch was lost). Exactness never depends on it: a stack
row is read only for the expert whose bytes it holds. The experts demanded for it are demanded
before its epoch begins: a refill the daemon makes for a demand waits for every epoch open at
the eviction, this client's own included.
"""

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from expertd.errors import DaemonError

from .pull import ABSENT, PULLED, decode_status

AHEAD_PAIRS = 4  # a call routing this many (token, slot) pairs per expert pulls the next ahead


class Stack:
    """Rows already assembled on the device, as a pull's source (``row_of`` as a pool's);
    ``pulled``: the experts among them read from the arena ahead (see :meth:`PromptPulls.take`)."""

    def __init__(self, arrays: list, row_of: np.ndarray, pulled: np.ndarray | None = None):
        self.arrays, self.row_of, self.pulled = arrays, row_of, pulled

    def pull_table(self):
        return mx.array(self.row_of)


@dataclass
class Ahead:
    """A launched pull of ``layer``'s stack: ``want`` (expert -> its row, -1: not in it) and
    the experts read from the arena, under ``epoch`` (of ``puller``'s attach)."""

    layer: int
    puller: object
    epoch: object
    want: np.ndarray
    pulled: np.ndarray
    arrays: list
    status: mx.array


class PromptPulls:
    """The stacks of a session's prompt calls (see the module's docstring).

    Args:
        session: the client session: its puller and epoch record (both of the attach), its
            demands, its counters (``pulled_ahead``: rows pulled ahead; ``pulled_ahead_unused``: of
            those, rows the next call's router did not choose or could not take).
    """

    def __init__(self, session):
        self.session = session
        self.enabled = True  # bench/gpu_pull.py compares prompts without it
        self.pending: Ahead | None = None
        self._stream = None

    # ---- one call's stack, after its router chose ------------------------------------------

    def assemble(self, layer: int, experts: np.ndarray, pool, ahead: Stack | None = None):
        """A stack of every expert of ``layer`` (one row each, at its own index) in which the
        rows of ``experts`` (distinct int32) hold their bytes: those in ``ahead`` (a stack
        pulled ahead, see :meth:`take`) or else in ``pool`` copied from it, the rest pulled
        from the arena inside an epoch once the daemon has read them, as many at a time as it
        leases at once (each later pass copies the stack so far on the device). The call
        computes on it exactly as resident mlx-lm does (the same shapes, the same ids); the
        other rows are never read. Waits for the pulls, not for the computation. None if the
        device's pull differed from the host copy (pull.verify_pull: the puller is dropped),
        or if four pulls in a row lost their epoch or found rows absent (an epoch on
        probation, evictions all the while): the caller takes the host path, whose leased
        reads need no epoch."""
        source = pool if ahead is None else ahead
        present = source.row_of[experts] >= 0
        missing = experts[~present]
        if ahead is not None and not len(missing):
            return ahead.arrays  # every routed expert is in it, at its own index
        # Expert e's row is row e; -1: not wanted (yet). Each pass adds its chunk, and its
        # stack's table is what it holds so far.
        want = np.full(self.session.manifest.layers[layer].num_experts, -1, np.int32)
        want[experts[present]] = experts[present]
        limit = self.session.demand_limit
        chunks = [missing[i:i + limit] for i in range(0, len(missing), limit)] or [missing]
        for chunk in chunks:
            want[chunk] = chunk
            arrays = self._pass(layer, chunk, want, source)
            if arrays is None:
                return None
            source = Stack(arrays, want.copy())
        return source.arrays

    def _pass(self, layer: int, chunk: np.ndarray, want: np.ndarray, source) -> list:
        session = self.session
        wanted = np.flatnonzero(want >= 0)
        for _ in range(4):
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
                nbytes = puller.count(layer, len(chunk))
                # The pull rate: passes that took their rows, less a kernel's first (its
                # build and compile) and the comparison with the host copy.
                if puller.warming:
                    puller.warming = False
                else:
                    puller.counters["pull_s"] += took
                    puller.counters["timed_bytes"] += nbytes
                return arrays
            session.counters["retries"] += 1  # evicted between the read and the pull: again
        return None

    # ---- the next call's stack, while this one computes -------------------------------------

    def wanted(self, pairs: int, num_experts: int, pool) -> bool:
        """Whether a call routing ``pairs`` pairs over ``num_experts`` experts pulls the next
        layer's stack (whose pool is ``pool``) ahead."""
        session = self.session
        return (self.enabled and pairs >= AHEAD_PAIRS * num_experts and not pool.complete
                and session.puller is not None and self.pending is None)

    def launch(self, layer: int, pool, computing) -> None:
        """Start ``computing`` (the calling layer's output), then pull ``layer``'s experts
        missing from ``pool`` into a stack on the device without waiting, on a stream of its
        own, which overlaps it. Not where the layer's pulls are still compared with the host
        copy (Metal's first), nor while a step's epoch is open (a pipelined decode's: its
        reads are not this pull's)."""
        session = self.session
        puller, epoch = session.puller, session.step_epoch
        if puller is None or epoch is None or epoch.inside or puller.unverified(layer):
            return
        missing = np.flatnonzero(pool.row_of < 0).astype(np.int32)
        if not len(missing):
            return
        # The pool's rows are copied on the other stream: whatever last wrote them (a
        # promotion, queued on this one) is done first, before the computation is queued
        # behind it.
        mx.eval(pool.arrays)
        mx.async_eval(computing)
        if len(missing) <= session.demand_limit:
            # Before the epoch (see the module's docstring). More than the daemon leases at
            # once would evict one another in its arena: those it holds are pulled, no more.
            session.demand_absent(layer, missing)
        elif not (session.lookup(layer, missing).slots >= 0).any():
            return
        puller, epoch = session.puller, session.step_epoch  # a restarted daemon's
        if puller is None or epoch is None:
            return
        want = np.arange(len(pool.row_of), dtype=np.int32)
        if self._stream is None:
            self._stream = mx.new_stream(mx.default_device())
        epoch.begin()
        try:
            with mx.stream(self._stream):
                arrays, status = puller.assemble(layer, mx.array(want), pool)
            mx.async_eval(arrays, status)
        except BaseException:
            mx.synchronize()  # no read of the arena may outlive the epoch
            epoch.end()
            raise
        self.pending = Ahead(layer, puller, epoch, want, missing, arrays, status)

    def take(self, layer: int) -> Stack | None:
        """The stack pulled ahead for ``layer``, its rows waited for and its epoch ended: the
        experts whose rows the arena lacked, or every pulled one if the epoch was lost, are
        left out of it (the call pulls them itself). None if none was pulled for this layer
        (a pending pull of another is waited for and dropped), or none of it can be used."""
        ahead, self.pending = self.pending, None
        if ahead is None:
            return None
        session, counters = self.session, self.session.counters
        try:
            mx.eval(ahead.arrays, ahead.status)
        finally:
            lost = ahead.epoch.end()
        n = len(ahead.pulled)
        counters["pulled_ahead"] += n
        if ahead.layer != layer or ahead.puller is not session.puller:
            counters["pulled_ahead_unused"] += n
            return None
        _, experts, kinds = decode_status(np.array(ahead.status))
        want = ahead.want.copy()
        if lost:
            kept = np.zeros(len(want), bool)
        else:
            kept = kinds == PULLED
        want[(experts >= 0) & ~kept] = -1
        taken = int(kept.sum())
        if taken:
            ahead.puller.count(layer, taken)
        counters["pulled_ahead_unused"] += n - taken  # the router's choice settles the rest
        return Stack(ahead.arrays, want, np.flatnonzero(kept).astype(np.int32))

    def routed(self, stack: Stack | None, experts: np.ndarray) -> None:
        """Count the rows of ``stack`` (taken for a call routing to ``experts``) pulled ahead
        that the router did not choose."""
        if stack is not None:
            unused = np.setdiff1d(stack.pulled, experts, assume_unique=True)
            self.session.counters["pulled_ahead_unused"] += len(unused)

    def settle(self) -> None:
        """Wait for a pending pull that no call will take (a model call that stopped between
        two layers) and end its epoch."""
        if self.pending is not None:
            self.take(-1)
