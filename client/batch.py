"""A batch decoded on expertd's pipelined step: mlx-lm's BatchGenerator, each step checked late.

mlx-lm's ``GenerationBatch`` builds a batch's step n+1 on step n's lazy tokens before it reads
them. A streamed model's speculative step must be checked before its tokens leave the model
(client/decode.py says why), so inside mlx-lm's loop each step would wait for its own check.
:class:`StreamedGenerationBatch` keeps mlx-lm's batch (its caches, samplers, stop sequences,
joins and leaves) and decodes it as decode.py decodes one sequence: step n+1 is launched on
step n's lazy tokens (``Steps.launch``), then step n is checked (``Steps.settle``), and its
tokens leave only once checked. A bad step and the one built on its tokens are trimmed from
every sequence's cache together, and the bad one runs again on the checked path.

The step in flight is *held*: before anything else calls the model (a joining request's
prompt, which may demand rows that the daemon would refill only after the held step's epoch),
before sequences leave or join, and before a cache is taken out, it is checked (and replayed
if it was bad), so that no other computation reads a step that was wrong.

:class:`StreamedBatchGenerator` is mlx-lm's ``BatchGenerator`` with that batch; for a model
that is not streamed it is mlx-lm's, step for step. ``expertd serve`` runs it in place of
mlx_lm.server's.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, BatchResponse, GenerationBatch
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from .decode import replayed
from .kvcache import trim
from .step import Launched, StepGuard


@dataclass
class Held:
    """The launched step whose tokens are the batch's next ones, unchecked."""

    step: Launched
    inputs: object  # the tokens it was launched on (a replay runs on them again)
    key: object  # MLX's random key before its tokens were sampled (a replay draws the same)


def steps_of(model):
    """The :class:`~expertd.client.step.Steps` of a streamed model, None for another."""
    return getattr(model, "__dict__", {}).get("_expertd_steps")


class StreamedGenerationBatch(GenerationBatch):
    """mlx-lm's generation batch, each step launched before the last is checked (see the
    module's docstring). Where the model is not streamed, does not speculate, or a sequence
    has logits processors (their token context cannot be replayed), it steps as mlx-lm's."""

    def __init__(self, *args, **kwargs):
        self._held = None
        self._broken = None  # what stopped a step whose check or replay did not finish
        super().__init__(*args, **kwargs)

    def _pipelines(self, steps) -> bool:
        return steps is not None and steps.pipelinable() and not any(self.logits_processors)

    def _step(self):
        self._check_whole()
        steps = steps_of(self.model)
        if not self._pipelines(steps):
            self.settle_held()
            return super()._step()
        try:
            return self._pipelined_step(steps)
        except BaseException as exc:
            self._break(steps, exc)
            raise

    def _check_whole(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"this batch stopped inside a step ({self._broken!r}): its KV "
                               "caches may hold a step that was never checked, so it decodes "
                               "no more; insert its requests into a new batch") from None

    def _break(self, steps, exc: BaseException) -> None:
        """A step's check or replay did not finish: nothing stays in flight, and the batch,
        whose caches and next tokens may hold a step that was wrong, decodes no more (mlx-lm's
        batch could not be resumed exactly either)."""
        self._held, self._broken = None, exc
        steps.release(self)
        steps.quiesce()

    def _pipelined_step(self, steps):
        cache = self.prompt_cache
        forward = super(StepGuard, self.model).__call__  # unguarded: launch checks later
        current, current_logprobs = self._next_tokens, self._next_logprobs
        held, self._held = self._held, None
        steps.release(self)
        # Checked before the next is launched: a drain (Steps.drain_due), and a step followed
        # by one that will not speculate (it may demand rows; Steps.plan).
        if held is not None and (steps.drain_due(held.step)
                                 or not steps.plan(current[:, None], cache)):
            if steps.settle(held.step) is not None:
                trim(cache, 1)
                current, current_logprobs = self._replay(held)
            held = None
        while True:
            step = steps.launch(forward, current[:, None], (), {"cache": cache})
            key = mx.random.state[0]
            sampled, logprobs = self._sample(step.logits)
            mx.async_eval(sampled, logprobs, *step.flat)  # the step and its check, at once
            if held is None or steps.settle(held.step, step) is None:
                break
            trim(cache, 2)  # the held step was bad, and the one built on its tokens too
            current, current_logprobs = self._replay(held, then=key)  # its draw is redone
            held = None
        self._held = Held(step, current, key)
        steps.hold(self)
        self._current_tokens, self._current_logprobs = current, current_logprobs
        self._next_tokens, self._next_logprobs = sampled, list(logprobs)
        mx.eval(current, current_logprobs)
        tokens = current.tolist()
        for sequence, token in zip(self.tokens, tokens):
            sequence.append(token)
        return tokens, current_logprobs

    def _sample(self, logits) -> tuple:
        """The tokens and log-probabilities of a step's ``logits``, drawn as mlx-lm's batch
        draws them: one call where the sequences share a sampler, else one a sequence."""
        logits = logits[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = [self.fallback_sampler if s is None else s
                    for s in (self.samplers or [None] * len(self.uids))]
        if all(s is samplers[0] for s in samplers):
            return samplers[0](logprobs), logprobs
        return mx.concatenate([s(logprobs[i:i + 1]) for i, s in enumerate(samplers)]), logprobs

    def _replay(self, held: Held, then=None) -> tuple:
        """A bad held step run again on the checked path (its cache entries trimmed already),
        its tokens drawn again with the key they had (``then``: see decode.replayed):
        ``(tokens, logprobs per sequence)``."""
        tokens, logprobs = replayed(held.key, self._again, held.inputs, then=then)
        return tokens, list(logprobs)

    def _again(self, inputs) -> tuple:
        return self._sample(self.model(inputs[:, None], cache=self.prompt_cache))

    def settle_held(self) -> None:
        """Check the step in flight now (replayed if bad): the batch's next tokens are then
        exact and nothing of it is in flight."""
        held, self._held = self._held, None
        steps = steps_of(self.model)
        if held is None or steps is None:
            return
        steps.release(self)
        try:
            if steps.settle(held.step) is not None:
                trim(self.prompt_cache, 1)
                self._next_tokens, self._next_logprobs = self._replay(held)
        except BaseException as exc:
            self._break(steps, exc)
            raise

    def abandon_held(self) -> None:
        """The batch stops (its generator closes): the step in flight is waited for and its
        epoch left, its tokens never used."""
        held, self._held = self._held, None
        steps = steps_of(self.model)
        if held is not None and steps is not None:
            steps.release(self)
            steps.quiesce()

    # What changes the batch, or reads a cache, comes after the step in flight is checked.

    def next(self):
        self._check_whole()  # (an empty batch has no step to take)
        return super().next()

    def extend(self, batch):
        self.settle_held()
        super().extend(batch)

    def filter(self, keep):
        self.settle_held()
        super().filter(keep)
        if not keep:  # no cache of a broken step is left
            self._broken = None

    def extract_cache(self, idx: int):
        self.settle_held()
        return super().extract_cache(idx)


class StreamedBatchGenerator(BatchGenerator):
    """mlx-lm's ``BatchGenerator`` (continuous batching: requests join as their prompts are
    processed and leave as they finish) whose decode steps are :class:`StreamedGenerationBatch`
    steps. ``completion_batch_size`` and ``prefill_batch_size`` are mlx_lm.server's
    ``--decode-concurrency`` and ``--prompt-concurrency``."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self._generation_batch = StreamedGenerationBatch.empty(self.model, self.sampler)

    def insert_segments(self, segments, max_tokens=None, caches=None, all_tokens=None,
                        *args, **kwargs):
        """mlx-lm's, with a request whose prompt a cache covers whole (mlx_lm.server's prompt
        cache found it exactly: no segment left) given its last token again, its cache trimmed
        by one, as mlx-lm's single-request path does; mlx-lm's raised, on the server's
        generation thread, which then died for every request."""
        segments = [list(s) for s in segments]
        caches = list(caches) if caches else [None] * len(segments)
        all_tokens = [list(t) for t in all_tokens] if all_tokens else [[] for _ in segments]
        for i, seq in enumerate(segments):
            if any(seq) or not all_tokens[i]:
                continue
            cache = caches[i]
            if cache is not None and can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                segments[i], all_tokens[i] = [all_tokens[i][-1:]], all_tokens[i][:-1]
            else:  # computed again from the start
                segments[i], caches[i], all_tokens[i] = [all_tokens[i]], None, []
        return super().insert_segments(segments, max_tokens, caches, all_tokens, *args,
                                       **kwargs)

    def close(self):
        batch = getattr(self, "_generation_batch", None)
        if isinstance(batch, StreamedGenerationBatch):
            batch.abandon_held()
        super().close()


def batch_generate(model, tokenizer, prompts: list, max_tokens=128, **kwargs) -> BatchResponse:
    """``mlx_lm.batch_generate`` on :class:`StreamedBatchGenerator`: each prompt's generated
    token ids (``token_ids``) and texts, its final stop token left out, as mlx-lm's.

    Args:
        prompts: token id lists.
        max_tokens: an int, or one a prompt.
        kwargs: :class:`StreamedBatchGenerator`'s (mlx-lm's ``BatchGenerator``'s) options.
    """
    gen = StreamedBatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                                 **kwargs)
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    try:
        uids = gen.insert(prompts, max_tokens)
        tokens = {uid: [] for uid in uids}
        with gen.stats() as stats:
            while responses := gen.next_generated():
                for r in responses:
                    if r.finish_reason != "stop":
                        tokens[r.uid].append(r.token)
    finally:
        gen.close()
    ids = [tokens[uid] for uid in uids]
    return BatchResponse([tokenizer.decode(t) for t in ids], stats, None, token_ids=ids)
