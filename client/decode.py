"""Decoding that builds the next step before this one is checked: expertd's own token loop.

mlx-lm's ``generate_step`` builds step n+1 on step n's lazy token while the device computes step
n. A streamed model's speculative step must be checked before its token leaves the model (a step
that met a row the arena lacked, or whose epoch was lost, computed the wrong logits), so inside
mlx-lm's loop each step waits for its own check, and the device idles while the host builds the
next step. This loop keeps both: it launches step n+1 on step n's lazy token (step.py,
``Steps.launch``), then checks step n (``Steps.settle``), and a token leaves only once its step
is checked. A bad step and the one built on its token are trimmed from the KV cache together,
and the bad one runs again on the checked path (``Steps.run``). Now and then (step.Drains) a
step is checked before the next is launched, so that recurring pulls are promoted into the
pools (a promotion must not rewrite a pool that a step in flight reads).

``stream_generate`` is mlx-lm's, with this loop for a streamed model; what this loop does not do
(a draft model, logits processors, a quantized KV cache, input embeddings, a pipeline rank, a
model that is not streamed) goes to mlx-lm's own. Options given as None or empty are not given.
"""

import time

import mlx.core as mx

from .kvcache import trim
from .step import StepGuard

# What the pipelined loop does itself; the rest is mlx-lm's, where given (not None or empty).
OWN = {"sampler", "max_kv_size", "prompt_cache", "prefill_step_size", "prompt_progress_callback"}
HONOURED = OWN | {"stream", "kv_group_size", "quantized_kv_start"}  # kv_bits None: not quantized


def _sample(logits, sampler):
    logits = logits[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return sampler(logprobs), logprobs.squeeze(0)


def pipelined_step(prompt, model, *, max_tokens: int = 256, sampler=None, prompt_cache=None,
                   max_kv_size: int | None = None, prefill_step_size: int = 2048,
                   prompt_progress_callback=None):
    """Yield ``(token, logprobs)`` as ``mlx_lm.generate.generate_step`` does (greedy without a
    sampler; ``max_tokens`` -1 for no limit; ``prompt_progress_callback(done, total)`` after
    each chunk of the prompt and once it is all done), each token's step checked before it
    leaves."""
    from mlx_lm.models.cache import make_prompt_cache

    steps = model.__dict__["_expertd_steps"]
    steps.new_generation()
    forward = super(StepGuard, model).__call__  # the model unguarded: launch checks later
    sampler = sampler or (lambda x: mx.argmax(x, axis=-1))
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model, max_kv_size)

    progress = prompt_progress_callback or (lambda done, total: None)
    total, done = prompt.size, 0  # the prompt's tokens, and those computed
    while prompt.size > 1:  # the prompt but its last token, in chunks (the checked path)
        n = min(prefill_step_size, prompt.size - 1)
        model(prompt[:n][None], cache=cache)
        mx.eval([c.state for c in cache])
        done += n
        progress(done, total)
        prompt = prompt[n:]
        mx.clear_cache()
    y, logprobs = _sample(model(prompt[None], cache=cache), sampler)
    mx.async_eval(y, logprobs)
    if prompt_progress_callback is not None:  # once the prompt is computed, as mlx-lm says
        mx.eval(y)
        progress(total, total)
    try:
        yield from _decode(model, steps, forward, cache, y, logprobs, sampler, max_tokens)
    finally:  # closed, interrupted or failed with steps in flight: none outlives its epoch
        steps.quiesce()


def _decode(model, steps, forward, cache, y, logprobs, sampler, max_tokens: int):
    current = inputs = None  # the launched step that made y (None: y is checked), its input
    # The random key before y's sample, and before next_y's: a replayed step samples its token
    # again with the key it had, so a sampled generation draws what mlx-lm's loop draws.
    key = next_key = None
    made = 0
    while True:
        last = max_tokens != -1 and made + 1 >= max_tokens
        # Settled before the next is launched: a drain (Steps.drain_due), and one followed by a
        # step that will not speculate (it may demand rows; Steps.plan).
        if current is not None and (steps.drain_due(current) or not steps.plan(y[None], cache)):
            if steps.settle(current) is not None:
                trim(cache, 1)
                y, logprobs = replayed(key, _again, model, inputs, cache, sampler)
            current = None
        # As mlx-lm's loop, a step is launched on every token before it leaves, the last's
        # too: its KV entries stay in the cache (a chat's next turn computes with them), and
        # its sample draws from the random key.
        nxt = steps.launch(forward, y[None], (), {"cache": cache})
        next_key = mx.random.state[0]
        next_y, next_logprobs = _sample(nxt.logits, sampler)
        mx.async_eval(next_y, next_logprobs, *nxt.flat)  # the step and its check, at once
        if current is not None:
            if steps.settle(current, nxt) is not None:  # y is wrong, and nxt (abandoned)
                trim(cache, 2)
                # nxt draws again, with the key it had, once launched again
                y, logprobs = replayed(key, _again, model, inputs, cache, sampler,
                                       then=next_key)
                current = None
                continue
        try:
            yield y.item(), logprobs
        except GeneratorExit:  # the consumer stopped (an end-of-text token): as at the end
            _finish(model, steps, cache, nxt, y, next_key, sampler)
            raise
        made += 1
        if last:
            _finish(model, steps, cache, nxt, y, next_key, sampler)
            return
        if made % 256 == 0:
            mx.clear_cache()
        inputs, y, logprobs, current, key = y, next_y, next_logprobs, nxt, next_key


def _finish(model, steps, cache, step, inputs, key, sampler) -> None:
    """The step launched on the last token that left is checked, and run again if it was bad:
    the KV cache the generation leaves is exact (its token is never used)."""
    if steps.settle(step) is not None:
        trim(cache, 1)
        mx.eval(replayed(key, _again, model, inputs, cache, sampler))


def _again(model, inputs, cache, sampler) -> tuple:
    """A bad step run again on the checked path, its token sampled."""
    return _sample(model(inputs[None], cache=cache), sampler)


def replayed(key, run, *args, then=None):
    """``run(*args)`` (a bad step run again, its token sampled) with MLX's random key set back to
    ``key``, the key its sample had: it draws what it drew. Then the key is ``then`` (the key of
    a step launched after it and abandoned, to be drawn again), or by default what it was
    before: whatever drew since the step's sample (another generation, the caller's own draws)
    keeps its draws."""
    after = mx.random.state[0] if then is None else then
    rewind(key)
    out = run(*args)
    rewind(after)
    return out


def rewind(key) -> None:
    """Set MLX's global random key back to ``key`` (an array taken from
    ``mx.random.state``): ``mx.random.seed`` of the 64-bit number whose halves the key holds."""
    import numpy as np

    hi, lo = (int(v) for v in np.array(key))
    mx.random.seed(hi << 32 | lo)


def pipelines(model, kwargs: dict) -> bool:
    """Whether :func:`stream_generate` runs ``model`` with ``kwargs`` on the pipelined loop."""
    steps = getattr(model, "__dict__", {}).get("_expertd_steps")
    given = {k for k, v in kwargs.items() if v is not None and not (
        isinstance(v, (list, tuple)) and not v)}
    if kwargs.get("draft_model") is None:
        given.discard("num_draft_tokens")  # mlx-lm drops it too
    return steps is not None and steps.pipelinable() and given <= HONOURED


def stream_generate(model, tokenizer, prompt, max_tokens: int = 256, **kwargs):
    """``mlx_lm.stream_generate``, its responses and their timings, on :func:`pipelined_step`
    for a streamed model (see the module's docstring for what goes to mlx-lm's own)."""
    import mlx_lm
    from mlx_lm.generate import GenerationResponse, generation_stream, wired_limit
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not pipelines(model, kwargs):
        yield from mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                          **kwargs)
        return
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if not isinstance(prompt, mx.array):
        if isinstance(prompt, str):  # special tokens as mlx-lm decides them
            special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
            prompt = tokenizer.encode(prompt, add_special_tokens=special)
        prompt = mx.array(prompt)
    detokenizer = tokenizer.detokenizer
    own = {k: v for k, v in kwargs.items() if k in OWN and v is not None}
    stream = kwargs.get("stream") or generation_stream
    with wired_limit(model, [stream]), mx.stream(stream):
        tic = time.perf_counter()
        token = logprobs = None
        n = 0
        for n, (token, logprobs) in enumerate(pipelined_step(prompt, model,
                                                             max_tokens=max_tokens, **own)):
            if n == 0:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield GenerationResponse(
                text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=False,
                prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
                generation_tps=(n + 1) / (time.perf_counter() - tic),
                peak_memory=mx.get_peak_memory() / 1e9, finish_reason=None)
        detokenizer.finalize()
        yield GenerationResponse(
            text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=False,
            prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason="stop" if token in tokenizer.eos_token_ids else "length")
