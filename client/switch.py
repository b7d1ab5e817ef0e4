"""The streamed switch layer: mlx-lm's own SwitchGLU / SwitchMLP computation over a pool.

A switch module is replaced in the model by a :class:`StreamedSwitch` (with
``update_modules``, as mlx-lm replaces ``Linear`` by ``QuantizedLinear``): a module of ours at
the same path that takes over the switch's children (the projections, the activation), so
parameter paths stay mlx-lm's, and computes with the switch class's own ``__call__``. The
expert stacks are dropped from the children; at call time they are the layer's pool arrays
(``(rows, *shape)``, at most every expert) and the router's ids are remapped to pool rows.
Every family's ``gather_qmm`` / ``gather_mm`` computation stays mlx-lm's. What makes the rows
resident and guesses ahead is in layer.py.
"""

import inspect

import mlx.nn as nn

from .dtypes import MLX_DTYPES


class StreamedSwitch(nn.Module):
    """The streamed replacement of an mlx-lm switch module, installed at its path.

    Args:
        switch: the mlx-lm ``SwitchGLU`` / ``SwitchMLP`` it replaces; its children become this
            module's (the same objects, at the same keys), and its plain attributes are copied.
        layer: the :class:`~expertd.client.layer.StreamedLayer` that runs its calls.
    """

    def __init__(self, switch: nn.Module, layer):
        super().__init__()
        for key, child in switch.items():
            self[key] = child
        for key, value in vars(switch).items():
            self.__dict__.setdefault(key, value)  # what mlx-lm's call reads (not the children)
        self._compute = type(switch).__call__  # a function: a plain attribute, not a child
        self.layer = layer

    def __call__(self, x, indices):
        return self.layer.forward(self, x, indices)

    def compute(self, x, rows):
        """mlx-lm's own computation of the replaced switch, on this module's children."""
        return self._compute(self, x, rows)


class BlockGuard:
    """Mixin placed in front of the class of a switch's parent, the MoE block (see
    :func:`guard_block`): its speculative decode calls run as one compiled graph
    (``StreamedLayer.block_call``), the rest as mlx-lm's own."""

    def __call__(self, x, *args, **kwargs):
        layer = self.__dict__["_expertd_layer"]
        if not args and not kwargs and layer.mode.speculative:
            return layer.block_call(self, x)
        return super().__call__(x, *args, **kwargs)

    def plain_call(self, x):
        """mlx-lm's own call of the block."""
        return super().__call__(x)


_BLOCKS: dict = {}  # mlx-lm block class -> its BlockGuard subclass


def fronted(module: nn.Module, mixin: type, made: dict) -> nn.Module:
    """A new object of ``module``'s class with ``mixin`` in front (the subclass made once per
    class, kept in ``made``), holding the same children (parameter paths stay mlx-lm's) and
    attributes; ``module`` is left as it was. It is installed in the module's place."""
    cls = type(module)
    sub = made.get(cls)
    if sub is None:
        sub = made[cls] = type(f"Streamed{cls.__name__}", (mixin, cls), {})
    new = sub.__new__(sub)
    dict.update(new, module)
    new.__dict__.update(vars(module))  # the training flag too: an eval-mode block stays one
    new.__dict__["_no_grad"] = set(module.__dict__.get("_no_grad", ()))  # its own set
    return new


def guard_block(block: nn.Module, layer) -> nn.Module | None:
    """``block`` (a switch's parent) with :class:`BlockGuard` in front (see :func:`fronted`),
    its calls run by ``layer`` (a ``StreamedLayer``); to install at the block's path. Only a
    block called with its input alone (mlx-lm's MoE blocks), not a decoder layer (its cache
    and mask): None otherwise."""
    try:
        params = list(inspect.signature(type(block).__call__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if len(params) != 1 or params[0].kind not in (params[0].POSITIONAL_ONLY,
                                                   params[0].POSITIONAL_OR_KEYWORD):
        return None
    new = fronted(block, BlockGuard, _BLOCKS)
    new.__dict__["_expertd_layer"] = layer
    return new


def compute(module, segments: list, arrays: list, x, rows):
    """mlx-lm's own computation of ``module`` with ``arrays`` as its expert stacks (lazy).

    Args:
        segments: ``(child module, attribute)`` per segment, in the order of ``arrays``.
        rows: the pool row of each (token, slot) pair, shaped as the router's indices.
    """
    for (child, attr), array in zip(segments, arrays):
        child[attr] = array
    try:
        return module.compute(x, rows)
    finally:
        # The graph keeps what it needs; the module holds no expert arrays between calls.
        for child, attr in segments:
            del child[attr]


def expert_segments(module, layer) -> list:
    """Detach ``layer``'s expert arrays from the switch ``module``; its segments as
    ``(child module, attribute, mlx dtype, per-expert shape, nbytes)``."""
    segments = []
    for seg in layer.segments:
        path, attr = seg.name.rsplit(".", 1)
        child = module
        for part in path.split("."):
            child = child[part]
        if attr in child:
            del child[attr]
        segments.append((child, attr, MLX_DTYPES[seg.dtype], seg.shape, seg.nbytes))
    return segments
