"""A speculative step's check: what its layers recorded, read after its one wait.

Steps (step.py) runs the step and decides what follows; :class:`StepCheck` reads the step's
records (layer.StepRecord) against the pools they ran with and the pulls' statuses, and either
names why the step must be replayed (what the replay acts on in :class:`Findings`) or does its
bookkeeping: use counts, promotions into the pools, reports to the daemon, and for a batch the
experts its sequences shared (docs/ARCHITECTURE.md, "The step").
"""

import math
from dataclasses import dataclass, field

import numpy as np

from .layer import StackedRows, count_pulled_steps, decoding
from .pull import ABSENT, PULLED, decode_status


def _parts(records: list) -> list:
    """``(record, slice)`` per :class:`~expertd.client.layer.StepRecord`: where its ids sit
    when the records' are concatenated in order."""
    out, at = [], 0
    for record in records:
        out.append((record, slice(at, at + record.ids.size)))
        at += record.ids.size
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


def needed_absent(pulled: list, kinds: np.ndarray, experts: np.ndarray,
                  sequences: int = 1) -> list:
    """``[(layer, experts)]`` the arena lacked that a step's replay will route to, from the
    step's decoded statuses (``pulled``: ``(record, slice)`` in layer order). Per sequence
    (of ``sequences``, the batch's rows, each layer's pairs in row order), only those of its
    layers up to the first where it met an absent row: from there on it computed without
    that expert's share (its rows zeros), and the layers after routed on that. What they routed
    to is a guess at the replay's, and reading a wrong guess evicts rows the replay needs from
    an arena too small for them all: on this CPU, a batch of 8 read 1.6 times the bytes a
    token demanding every layer's (bench/absent_reads.py); on the H100, where the device's
    pull left such rows uninitialised, 8 clients read twenty times the bytes of steps waiting
    per layer (run 28, bench/RESULTS.md). A layer part that does not split into the sequences
    counts as one sequence for all (its layers' after the first absent one are then not
    demanded)."""
    n = sequences if sequences > 1 and all(
        (part.stop - part.start) % sequences == 0 for _, part in pulled) else 1
    tainted = np.zeros(n, bool)  # the sequences that met an absent row in a layer before
    out = []
    for record, part in pulled:
        absent = (kinds[part] == ABSENT).reshape(n, -1)
        if not absent.any():
            continue
        lacked = experts[part].reshape(n, -1)[absent & ~tainted[:, None]]
        if lacked.size:
            out.append((record.layer, np.unique(lacked).astype(np.int32)))
        tainted |= absent.any(axis=1)
    return out


@dataclass
class Findings:
    """What a step's check found beside its cause: what a replay acts on (the (layer,
    experts) the arena lacked that the replay will route to (:func:`needed_absent`), demanded
    once nothing in flight holds rows; the layer whose pull differed from the host copy,
    whose puller is dropped), and what it promoted (a drain's promotions set the next
    drain's interval)."""

    absent: list = field(default_factory=list)
    drifted: int | None = None
    promoted: int = 0  # experts the check promoted into the pools (a drain's)


class StepCheck:
    """The check of one streamed model's steps, and the pulled steps' counting it defers.

    Args:
        session: the client session (its puller).
        counters: the steps' counters (``routed_pairs`` and ``union_experts`` count here).
    """

    def __init__(self, session, counters: dict):
        self.session, self.counters = session, counters
        # [(layout, layers, rows, experts)] of pulled steps not yet counted (see _defer)
        self.deferred: list = []

    def check(self, records: list, found: Findings, *flat: np.ndarray,
              promote: bool = True, sequences: int = 1) -> str | None:
        """Why the speculative step must be replayed ("pool": an id missed its pool without a
        puller; "absent": a pulled expert had no ready row in the arena; "device": a pull
        differed from the host copy), what the replay acts on in ``found``, or None after the
        host's bookkeeping of the step (pool use counts, promotions, reports to the daemon).
        Without ``promote`` (a pipelined step, another in flight) the pulled layers' counting
        waits in ``deferred`` for the next step that promotes (:meth:`flush`): the pools do not
        change in between, so counting then decides what counting now would, but for the
        order of the uses' decays against the counts (ExpertPool.count_steps). ``sequences``:
        the step's batch rows, whose absent rows :func:`needed_absent` sorts out."""
        # Each layer's part of the concatenated ids / statuses (see _flat), in record order.
        plain = _parts([r for r in records if r.status is None])
        pulled = _parts([r for r in records if r.status is not None])
        flat = list(flat)
        ids = flat.pop(0) if plain else None
        for record, part in plain:
            if (record.layer.pool.row_of[ids[part]] < 0).any():
                return "pool"  # the replay does the bookkeeping, on the per-layer path
        if pulled:
            rows, experts, kinds = decode_status(flat.pop(0))  # every pulled layer at once
            if (kinds == ABSENT).any():
                found.absent = needed_absent(pulled, kinds, experts, sequences)
                return "absent"
            found.drifted = self.drifted(pulled, kinds)
            if found.drifted is not None:
                return "device"
        shape = records[0].ids.shape if records else ()
        if len(shape) >= 3 and shape[-2] == 1 and math.prod(shape[:-2]) > 1:  # a batch's decode
            self.count_union(plain, [ids[part] for _, part in plain])
            self.count_union(pulled, [np.where(
                rows[part] >= 0, r.layer.pool.expert_of[np.maximum(rows[part], 0)], experts[part])
                for r, part in pulled])
        for record, part in plain:
            record.layer.after_speculation(ids[part])
        if not pulled:
            return None
        # A decode's pulled calls (a row per pair) are counted with the deferred steps, all at
        # once (flush); a drain then promotes what it pulled. A prompt's or a batch's stack
        # pulled each expert once and promotes by its pairs (after_pull).
        plain_pulls, stacks = [], []
        for r, part in pulled:
            stacked = isinstance(r.arrays, StackedRows) or not decoding(r.ids.shape)
            (stacks if stacked else plain_pulls).append((r, part))
        if plain_pulls:
            self._defer(plain_pulls, rows, experts)
        if not promote:
            if stacks:  # a stack pulled each expert once: its other pairs count as none
                firsts = experts.copy()
                for record, part in stacks:
                    if isinstance(record.arrays, StackedRows):
                        firsts[part] = _first_only(experts[part])
                self._defer(stacks, rows, firsts)
            return None
        self.flush()
        for record, part in plain_pulls:
            if (experts[part] >= 0).any():
                found.promoted += record.layer.promote_pulled(experts[part], record.arrays)
        for record, part in stacks:
            found.promoted += record.layer.after_pull(rows[part], experts[part], record.arrays,
                                                      prompt=not decoding(record.ids.shape))
        return None

    def _defer(self, parts: list, rows: np.ndarray, experts: np.ndarray) -> None:
        """Keep a checked step's pulled ``parts`` (``(record, slice)`` of ``rows`` and
        ``experts``, the step's decoded statuses) to count at the next :meth:`flush`."""
        key = tuple((r.layer.index, part.start, part.stop) for r, part in parts)
        lo, hi = parts[0][1].start, parts[-1][1].stop
        self.deferred.append((key, [r.layer for r, _ in parts], rows[lo:hi], experts[lo:hi]))

    def drifted(self, pulled: list, kinds: np.ndarray) -> int | None:
        """The layer whose pull differed from the host copy, of those whose pulls are still
        compared with it (Metal's: pull.verify_pull): the step's logits are wrong. None if
        none did. A layer whose pull with rows from the arena agreed is compared no more.
        (The step's epoch held: a revoked one is replayed before this is asked.)"""
        puller = self.session.puller
        if puller is None or not puller.verify_first:
            return None
        for r, part in pulled:
            if (kinds[part] == PULLED).any() and puller.differs(r.layer.index, r.ids,
                                                                r.layer.pool, r.arrays, r.status):
                return r.layer.index
        return None

    def flush(self) -> None:
        """Count the pulled steps whose bookkeeping waited (see :meth:`check`): steps of one
        layout (a decode's, every step alike) as one table a layer, cut from their rows
        stacked; else each layer's steps padded to the longest."""
        deferred, self.deferred = self.deferred, []
        if not deferred:
            return
        key, layers = deferred[0][0], deferred[0][1]
        widths = {stop - start for _, start, stop in key}
        lo, hi = key[0][1], key[-1][2]
        if (all(d[0] == key for d in deferred) and len(widths) == 1
                and hi - lo == len(key) * widths.pop()):  # each layer's pairs, back to back
            shape = (len(deferred), len(key), -1)
            count_pulled_steps(layers, np.stack([d[2] for d in deferred]).reshape(shape),
                               np.stack([d[3] for d in deferred]).reshape(shape))
            return
        by_layer: dict = {}
        for key, layers, rows, experts in deferred:
            lo = key[0][1]
            for layer, (_, start, stop) in zip(layers, key):
                steps = by_layer.setdefault(layer.index, (layer, [], []))
                steps[1].append(rows[start - lo:stop - lo])
                steps[2].append(experts[start - lo:stop - lo])
        for layer, rows, experts in by_layer.values():
            layer.after_pulled_steps(_rows(rows), _rows(experts))

    def count_union(self, parts: list, experts: list) -> None:
        """A checked step of several sequences: the pairs its layers routed, and the distinct
        experts among them (``experts``: each layer's, in ``parts``' order), whose ratio says
        how much a batch's pulls are shared."""
        counters = self.counters
        for (_, part), used in zip(parts, experts):
            counters["routed_pairs"] += part.stop - part.start
            counters["union_experts"] += len(np.unique(used[used >= 0]))
