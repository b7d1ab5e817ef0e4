"""Whether a decode step speculates, and when the pipelined loop drains: pure logic, no I/O.

:class:`Speculation` weighs the replay rate and the measured costs of a speculative step and of
a step waiting per layer (docs/ARCHITECTURE.md, "The step"); :class:`Drains` paces the checks
that run with nothing else in flight, so that promotions into the pools can happen. Steps
(step.py) feeds both and asks them; tests drive them without a daemon or MLX.
"""

import statistics
from collections import deque
from dataclasses import dataclass, field

from expertd.choices import SPECULATE_MODES, check_choice

WINDOW = 16  # speculative steps per verdict
MAX_REPLAYS = 4  # replays in a window above which auto stops speculating (a replay costs a
# step, a speculative hit saves one wait per MoE layer, about a layer's compute on a GPU)
RETRY_AFTER = 32  # steps a stopped session first waits before it speculates again; the wait
MAX_RETRY_AFTER = 1024  # doubles each time it stops again, up to this, and resets on a good window
MIN_WINDOW = 4  # speculative steps a window needs before its replay rate is judged by cost
PROBE_AT = MIN_WINDOW // 2  # the window's step that waits per layer, once, to measure that cost
# (with the host copy; a device puller's waits per layer once a step was replayed)
TIMED_STEPS = 5  # the latest step times of each kind whose median the verdict weighs
SHADOW_STEPS = 4  # steps waiting per layer in a row that found every expert in its pool before
# auto speculates where nothing pulls a pool's misses (a speculative step is replayed unless they
# all are), until speculating was measured to save at least SHADOW_SAVES of a step waiting per
# layer (a GPU's waits: there a replay costs about a step and speculation pays despite some)
SHADOW_SAVES = 0.5
DRAIN_EVERY = 8  # one step in this many is drained (pipelined loop), while drains promote
MAX_DRAIN_EVERY = 64  # the most, reached by doubling after each drain that promoted nothing


def check_speculate(mode: str) -> str:
    return check_choice("speculate", mode, SPECULATE_MODES)


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
    # Replays on rows absent from the arena: reads the step would have waited for anyway, so
    # they weigh in the cost (:meth:`pays`) but not in MAX_REPLAYS. Where the arena is too
    # small for what the steps route to, they come at most steps, and the cost then decides.
    window_absent: int = 0
    idle_steps: int = 0
    retry_after: int = RETRY_AFTER
    stopped: int = 0  # times auto stopped speculating
    stopped_by_cost: int = 0  # of ``stopped``, times the measured costs decided
    # Steps waiting per layer in a row whose every expert was in its pool before the step (a
    # speculative step with the host copy would not have been replayed): see :meth:`shadow`.
    shadow_hits: int = 0
    shadowed: bool = False  # a step waiting per layer has told the shadow anything
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
        rate = (self.window_replays + self.window_absent) / self.window_steps
        return self.spec_s + rate * self.layer_s < self.layer_s

    def __post_init__(self):
        self.active = check_speculate(self.mode) != "off"

    def wanted(self, device: bool = False, replays_misses: bool | None = None) -> bool:
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
        if self.mode != "auto":
            return self.active
        if not self.active:
            self.idle_steps += 1
            if self.idle_steps >= self.retry_after:
                self.active, self.idle_steps = True, 0
                self._spec.clear()  # measured afresh: what stopped it may have passed
        return self.active and not self._gated(not device if replays_misses is None
                                               else replays_misses)

    def _gated(self, replays_misses: bool) -> bool:
        """Where nothing pulls a pool's misses (``replays_misses``) a speculative step that
        misses is computed twice, a whole step on a CPU: auto speculates only once
        SHADOW_STEPS steps waiting per layer in a row found every expert in their pools,
        unless speculating was measured to save at least SHADOW_SAVES of a step (a GPU's
        waits), where replays pay."""
        if self.mode != "auto" or not self.active or not replays_misses:
            return False
        if self.spec_s and self.layer_s and self.spec_s <= (1 - SHADOW_SAVES) * self.layer_s:
            return False
        return self.shadow_hits < SHADOW_STEPS

    def waiting(self, replays_misses: bool) -> bool:
        """For the summary: auto waits per layer for the shadow now (:meth:`_gated`), and a
        step waiting per layer told it so (not a session whose pools hold every expert)."""
        return self.shadowed and self._gated(replays_misses)

    def shadow(self, hit: bool) -> None:
        """A step waiting per layer found every expert it routed to in its pool already
        (``hit``: a speculative step would not have been replayed), or not."""
        self.shadowed = True
        self.shadow_hits = self.shadow_hits + 1 if hit else 0

    def _probe_due(self, device: bool) -> bool:
        if self.mode != "auto" or not self.active or not self.spec_s or self.layer_s:
            return False
        return (self.window_replays + self.window_absent > 0 if device
                else self.window_steps == PROBE_AT)

    def record(self, replayed: bool, absent: bool = False) -> None:
        """A speculative decode step checked: ``replayed`` or not, and whether for rows absent
        from the arena (``absent``: weighed in the cost alone, see :attr:`window_absent`)."""
        if replayed:
            self.shadow_hits = 0  # the host copy's next speculation waits for the shadow again
        self.window_steps += 1
        self.window_replays += replayed and not absent
        self.window_absent += replayed and absent
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
            self.window_steps = self.window_replays = self.window_absent = 0


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
