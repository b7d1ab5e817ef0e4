"""The streamed switch layer: mlx-lm's own SwitchGLU / SwitchMLP computation, experts fetched.

A switch module is turned into a streamed one in place: its class is extended with the
``__call__`` below and its stacked expert arrays are dropped. Children, parameter paths and the
``gather_qmm`` / ``gather_mm`` computation stay mlx-lm's, so every family works unchanged; the
only difference is that the expert stacks hold just the experts this call routes to, and the
indices are remapped onto them.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass
class StreamedLayer:
    """What one streamed switch module needs at call time."""

    session: object
    layer: int
    segments: list  # [(projection module, attribute, mlx dtype, per-expert shape)]
    staging: np.ndarray


class StreamedSwitch:
    """Mixin placed in front of SwitchGLU / SwitchMLP (see :func:`make_streamed`)."""

    def __call__(self, x, indices):
        st: StreamedLayer = self.__dict__["_expertd"]
        idx = np.array(indices)  # the one host sync of this layer: the router's choice
        unique = np.unique(idx).astype(np.int32)
        size = st.session.max_group
        if len(unique) <= size:
            self._load(st, unique)
            return self._compute(st, x, np.searchsorted(unique, idx).astype(idx.dtype))
        # More distinct experts than may be fetched at once: run each group over every token
        # (same shapes, same kernel path) and keep each slot's result from its own group.
        out = None
        for start in range(0, len(unique), size):
            group = unique[start:start + size]
            member = np.isin(idx, group)
            local = np.where(member, np.searchsorted(group, idx).clip(max=len(group) - 1), 0)
            self._load(st, group)
            y = self._compute(st, x, local.astype(idx.dtype))
            out = y if out is None else mx.where(mx.array(member)[..., None], y, out)
        return out

    def _load(self, st: StreamedLayer, experts: np.ndarray) -> None:
        views = st.session.fetch(st.layer, experts, st.staging)
        n = len(experts)
        for (module, attr, dtype, shape), view in zip(st.segments, views):
            module[attr] = mx.array(view).view(dtype).reshape((n, *shape))

    def _compute(self, st: StreamedLayer, x, local: np.ndarray):
        try:
            return super().__call__(x, mx.array(local))
        finally:
            # The graph keeps what it needs; the module holds no expert memory between calls.
            for module, attr, _, _ in st.segments:
                del module[attr]


_CLASSES: dict = {}


def make_streamed(module, session, layer, staging: np.ndarray) -> None:
    """Turn an mlx-lm switch module into a streamed one, in place, and drop its expert arrays."""
    from .session import MLX_DTYPES

    cls = type(module)
    streamed = _CLASSES.get(cls)
    if streamed is None:
        streamed = _CLASSES[cls] = type(f"Streamed{cls.__name__}", (StreamedSwitch, cls), {})
    segments = []
    for seg in layer.segments:
        path, attr = seg.name.rsplit(".", 1)
        child = module
        for part in path.split("."):
            child = child[part]
        if attr in child:
            del child[attr]
        segments.append((child, attr, MLX_DTYPES[seg.dtype], seg.shape))
    module.__class__ = streamed
    # A plain attribute, not a child: the session is not part of the model's parameters.
    module.__dict__["_expertd"] = StreamedLayer(session, layer.index, segments, staging)
