"""The cache policies on their own: LFU with decay, LRU, the pin book, per-layer quotas,
eligibility and the warm-restart state, all through the events and questions the cache uses."""

import json
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from expertd.serving.hotset import load_hot_set
from expertd.serving.policy import (
    FREQUENCY_FLOOR,
    POLICIES,
    CachePolicy,
    KeySpace,
    LfuPolicy,
    LruPolicy,
    PinBook,
    make_policy,
)

A, B = b"a" * 16, b"b" * 16  # two clients' routing ids, for their holds


def all_rows(policy: CachePolicy) -> np.ndarray:
    return np.ones(policy.n_rows, dtype=bool)


def frequencies(policy: LfuPolicy) -> dict:
    """Every key's decayed frequency, as the saved state holds it (keys absent are at 0)."""
    return {(layer, expert): value for layer, expert, value in policy.state()["frequencies"]}


def frequency(policy: LfuPolicy, key) -> float:
    return frequencies(policy).get(key, 0.0)


def n_explicit(policy: CachePolicy) -> int:
    """Keys pinned for good: those the saved state keeps."""
    return len(policy.state()["pins"])


def auto_pin(policy: CachePolicy, n: int, rows) -> list:
    """Auto-pins by the policy's ranking, as the cache asks for them."""
    return policy.pins.auto_pin(n, rows, policy.hottest)


def filled(n_rows: int, n_layers: int = 2, n_experts: int = 8,
           **options) -> tuple[LfuPolicy, np.ndarray]:
    """A policy and its slot table (flat key per row) whose rows hold keys (0, 0), (0, 1), ...
    in row order; each fill counts one touch, as the daemon's fills do."""
    policy = LfuPolicy(n_rows, n_layers, n_experts, **options)
    for row in range(n_rows):
        policy.on_touched(divmod(row, n_experts))
    return policy, np.arange(n_rows, dtype=np.int64)


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


def test_explicit_pins_are_never_victims():
    policy, rows = filled(4)
    pins = policy.pins
    pins.set_explicit([(0, 0), (0, 2), (1, 7)])  # (1, 7) is not resident: allowed
    assert pins.is_pinned((0, 0)) and not pins.is_pinned((0, 1))
    assert pins.pinned_keys == {(0, 0), (0, 2), (1, 7)}
    assert pins.n_pinned_rows(rows) == 2
    assert n_explicit(policy) == pins.n_capped == 3
    assert policy.victims(4, all_rows(policy), rows) == [1, 3]
    pins.set_explicit([(0, 2), (1, 7)])  # the pin file without (0, 0)
    assert sorted(policy.victims(4, all_rows(policy), rows)) == [0, 1, 3]


def test_auto_pins_take_the_hottest_resident_keys_and_replace_each_other():
    policy, rows = filled(5)
    for expert, count in enumerate([5, 1, 9, 3, 7]):
        policy.on_touched((0, expert), count)
    policy.on_touched((1, 0), 100)  # hottest, but not resident
    pins = policy.pins
    pins.set_explicit([(0, 2)])  # explicit pins are not auto-pin candidates
    assert auto_pin(policy, 2, rows) == [(0, 4), (0, 0)]
    assert pins.pinned_keys == {(0, 2), (0, 4), (0, 0)}
    assert pins.n_pinned_rows(rows) == 3
    assert pins.n_capped == 1  # automatic pins are not counted against the cap
    assert policy.victims(5, all_rows(policy), rows) == [1, 3]

    policy.on_touched((0, 1), 50)
    assert auto_pin(policy, 1, rows) == [(0, 1)]
    assert pins.pinned_keys == {(0, 2), (0, 1)}
    assert policy.victims(5, all_rows(policy), rows) == [3, 0, 4]

    pins.set_explicit([])
    assert auto_pin(policy, 0, rows) == []
    assert pins.pinned_keys == set()
    assert len(policy.victims(5, all_rows(policy), rows)) == 5


def test_auto_and_explicit_pins_are_separate():
    policy, rows = filled(3)
    pins = policy.pins
    policy.on_touched((0, 1), 10)
    assert auto_pin(policy, 1, rows) == [(0, 1)]
    pins.set_explicit([(0, 1)])
    pins.set_explicit([])  # drops the explicit pin only
    assert pins.is_pinned((0, 1))
    pins.set_explicit([(0, 0)])
    auto_pin(policy, 0, rows)  # drops the automatic pins only
    assert pins.pinned_keys == {(0, 0)}


def test_holds_are_counted_per_client_and_never_victims():
    policy, rows = filled(4)
    pins = policy.pins
    assert pins.hold(A, [(0, 1), (1, 5)]) == [(0, 1), (1, 5)]  # (1, 5) not resident: allowed
    assert pins.hold(B, [(0, 1)]) == [(0, 1)]  # a second client
    assert pins.hold(A, [(0, 1)]) == []  # the same one twice holds it once
    assert pins.is_pinned((0, 1)) and pins.is_pinned((1, 5))
    assert pins.pinned_keys == {(0, 1), (1, 5)}
    assert pins.n_capped == 2 and n_explicit(policy) == 0
    assert pins.n_pinned_rows(rows) == 1
    assert policy.victims(4, all_rows(policy), rows) == [0, 2, 3]
    pins.release(A, [(0, 1)])
    assert pins.is_pinned((0, 1))  # B's hold is left
    assert 1 not in policy.victims(4, all_rows(policy), rows)
    pins.release(B, [(0, 1)])
    assert not pins.is_pinned((0, 1))
    assert sorted(policy.victims(4, all_rows(policy), rows)) == [0, 1, 2, 3]
    pins.release(B, [(0, 1), (1, 5)])  # what B does not hold is left alone
    assert pins.pinned_keys == {(1, 5)}
    pins.forget(A)  # a client that goes lets go of all it held
    assert pins.pinned_keys == set() and pins.n_capped == 0


def test_holds_explicit_and_auto_pins_are_separate():
    policy, rows = filled(3)
    pins = policy.pins
    policy.on_touched((0, 2), 10)
    pins.hold(A, [(0, 0)])
    pins.set_explicit([(0, 0)])
    pins.set_explicit([])  # the hold stays
    assert pins.is_pinned((0, 0))
    pins.set_explicit([(0, 1)])
    pins.hold(A, [(0, 1)])
    pins.release(A, [(0, 1)])  # the explicit pin stays
    assert pins.is_pinned((0, 1))
    pins.hold(B, [(0, 2)])
    assert auto_pin(policy, 1, rows) == [(0, 2)]  # held keys stay candidates: holds end
    pins.forget(B)
    assert pins.is_pinned((0, 2))  # still auto-pinned
    auto_pin(policy, 0, rows)
    assert pins.pinned_keys == {(0, 0), (0, 1)}
    assert pins.n_capped == 2 and n_explicit(policy) == 1


def test_the_cap_bounds_explicit_pins_and_holds_and_leaves_auto_pins_the_rest():
    keys = KeySpace(2, 8)
    policy = LfuPolicy(4, 2, 8, pins=PinBook(keys, 4, cap=2))
    pins, rows = policy.pins, np.arange(4, dtype=np.int64)
    for expert, count in enumerate([4, 3, 2, 1]):
        policy.on_touched((0, expert), count)
    pins.set_explicit([(1, 7)])
    assert pins.hold(A, [(0, 0), (0, 1)]) is None  # three keys: nothing is held
    assert pins.pinned_keys == {(1, 7)}
    assert pins.hold(A, [(0, 0)]) == [(0, 0)]
    assert pins.hold(B, [(0, 0)]) == [(0, 0)]  # pinned already: it takes no more room
    assert pins.hold(B, [(0, 1)]) is None
    assert auto_pin(policy, 2, rows) == []  # no room left
    pins.forget(A)
    pins.forget(B)
    assert auto_pin(policy, 2, rows) == [(0, 0)]  # room for one
    with pytest.raises(ValueError, match="must span"):
        LfuPolicy(4, 2, 8, pins=PinBook(KeySpace(2, 4), 4))


def test_holds_are_not_saved():
    policy, rows = filled(2)
    policy.pins.hold(A, [(0, 0)])
    policy.pins.set_explicit([(1, 1)])
    state = policy.state()
    assert state["pins"] == [[1, 1]]
    restored = LfuPolicy(2, 2, 8)
    restored.load_state(state)
    assert restored.pins.pinned_keys == {(1, 1)}
    policy.load_state(state)  # loading replaces explicit pins only; live clients keep theirs
    assert policy.pins.pinned_keys == {(0, 0), (1, 1)}


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


def test_state_round_trip_through_json():
    policy, rows = filled(4, decay_interval=1000)
    for expert, count in enumerate([5, 1, 9, 3]):
        policy.on_touched((0, expert), count)
    policy.on_touched((1, 6), 978)  # the 1000th touch: one decay, and frequencies with halves
    policy.pins.set_explicit([(1, 7)])
    auto_pin(policy, 1, rows)  # automatic pins are not saved
    snapshot = json.loads(json.dumps(policy.state()))
    assert len(snapshot["frequencies"]) == 5
    assert frequency(policy, (0, 1)) == 1.0

    restored = LfuPolicy(4, 2, 8, decay_interval=1000)
    restored.load_state(snapshot)
    assert restored.pins.pinned_keys == {(1, 7)}
    assert restored.hot_keys(10) == policy.hot_keys(10)
    assert frequencies(restored) == frequencies(policy)
    assert restored.state() == snapshot


@pytest.mark.parametrize("text", [b"[" * 5000 + b"]" * 5000, b'{"policy": ' + b"[" * 5000],
                         ids=["nested", "nested-unclosed"])
def test_a_state_file_nested_too_deeply_is_ignored_with_one_line(tmp_path, caplog, text):
    """json.loads raises RecursionError (no ValueError) past Python's stack: still one line."""
    path = tmp_path / "state.json"
    path.write_bytes(text)
    policy, _ = filled(4)
    before = policy.state()
    with caplog.at_level(logging.WARNING, logger="expertd"):
        assert load_hot_set(path, policy) == []
    assert [r.getMessage() for r in caplog.records] == [
        f"ignoring unreadable state file {path}: nested too deeply"]
    assert policy.state() == before


def test_load_state_ignores_out_of_range_entries():
    policy = LfuPolicy(2, 2, 4)
    policy.on_touched((0, 0), 9)
    state = {"format": "expertd-policy", "version": 1,
             "frequencies": [[0, 1, 3.5], [2, 0, 8], [1, 4, 2], [-1, 0, 1], [1, 3, 1]],
             "pins": [[0, 2], [5, 5]]}
    policy.load_state(state)
    assert policy.hot_keys(10) == [(0, 1), (1, 3)]  # loading replaces, (0, 0) is gone
    assert policy.pins.pinned_keys == {(0, 2)}


@pytest.mark.parametrize("state, message", [
    ([], "not an expertd-policy state"),
    ({"format": "other", "version": 1, "frequencies": [], "pins": []}, "not an expertd-policy"),
    ({"format": "expertd-policy", "version": 2, "frequencies": [], "pins": []}, "version 2"),
    ({"format": "expertd-policy", "version": 1, "pins": []}, "lists"),
    ({"format": "expertd-policy", "version": 1, "frequencies": [[0, 1]], "pins": []}, "entry"),
    ({"format": "expertd-policy", "version": 1, "frequencies": [[0, 1, -2]], "pins": []}, ">= 0"),
    ({"format": "expertd-policy", "version": 1, "frequencies": [[0, 1, float("nan")]], "pins": []},
     "finite"),
    ({"format": "expertd-policy", "version": 1, "frequencies": [[0.5, 1, 2]], "pins": []},
     "integers"),
    ({"format": "expertd-policy", "version": 1, "frequencies": [], "pins": [[0, True]]}, "integers"),
    ({"format": "expertd-policy", "version": 1, "frequencies": [], "pins": [0]}, "pin entry"),
])
def test_load_state_rejects_malformed_snapshots_without_changing_anything(state, message):
    policy = LfuPolicy(2, 2, 4)
    policy.on_touched((0, 0), 9)
    policy.pins.set_explicit([(1, 1)])
    with pytest.raises(ValueError, match=message):
        policy.load_state(state)
    assert policy.hot_keys(10) == [(0, 0)] and policy.pins.pinned_keys == {(1, 1)}


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


def reference_order(policy: LfuPolicy, eligible: np.ndarray, row_keys: np.ndarray) -> list[int]:
    """Every qualifying row by a full sort: empty rows, then (frequency, recency)."""
    empty, resident = [], []
    freq = frequencies(policy)
    for row in range(policy.n_rows):
        flat = int(row_keys[row])
        if not eligible[row]:
            continue
        key = divmod(flat, policy.n_experts)
        if flat < 0:
            empty.append(row)
        elif not policy.pins.is_pinned(key):
            # Recency is internal; the clock value of the key's last fill or touch.
            resident.append((freq.get(key, 0.0), int(policy._last_used[flat]), row))
    return empty + [row for _, _, row in sorted(resident)]


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


# --- per-layer quotas ---


def two_layers(layer_quotas: bool = True, **options) -> tuple[LfuPolicy, np.ndarray]:
    """Six rows, quotas 3 and 3: layer 0 holds four keys (frequencies 9, 5, 7, 6 in rows
    0..3), layer 1 two cold ones (frequency 1, rows 4 and 5)."""
    policy = LfuPolicy(6, 2, 8, decay_interval=1000, layer_quotas=layer_quotas, **options)
    rows = np.array([0, 1, 2, 3, 8, 9], dtype=np.int64)
    for flat in rows:
        policy.on_touched(divmod(int(flat), 8))
    for expert, count in enumerate([8, 4, 6, 5]):
        policy.on_touched((0, expert), count)
    return policy, rows


def test_quotas_start_as_an_even_split():
    assert LfuPolicy(10, 4, 8).quotas.rows.tolist() == [3, 3, 2, 2]
    assert two_layers()[0].quotas.rows.tolist() == [3, 3]


def test_a_layer_at_its_quota_evicts_its_own_rows():
    policy, rows = two_layers()
    assert policy.victims(1, all_rows(policy), rows) == [4]  # plain LFU: the coldest anywhere
    assert policy.victims(1, all_rows(policy), rows, layer=0) == [1]
    assert policy.victims(4, all_rows(policy), rows, layer=0) == [1, 3, 2, 0]
    eligible = all_rows(policy)
    eligible[1] = False  # the demand uses row 1
    assert policy.victims(1, eligible, rows, layer=0) == [3]
    rows[5] = -1
    assert policy.victims(2, all_rows(policy), rows, layer=0) == [5, 1]  # empty rows first


def test_a_layer_under_its_quota_takes_rows_of_layers_over_theirs():
    policy, rows = two_layers()
    assert policy.victims(1, all_rows(policy), rows, layer=1) == [1]
    # Layer 1 has room for one row more: the second victim is its own coldest.
    assert policy.victims(2, all_rows(policy), rows, layer=1) == [1, 4]
    assert policy.victims(1, all_rows(policy), rows, layer=1, missing=[5]) == [1]
    rows[2] = -1  # layer 0 is down to its quota: the room is the empty row
    assert policy.victims(2, all_rows(policy), rows, layer=1) == [2, 4]
    rows[3] = -1  # and empty rows are taken first in every step
    assert policy.victims(2, all_rows(policy), rows, layer=1) == [2, 3]
    # Quotas off: the layer is ignored.
    plain, rows = two_layers(layer_quotas=False)
    assert plain.victims(1, all_rows(plain), rows, layer=1) == [4]


def test_too_few_rows_in_the_quota_fall_back_to_any_eligible_row():
    policy, rows = two_layers()
    policy.pins.set_explicit([(0, 1)])
    eligible = np.array([True, True, False, False, True, True])  # rows 2 and 3 leased
    # Layer 0's own rows give only row 0 (row 1 is pinned); the rest is plain LFU.
    assert policy.victims(3, eligible, rows, layer=0) == [0, 4, 5]
    assert policy.victims(9, eligible, rows, layer=0) == [0, 4, 5]
    assert policy.victims(9, eligible, rows, layer=1) == [0, 4, 5]
    assert policy.victims(1, np.zeros(6, dtype=bool), rows, layer=0) == []


def three_layers(**options) -> tuple[LfuPolicy, np.ndarray]:
    """Six rows, quotas 2, 2, 2; each layer's weakest key: layer 0 3, layer 1 2, layer 2 1."""
    policy = LfuPolicy(6, 3, 4, decay_interval=1000, layer_quotas=True, **options)
    rows = np.array([0, 1, 4, 5, 8, 9], dtype=np.int64)
    for flat, count in zip(rows, [9, 3, 8, 2, 7, 1]):
        policy.on_touched(divmod(int(flat), 4), int(count))
    return policy, rows


def test_a_miss_on_a_ghost_moves_quota_from_the_layer_with_the_weakest_key():
    policy, rows = three_layers()
    assert policy.victims(1, all_rows(policy), rows, 0, [2]) == [1]  # evicts (0, 1)
    rows[1] = 2
    assert policy.quotas.rows.tolist() == [2, 2, 2]  # (0, 2) was no ghost
    # (0, 1) comes back: layer 0 is short of rows and takes one of layer 2's.
    assert policy.victims(1, all_rows(policy), rows, 0, [1]) == [5]
    assert policy.quotas.rows.tolist() == [3, 2, 1]
    rows[5] = 1
    # A ghost counts once; (2, 1) is a ghost of layer 2 now.
    assert policy.victims(1, all_rows(policy), rows, 0, [1]) == [1]
    assert policy.quotas.rows.tolist() == [3, 2, 1]


def test_pinned_keys_and_min_quota_limit_the_donors():
    policy, rows = three_layers(min_quota=2)
    policy.victims(1, all_rows(policy), rows, 0, [2])
    rows[1] = 2
    assert policy.victims(1, all_rows(policy), rows, 0, [1]) == [1]
    assert policy.quotas.rows.tolist() == [2, 2, 2]  # no layer may go below 2

    policy, rows = three_layers()
    policy.pins.set_explicit([(2, 1)])
    policy.victims(1, all_rows(policy), rows, 0, [2])
    rows[1] = 2
    policy.victims(1, all_rows(policy), rows, 0, [1])
    assert policy.quotas.rows.tolist() == [3, 1, 2]  # layer 2's weakest key is pinned: layer 1 gives


def test_ghost_lists_keep_the_last_evictions_of_each_layer():
    policy, rows = three_layers(ghosts=1)
    policy.victims(2, all_rows(policy), rows, 0, [2, 3])  # evicts (0, 1) then (0, 0)
    rows[[1, 0]] = [2, 3]
    # (0, 1) was pushed out of the ghosts by (0, 0): one move, not two.
    policy.victims(2, all_rows(policy), rows, 0, [1, 0])
    assert policy.quotas.rows.tolist() == [3, 2, 1]


def test_layer_none_is_the_plain_rule_whatever_the_quotas():
    rng = np.random.default_rng(1)
    n_rows, n_layers, n_experts = 400, 8, 100
    policy = LfuPolicy(n_rows, n_layers, n_experts, decay_interval=10**9, layer_quotas=True,
                       min_quota=4)
    row_keys = rng.choice(n_layers * n_experts, size=n_rows, replace=False).astype(np.int64)
    for flat in row_keys:
        policy.on_touched(divmod(int(flat), n_experts))
    for layer in range(n_layers):
        experts = rng.integers(0, n_experts, size=300).tolist()
        for expert, count in zip(experts, rng.integers(0, 3, size=300).tolist()):
            policy.on_touched((layer, expert), count)
    policy.pins.set_explicit([divmod(int(flat), n_experts)
                              for flat in rng.choice(row_keys, size=20, replace=False)])
    row_keys[rng.choice(n_rows, size=10, replace=False)] = -1
    for _ in range(50):  # layered demands move quotas and record ghosts in between
        eligible = rng.random(n_rows) < 0.9
        layer = int(rng.integers(n_layers))
        missing = rng.integers(0, n_experts, size=4).tolist()
        assert set(policy.victims(4, eligible, row_keys, layer, missing)) <= set(
            reference_order(policy, eligible, row_keys))
        for n in [1, 7, 60, n_rows]:
            assert policy.victims(n, eligible, row_keys) == reference_order(
                policy, eligible, row_keys)[:n]
    assert policy.quotas.rows.sum() == n_rows


def test_quotas_are_not_saved_and_old_states_load():
    policy, rows = three_layers()
    policy.victims(1, all_rows(policy), rows, 0, [2])
    rows[1] = 2
    policy.victims(1, all_rows(policy), rows, 0, [1])
    state = json.loads(json.dumps(policy.state()))
    assert set(state) == {"format", "version", "frequencies", "pins"}
    restored = LfuPolicy(6, 3, 4)
    restored.load_state(state)
    assert restored.quotas.rows.tolist() == [2, 2, 2]
    assert restored.hot_keys(10) == policy.hot_keys(10)


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


class PolicyMachine(RuleBasedStateMachine):
    """Random event sequences against a plain model of rows, frequencies and pins."""

    N_ROWS, N_LAYERS, N_EXPERTS, INTERVAL, MIN_QUOTA = 6, 2, 5, 7, 2

    def __init__(self):
        super().__init__()
        self.policy = LfuPolicy(self.N_ROWS, self.N_LAYERS, self.N_EXPERTS,
                                decay_interval=self.INTERVAL, decay_factor=0.5,
                                layer_quotas=True, min_quota=self.MIN_QUOTA, ghosts=2)
        self.rows = {}  # row -> key: the model of the daemon's slot table
        self.freq = {}  # key -> frequency, mirrored exactly (powers of two)
        self.since_decay = 0
        self.explicit = set()
        self.auto = set()
        self.holds = {}  # client -> the keys it holds, clients holding nothing removed

    def row_keys(self) -> np.ndarray:
        """The slot table as the daemon passes it: flat key per row, -1 for an empty row."""
        table = np.full(self.N_ROWS, -1, dtype=np.int64)
        for row, (layer, expert) in self.rows.items():
            table[row] = layer * self.N_EXPERTS + expert
        return table

    def held(self) -> set:
        return set().union(*self.holds.values())

    def pinned(self) -> set:
        return self.explicit | self.auto | self.held()

    keys = st.tuples(st.integers(0, N_LAYERS - 1), st.integers(0, N_EXPERTS - 1))
    row_numbers = st.integers(0, N_ROWS - 1)
    clients = st.sampled_from([A, B])

    def _touched(self, key, count):
        self.freq[key] = self.freq.get(key, 0.0) + count
        self.since_decay += count
        while self.since_decay >= self.INTERVAL:
            self.since_decay -= self.INTERVAL
            self._decay()

    def _decay(self):
        self.freq = {k: (v / 2 if v / 2 >= FREQUENCY_FLOOR else 0.0) for k, v in self.freq.items()}

    @rule(row=row_numbers, key=keys)
    def fill(self, row, key):
        # The slot table holds a key in one row at most; a fill is one touch of its key.
        if key in self.rows.values() and self.rows.get(row) != key:
            return
        self.rows[row] = key
        self.policy.on_touched(key)
        self._touched(key, 1)

    @rule(row=row_numbers)
    def remove(self, row):
        self.rows.pop(row, None)

    @rule(key=keys, count=st.integers(0, 4))
    def touch(self, key, count):
        self.policy.on_touched(key, count)
        if count:
            self._touched(key, count)

    @rule(row=row_numbers, key=keys, uses=st.integers(0, 3))
    def refill(self, row, key, uses):
        # The cache's events for a row given to another key: the old key's late uses, then the
        # fill (a use unless it is a prefetch's guess).
        if key in self.rows.values() or row not in self.rows:
            return
        self.policy.on_evicted(self.rows[row], uses)
        if uses:
            self._touched(self.rows[row], uses)
        used = uses != 1
        self.rows[row] = key
        self.policy.on_filled(key, used)
        if used:
            self._touched(key, 1)

    @rule(key=keys, on=st.booleans())
    def pin(self, key, on):
        if on:
            self.explicit.add(key)
        else:
            self.explicit.discard(key)
        self.policy.pins.set_explicit(sorted(self.explicit))

    @rule(client=clients, keys=st.lists(keys, max_size=3, unique=True))
    def hold(self, client, keys):
        mine = self.holds.get(client, set())
        assert self.policy.pins.hold(client, keys) == [k for k in keys if k not in mine]
        if keys:
            self.holds[client] = mine | set(keys)

    @rule(client=clients, keys=st.lists(keys, max_size=3))
    def release(self, client, keys):
        self.policy.pins.release(client, keys)  # keys it does not hold are left alone
        mine = self.holds.pop(client, set()) - set(keys)
        if mine:
            self.holds[client] = mine

    @rule(client=clients)
    def forget(self, client):
        self.policy.pins.forget(client)
        self.holds.pop(client, None)

    @rule(n=st.integers(0, 3))
    def auto_pin(self, n):
        chosen = auto_pin(self.policy, n, self.row_keys())
        candidates = {k for k in self.rows.values()
                      if k not in self.explicit and self.freq.get(k, 0) > 0}
        assert len(chosen) == min(n, len(candidates)) == len(set(chosen))
        assert set(chosen) <= candidates
        rest = candidates - set(chosen)
        freqs = [self.freq[k] for k in chosen]
        assert freqs == sorted(freqs, reverse=True)
        assert all(self.freq[k] >= self.freq[r] for k in chosen for r in rest)
        self.auto = set(chosen)

    @rule(n=st.integers(0, N_ROWS + 2), mask=st.lists(st.booleans(), min_size=N_ROWS,
                                                       max_size=N_ROWS))
    def victims(self, n, mask):
        eligible = np.array(mask, dtype=bool)
        chosen = self.policy.victims(n, eligible, self.row_keys())
        qualify = self.check_victims(n, eligible, chosen)
        # Empty rows first, then non-decreasing frequency; nothing left behind is colder.
        empties = [r for r in chosen if r not in self.rows]
        assert chosen[:len(empties)] == empties
        freqs = [self.freq.get(self.rows[r], 0.0) for r in chosen[len(empties):]]
        assert freqs == sorted(freqs)
        for r in qualify - set(chosen):
            if r not in self.rows:
                assert not freqs and all(c < r for c in chosen)
            elif freqs:
                assert self.freq.get(self.rows[r], 0.0) >= freqs[-1]

    @rule(n=st.integers(0, N_ROWS + 2), mask=st.lists(st.booleans(), min_size=N_ROWS,
                                                       max_size=N_ROWS),
          layer=st.integers(0, N_LAYERS - 1),
          missing=st.lists(st.integers(0, N_EXPERTS - 1), max_size=3))
    def victims_of_a_layer(self, n, mask, layer, missing):
        # Quotas change which rows go first, never which rows may go, nor how many.
        eligible = np.array(mask, dtype=bool)
        self.check_victims(n, eligible, self.policy.victims(n, eligible, self.row_keys(), layer,
                                                            missing))

    def check_victims(self, n, eligible, chosen) -> set:
        """Distinct ints, as many as asked or as qualify, all qualifying; the qualifying rows
        (eligible, and empty or holding an unpinned key)."""
        pinned = self.pinned()
        qualify = {r for r in range(self.N_ROWS)
                   if eligible[r] and (r not in self.rows or self.rows[r] not in pinned)}
        assert all(isinstance(r, int) for r in chosen)
        assert len(chosen) == len(set(chosen)) == min(n, len(qualify))
        assert set(chosen) <= qualify
        return qualify

    @invariant()
    def quotas_share_the_rows(self):
        quotas = self.policy.quotas.rows
        assert quotas.sum() == self.N_ROWS and quotas.min() >= self.MIN_QUOTA

    @invariant()
    def frequencies_agree_with_the_model(self):
        assert frequencies(self.policy) == {k: v for k, v in self.freq.items() if v}

    @invariant()
    def pins_agree_with_the_model(self):
        pins, pinned = self.policy.pins, self.pinned()
        assert pins.pinned_keys == pinned
        assert all(pins.is_pinned(k) for k in pinned)
        assert pins.n_pinned_rows(self.row_keys()) == sum(k in pinned for k in self.rows.values())
        assert n_explicit(self.policy) == len(self.explicit)
        assert pins.n_capped == len(self.explicit | self.held())
        assert self.policy.state()["pins"] == [list(k) for k in sorted(self.explicit)]


PolicyMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                           deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_policy_machine = PolicyMachine.TestCase
