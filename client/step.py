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
"""

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from expertd.choices import SPECULATE_MODES

from .counters import REPLAY_CAUSES
from .layer import DECODE_IDS, StackedRows, StepMode
from .pool import free_memory
from .predict import check_choice
from .pull import ABSENT, PULLED, decode_status
from .switch import fronted

WINDOW = 16  # speculative steps per verdict
MAX_REPLAYS = 4  # replays in a window above which auto stops speculating (a replay costs a
# step, a speculative hit saves one wait per MoE layer, about a layer's compute on a GPU)
RETRY_AFTER = 32  # steps a stopped session first waits before it speculates again; the wait
MAX_RETRY_AFTER = 1024  # doubles each time it stops again, up to this, and resets on a good window
PROMPT_RETRY = 8  # prompts that wait per layer after one that could not speculate ran so


def check_speculate(mode: str) -> str:
    return check_choice("speculate", mode, SPECULATE_MODES)


log = logging.getLogger("expertd")
MIN_WINDOW = 4  # speculative steps a window needs before its replay rate is judged by cost
PROBE_AT = MIN_WINDOW // 2  # the window's step that waits per layer, once, to measure that cost
# (with the host copy; a device puller's waits per layer once a step was replayed)
TIMED_STEPS = 5  # the latest step times of each kind whose median the verdict weighs
BATCH_FIT_EVERY = 256  # steps after which a batch's stacks are weighed against free memory again
DRAIN_EVERY = 8  # one step in this many is drained (pipelined loop), while drains promote
MAX_DRAIN_EVERY = 64  # the most, reached by doubling after each drain that promoted nothing


@dataclass
class Speculation:
    """Whether steps should speculate (pure logic): auto stops when replays are frequent, or
    when they cost more than the waits speculation saves, judged from measured times: a
    speculative step costs ``spec_s`` and, replayed, a per-layer step ``layer_s`` more; a
    per-layer step costs ``layer_s``. Speculating pays while ``spec_s + rate * layer_s <
    layer_s``. On a backend where the per-layer waits cost little (a CPU), that rate is low.

    Each cost is the median of the latest TIMED_STEPS steps of its kind, so that one slow step
    (the first, which compiles the device's kernels: hundreds of milliseconds on CUDA) decides
    nothing; and a restart after a stop measures its speculative steps afresh."""

    mode: str = "auto"
    active: bool = True
    window_steps: int = 0
    window_replays: int = 0
    idle_steps: int = 0
    retry_after: int = RETRY_AFTER
    stopped: int = 0  # times auto stopped speculating
    stopped_by_cost: int = 0  # of ``stopped``, times the measured costs decided
    _spec: deque = field(default_factory=lambda: deque(maxlen=TIMED_STEPS))
    _layer: deque = field(default_factory=lambda: deque(maxlen=TIMED_STEPS))

    @property
    def spec_s(self) -> float:
        """A speculative decode step's seconds (its one wait included): the median of the
        latest measured, 0 while none is."""
        return statistics.median(self._spec) if self._spec else 0.0

    @property
    def layer_s(self) -> float:
        """A per-layer decode step's seconds, as :attr:`spec_s`."""
        return statistics.median(self._layer) if self._layer else 0.0

    def timed(self, speculative: bool, seconds: float) -> None:
        """A decode step's seconds: speculative (its one wait included), or per layer."""
        (self._spec if speculative else self._layer).append(seconds)

    def pays(self) -> bool:
        """Speculating at this window's replay rate costs less than waiting per layer (True
        while either cost is unmeasured)."""
        if not (self.spec_s and self.layer_s) or self.window_steps < MIN_WINDOW:
            return True
        rate = self.window_replays / self.window_steps
        return self.spec_s + rate * self.layer_s < self.layer_s

    def __post_init__(self):
        self.active = check_speculate(self.mode) != "off"

    def wanted(self, device: bool = False) -> bool:
        """Whether the next decode step speculates. With the host copy (``device`` False) one
        step of a window waits per layer, once, to time what speculating is weighed against:
        a speculative step may cost what such a step does (both copy and compute on the
        host), which stops auto without any replay. A ``device`` puller's speculative step
        never costs that much, so the cost matters only once a step was replayed: the step
        after it waits per layer (in the pipelined loop, the replay's own run; elsewhere the
        replay itself ran per layer and timed it), and a session never replayed waits once a
        step."""
        if self._probe_due(device):
            return False  # one step waiting per layer: what speculating is weighed against
        if self.mode != "auto" or self.active:
            return self.active
        self.idle_steps += 1
        if self.idle_steps >= self.retry_after:
            self.active, self.idle_steps = True, 0
            self._spec.clear()  # measured afresh: what stopped it may have passed
        return self.active

    def _probe_due(self, device: bool) -> bool:
        if self.mode != "auto" or not self.active or not self.spec_s or self.layer_s:
            return False
        return self.window_replays > 0 if device else self.window_steps == PROBE_AT

    def record(self, replayed: bool) -> None:
        self.window_steps += 1
        self.window_replays += replayed
        # Weighed on a replay, and at a window's end. A speculative step that costs as much as
        # waiting per layer (a CPU, where both cost compute) does not pay even without
        # replays: that is known once MIN_WINDOW steps are measured, and stops it then.
        level = self.window_steps >= MIN_WINDOW and self.spec_s >= self.layer_s > 0
        costly = (replayed or level or self.window_steps >= WINDOW) and not self.pays()
        if (self.window_replays > MAX_REPLAYS or costly) and self.mode == "auto":
            self.stopped_by_cost += costly and self.window_replays <= MAX_REPLAYS
            if self.stopped:
                self.retry_after = min(2 * self.retry_after, MAX_RETRY_AFTER)
            self.active = False
            self.stopped += 1
        elif self.window_steps >= WINDOW:
            self.retry_after = RETRY_AFTER  # a window that paid: a later stop waits little
        if self.window_steps >= WINDOW or not self.active:
            self.window_steps = self.window_replays = 0


@dataclass
class Drains:
    """When expertd's pipelined loop (client/decode.py) drains: checks a step with nothing else
    in flight, so that the experts its pulls keep bringing are promoted into the pools (a
    promotion must not rewrite a pool that a step in flight reads). A drain costs the device an
    idle spell (the host's bookkeeping, then the next step's build), so one that promoted
    nothing doubles the interval, up to MAX_DRAIN_EVERY; one that promoted brings it back to
    DRAIN_EVERY. A pulled step checked by :meth:`Steps.run` (a replay, a prompt's last token)
    has nothing in flight either, so it counts as a drain. Pure logic."""

    every: int = DRAIN_EVERY
    pipelined: int = 0  # steps settled with another in flight since the last drain

    def due(self) -> bool:
        """The step to settle next should be drained."""
        return self.pipelined + 1 >= self.every

    def drained(self, promoted: int) -> None:
        self.pipelined = 0
        self.every = DRAIN_EVERY if promoted else min(2 * self.every, MAX_DRAIN_EVERY)


def _parts(records: list) -> list:
    """``(record, slice)`` per record: where its ids (``record[1]``) sit when the records'
    are concatenated in order."""
    out, at = [], 0
    for record in records:
        out.append((record, slice(at, at + record[1].size)))
        at += record[1].size
    return out


def _first_only(experts: np.ndarray) -> np.ndarray:
    """``experts`` with each one's later pairs -1 (none pulled)."""
    out = np.full_like(experts, -1)
    _, first = np.unique(experts, return_index=True)
    out[first] = experts[first]
    return out


def _rows(arrays: list) -> np.ndarray:
    """1-D arrays as the rows of one, each padded with -1 to the longest (a batch's steps
    differ in length where sequences joined or left between them)."""
    out = np.full((len(arrays), max(len(a) for a in arrays)), -1, np.int64)
    for row, a in zip(out, arrays):
        row[:len(a)] = a
    return out


def token_shape(inputs, kwargs: dict) -> tuple:
    """The shape of a model call's tokens: its ids', or its input embeddings' less their last
    axis where it passes those (mlx-lm's models then take ids of size 0)."""
    embeddings = kwargs.get("input_embeddings")
    return tuple(embeddings.shape[:-1] if embeddings is not None else inputs.shape)


def stacks_fit(stack_bytes: int, free: int | None) -> bool:
    """A prompt may speculate with ``stack_bytes`` of stacks (every layer's, a row per
    expert): they fit in half of the ``free`` bytes (see pool.free_memory; None: unknown). The device
    may allocate every layer's stack before the first is freed (its evaluation runs ahead of
    the computation), where a prompt waiting per layer holds one at a time: on a model larger
    than memory, that prompt waits per layer."""
    return free is None or 2 * stack_bytes <= free


def trim(cache, tokens: int) -> None:
    """Take a step's ``tokens`` back out of every KV cache of ``cache`` (None: no cache)."""
    for c in cache or []:
        c.trim(tokens)


def replayable(cache, tokens: int) -> bool:
    """Can every cache of ``cache`` be trimmed back exactly by ``tokens`` after a step?"""
    from mlx_lm.models import cache as caches

    exact = (caches.KVCache, caches.QuantizedKVCache, caches.ConcatenateKVCache,
             caches.BatchKVCache)
    for c in cache:
        if isinstance(c, caches.CacheList):
            if not replayable(c.caches, tokens):
                return False
        elif isinstance(c, caches.RotatingKVCache):
            if c.offset + tokens >= c.max_size:  # would wrap: the old entries are gone
                return False
        elif not isinstance(c, exact):
            return False
    return True


@dataclass
class Findings:
    """What a step's check found beside its cause: what a replay acts on (the (layer,
    experts) the arena lacked, demanded once nothing in flight holds rows; the layer whose
    pull differed from the host copy, whose puller is dropped), and what it promoted (a
    drain's promotions set the next drain's interval)."""

    absent: list = field(default_factory=list)
    drifted: int | None = None
    promoted: int = 0  # experts the check promoted into the pools (a drain's)


@dataclass
class Launched:
    """A decode step built and computing, its check still to come (:meth:`Steps.launch`)."""

    logits: object
    records: list | None  # (layer, ids, status, arrays) to check; None: nothing to check
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
        session: the client session (its counters get ``steps``, ``host_waits``,
            ``speculative_steps``, ``unchecked_steps`` and ``replays``).
        layers: the model's :class:`~expertd.client.layer.StreamedLayer` s, in order.
        mode: the :class:`~expertd.client.layer.StepMode` the layers ask (this sets it).
        speculate: "auto" (default: speculate while replays are rare), "on" or "off".
        pipeline: True on a pipeline rank, which never speculates.
    """

    def __init__(self, session, layers: list, mode: StepMode, speculate: str = "auto",
                 pipeline: bool = False):
        self.session, self.layers, self.mode = session, layers, mode
        self.speculation = Speculation(speculate)
        self.pipeline = pipeline
        self._settled = None  # when the last pipelined step was checked, another in flight
        self._planned = None  # plan()'s decision for the next launch
        # layer index -> (layer, [(rows, experts)] of its pulled steps not yet counted)
        self._deferred: dict = {}
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
        self.flush()  # the pools may change during this step: count what waited first
        counters = self.session.counters
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
        ``prompt`` a lost epoch too. A decode step's are timed and judged (:class:`Speculation`);
        it demands every layer's absent rows, a prompt only the first layer's that lacked any
        (it routed on exact inputs; the layers after it routed on rows it did not have)."""
        for attempt in range(2):
            started = time.perf_counter()
            logits, cause, found = self._speculative_step(forward, inputs, args, kwargs)
            # A pull that found its expert absent from the arena is a read from the disk the
            # step had to wait for anyway, not a wrong guess: it does not count against
            # speculating, and the step runs again without waits once the daemon has read it.
            if not prompt:
                self.speculation.timed(True, time.perf_counter() - started)
                if cause != "absent":
                    self.speculation.record(cause is not None)
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
            for layer, experts in found.absent[:1] if prompt else found.absent:
                self.session.demand_absent(layer.index, experts)
        return None

    def _prompt(self, forward, inputs, args: tuple, kwargs: dict, cache, tokens: int):
        """A prompt's model call (``tokens`` a sequence): speculative where
        :meth:`_speculate_prompt` allows (one wait; replayed once so after a lost epoch, or
        once the rows its first layer lacking any found absent from the arena were demanded;
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
        if not puller.counters["timed_bytes"]:
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
        counters = self.session.counters
        counters["steps"] += 1
        sequences = self._count_decode(token_shape(inputs, kwargs))
        if self._unchecked():
            counters["unchecked_steps"] += 1
            return Launched(self._without_waits(forward, inputs, args, kwargs, None)[0],
                            None, [], None, sequences)
        cache = kwargs.get("cache", args[0] if args else None)
        planned, self._planned = self._planned, None
        if not (self.plan(inputs, cache) if planned is None else planned):
            self.flush()
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
        launched on its token) abandoned and then the experts the arena lacked demanded (the
        daemon may have to evict for them, and ``after``'s epoch would hold those rows). With
        ``after`` pulling, the epoch record advances by two and stays odd, and pulled experts
        are counted but not promoted (a promotion rewrites a pool the step in flight reads).
        A pulled step that was not replayed moves :attr:`drains` on: settled with ``after``
        pulling, a pipelined one; without, a drain (what it promoted sets the next
        interval)."""
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
                                  promote=not more)
        session.timing["step_wait_s"] += checked - waited
        session.timing["step_book_s"] += time.perf_counter() - checked
        if cause != "absent":
            self.speculation.record(cause is not None)
        if cause is not None:
            self._settled = None
            if after is not None:
                self.abandon(after)
            if cause == "device":
                session.drop_puller(found.drifted)  # once nothing in flight reads it
            self._uncount(step)  # the replay through the model counts it (as run() does)
            self._count_replay(cause)
            for layer, experts in found.absent:
                session.demand_absent(layer.index, experts)
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
        self.flush()

    def _per_layer(self, forward, inputs, args: tuple, kwargs: dict):
        """A decode step waiting in every MoE layer, timed for the speculation's verdict (its
        logits evaluated, as a speculative step's are)."""
        started = time.perf_counter()
        logits = forward(inputs, *args, **kwargs)
        mx.eval(logits)
        self.speculation.timed(False, time.perf_counter() - started)
        return logits

    def _speculative_step(self, forward, inputs, args: tuple, kwargs: dict) -> tuple:
        """One step without waits: ``(logits, cause, found)``; ``cause`` is None, or why the
        step must be replayed (see :meth:`_check`), ``found`` its :class:`Findings`."""
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
        cause, found = self._book(records, flat, lost,
                                  any(status is not None for _, _, status, _ in records))
        timing = session.timing
        timing["step_build_s"] += built - started
        timing["step_wait_s"] += waited - built
        timing["step_book_s"] += time.perf_counter() - waited
        return logits, cause, found

    def _book(self, records: list, flat: list, lost: bool, pulled: bool,
              promote: bool = True) -> tuple:
        """A waited-for speculative step counted and checked (see :meth:`_check`; ``lost``:
        its epoch was revoked): ``(cause, found)``. A good step that ``pulled`` moves
        :attr:`drains` on: checked with another step in flight (not ``promote``), a
        pipelined one; with nothing in flight, a drain."""
        counters = self.session.counters
        counters["host_waits"] += 1
        counters["speculative_steps"] += 1
        counters["pulled_steps"] += pulled
        found = Findings()
        cause = "epoch" if lost else self._check(records, found, *(np.array(f) for f in flat),
                                                 promote=promote)
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

    @staticmethod
    def _flat(records: list) -> list:
        """What a step's check reads, lazy: the plain layers' ids, then the pulled ones'
        statuses, each concatenated (see :meth:`_check`)."""
        ids = [idx.reshape(-1) for _, idx, status, _ in records if status is None]
        statuses = [status for _, _, status, _ in records if status is not None]
        return [mx.concatenate(part) for part in (ids, statuses) if part]

    def _count_replay(self, cause: str) -> None:
        counters = self.session.counters
        counters["replays"] += 1
        log.debug("step %d replayed: %s", counters["steps"], REPLAY_CAUSES[cause])
        if cause != "pool":
            counters[f"replays_{cause}"] += 1

    def _count_decode(self, shape: tuple) -> int:
        """A decode step (one token a sequence) of tokens ``shape``: its sequences counted and
        returned (0 for a call that is no decode step)."""
        if not shape or shape[-1] != 1:
            return 0
        sequences = math.prod(shape)
        counters = self.session.counters
        counters["decode_tokens"] += sequences
        counters["batch_steps"] += sequences > 1
        return sequences

    def _uncount(self, step: Launched) -> None:
        """A launched step that runs again (replayed, or launched anew) is counted then."""
        counters = self.session.counters
        counters["steps"] -= 1
        counters["decode_tokens"] -= step.sequences
        counters["batch_steps"] -= step.sequences > 1

    def _count_union(self, parts: list, experts: list) -> None:
        """A checked step of several sequences: the pairs its layers routed, and the distinct
        experts among them (``experts``: each layer's, in ``parts``' order), whose ratio says
        how much a batch's pulls are shared."""
        counters = self.session.counters
        for (_, part), used in zip(parts, experts):
            counters["routed_pairs"] += part.stop - part.start
            counters["union_experts"] += len(np.unique(used[used >= 0]))

    def _speculate(self, shape: tuple, cache, depth: int = 1) -> bool:
        """A decode step of tokens ``shape`` (see :func:`token_shape`) speculates (a batch's,
        pulled, where its stacks fit: :meth:`_batch_fits`)."""
        puller = self.session.puller
        if self.pipeline or not self.layers or not self.speculation.wanted(
                device=puller is not None and puller.traceable):
            return False
        if puller is not None and len(shape) > 1 and math.prod(shape[:-1]) > 1 \
                and not self._batch_fits(math.prod(shape) * self._top_k):
            return False
        return cache is None or replayable(cache, depth * shape[-1])

    def _batch_fits(self, pairs: int) -> bool:
        """A pulled batch step of ``pairs`` pairs a layer may speculate: its stacks (a row per
        routed expert, at most ``pairs``, every layer's: they may all be allocated before the
        first is freed) fit, as a prompt's must (:func:`stacks_fit`). Asked of the free memory
        once per batch size, and again every BATCH_FIT_EVERY steps."""
        steps = self.session.counters["steps"]
        if steps - self._fits_at >= BATCH_FIT_EVERY:
            self._fits, self._fits_at = {}, steps
        fits = self._fits.get(pairs)
        if fits is None:
            manifest = self.session.manifest
            stack = sum(min(layer.num_experts, pairs) * manifest.layers[layer.index].expert_bytes
                        for layer in self.layers)
            fits = self._fits[pairs] = stacks_fit(stack, free_memory())
        return fits

    def _check(self, records: list, found: Findings, *flat: np.ndarray,
               promote: bool = True) -> str | None:
        """Why the speculative step must be replayed ("pool": an id missed its pool without a
        puller; "absent": a pulled expert had no ready row in the arena; "device": a pull
        differed from the host copy), what the replay acts on in ``found``, or None after the
        host's bookkeeping of the step (pool use counts, promotions, reports to the daemon).
        Without ``promote`` (a pipelined step, another in flight) the pulled layers' counting
        waits in ``_deferred`` for the next step that promotes (:meth:`flush`): the pools do not
        change in between, so counting then decides what counting now would, but for the
        order of the uses' decays against the counts (ExpertPool.count_steps)."""
        # Each layer's part of the concatenated ids / statuses (see _flat), in record order.
        plain = _parts([r for r in records if r[2] is None])
        pulled = _parts([r for r in records if r[2] is not None])
        flat = list(flat)
        ids = flat.pop(0) if plain else None
        for (layer, _, _, _), part in plain:
            if (layer.pool.row_of[ids[part]] < 0).any():
                return "pool"  # the replay does the bookkeeping, on the per-layer path
        if pulled:
            rows, experts, kinds = decode_status(flat.pop(0))  # every pulled layer at once
            if (kinds == ABSENT).any():
                for (layer, _, _, _), part in pulled:
                    lacked = experts[part][kinds[part] == ABSENT]
                    if lacked.size:
                        found.absent.append((layer, np.unique(lacked).astype(np.int32)))
                return "absent"
            found.drifted = self._drifted(pulled, kinds)
            if found.drifted is not None:
                return "device"
        shape = records[0][1].shape if records else ()
        if len(shape) >= 3 and shape[-2] == 1 and math.prod(shape[:-2]) > 1:  # a batch's decode
            self._count_union(plain, [ids[part] for _, part in plain])
            self._count_union(pulled, [np.where(rows[part] >= 0,
                                                layer.pool.expert_of[np.maximum(rows[part], 0)],
                                                experts[part])
                                       for (layer, _, _, _), part in pulled])
        for (layer, _, _, _), part in plain:
            layer.after_speculation(ids[part])
        if pulled and promote:
            self.flush()
        for (layer, _, _, arrays), part in pulled:
            if promote:
                found.promoted += layer.after_pull(rows[part], experts[part], arrays)
            else:  # a stack pulled each expert once: its other pairs count as none
                self._deferred.setdefault(layer.index, (layer, []))[1].append(
                    (rows[part], _first_only(experts[part]) if isinstance(arrays, StackedRows)
                     else experts[part]))
        return None

    def _drifted(self, pulled: list, kinds: np.ndarray) -> int | None:
        """The layer whose pull differed from the host copy, of those whose pulls are still
        compared with it (Metal's: pull.verify_pull): the step's logits are wrong. None if
        none did. A layer whose pull with rows from the arena agreed is compared no more.
        (The step's epoch held: a revoked one is replayed before this is asked.)"""
        puller = self.session.puller
        if puller is None or not puller.verify_first:
            return None
        for (layer, ids, status, arrays), part in pulled:
            if (kinds[part] == PULLED).any() and puller.differs(layer.index, ids, layer.pool,
                                                                arrays, status):
                return layer.index
        return None

    def flush(self) -> None:
        """Count the pulled steps whose bookkeeping waited (see :meth:`_check`)."""
        deferred, self._deferred = self._deferred, {}
        for layer, steps in deferred.values():
            layer.after_pulled_steps(_rows([r for r, _ in steps]), _rows([e for _, e in steps]))
