"""The cache policies' victim order on their own: LFU by decayed frequency then recency, LRU by
recency alone, eligibility, against a full sort at scale; and what the policies refuse."""

import json

import numpy as np
import pytest
from harness import A, all_rows, auto_pin, filled, frequencies, frequency, reference_order

from expertd.serving.policy import FREQUENCY_FLOOR, POLICIES, LfuPolicy, LruPolicy, make_policy


def test_empty_rows_come_first_in_row_order():
    policy, rows = filled(4)
    policy.on_touched((0, 2), 5)
    rows[[3, 1]] = -1
    assert policy.victims(3, all_rows(policy), rows) == [1, 3, 0]
    assert policy.victims(2, all_rows(policy), rows) == [1, 3]


def test_lowest_frequency_first():
    policy, rows = filled(4)
    for key, count in [((0, 0), 7), ((0, 1), 2), ((0, 2), 9), ((0, 3), 4)]:
        policy.on_touched(key, count)
    assert policy.victims(4, all_rows(policy), rows) == [1, 3, 0, 2]
    assert policy.victims(1, all_rows(policy), rows) == [1]


def test_ties_go_to_least_recently_used():
    policy, rows = filled(3)  # every key filled once: equal frequencies
    policy.on_touched((0, 0))
    policy.on_touched((0, 2))
    policy.on_touched((0, 1))
    assert policy.victims(3, all_rows(policy), rows) == [0, 2, 1]
    for expert in (0, 1, 2):
        policy.on_touched((0, expert))
    assert policy.victims(3, all_rows(policy), rows) == [0, 1, 2]


def test_decay_lets_a_formerly_hot_key_go_before_a_recently_warm_one():
    policy, rows = filled(2, decay_interval=100, decay_factor=0.5)
    policy.on_touched((0, 0), 98)  # 99 + 1 (the fill of row 1) = 100 touches: one decay
    assert frequency(policy, (0, 0)) == pytest.approx(99 / 2)
    assert policy.victims(1, all_rows(policy), rows) == [1]
    for _ in range(4):  # 400 touches of the warm key, four decays
        policy.on_touched((0, 1), 100)
    assert frequency(policy, (0, 0)) == pytest.approx(99 / 32)
    assert frequency(policy, (0, 1)) > frequency(policy, (0, 0))
    assert policy.victims(1, all_rows(policy), rows) == [0]


def test_default_decay_interval_is_eight_times_rows():
    policy = LfuPolicy(4, 1, 4)
    assert policy.decay_interval == 32
    policy.on_touched((0, 0), 31)
    assert frequency(policy, (0, 0)) == 31
    policy.on_touched((0, 1))
    assert frequency(policy, (0, 0)) == 15.5
    policy.on_touched((0, 1), 32)  # one interval more: one decay more
    assert frequency(policy, (0, 0)) == 7.75
    policy.on_touched((0, 1), 64)  # two intervals in one touch: two decays
    assert frequency(policy, (0, 0)) == 7.75 / 4


def test_decay_flushes_tiny_frequencies_to_zero():
    policy = LfuPolicy(1, 1, 2, decay_interval=1, decay_factor=0.5)  # a decay every touch
    policy.on_touched((0, 0))
    while frequency(policy, (0, 0)) >= 2 * FREQUENCY_FLOOR:
        policy.on_touched((0, 1))
    policy.on_touched((0, 1))
    assert frequency(policy, (0, 0)) == 0.0
    assert policy.hot_keys(10) == [(0, 1)]  # the flushed key is no hot key any more


def test_ineligible_rows_are_never_victims():
    policy, rows = filled(6)
    rows[5] = -1
    eligible = np.array([True, False, True, False, True, False])
    assert policy.victims(6, eligible, rows) == [0, 2, 4]
    assert policy.victims(6, np.zeros(6, dtype=bool), rows) == []


def test_fewer_victims_when_not_enough_qualify():
    policy, rows = filled(4)
    policy.pins.set_explicit([(0, 3)])
    eligible = np.array([True, True, False, True])
    assert policy.victims(10, eligible, rows) == [0, 1]
    assert policy.victims(0, eligible, rows) == []


def test_history_survives_eviction():
    policy, rows = filled(2, decay_interval=1000)
    policy.on_touched((0, 0), 20)
    rows[0] = -1
    policy.on_touched((0, 1), 3)
    rows[0] = 0
    policy.on_filled((0, 0), used=True)  # refilled: its 21 uses, plus one; per row it would be 1
    assert frequency(policy, (0, 0)) == 22
    assert policy.victims(1, all_rows(policy), rows) == [1]


def test_fills_and_evictions_are_uses_when_the_cache_says_so():
    policy = LfuPolicy(2, 1, 4)
    policy.on_filled((0, 1), used=False)  # a prefetch's guess: no use yet
    policy.on_evicted((0, 2), 0)
    assert policy.hot_keys(4) == []
    policy.on_filled((0, 1), used=True)
    policy.on_evicted((0, 2), 3)  # uses the table counted before the row was given up
    assert frequencies(policy) == {(0, 2): 3, (0, 1): 1}


def test_row_keys_of_any_integer_dtype_are_accepted():
    policy = LfuPolicy(3, 2, 4)
    policy.on_touched((1, 3), 2)
    policy.on_touched((0, 2))
    for dtype in (np.int8, np.int32, np.int64):
        rows = np.array([-1, 7, 2], dtype=dtype)
        assert policy.victims(3, all_rows(policy), rows) == [0, 2, 1]
        assert auto_pin(policy, 1, rows) == [(1, 3)]
        assert policy.pins.n_pinned_rows(rows) == 1
        auto_pin(policy, 0, rows)
    assert policy.victims(3, all_rows(policy), np.array([2, 1, 0], dtype=np.uint16)) == [1, 2, 0]


def test_hot_keys_by_frequency_then_recency():
    policy = LfuPolicy(2, 2, 4)
    policy.on_touched((1, 2), 3)
    policy.on_touched((0, 1), 5)
    policy.on_touched((0, 3), 3)
    assert policy.hot_keys(10) == [(0, 1), (0, 3), (1, 2)]
    assert policy.hot_keys(2) == [(0, 1), (0, 3)]
    assert policy.hot_keys(0) == []


@pytest.mark.parametrize("args, options, message", [
    ((0, 2, 4), {}, "n_rows must be at least 1"),
    ((4, 0, 4), {}, "n_layers must be at least 1"),
    ((4, 2, -1), {}, "n_experts must be at least 1"),
    ((4.0, 2, 4), {}, "n_rows must be an integer"),
    ((True, 2, 4), {}, "n_rows must be an integer"),
    ((4, 2, 4), {"decay_interval": -1}, "decay_interval must be a non-negative integer"),
    ((4, 2, 4), {"decay_factor": 0.0}, r"decay_factor must be in \(0, 1\]"),
    ((4, 2, 4), {"decay_factor": 1.5}, r"decay_factor must be in \(0, 1\]"),
    ((4, 2, 4), {"decay_factor": "half"}, "decay_factor must be a number"),
    ((4, 2, 4), {"min_quota": 0}, "min_quota must be at least 1"),
    ((4, 2, 4), {"ghosts": -1}, "ghosts must be a non-negative integer"),
    ((4, 2, 4), {"layer_quotas": 1}, "layer_quotas must be True or False"),
])
def test_constructor_rejects_bad_arguments(args, options, message):
    with pytest.raises(ValueError, match=message):
        LfuPolicy(*args, **options)


EMPTY = np.full(3, -1, dtype=np.int64)  # the slot table of a 3-row arena with nothing in it


@pytest.mark.parametrize("call, message", [
    (lambda p: p.on_touched((2, 0)), "out of range"),
    (lambda p: p.on_touched((-1, 0)), "out of range"),  # no negative-index wrap-around
    (lambda p: p.on_touched((0, 4)), "out of range"),
    (lambda p: p.on_touched((0, 1.0)), "pair of integers"),
    (lambda p: p.on_touched((0, 1, 2)), "pair of integers"),
    (lambda p: p.on_touched((0, 1), -1), "count must be a non-negative integer"),
    (lambda p: p.on_filled((2, 0), True), "out of range"),
    (lambda p: p.on_evicted((0, 4), 1), "out of range"),
    (lambda p: p.pins.set_explicit([(0, 1), (0, 9)]), "out of range"),
    (lambda p: p.pins.hold(A, [(2, 0)]), "out of range"),
    (lambda p: p.pins.release(A, [(0, 4)]), "out of range"),
    (lambda p: p.victims(-1, np.ones(3, dtype=bool), EMPTY), "n must be a non-negative integer"),
    (lambda p: p.victims(1, np.ones(4, dtype=bool), EMPTY), r"shape \(3,\)"),
    (lambda p: p.victims(1, np.ones(3, dtype=np.int8), EMPTY), "bool array"),
    (lambda p: p.victims(1, np.ones(3, dtype=bool), EMPTY[:2]), r"row_keys .* shape \(3,\)"),
    (lambda p: p.victims(1, np.ones(3, dtype=bool), EMPTY.astype(float)), "integer array"),
    (lambda p: p.victims(1, np.ones(3, dtype=bool), EMPTY, 2), "layer 2 out of range"),
    (lambda p: p.victims(1, np.ones(3, dtype=bool), EMPTY, True), "layer must be an integer"),
    (lambda p: p.victims(1, np.ones(3, dtype=bool), EMPTY, 0, [4]), r"key \(0, 4\) out of range"),
    (lambda p: p.hot_keys(-1), "limit must be a non-negative integer"),
    (lambda p: auto_pin(p, -2, EMPTY), "n must be a non-negative integer"),
    (lambda p: auto_pin(p, 1, [[0, 1, 2]]), "row_keys must be an integer array"),
    (lambda p: auto_pin(p, 1, np.array([0, 1, 8])), "row_keys out of range"),
    (lambda p: p.pins.n_pinned_rows(np.array([-1, -1])), "row_keys must be"),
    (lambda p: p.pins.n_pinned_rows(np.array([-1, -1, 99])), "row_keys out of range"),
])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_methods_reject_bad_input(name, call, message):
    policy = make_policy(name, 3, 2, 4)
    before = (policy.state(), policy.pins.pinned_keys)
    with pytest.raises(ValueError, match=message):
        call(policy)
    assert (policy.state(), policy.pins.pinned_keys) == before  # refused: nothing changed


def test_the_mapping_picks_a_policy_by_name():
    assert POLICIES == {"lfu": LfuPolicy, "lru": LruPolicy}
    assert type(make_policy("lru", 4, 2, 8, layer_quotas=False)) is LruPolicy
    with pytest.raises(ValueError, match="unknown cache policy 'mru'; one of lfu, lru"):
        make_policy("mru", 4, 2, 8)


def test_large_arena_matches_a_full_sort():
    rng = np.random.default_rng(0)
    n_rows, n_layers, n_experts = 100_000, 100, 1500
    policy = LfuPolicy(n_rows, n_layers, n_experts, decay_interval=10**9)
    row_keys = rng.choice(n_layers * n_experts, size=n_rows, replace=False).astype(np.int64)
    for flat in row_keys:
        policy.on_touched(divmod(int(flat), n_experts))  # the fills
    for layer in range(n_layers):
        # Few distinct counts, so the ties at the cut are large and recency decides them.
        experts = rng.integers(0, n_experts, size=3000).tolist()
        for expert, count in zip(experts, rng.integers(0, 3, size=3000).tolist()):
            policy.on_touched((layer, expert), count)
    policy.pins.set_explicit([divmod(int(flat), n_experts)
                              for flat in rng.choice(row_keys, size=500, replace=False)])
    policy.pins.hold(A, [divmod(int(flat), n_experts)
                         for flat in rng.choice(row_keys, size=300, replace=False)])
    row_keys[rng.choice(n_rows, size=1000, replace=False)] = -1
    eligible = rng.random(n_rows) < 0.9
    expected = reference_order(policy, eligible, row_keys)
    for n in [1, 500, 5000, 40_000, 100_000]:
        assert policy.victims(n, eligible, row_keys) == expected[:n]


# --- LRU: the same interface, another ranking ---


def test_lru_evicts_the_least_recent_use_whatever_the_counts():
    policy = LruPolicy(4, 2, 8, layer_quotas=False)
    rows = np.array([0, 1, 2, -1], dtype=np.int64)
    policy.on_touched((0, 0), 50)
    policy.on_filled((0, 1), used=True)
    policy.on_filled((0, 2), used=False)  # a prefetch's guess: never used, coldest of all
    policy.on_touched((0, 1), 0)  # no use
    assert policy.victims(4, all_rows(policy), rows) == [3, 2, 0, 1]
    policy.on_evicted((0, 0), 1)  # a late use counts as the latest
    policy.pins.set_explicit([(0, 1)])
    assert policy.victims(4, all_rows(policy), rows) == [3, 2, 0]
    assert policy.hot_keys(8) == [(0, 0), (0, 1)]
    assert auto_pin(policy, 1, rows) == [(0, 0)]  # the explicit pin is no candidate


def test_lru_state_keeps_the_order_and_quotas_apply_to_it():
    policy, rows = filled(4, n_layers=2, n_experts=2)
    lru = LruPolicy(4, 2, 2)
    for flat in [3, 1, 0, 2, 1]:
        lru.on_touched(divmod(flat, 2))
    restored = LruPolicy(4, 2, 2)
    restored.load_state(json.loads(json.dumps(lru.state())))
    assert restored.hot_keys(4) == lru.hot_keys(4) == [(0, 1), (1, 0), (0, 0), (1, 1)]
    assert restored.victims(4, all_rows(restored), rows) == lru.victims(4, all_rows(lru), rows)
    restored.on_touched((1, 1))  # newer than anything loaded
    assert restored.hot_keys(1) == [(1, 1)]
    # Layer 0 holds its quota (2 of 4 rows): it replaces its own least recent key, not the
    # least recent of all.
    assert lru.victims(1, all_rows(lru), rows) == [3]
    assert lru.victims(1, all_rows(lru), rows, layer=0, missing=[]) == [0]


def test_lru_matches_a_full_sort():
    rng = np.random.default_rng(2)
    policy = LruPolicy(300, 4, 100, layer_quotas=False)
    row_keys = rng.choice(400, size=300, replace=False).astype(np.int64)
    for flat in rng.choice(400, size=2000).tolist():
        policy.on_touched(divmod(flat, 100), int(rng.integers(0, 2)))
    policy.pins.set_explicit([divmod(int(flat), 100) for flat in row_keys[:20]])
    row_keys[rng.choice(300, size=10, replace=False)] = -1
    eligible = rng.random(300) < 0.9
    empty = [r for r in range(300) if eligible[r] and row_keys[r] < 0]
    resident = sorted((int(policy._last_used[k]), r) for r, k in enumerate(row_keys.tolist())
                      if eligible[r] and k >= 0 and not policy.pins.pinned[k])
    expected = empty + [r for _, r in resident]
    for n in [1, 15, 100, 300]:
        assert policy.victims(n, eligible, row_keys) == expected[:n]
