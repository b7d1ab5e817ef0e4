"""The client's expert pools on their own: the table, the choice of rows, in-place writes, the
budget. Real MLX arrays on both backings; the rows' bytes come from a reader that writes each
expert's own pattern (what the arena would hold), so every row can be checked."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertd.client.backing import segment_bases
from expertd.client.pool import ExpertPool, make_pool, plan_rows, smallest_rows

BACKINGS = ["host", "device"]
# Two segments of different dtypes and shapes, as a quantized projection has.
SEGMENTS = [(mx.uint32, (4, 8), 128), (mx.bfloat16, (4, 2), 16)]


def pattern(expert: int, nbytes: int) -> np.ndarray:
    return ((np.arange(nbytes) * 7 + expert * 13) % 251).astype(np.uint8)


class PatternReader:
    """A pool's source: writes each expert's pattern where the pool asks; counts what it was
    asked for."""

    def __init__(self):
        self.read = []

    def read_rows(self, layer, experts, dest, bases, positions):
        self.read.extend(int(e) for e in experts)
        for s, (_, _, nbytes) in enumerate(SEGMENTS):
            for e, p in zip(experts.tolist(), positions.tolist()):
                at = int(bases[s]) + p * nbytes
                dest[at:at + nbytes] = pattern(e * 10 + s, nbytes)


def new_pool(backing: str, rows: int, experts: int = 32, source=None) -> ExpertPool:
    layer = SimpleNamespace(index=0, num_experts=experts)
    return make_pool(layer, rows, SEGMENTS, backing, batch=8,
                     source=PatternReader() if source is None else source)


def row_bytes(pool: ExpertPool, row: int, segment: int) -> np.ndarray:
    array = pool.arrays[segment][row]
    return np.array(array.view(mx.uint8)).ravel()


def check_rows(pool: ExpertPool) -> None:
    for row, expert in enumerate(pool.expert_of.tolist()):
        if expert >= 0:
            assert pool.row_of[expert] == row
            for s, (_, _, nbytes) in enumerate(SEGMENTS):
                assert (row_bytes(pool, row, s) == pattern(expert * 10 + s, nbytes)).all(), \
                    (row, expert, s)


@pytest.mark.parametrize("backing", BACKINGS)
def test_only_missing_experts_move_and_rows_hold_them(backing):
    read = PatternReader()
    pool = new_pool(backing, rows=8, source=read)
    rows = pool.place(np.array([3, 5, 9], np.int32))
    assert sorted(read.read) == [3, 5, 9] and len(set(rows.tolist())) == 3
    check_rows(pool)
    read.read.clear()
    again = pool.place(np.array([3, 9, 11], np.int32))
    assert read.read == [11]  # 3 and 9 are in the pool: nothing of theirs moves
    assert again[0] == rows[0] and again[1] == rows[2]
    assert pool.counters["hits"] == 2 and pool.counters["moved"] == 4
    check_rows(pool)


@pytest.mark.parametrize("backing", BACKINGS)
def test_more_missing_experts_than_one_batch_move_batch_by_batch(backing):
    read = PatternReader()
    pool = new_pool(backing, rows=24, source=read)  # the device backing moves 8 rows a transfer
    experts = np.arange(3, 23, dtype=np.int32)
    pool.place(experts)
    assert sorted(read.read) == experts.tolist()
    check_rows(pool)


@pytest.mark.parametrize("backing", BACKINGS)
def test_a_full_pool_gives_up_its_least_used_row_never_one_the_call_needs(backing):
    read = PatternReader()
    pool = new_pool(backing, rows=4, source=read)
    for _ in range(3):
        pool.place(np.array([0, 1, 2], np.int32))
    pool.place(np.array([3], np.int32))  # the free row
    pool.place(np.array([0, 1, 2], np.int32))
    read.read.clear()
    pool.place(np.array([3, 4], np.int32))  # 3 is needed: the victim is not its row
    assert read.read == [4]
    assert pool.row_of[3] >= 0 and pool.row_of[4] >= 0
    assert sorted(e for e in pool.expert_of.tolist() if e >= 0) in ([0, 1, 3, 4], [0, 2, 3, 4],
                                                                     [1, 2, 3, 4])
    check_rows(pool)
    with pytest.raises(ValueError, match="rows wanted"):
        pool.victims(3, keep=np.array([0, 1], np.int32))


@pytest.mark.parametrize("backing", BACKINGS)
def test_a_row_is_rewritten_only_after_what_reads_it_is_evaluated(backing):
    """The lazy output of a call reads its rows when evaluated: a later write into one of them
    must not change it (the pool evaluates it first)."""
    read = PatternReader()
    pool = new_pool(backing, rows=2, experts=8, source=read)
    rows = pool.place(np.array([1, 2], np.int32))
    before = pool.arrays[0][mx.array(rows)].astype(mx.float32) * 1  # lazy: reads both rows
    pool.computing(rows, before)
    pool.place(np.array([5, 6], np.int32))  # both rows move
    check_rows(pool)
    want = np.stack([pattern(10, 128), pattern(20, 128)]).view(np.uint32).reshape(2, 4, 8)
    assert (np.array(before) == want.astype(np.float32)).all()
    assert pool.counters["settled"] == 1


def _row_pool(rows: int, backing: str):
    """A pool of ``rows`` rows of 4 KiB (expert e's bytes all e % 251), experts 0-7 in it."""
    def read(layer, experts, dest, bases, positions):
        for e, p in zip(experts.tolist(), positions.tolist()):
            dest[bases[0] + p * 4096:bases[0] + (p + 1) * 4096] = e % 251

    pool = make_pool(SimpleNamespace(index=0, num_experts=512), rows,
                     [(mx.uint8, (4096,), 4096)], backing, batch=8,
                     source=SimpleNamespace(read_rows=read))
    pool.place(np.arange(8, dtype=np.int32))
    return pool


def _growth(change, *ready) -> int:
    """The most bytes MLX holds beyond what it held before ``change()`` (with ``ready``
    evaluated first), the arrays it returns evaluated."""
    mx.eval(*ready)
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(change())
    return mx.get_peak_memory() - base


@pytest.mark.parametrize("backing", BACKINGS)
def test_a_write_moves_only_its_rows_whatever_the_pool_size(backing):
    """In place: the memory a write allocates is the moved rows' (MLX reuses the pool's buffer
    for its scatter, the host writes straight into it), not a copy of the pool."""
    grown = {}
    for rows in (16, 64, 256):
        pool = _row_pool(rows, backing)
        moved = np.arange(8, 16, dtype=np.int32) % rows + 16 * (rows > 16)
        grown[rows] = _growth(lambda: (pool.place(moved), pool.arrays)[1], pool.arrays)
        assert pool.arrays[0].shape == (rows, 4096)
        assert (np.array(pool.arrays[0][int(pool.row_of[16 * (rows > 16) + 8 % rows])])
                == (16 * (rows > 16) + 8 % rows) % 251).all()
    # Eight rows of 4 KiB moved each time: at most the moved bytes (and small index arrays),
    # never a pool's worth (64 KiB to 1 MiB).
    assert max(grown.values()) <= 2 * 8 * 4096 + 4096, grown


@pytest.mark.parametrize("backing", BACKINGS)
def test_a_promotion_moves_only_its_rows_whatever_the_pool_size(backing):
    """Pulled experts promoted into a pool (the step's bookkeeping, issue 24): the memory it
    allocates is the promoted rows', never a copy of the pool, and the rows hold their bytes."""
    grown = {}
    for rows in (16, 64, 256):
        pool = _row_pool(rows, backing)
        experts = np.arange(300, 308, dtype=np.int32)  # pulled: none is in the pool
        pulled = mx.array((experts[:, None] % 251 * np.ones((1, 4096))).astype(np.uint8))
        moved = []

        def promote():
            moved.append(pool.promote(experts, [pulled], np.arange(8), weights=np.full(8, 100)))
            return pool.arrays

        grown[rows] = _growth(promote, pool.arrays, pulled)
        assert moved == [8]
        for e in experts.tolist():
            assert (np.array(pool.arrays[0][int(pool.row_of[e])]) == e % 251).all()
    assert max(grown.values()) <= 2 * 8 * 4096 + 4096, grown


def test_a_prompt_promotes_only_into_rows_its_decode_does_not_use():
    """A prompt's experts take free rows and rows unused since their uses last decayed, never
    a row the decode uses (on the CPU study of bench/pool_policy.py a long prompt between two
    decodes pushed out the decode's experts: 10.5 rows pulled a decode token, 7.0 without);
    a decode's pulled experts still replace the least used rows. A prompt's hits are no
    uses: the layers touch no row for them."""
    pool = new_pool("device", rows=4)
    pool.place(np.array([0, 1, 2], np.int32))  # a decode's experts; row 3 free
    for _ in range(16):  # 0 and 1 keep being used; the uses decay once: 2's to none
        pool.touch(pool.row_of[np.array([0, 1])])
    assert pool.uses[pool.row_of[2]] == 0 and (pool.uses[pool.row_of[[0, 1]]] > 0).all()
    experts = np.array([10, 11, 12], np.int32)
    arrays = [mx.array(np.stack([pattern(e * 10 + s, nb).view(np.uint8) for e in experts])
                       .view(np.uint8)).view(dtype).reshape(len(experts), *shape)
              for s, (dtype, shape, nb) in enumerate(SEGMENTS)]
    heavy = np.full(3, 100)
    assert pool.promote(experts, arrays, np.arange(3), weights=heavy, prompt=True) == 2
    # The free row and expert 2's (no use since placed), the most pulled first.
    assert sorted(pool.expert_of.tolist()) == [0, 1, 10, 11]
    check_rows(pool)
    # The same pulls from a decode push out the least used rows, used or not.
    assert pool.promote(np.array([12], np.int32), [a[2:] for a in arrays], np.arange(1),
                        weights=heavy[:1]) == 1
    assert 12 in pool.expert_of.tolist() and len(set(pool.expert_of.tolist()) & {0, 1}) == 1
    check_rows(pool)


def test_plan_rows_splits_the_budget_and_refuses_below_the_smallest():
    layers = [SimpleNamespace(index=i, num_experts=16, expert_bytes=1 << 20, segments=[0] * 3)
              for i in range(4)]
    assert plan_rows(layers, 4, 68 / 1024, None) == [16] * 4  # 17 MiB a layer: every expert
    assert plan_rows(layers, 4, 24 / 1024, None) == [5] * 4  # 6 rows and their padding: no
    assert plan_rows(layers, 4, (24 + 1 / 1024) / 1024, None) == [6] * 4
    assert plan_rows(layers, 4, None, None) == [8] * 4  # 2 x top-k on unified memory
    with pytest.raises(ValueError, match=r"smallest that works, 0.01562 GiB \(4 rows"):
        plan_rows(layers, 4, 15 / 1024, None)
    with pytest.raises(ValueError, match="positive"):
        plan_rows(layers, 4, 0, 2**40)  # a budget given wins over the free memory
    # The default of a discrete GPU: what fits in half its free memory, split over the layers.
    mib = 2**20
    assert plan_rows(layers, 4, None, 2 * 4 * 17 * mib) == [16] * 4  # every expert
    assert plan_rows(layers, 4, None, 2**40) == [16] * 4  # never more than the layer has
    assert plan_rows(layers, 4, None, 2 * 4 * (10 * mib + 192)) == [10] * 4  # + the padding
    assert plan_rows(layers, 4, None, 2 * 4 * 10 * mib) == [9] * 4
    # A model larger than that never falls off a cliff: the smallest pools that work.
    for free in (2 * 4 * 3 * mib, mib, 0):
        assert plan_rows(layers, 4, None, free) == [4] * 4
    assert plan_rows(layers, 4, 24 / 1024, 0) == [5] * 4  # the budget given, not the free
    assert smallest_rows(SimpleNamespace(num_experts=2), 4) == 2


def test_segment_bases_are_aligned_and_disjoint():
    nbytes = np.array([100, 3, 64], dtype=np.intp)
    bases = segment_bases(5, nbytes)
    assert (bases % 64 == 0).all()
    assert all(bases[i] + 5 * nbytes[i] <= bases[i + 1] for i in range(2))


class Reports:
    """The session's side of a layer's bookkeeping: pulled rows counted, hits reported."""

    def __init__(self):
        self.pulled, self.reported = 0, []

    def count_pulled(self, layer, rows):
        self.pulled += rows

    def report_hits(self, layer, experts):
        self.reported.append(experts.tolist())

    def check_alive(self):
        pass


@given(st.lists(st.lists(st.integers(-1, 15), min_size=8, max_size=8), min_size=1,
                max_size=5))
@settings(max_examples=40, deadline=None)
def test_counting_pipelined_steps_together_counts_what_each_alone_would(steps):
    """A pipelined loop counts its pulled steps at the next promotion (step.py's flush): the
    uses, pulls, counters and reports equal those of counting each step on its own (below
    the decay's threshold, where the order of touches cannot matter). Values 0-7: a hit on
    that pool row; 8-15: a pull of that expert; -1 (both): the other kind of pair."""
    from expertd.client.layer import StepMode, StreamedLayer

    def one_pool():
        pool = new_pool("host", rows=8)
        pool.place(np.arange(8, dtype=np.int32))
        return pool

    table = np.array(steps)
    rows = np.where(table < 8, table, -1)
    experts = np.where(table >= 8, table, -1)
    alone, together = Reports(), Reports()
    a = StreamedLayer(alone, StepMode(), 0, one_pool(), [], 32)
    b = StreamedLayer(together, StepMode(), 0, one_pool(), [], 32)
    for r, e in zip(rows, experts):  # what one step's own counting did
        hit = np.unique(r[r >= 0])
        a.pool.counters["hits"] += len(hit)
        a.pool.touch(hit)
        a.pool.counters["pulled"] += int((e >= 0).sum())
        alone.count_pulled(0, int((e >= 0).sum()))
        pulled = np.unique(e[e >= 0])
        a.pool.note_pulls(pulled)
        a._report(np.union1d(a.pool.expert_of[hit], pulled).astype(np.int32))
    b.after_pulled_steps(rows, experts)
    assert (a.pool.uses == b.pool.uses).all() and (a.pool.pulls == b.pool.pulls).all()
    assert a.pool.counters == b.pool.counters and alone.pulled == together.pulled
    assert a._used == b._used and a._calls == b._calls and alone.reported == together.reported


@given(st.integers(1, 40), st.integers(0, 2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_counting_several_layers_at_once_counts_what_each_layer_alone_would(steps, seed):
    """A drain counts every layer's deferred steps with one sort (layer.count_pulled_steps):
    each layer's uses, pulls, counters and reports equal those of counting that layer alone,
    over fewer steps than a report's and over several reports' worth."""
    from expertd.client.layer import StepMode, StreamedLayer, count_pulled_steps

    def layers():  # layers of different pool rows and experts: one sort keeps them apart
        out = []
        for rows, experts in ((8, 32), (12, 40), (10, 24)):
            pool = new_pool("host", rows=rows, experts=experts)
            pool.place(np.arange(rows, dtype=np.int32))
            out.append(StreamedLayer(Reports(), StepMode(), 0, pool, [], experts))
        return out

    rng = np.random.default_rng(seed)
    alone, together = layers(), layers()
    rows, experts = np.full((steps, 3, 8), -1), np.full((steps, 3, 8), -1)
    for i, layer in enumerate(alone):  # a pair hits a row (any of the pool's) or pulls an
        kind = rng.random((steps, 8))  # expert the pool lacks, or is padding (-1 in both)
        rows[:, i] = np.where(kind < 0.45, rng.integers(0, layer.pool.rows, (steps, 8)), -1)
        experts[:, i] = np.where(kind > 0.55, rng.integers(layer.pool.rows, layer.num_experts,
                                                           (steps, 8)), -1)
    for i, layer in enumerate(alone):
        layer.after_pulled_steps(rows[:, i], experts[:, i])
    count_pulled_steps(together, rows, experts)
    for a, b in zip(alone, together):
        assert (a.pool.uses == b.pool.uses).all() and (a.pool.pulls == b.pool.pulls).all()
        assert a.pool.counters == b.pool.counters and a._used == b._used
        assert a._calls == b._calls
        assert a.session.pulled == b.session.pulled and a.session.reported == b.session.reported


def _steps_table(steps: int, rows: int = 8) -> tuple:
    """``(rows, experts)`` of ``steps`` pipelined steps of 8 pairs on a pool of ``rows`` rows:
    row 0 hit in the even steps, expert 20 pulled in the odd ones, the other pairs hits on
    rows 1-7 (touches enough to decay the counts several times over)."""
    hits = np.tile(np.arange(8) % (rows - 1) + 1, (steps, 1))
    hits[0::2, 0] = 0
    pulls = np.full((steps, 8), -1)
    pulls[1::2, 0] = 20
    hits[1::2, 0] = -1
    return hits, pulls


def _layer(reports):
    from expertd.client.layer import StepMode, StreamedLayer

    pool = new_pool("host", rows=8)
    pool.place(np.arange(8, dtype=np.int32))
    pool.uses[:] = 0
    return StreamedLayer(reports, StepMode(), 0, pool, [], 32)


def test_a_long_batch_of_steps_decays_uses_and_pulls_alike():
    """64 steps counted at once cross the decay's threshold several times: the uses and the
    pulls they bring weigh alike, as counted step by step (there, an expert pulled as often as
    a row is hit ends within one of it). Decaying the uses but adding the pulls after made the
    pulled expert look several times hotter than the row, and a drain after a long stretch
    promoted what step-by-step counting would not."""
    rows, experts = _steps_table(64)
    alone, together = _layer(Reports()), _layer(Reports())
    for layer in (alone, together):  # counts from before the batch: the decays apply to them
        layer.pool.uses[0] = layer.pool.pulls[20] = 16
    for r, e in zip(rows, experts):
        hit = np.unique(r[r >= 0])
        alone.pool.touch(hit)
        alone.pool.note_pulls(np.unique(e[e >= 0]))
    together.after_pulled_steps(rows, experts)
    assert abs(int(alone.pool.pulls[20]) - int(alone.pool.uses[0])) <= 1
    assert abs(int(together.pool.pulls[20]) - int(together.pool.uses[0])) <= 1
    assert together.pool.uses[0] < 16 + 32  # the batch decayed (the case this test is about)


def test_a_long_batch_of_steps_reports_to_the_daemon_as_step_by_step_counting_does():
    """The experts a layer used reach the daemon's LFU once per REPORT_EVERY steps, each
    report naming those steps' experts, whether the steps are counted one by one or 64 at a
    time (a pipelined loop whose drains backed off)."""
    from expertd.client.layer import REPORT_EVERY

    rows, experts = _steps_table(4 * REPORT_EVERY)
    experts[5, 3] = 25  # pulled once, in the first window only
    alone, together = Reports(), Reports()
    a, b = _layer(alone), _layer(together)
    for r, e in zip(rows, experts):
        hit = np.unique(r[r >= 0])
        a._report(np.union1d(a.pool.expert_of[hit], e[e >= 0]).astype(np.int32))
    b.after_pulled_steps(rows, experts)
    assert len(alone.reported) == 4 and together.reported == alone.reported
    assert 25 in together.reported[0] and 25 not in together.reported[1]
