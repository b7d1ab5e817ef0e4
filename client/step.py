"""One host wait per decode step: the router's choice stays on the device, a miss is replayed.

A speculative step runs every MoE layer without waiting for the host: the router's ids are
remapped to pool rows by a gather on the device (no remap at all in a pool with a row for every
expert, each at its own index), and an expert missing from its pool computes with a placeholder
row. The step's one evaluation, where mlx-lm evaluates the logits anyway, also returns every
layer's ids; the host checks them against the pool tables the step ran with. No miss: the logits
are mlx-lm's, bit for bit. A miss: the KV caches are trimmed back by the step's tokens and the
step runs again on the per-layer path, which moves the missing rows in; the wrong logits never
leave the model. A step is replayed at most once. When every pool holds every expert, nothing
can miss: the step is not checked at all and its logits stay lazy, so mlx-lm's own evaluation
is its only wait, and building the next step overlaps computing this one.

A step is not speculative where a replay could not be exact or would not pay (it then waits per
layer, as before): caches that cannot be trimmed back (linear-attention or SSM state, a rotating
cache that would wrap), pipeline ranks (their activations leave the rank during the step), and
sessions that replay too often (:class:`Speculation`, judged from the observed replay rate).

A prompt speculates where the device pulls rows from the arena (a device puller; the host copy
waits for each layer's ids anyway, and there a prompt waits per layer): each layer assembles a
stack with a row for every expert it routes to on the device (prompt_pull.py), and the prompt's
model call waits once, as resident mlx-lm's does, instead of once per layer, which left the GPU
idle while the host moved each layer's rows (bench/RESULTS.md, issue 24). A prompt that found
rows absent from the arena twice, or lost its epoch twice, runs again per layer (which demands
rows layer by layer, as a small arena needs), and the next PROMPT_RETRY prompts wait per layer
straight away.

A decode step of several sequences (a batch: client/batch.py) is one step like a single
sequence's: one wait, the union of the experts its sequences route to pulled once a layer
(layer.stacked), and a replay trims every sequence's cache by the step's token.

One job, over 400 lines: running each model call as a checked step, serially or pipelined
(its check is step_check.py, its policies speculation.py).
"""

import logging
import math
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from expertd.retry import RetryPolicy

from .counters import REPLAY_CAUSES, new_step_counters, new_step_timing
from .kvcache import replayable, sequences_of, stacks_fit, token_shape, trim
from .layer import DECODE_IDS, StepMode
from .pool import free_memory
from .speculation import Drains, Speculation
from .step_check import Findings, StepCheck
from .switch import fronted

PROMPT_RETRY = 8  # prompts that wait per layer after one that could not speculate ran so
# A step's speculative runs: a second after rows found absent (once the daemon has read them)
# or a prompt's lost epoch; then it runs per layer, which cannot miss.
SPECULATIVE_TRIES = RetryPolicy(attempts=2)

log = logging.getLogger("expertd")
BATCH_FIT_EVERY = 256  # steps after which a batch's stacks are weighed against free memory again


@dataclass
class Launched:
    """A decode step built and computing, its check still to come (:meth:`Steps.launch`)."""

    logits: object
    records: list | None  # the layers' StepRecords to check; None: nothing to check
    flat: list  # the lazy ids / statuses the check reads
    launched: int | None  # the epoch record's step when launched (None: no device pulls)
    sequences: int = 1  # the step's sequences (tokens: a decode step is one a sequence)


class StepGuard:
    """Mixin placed in front of the mlx-lm model class: each call is one checked step (see
    :func:`guarded`)."""

    def __call__(self, inputs, *args, **kwargs):
        return self.__dict__["_expertd_steps"].run(super().__call__, inputs,
                                                   args, kwargs)


_GUARDED: dict = {}  # mlx-lm model class -> its StepGuard subclass


def guarded(model, steps: "Steps"):
    """A new model object whose calls are ``steps``' checked steps: the model's class with
    :class:`StepGuard` in front (switch.fronted), holding the same children and attributes as
    ``model``, which is left as it was."""
    new = fronted(model, StepGuard, _GUARDED)
    new.__dict__["_expertd_steps"] = steps
    return new


class Steps:
    """The steps of one streamed model.

    Args:
        session: the client session (its puller, epoch record and requests; it carries
            this object's :attr:`counters` in its heartbeats).
        layers: the model's :class:`~expertd.client.layer.StreamedLayer` s, in order.
        mode: the :class:`~expertd.client.layer.StepMode` the layers ask (this sets it).
        speculate: "auto" (default: speculate while replays are rare), "on" or "off".
        pipeline: True on a pipeline rank, which never speculates.
    """

    def __init__(self, session, layers: list, mode: StepMode, speculate: str = "auto",
                 pipeline: bool = False):
        self.session, self.layers, self.mode = session, layers, mode
        # The steps' statistics are their own (counters.STEP_COUNTERS, STEP_TIMING): the
        # layers count into them through the mode, and the session reports them.
        self.counters, self.timing = new_step_counters(), new_step_timing()
        mode.counters = self.counters
        session.report_steps(self.counters)
        self.speculation = Speculation(speculate)
        self.pipeline = pipeline
        self._settled = None  # when the last pipelined step was checked, another in flight
        self._planned = None  # plan()'s decision for the next launch
        self.checks = StepCheck(session, self.counters)
        self._top_k = session.manifest.top_k
        self.drains = Drains()
        # Prompts speculate: None where the puller pulls on the device (the host copy waits
        # for each layer's ids anyway, so a speculative prompt would only hold its epoch, and
        # so other clients' refills, for the whole prompt, and replay it whole on an absent
        # row); True with any puller (the tests cover the path with the host copy); False
        # never (bench/gpu_pull.py compares prompts waiting per layer).
        self.speculate_prompts: bool | None = None
        # A speculative prompt's stacks, a row per expert in each layer (see stacks_fit).
        self._stack_bytes = sum(layer.num_experts * session.manifest.layers[layer.index].expert_bytes
                                for layer in layers)
        self._prompts_waiting = 0  # prompts still to wait per layer (see PROMPT_RETRY)
        self._holder = None  # who settles a launched step in flight (see hold)
        self._fits, self._fits_at = {}, 0  # _batch_fits' answers by pairs, and since when

    def new_generation(self) -> None:
        """A generation starts (client/decode.py): its experts are new, so it drains often."""
        self.drains = Drains()

    def pipelinable(self) -> bool:
        """A loop may launch these steps before checking the last (:meth:`launch`): not on a
        pipeline rank, and speculation not off."""
        return not self.pipeline and self.speculation.mode != "off"

    def drain_due(self, step: Launched) -> bool:
        """``step`` should be checked with nothing else in flight (see
        speculation.Drains): a step that pulled nothing (no puller: none to promote) never
        is."""
        return step.launched is not None and self.drains.due()

    def hold(self, holder) -> None:
        """``holder`` (client/batch.py's batch) has a launched step in flight that it settles
        itself: any other model call settles it first (``holder.settle_held()``), since that
        call may demand rows (which the daemon would refill only after the held step's epoch)
        or promote into a pool the held step reads."""
        self._holder = holder

    def release(self, holder) -> None:
        """``holder`` settled its step: nothing of it is in flight."""
        if self._holder is holder:
            self._holder = None

    def settle_held(self) -> None:
        """Have the holder of a launched step (see :meth:`hold`) settle it now."""
        holder, self._holder = self._holder, None
        if holder is not None:
            holder.settle_held()

    def run(self, forward, inputs, args: tuple, kwargs: dict):
        self.settle_held()
        # A step starts attached: after a daemon's death or a failed or interrupted wait for
        # it, the session attaches again here (or raises DaemonNotRunning), before any layer.
        self.session.check_alive()
        self.checks.flush()  # the pools may change during this step: count what waited first
        counters = self.counters
        counters["steps"] += 1
        if self._unchecked():
            # Every pool holds every expert at its index and nothing moves during the step:
            # nothing can miss, so nothing is checked. The logits stay lazy, as resident
            # mlx-lm's: its own evaluation is the step's only wait, and it overlaps building
            # the next step.
            logits, _ = self._without_waits(forward, inputs, args, kwargs, None)
            counters["unchecked_steps"] += 1
            return logits
        cache = kwargs.get("cache", args[0] if args else None)
        shape = token_shape(inputs, kwargs)
        pairs = math.prod(shape) * self._top_k
        if pairs > DECODE_IDS and shape[-1] > 1:
            return self._prompt(forward, inputs, args, kwargs, cache, shape[-1])
        self._count_decode(shape)
        if not self._speculate(shape, cache):
            if (self.speculation.mode == "auto" and self.layers and not self.pipeline
                    and (pairs <= DECODE_IDS or shape[-1] == 1)):
                return self._per_layer(forward, inputs, args, kwargs)  # measured while paused
            return forward(inputs, *args, **kwargs)
        logits = self._attempts(forward, inputs, args, kwargs, cache, shape[-1], prompt=False)
        return logits if logits is not None else self._per_layer(forward, inputs, args, kwargs)

    def _attempts(self, forward, inputs, args: tuple, kwargs: dict, cache, tokens: int,
                  prompt: bool):
        """At most two speculative steps of ``tokens`` a sequence: their logits, or None once
        the step was replayed and must run per layer (its caches trimmed back). A second
        speculative step follows rows found absent from the arena, once demanded, and for a
        ``prompt`` a lost epoch too. A decode step's are timed and judged (:class:`Speculation`).
        What is demanded is what the replay will route to (step_check.needed_absent): each
        sequence's absent rows up to its first layer that lacked any (it routed on exact
        inputs; the layers after it routed on rows it did not have)."""
        for attempt in SPECULATIVE_TRIES.tries():
            started = time.perf_counter()
            logits, cause, found = self._speculative_step(forward, inputs, args, kwargs)
            # A replay on rows absent from the arena is weighed in speculation's cost (not in
            # its count of replays: the reads were the step's anyway): where the arena is too
            # small for what the steps route to, each such step computes for nothing, and
            # steps waiting per layer may cost less (run 28 on the H100, bench/RESULTS.md).
            if not prompt:
                self.speculation.timed(True, time.perf_counter() - started)
                self.speculation.record(cause is not None, cause == "absent")
            if cause is None:
                return logits
            self._count_replay(cause)
            trim(cache, tokens)
            if cause == "device":  # the replay and every later step copy on the host
                self.session.drop_puller(found.drifted)
            if cause not in (("absent", "epoch") if prompt else ("absent",)) or attempt:
                return None
            # A client the daemon forgot (stopped past its client timeout) holds no epoch
            # record: attach again first, or the replay would be lost the same way.
            self.session.check_alive()
            self.session.demand_absent_all([(layer.index, experts)
                                            for layer, experts in found.absent])
        return None

    def _prompt(self, forward, inputs, args: tuple, kwargs: dict, cache, tokens: int):
        """A prompt's model call (``tokens`` a sequence): speculative where
        :meth:`_speculate_prompt` allows (one wait; replayed once so after a lost epoch, or
        once the rows each sequence's first layer lacking any found absent were demanded;
        a second replay runs it per layer), else waiting per layer, its logits lazy. A
        prompt that ran per layer so has the next PROMPT_RETRY prompts wait per layer."""
        if self._speculate_prompt(tokens, cache):
            logits = self._attempts(forward, inputs, args, kwargs, cache, tokens, prompt=True)
            if logits is not None:
                return logits
            self._prompts_waiting = PROMPT_RETRY
        return forward(inputs, *args, **kwargs)

    def _speculate_prompt(self, tokens: int, cache) -> bool:
        """A prompt speculates: a puller assembles its stacks on the device (Metal's once its
        pulls agreed with the host copy in every layer; the host copy only where
        :attr:`speculate_prompts` is True), whose pull rate was timed (a prompt
        waiting per layer times its pulls, for status and /metrics: the first that pulls
        does), speculation is not off, every stack fits (:func:`stacks_fit`), the caches can
        be trimmed back, and no prompt had to run per layer within PROMPT_RETRY prompts."""
        puller = self.session.puller
        if (puller is None or self.speculate_prompts is False or self.pipeline or not self.layers
                or self.speculation.mode == "off"):
            return False
        if self.speculate_prompts is None and not puller.traceable:
            return False
        if self._prompts_waiting:
            self._prompts_waiting -= 1
            return False
        if not puller.rate_known:
            return False
        if any(puller.unverified(layer.index) for layer in self.layers):
            return False
        if not stacks_fit(self._stack_bytes, free_memory()):
            return False
        return cache is None or replayable(cache, tokens)

    # ---- pipelined steps (client/decode.py): the next step is built before this one's check

    def launch(self, forward, inputs, args: tuple, kwargs: dict) -> Launched:
        """Build a decode step without waiting; its check comes later (:meth:`settle`), once the
        host has built the next step on its lazy token, as resident mlx-lm overlaps building
        with computing. The caller starts it computing: ``mx.async_eval`` of its token and of
        the step's ``flat`` together. A step that cannot speculate runs as :meth:`run` runs it
        (nothing left to check). At most two launched steps are unsettled at a time: another
        loop's held step (see :meth:`hold`) is settled first."""
        self.settle_held()
        self.session.check_alive()
        counters = self.counters
        counters["steps"] += 1
        sequences = self._count_decode(token_shape(inputs, kwargs))
        if self._unchecked():
            counters["unchecked_steps"] += 1
            return Launched(self._without_waits(forward, inputs, args, kwargs, None)[0],
                            None, [], None, sequences)
        cache = kwargs.get("cache", args[0] if args else None)
        planned, self._planned = self._planned, None
        if not (self.plan(inputs, cache) if planned is None else planned):
            self.checks.flush()
            return Launched(self._per_layer(forward, inputs, args, kwargs), None, [], None,
                            sequences)
        epoch = self.session.step_epoch if self.session.puller is not None else None
        launched = None
        if epoch is not None:
            epoch.begin()  # a no-op while the step before is in flight: the record stays odd
            launched = epoch.step
        try:
            logits, records = self._without_waits(forward, inputs, args, kwargs, [])
        except BaseException:
            if epoch is not None:
                mx.synchronize()  # no read of a step built in part may outlive its epoch
                epoch.end()
            raise
        # Not started here: the caller starts what it samples from the logits and ``flat`` in
        # one mx.async_eval (on CUDA each is a graph encoded and launched on this thread).
        return Launched(logits, records, self._flat(records), launched, sequences)

    def plan(self, inputs, cache) -> bool:
        """Whether the next :meth:`launch` on ``inputs`` will speculate (decided now, once). A
        step that will not waits per layer and may demand rows from the daemon: the step
        before it must be settled first, or the daemon's refills for those demands would wait
        for this client's own epoch."""
        if self._unchecked():
            return True  # nothing is demanded
        # Two steps in flight: a bad one and the one built on its token are trimmed together.
        self._planned = self._speculate(tuple(inputs.shape), cache, depth=2)
        return self._planned

    def settle(self, step: Launched, after: Launched | None = None) -> str | None:
        """Check a launched step (the wait for its ids or statuses): None when its logits are
        exact, its bookkeeping done; else why it must be replayed, with ``after`` (the step
        launched on its token) abandoned and then the experts the arena lacked that the replay
        will route to demanded (step_check.needed_absent; the daemon may have to evict for
        them, and ``after``'s epoch would hold those rows). With ``after`` pulling, the epoch
        record advances by two and stays odd, and pulled experts are counted but not promoted
        (a promotion rewrites a pool the step in flight reads). A pulled step that was not
        replayed moves :attr:`drains` on: settled with ``after`` pulling, a pipelined one;
        without, a drain (what it promoted sets the next interval)."""
        if step.records is None:
            return None
        more = after is not None and after.launched is not None
        session = self.session
        epoch = session.step_epoch if step.launched is not None else None
        lost = False
        waited = time.perf_counter()
        try:
            mx.eval(*step.flat)
        finally:
            if epoch is not None:
                lost = epoch.check(step.launched, more)
        checked = time.perf_counter()
        if self._settled is not None:  # a pipelined step's cost: from one check to the next
            self.speculation.timed(True, checked - self._settled)
        self._settled = checked if more else None
        cause, found = self._book(step.records, step.flat, lost, step.launched is not None,
                                  promote=not more, sequences=max(1, step.sequences))
        self.timing["step_wait_s"] += checked - waited
        self.timing["step_book_s"] += time.perf_counter() - checked
        self.speculation.record(cause is not None, cause == "absent")  # see _attempts
        if cause is not None:
            self._settled = None
            if after is not None:
                self.abandon(after)
            if cause == "device":
                session.drop_puller(found.drifted)  # once nothing in flight reads it
            self._uncount(step)  # the replay through the model counts it (as run() does)
            self._count_replay(cause)
            if found.absent:
                session.demand_absent_all([(layer.index, experts)
                                           for layer, experts in found.absent])
        return cause

    def abandon(self, step: Launched) -> None:
        """A launched step that will never be used (built on a bad step's token): its reads
        end before its epoch does, with nothing else in flight. It is launched again, and
        counted then."""
        self._uncount(step)
        if step.records is None:
            return
        mx.eval(*step.flat)
        if step.launched is not None:
            self.session.step_epoch.check(step.launched, more=False)

    def quiesce(self) -> None:
        """No launched step is in flight any more: after a pipelined loop stops, whatever it
        left unsettled (its tokens never left) is waited for and the epoch record leaves the
        step, so that the daemon holds nothing back for it."""
        self._settled = self._planned = None
        epoch = self.session.step_epoch
        if epoch is not None and epoch.inside:
            mx.synchronize()
            epoch.end()
        self.checks.flush()

    def _per_layer(self, forward, inputs, args: tuple, kwargs: dict):
        """A decode step waiting in every MoE layer, timed for the speculation's verdict (its
        logits evaluated, as a speculative step's are), and told it whether the step found
        every expert in its pool (with the host copy, a speculative step would have hit)."""
        moved = self._moved()
        started = time.perf_counter()
        logits = forward(inputs, *args, **kwargs)
        mx.eval(logits)
        self.speculation.timed(False, time.perf_counter() - started)
        self.speculation.shadow(self._moved() == moved)
        return logits

    def _moved(self) -> int:
        """Rows the layers' pools have moved in, staged beside them, pulled for them or used
        written ahead, so far: a step that changes none of these found every expert in its
        pool before it ran."""
        return sum(layer.pool.counters[key] for layer in self.layers
                   for key in ("moved", "staged", "pulled", "ahead_used"))

    def _speculative_step(self, forward, inputs, args: tuple, kwargs: dict) -> tuple:
        """One step without waits: ``(logits, cause, found)``; ``cause`` is None, or why the
        step must be replayed (see StepCheck.check), ``found`` its Findings."""
        session = self.session
        epoch = session.step_epoch if session.puller is not None else None
        if epoch is not None:
            epoch.begin()  # published before any kernel of the step reads the slot table
        lost = False
        started = time.perf_counter()
        try:
            logits, records = self._without_waits(forward, inputs, args, kwargs, [])
            flat = self._flat(records)
            built = time.perf_counter()
            mx.eval(logits, *flat)  # the step's one wait
        except BaseException:
            if epoch is not None:
                mx.synchronize()  # no read of a step that stopped may outlive its epoch
            raise
        finally:
            if epoch is not None:
                lost = epoch.end()  # every read of the step is done
        waited = time.perf_counter()
        cause, found = self._book(records, flat, lost, any(r.status is not None for r in records),
                                  sequences=sequences_of(token_shape(inputs, kwargs)))
        timing = self.timing
        timing["step_build_s"] += built - started
        timing["step_wait_s"] += waited - built
        timing["step_book_s"] += time.perf_counter() - waited
        return logits, cause, found

    def _book(self, records: list, flat: list, lost: bool, pulled: bool,
              promote: bool = True, sequences: int = 1) -> tuple:
        """A waited-for speculative step counted and checked (see StepCheck.check; ``lost``:
        its epoch was revoked): ``(cause, found)``. A good step that ``pulled`` moves
        :attr:`drains` on: checked with another step in flight (not ``promote``), a
        pipelined one; with nothing in flight, a drain."""
        counters = self.counters
        counters["host_waits"] += 1
        counters["speculative_steps"] += 1
        counters["pulled_steps"] += pulled
        found = Findings()
        cause = "epoch" if lost else self.checks.check(
            records, found, *(np.array(f) for f in flat), promote=promote, sequences=sequences)
        if cause is None and pulled:
            if promote:
                self.drains.drained(found.promoted)
            else:
                self.drains.pipelined += 1
        return cause, found

    def _without_waits(self, forward, inputs, args: tuple, kwargs: dict, records):
        """The forward with every layer on its speculative path; ``records`` (a list, or None
        to record nothing) collects each layer's lazy ids. An interrupted step's go with it."""
        self.mode.records, self.mode.speculative = records, True
        try:
            return forward(inputs, *args, **kwargs), records
        finally:
            self.mode.speculative, self.mode.records = False, None

    def _unchecked(self) -> bool:
        """Every pool holds every expert at its index: nothing can miss, nothing is checked."""
        return (self.speculation.mode != "off" and bool(self.layers)
                and all(layer.pool.complete for layer in self.layers))

    def _flat(self, records: list) -> list:
        """What a step's check reads, lazy: the plain layers' ids, then the pulled ones'
        statuses (joined by the puller: CudaPuller.join), each concatenated (see
        StepCheck.check)."""
        ids = [r.ids.reshape(-1) for r in records if r.status is None]
        statuses = [r.status for r in records if r.status is not None]
        flat = [mx.concatenate(ids)] if ids else []
        if statuses:
            puller = self.session.puller
            flat.append(puller.join(statuses) if puller is not None
                        else mx.concatenate(statuses))
        return flat

    def _count_replay(self, cause: str) -> None:
        counters = self.counters
        counters["replays"] += 1
        log.debug("step %d replayed: %s", counters["steps"], REPLAY_CAUSES[cause])
        if cause != "pool":
            counters[f"replays_{cause}"] += 1

    def _count_decode(self, shape: tuple) -> int:
        """A decode step (one token a sequence) of tokens ``shape``: its sequences counted and
        returned (0 for a call that is no decode step)."""
        if not shape or shape[-1] != 1:
            return 0
        sequences = sequences_of(shape)
        counters = self.counters
        counters["decode_tokens"] += sequences
        counters["batch_steps"] += sequences > 1
        return sequences

    def _uncount(self, step: Launched) -> None:
        """A launched step that runs again (replayed, or launched anew) is counted then."""
        counters = self.counters
        counters["steps"] -= 1
        counters["decode_tokens"] -= step.sequences
        counters["batch_steps"] -= step.sequences > 1

    def _speculate(self, shape: tuple, cache, depth: int = 1) -> bool:
        """A decode step of tokens ``shape`` (see :func:`token_shape`) speculates (a batch's,
        pulled, where its stacks fit: :meth:`_batch_fits`)."""
        puller = self.session.puller
        if self.pipeline or not self.layers or not self.speculation.wanted(
                device=puller is not None and puller.traceable, replays_misses=puller is None):
            return False
        if puller is not None and sequences_of(shape) > 1 \
                and not self._batch_fits(math.prod(shape) * self._top_k):
            return False
        return cache is None or replayable(cache, depth * shape[-1])

    def _batch_fits(self, pairs: int) -> bool:
        """A pulled batch step of ``pairs`` pairs a layer may speculate: its stacks (a row per
        routed expert, at most ``pairs``, every layer's: they may all be allocated before the
        first is freed) fit, as a prompt's must (:func:`stacks_fit`). Asked of the free memory
        once per batch size, and again every BATCH_FIT_EVERY steps."""
        steps = self.counters["steps"]
        if steps - self._fits_at >= BATCH_FIT_EVERY:
            self._fits, self._fits_at = {}, steps
        fits = self._fits.get(pairs)
        if fits is None:
            manifest = self.session.manifest
            stack = sum(min(layer.num_experts, pairs) * manifest.layers[layer.index].expert_bytes
                        for layer in self.layers)
            fits = self._fits[pairs] = stacks_fit(stack, free_memory())
        return fits
