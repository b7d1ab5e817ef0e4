"""The streamed switch layer: mlx-lm's own SwitchGLU / SwitchMLP computation, experts fetched.

A switch module is turned into a streamed one in place: its class is extended with the
``__call__`` below and its stacked expert arrays are dropped. Children, parameter paths and the
``gather_qmm`` / ``gather_mm`` computation stay mlx-lm's, so every family works unchanged; the
only difference is that the expert stacks hold just the experts this call routes to, and the
indices are remapped onto them.
"""

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

# Safetensors dtype names (as the manifest records them) to MLX dtypes.
MLX_DTYPES = {
    "BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32, "U32": mx.uint32, "U8": mx.uint8,
    "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16, "I32": mx.int32, "U64": mx.uint64,
    "I64": mx.int64, "BOOL": mx.bool_,
}
DECODE_IDS = 64  # a call routing at most this many (token, slot) pairs is decoding


class StagingBuffer:
    """MLX-owned memory the rows are copied into, and the last output computed from it."""

    def __init__(self, nbytes: int):
        self.array = mx.zeros((nbytes,), dtype=mx.uint8)
        mx.eval(self.array)
        self.host = np.array(self.array, copy=False)  # a writable view, not a copy
        if not (self.host.flags.writeable and self.host.flags.c_contiguous):
            raise RuntimeError("this MLX build does not expose array memory to numpy")
        self.last = None
        self.staged = None  # the copier's rows of the next layer's guess, being copied in
        # Typed views of the buffer per (segment layout, expert count). Slices, dtype views and
        # reshapes of a contiguous buffer share its memory, so a view made once shows whatever
        # the latest copy put there; building them again for every layer costs more than the
        # rest of the hit path.
        self.views: dict = {}


@dataclass
class Staging:
    """Two buffers used in turn, so a layer's copy never overwrites rows still being read.

    Before a buffer is reused, the output last computed from it is evaluated. In a forward pass
    that output was already evaluated by the next layer's router sync, so this costs nothing;
    it only matters when a caller builds several lazy forwards before evaluating them.
    """

    nbytes: int
    buffers: list = field(default_factory=list)
    turn: int = 0

    def acquire(self, layer: int):
        """The next buffer, and the rows staged in it for ``layer`` (or None)."""
        staged = self.idle().staged
        # The copier must be done with the buffer before anyone writes into it; until that wait
        # returns (a KeyboardInterrupt may cut it short), the job stays on the buffer, so the
        # next acquire waits for it again.
        buf = self.free_idle()
        self.turn ^= 1
        return buf, staged if staged is not None and staged.layer == layer else None

    def free_idle(self) -> StagingBuffer:
        """The idle buffer, ready for a new copy job: one still staged there from a forward
        pass that never used it is waited for and dropped, so the copier never shares a buffer
        with another writer."""
        buf = self.idle()
        if buf.staged is not None and buf.staged.job is not None:
            buf.staged.job.wait()
        buf.staged = None
        return buf

    def idle(self) -> StagingBuffer:
        """The buffer the next :meth:`acquire` returns, free to be written into."""
        if not self.buffers:
            self.buffers = [StagingBuffer(self.nbytes), StagingBuffer(self.nbytes)]
        buf = self.buffers[self.turn]
        if buf.last is not None:
            mx.eval(buf.last)
            buf.last = None
        return buf


@dataclass
class StreamedLayer:
    """What one streamed switch module needs at call time."""

    session: object
    layer: int
    segments: list  # [(projection module, attribute, mlx dtype, per-expert shape, nbytes)]
    staging: Staging
    layout: tuple = ()  # what the segment views depend on: (dtype, shape, nbytes) per segment
    num_experts: int = 0  # experts of this layer in the resident model
    guesser: object = None  # predict.Guesser for the next MoE layer, or None
    incoming: object = None  # predict.LayerGuesses scoring the guesses made for this layer
    copier: object = None  # copier.Copier shared by the model's layers


class StreamedSwitch:
    """Mixin placed in front of SwitchGLU / SwitchMLP (see :func:`make_streamed`)."""

    def __call__(self, x, indices):
        st: StreamedLayer = self.__dict__["_expertd"]
        session = st.session
        started = time.perf_counter()
        guess = None
        # Guess the next layer's experts in the same evaluation as this layer's router: no
        # extra host sync. Only while decoding: a prompt's layer routes to most experts anyway.
        if st.guesser is not None and indices.size <= DECODE_IDS and st.guesser.guesses.wanted():
            guess = st.guesser.lazy(x, indices.shape[-1], session.guess_width)
            mx.eval(indices, guess)
        idx = np.array(indices)  # the one host sync of this layer: the router's choice
        synced = time.perf_counter()
        if idx.size <= DECODE_IDS:  # a handful of ids: cheaper without numpy's sort machinery
            unique = np.array(sorted(set(idx.ravel().tolist())), dtype=np.int32)
        else:
            unique = np.unique(idx).astype(np.int32)
        staged = st.staging.idle().staged
        if staged is not None and staged.layer == st.layer and st.incoming is not None:
            st.incoming.record(staged.guessed[:staged.n_core], unique, staged.guessed)
        size = session.max_group
        if len(unique) <= size:
            out, fetched = self._run_one(st, x, idx, unique)
        else:
            out, fetched = self._run_groups(st, x, idx, unique, size), None
        timing = session.timing
        if guess is not None:
            staging = time.perf_counter()
            g = np.array(guess)
            # Best first: every token's first choice, then every token's second, and so on;
            # the core (the top-k) comes first, and a daemon short of side rows reads the most
            # likely experts and drops the rest.
            ranked = list(dict.fromkeys(g.reshape(-1, g.shape[-1]).T.ravel().tolist()))
            n_core = len(set(g[..., :indices.shape[-1]].ravel().tolist()))
            buf = st.staging.free_idle()
            buf.staged = session.prestage(st.layer + 1, np.array(ranked, dtype=np.int32),
                                          n_core, buf.host, st.copier)
            timing["prestage_s"] += time.perf_counter() - staging
        timing["sync_s"] += synced - started
        if fetched is not None:
            timing["exposed_s"] += fetched - synced
        timing["layers"] += 1
        if session.timeline is not None:
            session.timeline.append((st.layer, started, synced, fetched, time.perf_counter()))
        return out

    def _run_one(self, st: StreamedLayer, x, idx: np.ndarray, unique: np.ndarray):
        """Every routed expert fits one group: stage them (using rows the copier already put
        in place) and compute as mlx-lm does, indices remapped to staging positions."""
        buf, staged = st.staging.acquire(st.layer)
        positions = st.session.fetch(st.layer, unique, buf.host, staged)
        fetched = time.perf_counter()
        local = positions[np.searchsorted(unique, idx)].astype(idx.dtype)
        return self._compute(st, buf, x, int(positions.max()) + 1, local), fetched

    def _run_groups(self, st: StreamedLayer, x, idx: np.ndarray, unique: np.ndarray, size: int):
        """More distinct experts than may be fetched at once: each group of at most ``size``
        experts computes only the (token, slot) pairs routed into it, and the pairs' results
        are put back in place, so the layer costs what resident mlx-lm's does.

        Exactness rests on each pair's result not depending on which other pairs share the
        call: mlx-lm's switch layers compute every pair as its own one-row product (tokens
        become rows of shape (1, D) before ``gather_qmm`` / ``gather_mm``), and the activation
        between projections is elementwise. tests/test_prefill_groups.py checks this on the
        backend it runs on. On Metal, ``gather_qmm`` also picks its kernel from the call's
        shape (a batched kernel when indices are sorted and there are at least 4 rows per
        staged expert); a group is padded up to that size when the resident call would take
        the batched kernel, so the group takes it too.

        Each group's computation starts as soon as its rows are staged, while the next group's
        rows are filled and copied into the other buffer.
        """
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        # Pairs sorted by expert: each group is one contiguous run of them.
        order = np.argsort(flat, kind="stable")
        ids = flat[order]
        starts = range(0, len(unique), size)
        cuts = np.searchsorted(ids, unique[list(starts)]).tolist() + [len(ids)]
        dim = x.shape[-1]
        rows = mx.broadcast_to(x, (*idx.shape[:-1], dim)).reshape(-1, dim)
        # mlx-lm sorts a call's pairs when there are 64 or more; Metal's gather_qmm then uses
        # its batched kernel when the pairs number at least 4 per expert in the stack.
        batched = flat.size >= 64 and flat.size // st.num_experts >= 4
        parts = []
        for g, start in enumerate(starts):
            group = unique[start:start + size]
            lo, hi = cuts[g], cuts[g + 1]
            pairs, local = order[lo:hi], np.searchsorted(group, ids[lo:hi])
            want = max(64, 4 * len(group)) if batched else 0
            if hi - lo < want:  # repeat the last pair; its copies are dropped below
                pairs = np.concatenate([pairs, np.full(want - (hi - lo), pairs[-1])])
                local = np.concatenate([local, np.full(want - (hi - lo), local[-1])])
            y = self._run(st, rows[mx.array(pairs // k)], group,
                          local.astype(idx.dtype)[:, None])
            # Start computing this group now, on MLX's own thread, so the next group's fills
            # and copy (into the other staging buffer) overlap with it. A buffer is reused only
            # after the output computed from it is evaluated (Staging.acquire).
            mx.async_eval(y)
            parts.append(y[:hi - lo, 0])
        # Back from expert order to (token, slot) order: a pure permutation of the rows.
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        out = mx.concatenate(parts)[mx.array(inverse)]
        return out.reshape(*idx.shape, out.shape[-1])

    def _run(self, st: StreamedLayer, x, experts: np.ndarray, local: np.ndarray):
        """One group of a grouped call: its experts staged in order, no guess used."""
        buf, _ = st.staging.acquire(st.layer)
        st.session.fetch(st.layer, experts, buf.host)
        return self._compute(st, buf, x, len(experts), local)

    def _compute(self, st: StreamedLayer, buf: StagingBuffer, x, n: int, local: np.ndarray):
        """mlx-lm's own computation over the first ``n`` staged experts (lazy)."""
        views = buf.views.get((st.layout, n))
        if views is None:
            bases = st.session.bases(st.layer).tolist()
            views = buf.views[(st.layout, n)] = [
                buf.array[base:base + n * nbytes].view(dtype).reshape((n, *shape))
                for (_, _, dtype, shape, nbytes), base in zip(st.segments, bases)]
        for (module, attr, _, _, _), view in zip(st.segments, views):
            module[attr] = view
        try:
            buf.last = super().__call__(x, mx.array(local))
        finally:
            # The graph keeps what it needs; the module holds no expert arrays between calls.
            for module, attr, _, _, _ in st.segments:
                del module[attr]
        return buf.last


_CLASSES: dict = {}


def make_streamed(module, session, layer, staging: Staging, guesser=None, incoming=None,
                  copier=None) -> None:
    """Turn an mlx-lm switch module into a streamed one, in place, and drop its expert arrays."""
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
        segments.append((child, attr, MLX_DTYPES[seg.dtype], seg.shape, seg.nbytes))
    module.__class__ = streamed
    # A plain attribute, not a child: the session is not part of the model's parameters.
    layout = tuple((seg.dtype, seg.shape, seg.nbytes) for seg in layer.segments)
    module.__dict__["_expertd"] = StreamedLayer(session, layer.index, segments, staging, layout,
                                                layer.num_experts, guesser, incoming, copier)
