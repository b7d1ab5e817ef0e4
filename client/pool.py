"""A layer's expert pool: which expert each row holds, which row to give up, what may not move.

The pool is the client's own tier of experts (L1; the daemon's arena is L2). A routed expert in
the pool moves nothing; one missing is read from the arena into a row chosen here: a free row,
else the least used one (LFU with decay, within the layer), never a row the running call needs,
and never one a computation not yet evaluated may read (that computation is evaluated first).
Rows guessed for the next call can be written ahead (:meth:`write_ahead`) and are taken into the
table only once their copy is done and still validates (:meth:`commit_ahead`).

One job, over 400 lines: one layer's pool and its table.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from expertd.shm.layout import available_memory

from .backing import ALIGN, DeviceRows, HostRows, Staging

DECAY_EVERY = 8  # uses are halved after this many times the pool's rows of touches
MAX_PENDING = 2  # outputs remembered per pool before the oldest is evaluated (waited for)


@dataclass
class Ahead:
    """Rows being written ahead of their layer's call."""

    epoch: int
    experts: np.ndarray
    rows: np.ndarray
    source: object  # the arena_view.ArenaRows being copied
    job: object  # the copier's CopyJob
    finish: object  # backing's callable(keep) issued on commit, or None


# What each pool counts (session.all_counters says what each means).
POOL_COUNTERS = ("hits", "moved", "ahead", "ahead_used", "ahead_unused", "settled",
                 "pulled", "promoted", "staged")
PROMOTE_AFTER = 2  # pulls (decayed) after which a pulled expert may take a pool row


class ExpertPool:
    """The pool of one MoE layer.

    Args:
        layer: the MoE layer's index in the manifest.
        num_experts: experts of the layer.
        backing: a :class:`HostRows` or :class:`DeviceRows` of at most ``num_experts`` rows.
        source: where the rows' bytes come from (the session): ``source.read_rows(layer,
            experts, dest, bases, positions)`` copies the bytes of ``experts`` out of the arena
            (found there, or demanded from the daemon), and ``source.arena_rows(layer, slots,
            versions)`` gives rows a lookup found, to copy ahead.
    """

    def __init__(self, layer: int, num_experts: int, backing, source):
        if not 1 <= backing.rows <= num_experts:
            raise ValueError(f"a pool has 1 to {num_experts} rows, not {backing.rows}")
        self.layer, self.num_experts, self.backing = layer, num_experts, backing
        self.source = source
        self.rows = backing.rows
        self.arrays = backing.arrays
        self.row_of = np.full(num_experts, -1, np.int32)
        self.expert_of = np.full(self.rows, -1, np.int32)
        self.uses = np.zeros(self.rows, np.int64)
        self.ahead_flag = np.zeros(self.rows, bool)  # written ahead, not used since
        self.pending: list = []  # [(call, rows, output)] computations maybe not evaluated
        self.ahead: Ahead | None = None
        # A pool with a row for every expert keeps each expert at its own index: the router's
        # ids are then the rows, and a call needs no remap at all.
        self.identity = self.rows == num_experts
        self._table = None  # the expert -> row table on the device (see table())
        self._pull_table = None  # the same with -1 for a missing expert (see pull_table())
        self.pulls = np.zeros(num_experts, np.int64)  # times each expert was pulled, decayed
        self._complete = None  # cached `complete`, dropped whenever a row changes
        self.counters = dict.fromkeys(POOL_COUNTERS, 0)
        self._touches = 0
        self._call = 0

    @property
    def complete(self) -> bool:
        """Every expert of the layer is in the pool, at its own index: nothing can miss."""
        if self._complete is None:
            self._complete = self.identity and bool((self.expert_of >= 0).all())
        return self._complete

    @property
    def nbytes(self) -> int:
        return self.backing.nbytes_total

    def table(self):
        """The expert -> row table as an MLX array, a missing expert mapped to row 0 (the
        placeholder a speculative call computes with before its step is checked and
        replayed). Rebuilt only after the pool changed."""
        if self._table is None:
            self._table = mx.array(np.maximum(self.row_of, 0))
        return self._table

    def pull_table(self):
        """The expert -> row table on the device, -1 for an expert missing from the pool (the
        pull kernel reads it from the arena). Rebuilt only after the pool changed."""
        if self._pull_table is None:
            self._pull_table = mx.array(self.row_of)
        return self._pull_table

    def note_pulls(self, experts: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Count pulls of ``experts`` (``weights``: uses to count for each, default one)."""
        self.pulls[experts] += 1 if weights is None else weights

    def promote(self, experts: np.ndarray, arrays: list, positions: np.ndarray,
                weights: np.ndarray | None = None, prompt: bool = False) -> int:
        """Take pulled ``experts`` (distinct, missing from the pool) into pool rows, their
        bytes at ``positions`` of the evaluated ``arrays``: those pulled at least
        PROMOTE_AFTER times (decayed) whose count beats the coldest row they would replace.
        ``weights``: uses to count for each (default one). A ``prompt``'s experts take only
        rows free or unused since their uses last decayed, and a prompt's hits are no uses
        (the layers touch no row for them): a prompt routes to most experts of a layer once,
        and its experts would push out the ones the decode that follows keeps using. A pool
        hit saves a decode a row's pull every token; a prompt pulls a stack of its experts
        whatever the pool holds.
        Returns how many moved (a device copy each, no host copy)."""
        self.note_pulls(experts, weights)
        order = np.argsort(-self.pulls[experts], kind="stable")
        take, victims = [], []
        # The coldest rows first; a row taken is out of the running.
        score = None if self.identity else np.where(self.expert_of < 0, -1, self.uses)
        if prompt and score is not None:
            score = np.where(score > 0, np.iinfo(np.int64).max, score)
        for i in order.tolist():
            e = int(experts[i])
            if self.pulls[e] < PROMOTE_AFTER:
                break
            if self.identity:
                row = e
            else:
                row = int(np.argmin(score))
                if score[row] >= self.pulls[e]:
                    break
                score[row] = np.iinfo(np.int64).max
            take.append(i)
            victims.append(row)
        if not take:
            return 0
        victims = np.array(victims, np.int32)
        self._evict(victims)
        at = mx.array(positions[take].astype(np.int32))
        self.backing.put(victims, [a[at] for a in arrays])
        self._assign(experts[take].astype(np.int32), victims)
        self.uses[victims] = self.pulls[experts[take]]
        self.pulls[experts[take]] = 0
        self.counters["promoted"] += len(take)
        return len(take)

    # ---- the call's rows -------------------------------------------------------------------

    def place(self, experts: np.ndarray) -> np.ndarray:
        """Make ``experts`` (distinct, at most ``rows``) resident; their rows, in order. The
        missing ones are read from the source in batches (of the backing's size) into victim
        rows."""
        rows = self.row_of[experts]
        absent = rows < 0
        n_missing = int(absent.sum())
        if n_missing:
            missing = experts[absent]
            victims = (missing.astype(np.int32) if self.identity
                       else self.victims(len(missing), keep=rows[~absent]))
            self._evict(victims)
            self.backing.write(victims, missing, self._read)
            self._assign(missing, victims)
            self.counters["moved"] += n_missing
            rows[absent] = victims  # rows is a copy (fancy indexing)
        self.counters["hits"] += len(experts) - n_missing
        self.touch(rows)
        return rows

    def hit(self, rows: np.ndarray, prompt: bool = False) -> None:
        """A call found its experts in ``rows``: counted as hits, and as uses unless the call
        is a ``prompt``'s (a pool's uses are its decode's: see :meth:`promote`)."""
        self.counters["hits"] += len(rows)
        if not prompt:
            self.touch(rows)

    def touch(self, rows: np.ndarray) -> None:
        """Count a use of each row (LFU), and a written-ahead row's first use."""
        self._use(rows, 1)
        self._touches += len(rows)
        if self._touches >= DECAY_EVERY * self.rows:
            self._decay(1)
            self._touches = 0

    def count_steps(self, rows: np.ndarray, times: np.ndarray, pulled: np.ndarray,
                    counts: np.ndarray) -> None:
        """Several steps' uses and pulls counted at once (``times`` uses of each of ``rows``,
        ``counts`` pulls of each of ``pulled``; step.py's deferred counting). The decays
        those steps' touches bring are applied first, then the uses and the pulls alike:
        step by step each step's counts would come before the decays after it, so neither
        kind is favoured over the other (decaying the uses and not the pulls made a long
        batch's pulled experts look hotter than the rows they would replace)."""
        decays, self._touches = divmod(self._touches + int(times.sum()),
                                       DECAY_EVERY * self.rows)
        self._decay(decays)
        self._use(rows, times)
        self.pulls[pulled] += counts

    def _use(self, rows: np.ndarray, times) -> None:
        """``times`` uses of each of ``rows`` (an int or one per row); a written-ahead row's
        first use counted."""
        self.uses[rows] += times
        flagged = self.ahead_flag[rows]
        if flagged.any():
            self.counters["ahead_used"] += int(flagged.sum())
            self.ahead_flag[rows] = False

    def _decay(self, times: int) -> None:
        """Halve the uses and the pulls ``times`` times over."""
        if times:
            self.uses >>= min(times, 62)
            self.pulls >>= min(times, 62)

    def begin_call(self) -> None:
        """A call of the layer starts: the outputs recorded from now on are this call's."""
        self._call += 1

    def computing(self, rows: np.ndarray, output) -> None:
        """``output`` (lazy) reads ``rows``: they may not be rewritten before it is evaluated."""
        self.pending.append((self._call, rows, output))
        if len(self.pending) > MAX_PENDING:
            _, _, oldest = self.pending.pop(0)
            mx.eval(oldest)

    def evaluated(self) -> None:
        """The latest call's outputs have been evaluated (the next layer's router sync depends
        on them): forget them, so that their memory goes. Older calls' stay, since a caller
        may have built several forwards before evaluating any."""
        if self.pending:
            self.pending = [p for p in self.pending if p[0] != self._call]

    def settle(self, rows: np.ndarray | None = None) -> None:
        """Evaluate the computations that read ``rows`` (all of them for None, or when a write
        needs the whole array free)."""
        if not self.pending:
            return
        if rows is None or self.backing.whole_array_writes:
            outputs = [out for _, _, out in self.pending]
            self.pending = []
        else:
            hit = np.zeros(self.rows, bool)
            hit[rows] = True
            outputs = [out for _, r, out in self.pending if hit[r].any()]
            self.pending = [p for p in self.pending if not hit[p[1]].any()]
        if outputs:
            mx.eval(outputs)
            self.counters["settled"] += len(outputs)

    def victims(self, n: int, keep: np.ndarray) -> np.ndarray:
        """``n`` rows to give up: free rows first, then the least used; never ``keep``. No write
        ahead is pending when rows are chosen: callers commit it first."""
        score = np.where(self.expert_of < 0, -1, self.uses)
        banned = np.zeros(self.rows, bool)
        banned[keep] = True
        score = np.where(banned, np.iinfo(np.int64).max, score)
        if n > int((~banned).sum()):
            raise ValueError(f"layer {self.layer}: {n} rows wanted, {int((~banned).sum())} "
                             "can move")
        if n == self.rows:
            return np.arange(self.rows, dtype=np.int32)
        return np.argpartition(score, n - 1)[:n].astype(np.int32)

    # ---- rows written ahead ----------------------------------------------------------------

    def write_ahead(self, experts: np.ndarray, slots: np.ndarray, versions: np.ndarray,
                    epoch: int, copier) -> int:
        """Start writing the guessed ``experts`` that are absent from the pool but ready in the
        arena (at ``slots``, with ``versions``, as a lookup of the source found them) into free
        or cold rows, on ``copier``'s thread. Returns how many."""
        self.commit_ahead(epoch)  # rows read ahead from an arena before a reconnect are dropped
        present = self.row_of[experts] >= 0
        wanted = ~present & (slots >= 0)
        keep = self.row_of[experts[present]]
        # A guess never takes more than half the pool, nor more than one batch.
        n = min(int(wanted.sum()), self.rows - len(keep),
                max(1, self.rows // 2), self.backing.ahead_limit)
        if n <= 0:
            return 0
        source = self.source.arena_rows(self.layer, slots[wanted][:n], versions[wanted][:n])
        wanted = experts[wanted][:n]
        victims = wanted.astype(np.int32) if self.identity else self.victims(n, keep)
        self._evict(victims)
        run, finish = self.backing.staged_write(victims, source.copy)
        self.ahead = Ahead(epoch, wanted, victims, source, copier.submit(run), finish)
        return n

    def commit_ahead(self, epoch: int | None = None) -> None:
        """Take the rows written ahead into the table: those copied whole from rows that did
        not change meanwhile (seqlock), and read from the arena attached now."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return
        if not ahead.job.wait() or (epoch is not None and ahead.epoch != epoch):
            return
        keep = np.flatnonzero(ahead.source.intact())
        if not len(keep):
            return
        if ahead.finish is not None:
            ahead.finish(keep)
        self._assign(ahead.experts[keep], ahead.rows[keep])
        self.ahead_flag[ahead.rows[keep]] = True
        ahead.source.count_hits(keep)
        self.counters["ahead"] += len(keep)

    def forget(self) -> None:
        """Drop every row (the model's experts changed under it: never after a plain restart,
        since the blob directory's digest is checked on every attach)."""
        self.commit_ahead()
        self.settle()
        self.row_of[:] = -1
        self.expert_of[:] = -1
        self.uses[:] = 0
        self._table = self._complete = self._pull_table = None

    # ---- internals -------------------------------------------------------------------------

    def fetch(self, experts: np.ndarray) -> list:
        """The rows of ``experts`` read from the source into arrays of their own, outside the
        pool (device backing: see DeviceRows.read)."""
        return self.backing.read(experts, self._read)

    def _read(self, experts, dest, bases, positions) -> None:
        self.source.read_rows(self.layer, experts, dest, bases, positions)

    def _evict(self, victims: np.ndarray) -> None:
        self.settle(victims)
        self._table = self._complete = self._pull_table = None
        old = self.expert_of[victims]
        self.row_of[old[old >= 0]] = -1
        self.expert_of[victims] = -1
        unused = self.ahead_flag[victims]
        self.counters["ahead_unused"] += int(unused.sum())
        self.ahead_flag[victims] = False
        self.uses[victims] = 0

    def _assign(self, experts: np.ndarray, rows: np.ndarray) -> None:
        self._table = self._complete = self._pull_table = None
        self.row_of[experts] = rows
        self.expert_of[rows] = experts


# ---- the pool budget ---------------------------------------------------------------------------

POOL_BACKINGS = ("host", "device")


def default_backing() -> str:
    """``device`` on a discrete GPU (CUDA), ``host`` where the GPU shares the host's memory."""
    return "device" if mx.default_device() == mx.gpu and not mx.metal.is_available() else "host"


def smallest_rows(layer, top_k: int) -> int:
    """The fewest rows a layer's pool works with: one decode token's experts in one call."""
    return min(layer.num_experts, max(1, top_k))


def free_device_bytes(info: dict | None = None) -> int | None:
    """Free memory of a discrete GPU as MLX sees it (``info``: ``mx.device_info()``, asked
    for where not given), or None if it does not say."""
    info = mx.device_info() if info is None else info
    if info.get("free_memory") is not None:  # CUDA says it (cudaMemGetInfo)
        return int(info["free_memory"])
    total = info.get("memory_size") or info.get("total_memory")
    if not total:
        return None
    return max(0, int(total) - mx.get_active_memory() - mx.get_cache_memory())


def free_memory() -> int | None:
    """What a client's transient device arrays (a prompt's stacks) may take: a discrete GPU's
    free memory; where the GPU shares the host's memory (Metal, the CPU), the host's available
    memory (shm.layout.available_memory: other processes' pages and, on Linux, the arena's are
    used there, where MLX's own figures count neither), within what MLX sees free of the
    device's size; None if neither is known."""
    info = mx.device_info()
    if info.get("free_memory") is not None:  # a discrete GPU's (CUDA)
        return free_device_bytes(info)
    known = [b for b in (free_device_bytes(info), available_memory()) if b is not None]
    return min(known) if known else None


def default_free(backing: str) -> int | None:
    """What :func:`plan_rows` sizes default pools by: the GPU's free memory for device pools
    (a discrete GPU's), None for host pools (memory the GPU shares with the host)."""
    return free_device_bytes() if backing == "device" else None


def plan_rows(layers, top_k: int, pool_gb: float | None, free: int | None,
              sequences: int = 1, room: int | None = None) -> list:
    """Rows of each MoE layer's pool.

    Args:
        layers: the manifest's MoE layers served by this client.
        top_k: experts each token routes to.
        pool_gb: the budget in GiB, split evenly over the layers; None for the default: every
            expert that fits in half of ``free``, at least the smallest pool that works, or
            without ``free`` that smallest pool once more than the ``sequences`` decoded
            together route to (``(sequences + 1) x top_k`` rows a layer, ``2 x top_k`` for
            one), within half of ``room``.
        free: the free bytes of a discrete GPU's memory, for device pools (see
            :func:`default_free`); None elsewhere.
        sequences: the sequences decoded together (a server's ``--decode-concurrency``).
        room: the bytes host pools may take at most twice over (see :func:`free_memory`);
            None: unbounded.
    Raises:
        ValueError: a budget below the smallest pool that works (the message names it).
    """
    if not layers:
        return []
    smallest = [smallest_rows(layer, top_k) for layer in layers]
    if pool_gb is None:
        if free is None:
            # A batch's sequences share most experts (8 at top-8 of 128 route to about 52),
            # and a step whose pools lack its experts replays where nothing pulls them.
            rows = [min(layer.num_experts, (sequences + 1) * s)
                    for layer, s in zip(layers, smallest)]
            if room is not None and sequences > 1:
                share = room // 2 // len(layers)
                rows = [min(r, max(2 * s, share // layer.expert_bytes))
                        for r, s, layer in zip(rows, smallest, layers)]
            return rows
        share = free // 2 // len(layers)
    elif isinstance(pool_gb, bool) or not pool_gb > 0:
        raise ValueError(f"pool_gb must be a positive number of GiB, not {pool_gb!r}")
    else:
        share = int(pool_gb * 2**30) // len(layers)
    # Each segment of a pool starts 64-byte aligned: that padding comes out of the share too.
    rows = [min(layer.num_experts, max(0, share - ALIGN * len(layer.segments))
                // layer.expert_bytes) for layer in layers]
    if pool_gb is None:
        # A model larger than half the free memory gets the smallest pools that work (its
        # misses are pulled from the arena), never an error.
        return [max(r, s) for r, s in zip(rows, smallest)]
    if any(r < s for r, s in zip(rows, smallest)):
        need = max(s * layer.expert_bytes for s, layer in zip(smallest, layers)) * len(layers)
        raise ValueError(f"a pool of {pool_gb} GiB is below the smallest that works, "
                         f"{need / 2**30:.4g} GiB ({smallest[0]} rows of each of "
                         f"{len(layers)} MoE layers)")
    return rows


def make_pool(layer, rows: int, segments: list, backing: str, batch: int, source,
              staging: Staging | None = None) -> ExpertPool:
    """A pool of ``rows`` rows for ``layer``, ``segments`` as ``(dtype, shape, nbytes)``, on
    the ``backing`` (one of POOL_BACKINGS; ``load`` checks it), its rows read from ``source``
    (see :class:`ExpertPool`); device pools move their rows through ``staging``, shared by the
    pools of a model."""
    rows_backing = (HostRows(rows, segments) if backing == "host"
                    else DeviceRows(rows, segments, batch, staging))
    return ExpertPool(layer.index, layer.num_experts, rows_backing, source)
