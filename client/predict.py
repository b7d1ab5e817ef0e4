"""Cross-layer prediction: which experts the next MoE layer will route to, and whether guessing pays.

At layer L's router sync the client also evaluates layer L+1's router on layer L's MoE input (the
same ``mx.eval``, so no extra host sync). Layer L's input is normalised with layer L's norm; when
both layers use a weighted RMS norm, rescaling by the ratio of their weights gives exactly what
layer L+1's norm would make of the same residual stream. A guess is only a hint: the rows it
stages are used only if the router really chose them and their versions still validate, so a
wrong guess costs work, never exactness.

A guess has two widths. Its core is the next router's top-k (as many experts as it will route
to): the resident ones are written ahead into the next layer's pool. The read-ahead asks the
daemon for :data:`GUESS_WIDTH` times as many, best first, and the daemon fills the absent ones
into its side rows while there are side rows free. A wrong read-ahead costs an SSD read off the
critical path, a right one saves one on it; a wrong copy ahead costs memory bandwidth the
layer's own compute needs (on Apple Silicon the GPU shares it), so copies stay at the core.
On the learned benchmark model, recall of the next layer's experts goes from 0.80-0.87 at the
core to 0.96-0.99 at twice its width (bench/RESULTS.md).

Each predicted layer keeps its own precision (of the core) over a window of guesses. In
``auto`` mode a layer whose precision falls below :data:`MIN_PRECISION` stops guessing and tries
again after :data:`RETEST_AFTER` calls. 0.5 is the break-even point when a right guess saves about what a
wrong one costs (one row copy, and one SSD read if the row was not resident).

What is read ahead is judged apart, on its own hits (:class:`ReadAhead`): the core's absent
experts and the rest of the width's each have a verdict, scored on every guess on what it would
read, read or not, so learning costs no SSD bytes. In ``auto`` a part is read only after a window
of such experts was mostly routed, and stops as soon as a window wastes more than a passing one
may. A budget per layer then bounds what is read by what was demanded: each call earns
max(its demand misses, its read-ahead hits) experts, each expert read ahead spends one, so the
read-ahead bytes not used never exceed the demand reads (see :meth:`LayerGuesses.settle`).
"""

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from expertd.choices import PREFETCH_MODES, check_choice

WINDOW = 32  # guesses per precision verdict
MIN_PRECISION = 0.5
RETEST_AFTER = 256  # calls a switched-off layer waits before it guesses again
READ_WINDOW = 16  # experts a read-ahead verdict is judged on
MIN_READ_PRECISION = 0.5  # a right read-ahead saves a demand read, a wrong one costs a read


def check_mode(mode: str) -> str:
    return check_choice("prefetch", mode, PREFETCH_MODES)


@dataclass
class ReadAhead:
    """Whether one part of a layer's read-ahead (its core, or the rest of its width) is read.

    Scored on the experts it would read (guessed, absent from the arena and the pool), whether
    they were read or not. ``auto`` starts off; a window of :data:`READ_WINDOW` experts with at
    most half of them wrong turns it on; more wrong ones than that in a window turn it off at once.
    """

    mode: str = "auto"
    active: bool = False
    window_scored: int = 0
    window_right: int = 0
    scored: int = 0  # experts it would have read, all time
    right: int = 0  # of which the router chose
    started: int = 0  # times auto began reading
    stopped: int = 0  # times auto stopped reading

    def __post_init__(self):
        self.active = check_mode(self.mode) == "on"

    def record(self, scored: int, right: int) -> None:
        self.scored += scored
        self.right += right
        if self.mode != "auto":
            return
        self.window_scored += scored
        self.window_right += right
        if self.window_scored - self.window_right > (1 - MIN_READ_PRECISION) * READ_WINDOW:
            self.stopped += self.active
            self.active = False
        elif self.window_scored >= READ_WINDOW:
            self.started += not self.active
            self.active = True
        else:
            return
        self.window_scored = self.window_right = 0

    def summary(self) -> dict:
        return dict(active=self.active, scored=self.scored,
                    precision=round(self.right / self.scored, 4) if self.scored else None,
                    started=self.started, stopped=self.stopped)


@dataclass
class LayerGuesses:
    """Precision bookkeeping of the guesses made for one MoE layer.

    Args:
        mode: "auto", "on" or "off".
    """

    mode: str = "auto"
    active: bool = True
    idle_calls: int = 0  # calls since an auto layer switched itself off
    window_calls: int = 0
    window_guessed: int = 0
    window_right: int = 0
    calls: int = 0  # guesses scored, all time
    guessed: int = 0  # experts in the guesses' cores, all time
    right: int = 0  # of which the router chose
    routed: int = 0  # experts routed in calls that had a guess
    wide_guessed: int = 0  # experts read ahead (the whole width), all time
    wide_right: int = 0  # of which the router chose
    switched_off: int = 0
    near: ReadAhead = field(init=False)  # the read-ahead of the core's absent experts
    wide: ReadAhead = field(init=False)  # of the rest of the width's
    credit: int = 0  # experts auto may read ahead now (the budget, see settle)
    cap: int = 0  # most credit kept: one guess's width
    read: int = 0  # experts asked to be read ahead, all time
    read_right: int = 0  # of which the router chose
    held_back: int = 0  # experts the verdicts passed and the budget kept from being read
    _plan: tuple | None = None  # (absent, read) of the guess not scored yet
    _hits: int = 0  # experts read ahead for this layer's coming call that it routed

    def __post_init__(self):
        self.active = check_mode(self.mode) != "off"
        self.near, self.wide = ReadAhead(self.mode), ReadAhead(self.mode)

    def wanted(self) -> bool:
        """Should the previous layer guess for this one now?"""
        if self.mode != "auto" or self.active:
            return self.active
        self.idle_calls += 1
        if self.idle_calls >= RETEST_AFTER:
            self.active, self.idle_calls = True, 0
        return self.active

    def plan(self, absent: np.ndarray, n_core: int) -> np.ndarray:
        """Which of a guess's experts to read ahead, and spend the budget on them.

        Args:
            absent: bool per guessed expert (best first), True where neither the arena nor the
                pool holds it.
            n_core: how many of them are the guess's core.
        Returns:
            Bool per guessed expert: read it ahead.
        """
        read = absent.copy()
        read[:n_core] &= self.near.active
        read[n_core:] &= self.wide.active
        if self.mode == "auto":
            self.cap = len(absent)
            picked = np.flatnonzero(read)
            held = picked[self.credit:]  # best first: the budget drops the least likely
            read[held] = False
            self.held_back += len(held)
            self.credit -= len(picked) - len(held)
        self.read += int(read.sum())
        self._plan = (absent, read)
        return read

    def settle(self, misses: int) -> None:
        """A call of this layer ended, having demanded ``misses`` experts the arena lacked: the
        budget earns max(misses, the call's read-ahead hits), at most :attr:`cap` kept.

        The reads spent never exceed what was earned, so read-ahead unused stays within the
        demand misses: a read-ahead hit pays for itself, and one the daemon did not read in
        time (or lost) was demanded in this same call, hence the max and not the sum."""
        if self.mode == "auto":
            self.credit = min(self.cap, self.credit + max(misses, self._hits))
        self._hits = 0

    def record(self, guessed: np.ndarray, routed: np.ndarray,
               wide: np.ndarray | None = None) -> None:
        """Score a guess against the experts the router chose.

        Args:
            guessed: the guess's core (distinct experts); auto's verdict is on its precision.
            routed: the experts the router chose (distinct).
            wide: the whole read-ahead (distinct, the core included), if wider than the core.
        """
        chosen = set(routed.tolist())
        right = len(chosen.intersection(guessed.tolist()))
        if wide is None:
            wide = guessed
        self.calls += 1
        self.guessed += len(guessed)
        self.right += right
        self.routed += len(routed)
        self.wide_guessed += len(wide)
        self.wide_right += len(chosen.intersection(wide.tolist()))
        if self._plan is not None:
            absent, read = self._plan
            self._plan = None
            if len(absent) == len(wide):
                hit = np.isin(wide, routed)
                n = len(guessed)
                self.near.record(int(absent[:n].sum()), int((absent & hit)[:n].sum()))
                self.wide.record(int(absent[n:].sum()), int((absent & hit)[n:].sum()))
                self._hits = int((read & hit).sum())
                self.read_right += self._hits
        self.window_calls += 1
        self.window_guessed += len(guessed)
        self.window_right += right
        if self.window_calls >= WINDOW:
            if self.mode == "auto" and self.window_right < MIN_PRECISION * self.window_guessed:
                self.active = False
                self.switched_off += 1
            self.window_calls = self.window_guessed = self.window_right = 0

    def summary(self) -> dict:
        return dict(active=self.active, calls=self.calls, guessed=self.guessed, right=self.right,
                    routed=self.routed,
                    precision=round(self.right / self.guessed, 4) if self.guessed else None,
                    recall=round(self.right / self.routed, 4) if self.routed else None,
                    wide_guessed=self.wide_guessed,
                    wide_precision=(round(self.wide_right / self.wide_guessed, 4)
                                    if self.wide_guessed else None),
                    wide_recall=round(self.wide_right / self.routed, 4) if self.routed else None,
                    switched_off=self.switched_off, read=self.read, read_right=self.read_right,
                    held_back=self.held_back, read_near=self.near.summary(),
                    read_wide=self.wide.summary())


@dataclass
class Guesser:
    """Layer L+1's router, as layer L evaluates it on its own MoE input."""

    router: object  # the next MoE block's router module (mlx-lm's own)
    scale: mx.array | None  # next norm's weight / this norm's weight, when both are RMS norms
    guesses: LayerGuesses = field(default_factory=LayerGuesses)

    def lazy(self, x: mx.array, k: int, width: int = 1) -> mx.array:
        """The experts the next router ranks best for ``x``, best first along the last axis:
        ``k * width`` of them (at most every expert), lazy, not evaluated. The first ``k`` are
        its top-k. Routers that pick their experts themselves (DeepSeek's) give their top-k
        only, unordered."""
        if self.scale is not None:
            x = x * self.scale
        out = self.router(x)
        if isinstance(out, tuple):
            return out[0]
        n = min(k * width, out.shape[-1])
        if n == k:
            return mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]
        # Sorted, so the top-k come first; argsort of a few dozen scores per token is nothing
        # next to the router's matmul.
        return mx.argsort(-out, axis=-1)[..., :n]


def find_router(block, switch, num_experts: int):
    """The child of an MoE block that scores the experts: a weight with one row per expert."""
    for _, child in block.children().items():
        if child is switch:
            continue
        weight = getattr(child, "weight", None)
        if isinstance(weight, mx.array) and weight.ndim == 2 and weight.shape[0] == num_experts:
            return child
    return None


def norm_weight(decoder_layer):
    """The weight of the RMS norm in front of a decoder layer's MoE block, if it has one."""
    norm = getattr(decoder_layer, "post_attention_layernorm", None) if decoder_layer else None
    weight = getattr(norm, "weight", None)
    if isinstance(weight, mx.array) and weight.ndim == 1 and "RMSNorm" in type(norm).__name__:
        return weight
    return None


def make_guessers(modules: dict, layers, mode: str) -> list:
    """One :class:`Guesser` per MoE layer but the last (for the layer after it), or None.

    Args:
        modules: the model's ``named_modules()`` as a dict.
        layers: the manifest's MoE layers, in order.
        mode: "auto", "on" or "off".
    """
    check_mode(mode)
    found = []
    for layer in layers:
        block_path, _, _ = layer.module.rpartition(".")
        decoder_path, _, _ = block_path.rpartition(".")
        block, switch = modules.get(block_path), modules.get(layer.module)
        router = find_router(block, switch, layer.num_experts) if block is not None else None
        found.append((router, norm_weight(modules.get(decoder_path))))
    guessers = []
    for (_, weight), (router, next_weight) in zip(found, found[1:]):
        if mode == "off" or router is None:
            guessers.append(None)
            continue
        scale = None
        if weight is not None and next_weight is not None:
            scale = mx.where(weight == 0, 0, next_weight / mx.where(weight == 0, 1, weight))
            mx.eval(scale)
        guessers.append(Guesser(router, scale, LayerGuesses(mode)))
    return guessers + [None]
