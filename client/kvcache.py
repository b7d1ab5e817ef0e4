"""What a checked step needs of a model call's inputs and KV caches: the shape of its tokens,
whether a replay can trim its caches back exactly, the trim itself, and whether a speculative
call's stacks fit in memory (step.py, batch.py and decode.py use them)."""

import math


def token_shape(inputs, kwargs: dict) -> tuple:
    """The shape of a model call's tokens: its ids', or its input embeddings' less their last
    axis where it passes those (mlx-lm's models then take ids of size 0)."""
    embeddings = kwargs.get("input_embeddings")
    return tuple(embeddings.shape[:-1] if embeddings is not None else inputs.shape)


def sequences_of(shape: tuple) -> int:
    """The sequences (batch rows) of a model call's tokens of ``shape`` (:func:`token_shape`):
    one for a call of one sequence's tokens alone."""
    return math.prod(shape[:-1]) if len(shape) > 1 else 1


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
