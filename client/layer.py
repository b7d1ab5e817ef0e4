"""One streamed MoE layer's call: the router's choice, its rows in the pool, the next layer's guess.

Per call: one host sync (the router's ids, and the next layer's guess in the same evaluation);
the rows written ahead for this layer are taken into the pool; the routed experts missing from
the pool move in (from the arena, demanded from the daemon when absent there); mlx-lm's own
computation runs on the pool (switch.py). Then the guess for the next layer is sent to the
daemon (read ahead into side rows, as far as predict.py allows) and its resident core is
written ahead into the next pool, on the copier's thread, while this layer computes. In a
speculative step (step.py) a call waits for nothing: its ids are remapped on the device and
checked at the step's end, and a decode's call of the whole MoE block is one compiled graph
(``StreamedLayer.block_call``): on a GPU the host is a decode's bound, and a compiled call
builds no Python operations.

One job, over 400 lines: one streamed MoE layer's call, waiting or speculative.
"""

import math
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from expertd.protocol import GUESS_WIDTH

from .pool import PROMOTE_AFTER
from .prompt_pull import assemble
from .switch import compute

DECODE_IDS = 64  # a call routing at most this many (token, slot) pairs is decoding
REPORT_EVERY = 16  # calls between reports of a layer's pooled experts to the daemon's LFU


def distinct(idx: np.ndarray) -> np.ndarray:
    """The distinct ids of ``idx``, sorted, int32."""
    if idx.size <= DECODE_IDS:  # a handful of ids: cheaper without numpy's sort machinery
        return np.array(sorted(set(idx.ravel().tolist())), dtype=np.int32)
    return np.unique(idx).astype(np.int32)


def _distinct_counts(values: np.ndarray, base: int) -> tuple:
    """``(codes, counts)``: ``layer * base + value`` of each value >= 0 of ``values``
    (``(steps, layers, pairs)``), and in how many steps each occurs (a step's repeats once)."""
    v = np.sort(values, axis=2)
    first = np.ones(v.shape, dtype=bool)
    first[..., 1:] = v[..., 1:] != v[..., :-1]
    codes = np.arange(v.shape[1], dtype=np.int64)[None, :, None] * base + v
    return np.unique(codes[first & (v >= 0)], return_counts=True)


def count_pulled_steps(layers: list, rows: np.ndarray, experts: np.ndarray) -> None:
    """Several pulled steps of ``layers`` counted at once, nothing promoted (a pipelined
    loop's deferred counting, client/step_check.py): ``rows``, ``experts`` ``(steps, layers,
    pairs)`` of their decoded statuses (pull.decode_status; -1 pads a step of fewer pairs).
    Each step's distinct hits and pulls are counted once (ExpertPool.count_steps), and each
    layer's used experts reported to the daemon at the rate step-by-step counting reports them
    (one report per REPORT_EVERY steps, each of the experts those steps used). One sort for
    every layer: a drain's host time is a decode step's the device waits for."""
    n = len(layers)
    row_base = max(layer.pool.rows for layer in layers)
    expert_base = max(layer.num_experts for layer in layers)
    hit, times = _distinct_counts(rows, row_base)
    pulled, counts = _distinct_counts(experts, expert_base)
    hit_at = np.searchsorted(hit, np.arange(n + 1) * row_base)
    pulled_at = np.searchsorted(pulled, np.arange(n + 1) * expert_base)
    for i, layer in enumerate(layers):
        h, p = slice(hit_at[i], hit_at[i + 1]), slice(pulled_at[i], pulled_at[i + 1])
        layer._counted_steps((hit[h] - i * row_base).astype(np.int64), times[h],
                             (pulled[p] - i * expert_base).astype(np.int64), counts[p],
                             rows[:, i], experts[:, i])


def stacked(shape) -> bool:
    """A pulled call of router ids of ``shape`` assembles a stack, each routed expert pulled
    once (see :meth:`StreamedLayer._stacked_call`), rather than a row per (token, slot) pair:
    a prompt's call (more than DECODE_IDS pairs), or a call of several sequences (a batch's
    decode step), whose shared experts are pulled once and computed as resident's are."""
    return math.prod(shape) > DECODE_IDS or (len(shape) >= 3 and math.prod(shape[:-2]) > 1)


class StackedRows(list):
    """A stacked call's arrays (see :func:`stacked_compute`) for a layer of ``experts``:
    expert e's bytes are in row e, or, where the stack is ``compact`` (fewer rows than
    experts), in the row of e's rank among the call's routed experts."""

    def __init__(self, arrays, experts: int):
        super().__init__(arrays)
        self.compact = arrays[0].shape[0] < experts


def stacked_compute(module, segments: list, x, indices, n: int, assemble) -> tuple:
    """A prompt's or a batch's speculative call: ``(out, status, stack)``. The experts the
    router chose (``indices``, of ``n`` experts) are pulled into a stack by ``assemble(want)``
    (``want``: an expert a row, -1 a row not wanted; returns the arrays and each row's status,
    see pull.py), each once however many pairs route to it, decided on the device (no wait),
    and mlx-lm's call runs on it as resident's does. A call of fewer pairs than experts (a
    batch's decode) stacks only as many rows, the routed experts in order, and its ids are
    mapped onto their ranks: the map keeps their order, so mlx-lm's sort groups and orders
    the pairs exactly as resident's. Else the stack has a row for every expert and the
    router's own ids compute. ``status``: each pair's, that of its expert's row; ``stack``:
    the stack's arrays (:class:`StackedRows`), kept for the step's check, which promotes
    from them (step.stacks_fit bounds what a prompt's stacks may take). Device operations
    alone where ``assemble``'s are: a batch's decode traces it into one compiled graph
    (:meth:`StreamedLayer.block_call`)."""
    flat = indices.reshape(-1)
    routed = mx.zeros((n,), mx.int32).at[flat].add(1) > 0
    every = mx.arange(n, dtype=mx.int32)
    span = min(n, flat.size)
    if span == n:
        want, ids, rank = mx.where(routed, every, -1), indices, None
    else:
        order = mx.sort(mx.where(routed, every, n))[:span]  # unrouted last, as n
        want = mx.where(order < n, order, -1)
        rank = mx.cumsum(routed.astype(mx.int32)) - 1
        ids = rank[indices].astype(indices.dtype)
    arrays, rows = assemble(want)  # the host copy waits for want
    stack = StackedRows(arrays, n)
    status = rows[flat] if rank is None else rows[rank[flat]]
    return compute(module, segments, arrays, x, ids), status, stack


def decoding(shape) -> bool:
    """Whether router ids of ``shape`` are a decode's: at most DECODE_IDS pairs, or one token
    of each of several sequences (a batch's step, whose call :meth:`StreamedLayer.block_call`
    compiles as it does one sequence's)."""
    return math.prod(shape) <= DECODE_IDS or (len(shape) >= 3 and shape[-2] == 1)


@dataclass
class StepRecord:
    """What one layer's speculative call leaves for the step's check (step.Steps): its
    router's ids (lazy), and for a pulled call each pair's status and the rows it pulled
    (:class:`StackedRows` for a stack); a remapped call has neither."""

    layer: "StreamedLayer"
    ids: object
    status: object = None
    arrays: object = None


@dataclass
class StepMode:
    """What the running model call is, for its layers to ask (step.Steps sets it): a
    speculative step (no layer waits, and each :meth:`report` s what the step's check reads,
    kept where the step keeps ``records``) or not (each layer waits for its router's ids)."""

    speculative: bool = False
    records: list | None = None  # the step's StepRecords; None: the step checks nothing
    counters: dict = field(default_factory=dict)  # the steps' counters (step.Steps sets it)

    def report(self, layer: "StreamedLayer", ids, status=None, arrays=None) -> None:
        """A layer's speculative call, for the step's check: the layers' one way to the step."""
        if self.records is not None:
            self.records.append(StepRecord(layer, ids, status, arrays))

    def waited(self, pairs: int = 0, union: int = 0) -> None:
        """A layer's call outside a speculative step waited for its router's ids; a batch's
        decode (``pairs`` routed, ``union`` distinct experts among them) is counted too."""
        counters = self.counters
        if counters:
            counters["host_waits"] += 1
            counters["routed_pairs"] += pairs
            counters["union_experts"] += union


@dataclass
class StreamedLayer:
    """What one streamed switch module needs at call time."""

    session: object
    mode: StepMode  # the model's one step mode, shared by its layers and step.Steps
    index: int  # the MoE layer's index in the manifest
    pool: object  # pool.ExpertPool
    segments: list  # [(child module, attribute)] in the pool's segment order
    num_experts: int
    guesser: object = None  # predict.Guesser for the next MoE layer, or None
    incoming: object = None  # predict.LayerGuesses scoring the guesses made for this layer
    next: "StreamedLayer | None" = None
    previous: "StreamedLayer | None" = None
    copier: object = None  # copier.Copier shared by the model's layers
    # A per-layer call starts computing its output at once (mx.async_eval), so the host's
    # work after it (the guess, reports, the next layer's graph up to its router) overlaps
    # the computation. Where the backend computes on a thread of its own (the CPU) that is
    # time saved; where launching encodes on the calling thread (MLX's CUDA backend) it
    # costs more than it overlaps (bench/RESULTS.md, issue 24), so the loader decides.
    start_early: bool = False
    guess_width: int = GUESS_WIDTH  # experts guessed per routed one (see predict.py)
    compiled: bool = True  # a decode's speculative call runs compiled (see _graph); False:
    # plainly, as bench/token_times.py's "plain" rounds compare
    copy_ahead_bytes: int = 0  # the least a guess's core must weigh to be written ahead
    # (ranked experts, n_core) this layer guessed for the next layer's coming call, which
    # takes it (and scores it through its ``incoming``)
    guess_sent: tuple | None = None
    _used: set = field(default_factory=set)
    _rows_cache: dict = field(default_factory=dict)
    # kind (a switch's call) or ("block", kind) -> (puller, call, compiled call)
    _graphs: dict = field(default_factory=dict)
    # a block's input shape -> the router's ids' (shape, dtype), learnt from a plain call
    _ids_like: dict = field(default_factory=dict)
    _seen: tuple | None = None  # the latest call's ids' (shape, dtype)
    _graphs_puller: object = None  # the puller the graphs were made with
    traces: int = 0  # block graphs traced (mx.compile runs the block's Python once a shape)
    _tracing: tuple | None = None  # (kind, puller, inputs) while block_call traces
    _traced: tuple | None = None  # what the traced switch call hands block_call back
    _calls: int = 0

    def forward(self, module, x, indices):
        session, pool = self.session, self.pool
        if self.mode.speculative:
            return self._speculative(module, x, indices)
        started = time.perf_counter()
        misses = session.counters["misses"]  # the demand misses of this call earn read-ahead
        nxt = self.next
        guess = None
        # Guess the next layer's experts in the same evaluation as this layer's router: no
        # extra host sync. Only while decoding (a prompt's layer routes to most experts), and
        # not for a pool that holds every expert.
        if (self.guesser is not None and nxt is not None and indices.size <= DECODE_IDS
                and not nxt.pool.complete and self.guesser.guesses.wanted()):
            guess = self.guesser.lazy(x, indices.shape[-1], self.guess_width)
            mx.eval(indices, guess)
        idx = np.array(indices)  # the one host sync of this layer: the router's choice
        synced = time.perf_counter()
        if self.previous is not None:
            # That sync evaluated the previous layer's output (the router's input depends on
            # it): its rows may be rewritten without waiting, and its memory can go.
            self.previous.pool.evaluated()
        pool.begin_call()
        unique = distinct(idx)
        batch = idx.ndim >= 3 and idx.shape[-2] == 1 and idx.size > idx.shape[-1]
        # (a batch's decode: see StepCheck.count_union)
        self.mode.waited(idx.size if batch else 0, len(unique) if batch else 0)
        if pool.ahead is not None:
            waited = time.perf_counter()
            pool.commit_ahead(session.epoch)
            session.timing["copier_wait_s"] += time.perf_counter() - waited
        sent = self.previous.guess_sent if self.previous is not None else None
        if sent is not None:  # what the layer before guessed for this call, scored now
            ranked, n_core = sent
            self.previous.guess_sent = None
            if self.incoming is not None:
                self.incoming.record(ranked[:n_core], unique, ranked)
        out = None
        if session.puller is not None:
            # Rows missing from the pool are pulled from the arena by the device into one
            # stack with a row for every expert (inside an epoch, once the daemon has read
            # them); the prompt's recurring ones then join the pool. None: the device's pull
            # differed from the host copy, or kept losing its rows: the host path takes over.
            out = self._pulled_call(module, x, indices, idx, unique)
            fetched = time.perf_counter()
        if out is None:
            out, fetched = self._host_call(module, x, indices, idx, unique)
        if guess is not None:
            ahead = time.perf_counter()
            self._guess_ahead(np.array(guess), indices.shape[-1])
            session.timing["prestage_s"] += time.perf_counter() - ahead
        self._report(unique)
        if self.incoming is not None:
            self.incoming.settle(session.counters["misses"] - misses)
        timing = session.timing
        timing["sync_s"] += synced - started
        if fetched is not None:
            timing["exposed_s"] += fetched - synced
        timing["layers"] += 1
        if session.timeline is not None:
            session.timeline.append((self.index, started, synced, fetched, time.perf_counter()))
        return out

    def _host_call(self, module, x, indices, idx: np.ndarray, unique: np.ndarray) -> tuple:
        """The call with its rows moved by the host: ``(out, when its rows were in place)``."""
        pool = self.pool
        if len(unique) > pool.rows:
            # A call routing to more experts than the pool holds (a prompt, a batch): it runs
            # as resident's does, in one piece, on rows outside the pool. Unified memory: a
            # stage at the experts' own indices. Device memory: a stack laid out as a pulled
            # call's. Never in groups of the pool's size: on CUDA a pair's result depends
            # on the call it shares (gather_qmm picks its kernel from the call's shape).
            if pool.backing.whole_array_writes is False:
                out = self._staged_call(module, x, indices, unique)
            else:
                out = self._stacked_host_call(module, x, indices, idx, unique)
            return out, time.perf_counter()
        rows = pool.place(unique)
        fetched = time.perf_counter()
        # A pool with a row for every expert holds each at its index: the router's ids are
        # the rows, already on the device.
        out = compute(module, self.segments, pool.arrays, x, indices if pool.identity
                      else mx.array(pool.row_of[idx].astype(idx.dtype)))
        pool.computing(rows, out)
        if self.start_early:
            mx.async_eval(out)
        return out, fetched

    def _speculative(self, module, x, indices):
        """No host wait. With a puller, its one primitive assembles the pairs' rows (pool hits
        and arena misses) and mlx-lm's computation runs on them; else ids are remapped on the
        device (not at all in a pool with a row for every expert, each at its own index) and
        a missing expert computes with a placeholder row. The step's end checks the statuses
        or the ids (unless nothing can miss). A decode's call runs compiled: the whole MoE
        block's (:meth:`block_call`, which traces this with :attr:`_tracing` set), or this
        call's own (:meth:`_graph`)."""
        if self._tracing is not None:  # inside block_call's trace: its inputs, no records
            kind, puller, inputs = self._tracing
            out = self._entry(module, kind, puller)[1](x, indices, *inputs)
            self._traced = (indices, *out[1:])
            return out[0]
        pool, session = self.pool, self.session
        if pool.ahead is not None:
            pool.commit_ahead(session.epoch)
        self._seen = (indices.shape, indices.dtype)  # what block_call learns of its shape
        puller = self._current(session.puller)
        kind = self._kind(puller)
        if kind == "pulled" and stacked(indices.shape):  # a prompt's, a batch's decode
            out, status, arrays = self._stacked_call(module, x, indices, puller)
            self.mode.report(self, indices, status, arrays)
            return out
        if kind == "pulled":
            if not puller.traceable:  # the host copy waits for the ids: not a graph
                arrays, status = puller.assemble(self.index, indices, pool)
                out = compute(module, self.segments, arrays, x,
                              self._pair_rows(indices.shape, indices.dtype))
            else:
                graph = self._graph(module, "pulled", puller, indices.size)
                out, status, *arrays = graph(x, indices, *self._inputs("pulled", indices.shape,
                                                                       indices.dtype))
            self.mode.report(self, indices, status, arrays)
            return out
        self.mode.report(self, indices)
        return self._graph(module, kind, None, indices.size)(x, indices,
                                                             *self._inputs(kind))[0]

    def _stacked_call(self, module, x, indices, puller) -> tuple:
        """A prompt's or a batch's speculative call, plainly: ``(out, status, stack)`` (see
        :func:`stacked_compute`), its stack assembled from this layer's pool."""
        return stacked_compute(module, self.segments, x, indices, self.num_experts,
                               lambda want: puller.assemble(self.index, want, self.pool))

    def _kind(self, puller) -> str:
        """Which speculative call this layer makes now (see :meth:`_graph`): "pulled" with a
        puller where the pool may miss, else "identity" or "remap" by the pool's layout."""
        if puller is not None and not self.pool.complete:
            return "pulled"
        return "identity" if self.pool.identity else "remap"

    def _inputs(self, kind: str, shape=None, dtype=None) -> tuple:
        """What a speculative call of ``kind`` (see :meth:`_graph`) takes beside x and the
        router's ids (``shape`` and ``dtype``: theirs, for the pulled kind's pair rows)."""
        pool = self.pool
        if kind == "pulled":
            return (pool.pull_table(), self._pair_rows(shape, dtype), *pool.arrays)
        if kind == "stacked":
            return (pool.pull_table(), *pool.arrays)
        if kind == "remap":
            return (pool.table(), *pool.arrays)
        return tuple(pool.arrays)

    def _entry(self, module, kind: str, puller) -> tuple:
        """``(puller, call, compiled call)`` of a speculative call of ``kind`` (see
        :meth:`_graph`); one made with another puller was dropped by :meth:`_current`."""
        entry = self._graphs.get(kind)
        if entry is None:
            segments, index, n = self.segments, self.index, len(self.segments)
            experts = self.num_experts

            def call(x, indices, *inputs):
                extra, arrays = inputs[:-n], list(inputs[-n:])
                if kind == "stacked":
                    table, = extra
                    out, status, stack = stacked_compute(
                        module, segments, x, indices, experts,
                        lambda want: puller.pull(index, want, table, arrays))
                    return (out, status, *stack)
                if kind == "pulled":
                    table, rows = extra
                    arrays, status = puller.pull(index, indices, table, arrays)
                    return (compute(module, segments, arrays, x, rows), status, *arrays)
                rows = indices if kind == "identity" else extra[0][indices]
                return (compute(module, segments, arrays, x, rows),)

            entry = self._graphs[kind] = (puller, call, mx.compile(call))
        return entry

    def _graph(self, module, kind: str, puller, size: int):
        """A speculative call's device work as a function of arrays alone: ``(x, indices,
        *inputs, *pool arrays) -> (out, *rest)``. ``kind``: "identity" (the router's ids are
        pool rows), "remap" (inputs: the pool's table; a missing expert computes with row 0),
        "pulled" (inputs: the pull table and ``0..n-1`` shaped as the ids; ``rest``: the
        status and the assembled arrays, see pull.py). A decode's call (at most DECODE_IDS
        pairs, few shapes) is compiled (``mx.compile``, one graph per shape): the calls
        after the first build no Python operations and no kernel source, which is a
        streamed token's extra host time on a GPU, where the host is the bound
        (bench/RESULTS.md, issue 24). The arithmetic is mlx-lm's, exactly; a prompt's call
        (a new shape each) runs it plainly."""
        entry = self._entry(module, kind, puller)
        return entry[2] if self.compiled and size <= DECODE_IDS else entry[1]

    def _current(self, puller):
        """``puller`` (the session's), once the graphs made with another are dropped: a
        dropped or replaced puller (its arena mapping with it) is not kept alive by them."""
        if puller is not self._graphs_puller:
            self._graphs = {k: v for k, v in self._graphs.items() if v[0] is None}
            self._graphs_puller = puller
        return puller

    def block_call(self, block, x):
        """A speculative call of the whole MoE ``block`` (the switch's parent, see
        switch.guard_block). A decode's call of a shape seen before is one compiled graph: the
        router, the switch's call as :meth:`_speculative` makes it, and the block's combining
        of the experts' outputs, with the router's ids (and a pulled call's status and rows)
        as outputs for the step's check. Else (the first call of a shape, more than a
        decode's pairs, not compiling, a puller that is not device operations) the block runs
        plainly, which runs :meth:`_speculative`."""
        like = self._ids_like.get(x.shape)
        pool, session = self.pool, self.session
        puller = self._current(session.puller)
        kind = self._kind(puller)
        if kind == "pulled" and like is not None and stacked(like[0]):
            kind = "stacked"  # a batch's decode: its routed experts pulled once, stacked
        if not self.compiled or like is None or (kind in ("pulled", "stacked") and
                                                 not puller.traceable):
            self._seen = None
            y = block.plain_call(x)
            if self._seen is not None and decoding(self._seen[0]):
                self._ids_like[x.shape] = self._seen  # a decode's shape: compiled next time
            return y
        if kind not in ("pulled", "stacked"):
            puller = None
        if pool.ahead is not None:
            pool.commit_ahead(session.epoch)
        key = ("block", kind)
        entry = self._graphs.get(key)
        if entry is None:
            def call(x, *inputs):  # run by mx.compile once per shape: a trace
                self.traces += 1
                self._tracing = (kind, puller, inputs)
                try:
                    y = block.plain_call(x)
                finally:
                    self._tracing = None
                traced, self._traced = self._traced, None
                return (y, *traced)

            entry = self._graphs[key] = (puller, call, mx.compile(call))
        y, indices, *rest = entry[2](x, *self._inputs(kind, *like))
        if not rest:
            self.mode.report(self, indices)
        else:
            arrays = rest[1:]
            if kind == "stacked":
                arrays = StackedRows(arrays, self.num_experts)
            self.mode.report(self, indices, rest[0], arrays)
        return y

    def _pair_rows(self, shape, dtype):
        """``0..n-1`` of the router's ids' ``shape`` and ``dtype``: pair i computes with
        assembled row i."""
        key = (shape, dtype)
        rows = self._rows_cache.get(key)
        if rows is None:
            rows = mx.arange(math.prod(shape), dtype=dtype).reshape(shape)
            mx.eval(rows)
            self._rows_cache[key] = rows
        return rows

    def after_pull(self, rows: np.ndarray, experts: np.ndarray, arrays: list,
                   prompt: bool = False) -> int:
        """The bookkeeping of a step's pulled call, from its decoded statuses (``rows``,
        ``experts``: see pull.decode_status): pool hits counted, pulled experts that keep
        coming back promoted into the pool (a device copy), use reported. Returns how many
        were promoted. A stacked call's (``arrays`` :class:`StackedRows`) pulled each expert
        once, into its own row, and an expert counts its pairs towards promotion (at most
        PROMOTE_AFTER, as a prompt waiting per layer counts them)."""
        pool = self.pool
        hit = np.unique(rows[rows >= 0])
        if not prompt:  # a pool's uses are its decode's (see ExpertPool.promote)
            pool.touch(hit)
        pulled, counts = np.unique(experts[experts >= 0], return_counts=True)
        stack = isinstance(arrays, StackedRows)
        self._count(len(hit), pulled if stack else experts)
        used = np.union1d(pool.expert_of[hit], pulled).astype(np.int32)  # in the stack's order
        promoted = 0
        if len(pulled):
            if stack:  # a compact stack holds the routed experts in order
                where = np.searchsorted(used, pulled) if arrays.compact else pulled
                promoted = pool.promote(pulled.astype(np.int32), arrays, where,
                                        np.minimum(counts, PROMOTE_AFTER), prompt=prompt)
            else:
                promoted = self.promote_pulled(experts, arrays, counted=False)
        self._report(used)
        return promoted

    def promote_pulled(self, experts: np.ndarray, arrays: list, counted: bool = True) -> int:
        """Promote what a decode's pulled call (a row per pair, ``experts`` its pairs' pulled
        expert or -1) brought and keeps coming back (ExpertPool.promote); ``counted``: its
        pulls are counted already (a drain's, counted with the deferred steps)."""
        pulled, first = np.unique(experts[experts >= 0], return_index=True)
        if not len(pulled):
            return 0
        return self.pool.promote(pulled.astype(np.int32), arrays,
                                 np.flatnonzero(experts >= 0)[first],
                                 np.zeros(len(pulled), np.int64) if counted else None)

    def after_pulled_steps(self, rows: np.ndarray, experts: np.ndarray) -> None:
        """The counting of several steps' pulled calls at once (``(steps, pairs)`` each, as
        :meth:`after_pull` takes one step's; -1 pads a step of fewer pairs), nothing promoted:
        see :func:`count_pulled_steps`, which counts several layers' so."""
        count_pulled_steps([self], rows[:, None], experts[:, None])

    def _counted_steps(self, hit, times, pulled, counts, rows: np.ndarray,
                       experts: np.ndarray) -> None:
        """:func:`count_pulled_steps`' part for this layer: ``hit`` rows each hit in ``times``
        of the steps, ``pulled`` experts each pulled in ``counts`` of them, of the steps'
        ``rows`` and ``experts`` (``(steps, pairs)``)."""
        pool = self.pool
        pool.count_steps(hit, times, pulled, counts)
        self._count(int(times.sum()), experts)
        if rows.shape[0] <= REPORT_EVERY:
            self._report(np.union1d(pool.expert_of[hit], pulled).astype(np.int32),
                         rows.shape[0])
            return
        for start in range(0, rows.shape[0], REPORT_EVERY):
            r, e = rows[start:start + REPORT_EVERY], experts[start:start + REPORT_EVERY]
            used = np.union1d(pool.expert_of[r[r >= 0]], e[e >= 0]).astype(np.int32)
            self._report(used, len(r))

    def _count(self, hits: int, experts: np.ndarray) -> None:
        """Count ``hits`` pool hits and the pulled pairs of ``experts`` (an expert id, or -1
        for a hit)."""
        pool = self.pool
        pool.counters["hits"] += hits
        n_missed = int((experts >= 0).sum())
        pool.counters["pulled"] += n_missed
        self.session.count_pulled(self.index, n_missed)

    def _staged_call(self, module, x, indices, unique: np.ndarray):
        """A call on a stage with a row for every expert (session.stage: one buffer for the
        model's layers of this shape, rewritten by the next such call only once this one's
        output was evaluated): pool hits copied from the pool, misses read from the arena
        straight into their rows. Exact as resident: the same shapes, the router's own ids."""
        pool = self.pool
        stage = self.session.stage(self.num_experts, pool.backing)
        present = pool.row_of[unique] >= 0
        hits, misses = unique[present], unique[~present]
        if len(hits):
            stage.copy_from(pool.backing, pool.row_of[hits], hits)
            pool.hit(pool.row_of[hits], prompt=not decoding(indices.shape))
        if len(misses):
            self.session.read_rows(self.index, misses, stage.host, stage.bases, misses)
            pool.counters["staged"] += len(misses)
        out = compute(module, self.segments, stage.arrays, x, indices)
        stage.reading(out)
        return out

    def _stacked_host_call(self, module, x, indices, idx: np.ndarray, unique: np.ndarray):
        """A call routing to more experts than a device pool holds, on a stack laid out as a
        pulled call's (:func:`stacked_compute`): a row per expert and the router's own ids
        where the pairs are at least the experts, else the routed experts in order and the
        ids mapped to their ranks. Pool hits are taken on the device; the misses are read
        through the session (found in the arena, or demanded and leased) into the pool's
        staging buffer, a transfer of at most the backing's batch at a time. The misses that
        recur are then promoted into the pool from the stack, as a pulled call's are."""
        pool, n = self.pool, self.num_experts
        prompt = not decoding(indices.shape)
        present = pool.row_of[unique] >= 0
        hits, misses = unique[present], unique[~present]
        span = min(n, idx.size)
        # Where each stack row's bytes come from: the i-th hit is i, the i-th miss follows the
        # hits; rows nobody reads take the first.
        source = np.zeros(n, np.int32)
        source[hits] = np.arange(len(hits), dtype=np.int32)
        source[misses] = len(hits) + np.arange(len(misses), dtype=np.int32)
        if span == n:
            order, ids = np.arange(n), indices
        else:
            order = np.concatenate([unique, np.full(span - len(unique), unique[-1])])
            rank = np.zeros(n, np.int64)
            rank[unique] = np.arange(len(unique))
            ids = mx.array(rank[idx].astype(idx.dtype))
        moved = pool.fetch(misses)
        taken = mx.array(pool.row_of[hits].astype(np.int32))
        at = mx.array(source[order])
        stack = [mx.concatenate([array[taken], *rows])[at] for array, rows in zip(pool.arrays,
                                                                                 moved)]
        mx.eval(stack)  # the pool is free again: nothing lazy reads it
        pool.hit(pool.row_of[hits], prompt)
        pool.counters["staged"] += len(misses)
        out = compute(module, self.segments, stack, x, ids)
        if len(misses):
            counts = np.bincount(idx.reshape(-1), minlength=n)
            positions = misses if span == n else np.searchsorted(unique, misses)
            # A prompt's counts would outweigh every decode use for long: a prompt's expert
            # counts as recurring, no more.
            pool.promote(misses, stack, positions,
                         weights=np.minimum(counts[misses], PROMOTE_AFTER), prompt=prompt)
        return out

    def _pulled_call(self, module, x, indices, idx: np.ndarray, unique: np.ndarray):
        """A call whose missing experts are pulled from the arena: one stack with a row for
        every expert (prompt_pull.assemble: pool hits copied on the device, misses
        pulled) and mlx-lm's one call on it with the router's own ids, as resident: exact on
        every backend, where computing groups apart is not on CUDA. The prompt's pulls then
        join the pool.
        None if the device's pull differed from the host copy (it pulls no more), or if four
        pulls in a row lost their rows to refills (this call moves its rows on the host)."""
        pool, session = self.pool, self.session
        present = pool.row_of[unique] >= 0
        stack = assemble(session, self.index, unique, pool)
        if stack is None:
            return None
        prompt = not decoding(indices.shape)
        pool.hit(pool.row_of[unique[present]], prompt)
        pool.counters["pulled"] += int((~present).sum())
        out = compute(module, self.segments, stack, x, indices)
        if (~present).any():
            counts = np.bincount(idx.reshape(-1), minlength=self.num_experts)
            missing = unique[~present]
            # A prompt's counts would outweigh every decode use for long: a prompt's expert
            # counts as recurring, no more.
            pool.promote(missing, stack, missing,
                         weights=np.minimum(counts[missing], PROMOTE_AFTER), prompt=prompt)
        return out

    def after_speculation(self, ids: np.ndarray) -> None:
        """The bookkeeping of a speculative call that hit, from its ids at the step's end."""
        pool = self.pool
        unique = distinct(ids)
        pool.counters["hits"] += len(unique)
        pool.touch(pool.row_of[unique])
        # Not pool.evaluated(): a speculative call leaves nothing pending, and the pool's latest
        # per-layer call may belong to a step that was built and never evaluated.
        self._report(unique)

    def _guess_ahead(self, g: np.ndarray, k: int) -> None:
        """Have the daemon read ahead what the guess's verdicts and budget allow (predict.py),
        and write the guess's resident core into the next pool."""
        session, nxt = self.session, self.next
        # Best first: every token's first choice, then every token's second, and so on; the
        # core (the top-k) comes first, and a daemon short of side rows reads the most likely
        # experts and drops the rest.
        ranked = np.array(list(dict.fromkeys(g.reshape(-1, g.shape[-1]).T.ravel().tolist())),
                          dtype=np.int32)
        n_core = len(set(g[..., :k].ravel().tolist()))
        self.guess_sent = (ranked, n_core)
        session.check_alive()
        # One lookup serves the daemon's read-ahead and the copy ahead into the pool.
        found = session.lookup(nxt.index, ranked)
        resident = (found.slots >= 0) | (found.filling >= 0)
        # An expert the next pool holds needs no read, even where the arena lacks it.
        read = self.guesser.guesses.plan(~resident & (nxt.pool.row_of[ranked] < 0), n_core)
        if read.any():
            # The resident guesses are claimed (their side rows stay for this client), never
            # read: one evicted since the lookup would be a read the budget did not pay for.
            session.prefetch(nxt.index, ranked[read], int(read[:n_core].sum()),
                             ranked[resident])
        expert_bytes = session.manifest.layers[nxt.index].expert_bytes
        if n_core * expert_bytes >= self.copy_ahead_bytes:
            nxt.pool.write_ahead(ranked[:n_core], found.slots[:n_core], found.versions[:n_core],
                                 session.epoch, self.copier)

    def _report(self, unique: np.ndarray, calls: int = 1) -> None:
        """Pooled experts reach the daemon's LFU every REPORT_EVERY calls (no message)."""
        self._used.update(unique.tolist())
        self._calls += calls
        if self._calls >= REPORT_EVERY:
            self.session.check_alive()
            self.session.report_hits(self.index, np.array(sorted(self._used), dtype=np.int32))
            self._used.clear()
            self._calls = 0
