"""The cache policy on its own: LFU with decay, pins, eligibility and the warm-restart state."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from expertd.policy import FREQUENCY_FLOOR, LfuPolicy

def all_rows(policy: LfuPolicy) -> np.ndarray:
    return np.ones(policy.n_rows, dtype=bool)


def filled(n_rows: int, n_layers: int = 2, n_experts: int = 8, **options) -> LfuPolicy:
    """A policy whose rows hold keys (0, 0), (0, 1), ... in row order."""
    policy = LfuPolicy(n_rows, n_layers, n_experts, **options)
    for row in range(n_rows):
        policy.on_filled(row, divmod(row, n_experts))
    return policy


def test_empty_rows_come_first_in_row_order():
    policy = filled(4)
    policy.on_touched((0, 2), 5)
    policy.on_removed(3)
    policy.on_removed(1)
    assert policy.victims(3, all_rows(policy)) == [1, 3, 0]
    assert policy.victims(2, all_rows(policy)) == [1, 3]


def test_lowest_frequency_first():
    policy = filled(4)
    for key, count in [((0, 0), 7), ((0, 1), 2), ((0, 2), 9), ((0, 3), 4)]:
        policy.on_touched(key, count)
    assert policy.victims(4, all_rows(policy)) == [1, 3, 0, 2]
    assert policy.victims(1, all_rows(policy)) == [1]


def test_ties_go_to_least_recently_used():
    policy = filled(3)  # every key filled once: equal frequencies
    policy.on_touched((0, 0))
    policy.on_touched((0, 2))
    policy.on_touched((0, 1))
    assert policy.victims(3, all_rows(policy)) == [0, 2, 1]
    policy.touch_many(0, np.array([1, 0, 2]))  # recency within one call: expert order
    assert policy.victims(3, all_rows(policy)) == [0, 1, 2]


def test_decay_lets_a_formerly_hot_key_go_before_a_recently_warm_one():
    policy = filled(2, decay_interval=100, decay_factor=0.5)
    policy.on_touched((0, 0), 98)  # 99 + 1 (the fill of row 1) = 100 touches: one decay
    assert policy.frequency((0, 0)) == pytest.approx(99 / 2)
    assert policy.victims(1, all_rows(policy)) == [1]
    for _ in range(4):  # 400 touches of the warm key, four decays
        policy.on_touched((0, 1), 100)
    assert policy.frequency((0, 0)) == pytest.approx(99 / 32)
    assert policy.frequency((0, 1)) > policy.frequency((0, 0))
    assert policy.victims(1, all_rows(policy)) == [0]


def test_default_decay_interval_is_eight_times_rows():
    policy = LfuPolicy(4, 1, 4)
    assert policy.decay_interval == 32
    policy.on_touched((0, 0), 31)
    assert policy.frequency((0, 0)) == 31
    policy.on_touched((0, 1))
    assert policy.frequency((0, 0)) == 15.5
    policy.decay()
    assert policy.frequency((0, 0)) == 7.75


def test_decay_flushes_tiny_frequencies_to_zero():
    policy = LfuPolicy(1, 1, 2, decay_factor=0.5)
    policy.on_touched((0, 0))
    while policy.frequency((0, 0)) >= 2 * FREQUENCY_FLOOR:
        policy.decay()
    policy.decay()
    assert policy.frequency((0, 0)) == 0.0
    assert policy.hot_keys(10) == []


def test_explicit_pins_are_never_victims():
    policy = filled(4)
    policy.pin((0, 0))
    policy.pin((0, 2))
    policy.pin((1, 7))  # not resident: allowed
    assert policy.is_pinned((0, 0)) and not policy.is_pinned((0, 1))
    assert policy.pinned_keys == {(0, 0), (0, 2), (1, 7)}
    assert policy.n_pinned_rows == 2
    assert policy.victims(4, all_rows(policy)) == [1, 3]
    policy.unpin((0, 0))
    assert sorted(policy.victims(4, all_rows(policy))) == [0, 1, 3]


def test_auto_pins_take_the_hottest_resident_keys_and_replace_each_other():
    policy = filled(5)
    for expert, count in enumerate([5, 1, 9, 3, 7]):
        policy.on_touched((0, expert), count)
    policy.on_touched((1, 0), 100)  # hottest, but not resident
    policy.pin((0, 2))  # explicit pins are not auto-pin candidates
    assert policy.auto_pin(2) == [(0, 4), (0, 0)]
    assert policy.pinned_keys == {(0, 2), (0, 4), (0, 0)}
    assert policy.n_pinned_rows == 3
    assert policy.victims(5, all_rows(policy)) == [1, 3]

    policy.on_touched((0, 1), 50)
    assert policy.auto_pin(1) == [(0, 1)]
    assert policy.pinned_keys == {(0, 2), (0, 1)}
    assert policy.victims(5, all_rows(policy)) == [3, 0, 4]

    policy.unpin((0, 2))
    assert policy.auto_pin(0) == []
    assert policy.pinned_keys == set()
    assert len(policy.victims(5, all_rows(policy))) == 5


def test_auto_and_explicit_pins_are_separate():
    policy = filled(3)
    policy.on_touched((0, 1), 10)
    assert policy.auto_pin(1) == [(0, 1)]
    policy.pin((0, 1))
    policy.unpin((0, 1))  # drops the explicit pin only
    assert policy.is_pinned((0, 1))
    policy.pin((0, 0))
    policy.auto_pin(0)  # drops the automatic pins only
    assert policy.pinned_keys == {(0, 0)}


def test_ineligible_rows_are_never_victims():
    policy = filled(6)
    policy.on_removed(5)
    eligible = np.array([True, False, True, False, True, False])
    assert policy.victims(6, eligible) == [0, 2, 4]
    assert policy.victims(6, np.zeros(6, dtype=bool)) == []


def test_fewer_victims_when_not_enough_qualify():
    policy = filled(4)
    policy.pin((0, 3))
    eligible = np.array([True, True, False, True])
    assert policy.victims(10, eligible) == [0, 1]
    assert policy.victims(0, eligible) == []


def test_history_survives_eviction():
    policy = filled(2, decay_interval=1000)
    policy.on_touched((0, 0), 20)
    policy.on_removed(0)
    assert policy.row_of((0, 0)) is None and policy.key_of(0) is None
    policy.on_touched((0, 1), 3)
    policy.on_filled(0, (0, 0))  # comes back with its 21 uses, plus one; a per-row count would be 1
    assert policy.frequency((0, 0)) == 22
    assert policy.victims(1, all_rows(policy)) == [1]


def test_touch_many_adds_up_like_on_touched():
    one, many = LfuPolicy(4, 2, 8), LfuPolicy(4, 2, 8)
    experts = np.array([3, 1, 3, 7, 3], dtype=np.uint8)
    counts = np.array([2, 1, 1, 4, 0], dtype=np.int32)
    for expert, count in zip(experts, counts):
        one.on_touched((1, int(expert)), int(count))
    many.touch_many(1, experts, counts)
    many.touch_many(1, np.array([], dtype=np.int64))
    for expert in range(8):
        assert many.frequency((1, expert)) == one.frequency((1, expert))
        assert many.frequency((0, expert)) == 0
    many.touch_many(0, np.array([2, 2]))
    assert many.frequency((0, 2)) == 2


def test_row_and_key_lookups_follow_fills_and_removals():
    policy = LfuPolicy(3, 2, 4)
    assert policy.key_of(1) is None and policy.row_of((1, 3)) is None
    policy.on_filled(1, (1, 3))
    assert policy.key_of(1) == (1, 3) and policy.row_of((1, 3)) == 1
    policy.on_filled(1, (0, 2))  # overwrites the row's old key
    assert policy.row_of((1, 3)) is None and policy.row_of((0, 2)) == 1
    with pytest.raises(ValueError, match="already in row 1"):
        policy.on_filled(0, (0, 2))
    policy.on_removed(1)
    policy.on_removed(1)  # idempotent
    assert policy.key_of(1) is None and policy.row_of((0, 2)) is None


def test_hot_keys_by_frequency_then_recency():
    policy = LfuPolicy(2, 2, 4)
    policy.on_touched((1, 2), 3)
    policy.on_touched((0, 1), 5)
    policy.on_touched((0, 3), 3)
    assert policy.hot_keys(10) == [(0, 1), (0, 3), (1, 2)]
    assert policy.hot_keys(2) == [(0, 1), (0, 3)]
    assert policy.hot_keys(0) == []


def test_state_round_trip_through_json():
    policy = filled(4, decay_interval=1000)
    for expert, count in enumerate([5, 1, 9, 3]):
        policy.on_touched((0, expert), count)
    policy.on_touched((1, 6), 2)
    policy.decay()
    policy.pin((1, 7))
    policy.auto_pin(1)  # automatic pins are not saved
    snapshot = json.loads(json.dumps(policy.state()))
    assert len(snapshot["frequencies"]) == 5

    restored = LfuPolicy.from_state(snapshot, 4, 2, 8, decay_interval=1000)
    assert restored.pinned_keys == {(1, 7)}
    assert restored.hot_keys(10) == policy.hot_keys(10)
    for key in [(0, 0), (0, 1), (0, 2), (0, 3), (1, 6), (1, 0)]:
        assert restored.frequency(key) == policy.frequency(key)
    assert restored.state() == snapshot


def test_load_state_ignores_out_of_range_entries():
    policy = LfuPolicy(2, 2, 4)
    policy.on_touched((0, 0), 9)
    state = {"format": "expertd-policy", "version": 1,
             "frequencies": [[0, 1, 3.5], [2, 0, 8], [1, 4, 2], [-1, 0, 1], [1, 3, 1]],
             "pins": [[0, 2], [5, 5]]}
    policy.load_state(state)
    assert policy.hot_keys(10) == [(0, 1), (1, 3)]  # loading replaces, (0, 0) is gone
    assert policy.pinned_keys == {(0, 2)}


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
    policy.pin((1, 1))
    with pytest.raises(ValueError, match=message):
        policy.load_state(state)
    assert policy.hot_keys(10) == [(0, 0)] and policy.pinned_keys == {(1, 1)}


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
])
def test_constructor_rejects_bad_arguments(args, options, message):
    with pytest.raises(ValueError, match=message):
        LfuPolicy(*args, **options)


@pytest.mark.parametrize("call, message", [
    (lambda p: p.on_touched((2, 0)), "out of range"),
    (lambda p: p.on_touched((-1, 0)), "out of range"),  # no negative-index wrap-around
    (lambda p: p.on_touched((0, 4)), "out of range"),
    (lambda p: p.on_touched((0, 1.0)), "pair of integers"),
    (lambda p: p.on_touched((0, 1, 2)), "pair of integers"),
    (lambda p: p.on_touched((0, 1), -1), "count must be a non-negative integer"),
    (lambda p: p.on_filled(3, (0, 0)), "row 3 out of range"),
    (lambda p: p.on_removed(-1), "row -1 out of range"),
    (lambda p: p.key_of(3), "row 3 out of range"),
    (lambda p: p.pin((0, 9)), "out of range"),
    (lambda p: p.touch_many(2, np.array([0])), "layer 2 out of range"),
    (lambda p: p.touch_many(0, np.array([0, 4])), "experts out of range"),
    (lambda p: p.touch_many(0, np.array([0, -1])), "experts out of range"),
    (lambda p: p.touch_many(0, np.array([0.0])), "integer array"),
    (lambda p: p.touch_many(0, np.array([0, 1]), np.array([1])), "same length"),
    (lambda p: p.touch_many(0, np.array([0, 1]), np.array([1, -1])), "non-negative"),
    (lambda p: p.victims(-1, np.ones(3, dtype=bool)), "n must be a non-negative integer"),
    (lambda p: p.victims(1, np.ones(4, dtype=bool)), r"shape \(3,\)"),
    (lambda p: p.victims(1, np.ones(3, dtype=np.int8)), "bool array"),
    (lambda p: p.hot_keys(-1), "limit must be a non-negative integer"),
    (lambda p: p.auto_pin(-2), "n must be a non-negative integer"),
])
def test_methods_reject_bad_input(call, message):
    policy = LfuPolicy(3, 2, 4)
    with pytest.raises(ValueError, match=message):
        call(policy)


def reference_order(policy: LfuPolicy, eligible: np.ndarray) -> list[int]:
    """Every qualifying row by a full sort: empty rows, then (frequency, recency)."""
    empty, resident = [], []
    for row in range(policy.n_rows):
        key = policy.key_of(row)
        if not eligible[row]:
            continue
        if key is None:
            empty.append(row)
        elif not policy.is_pinned(key):
            # Recency is internal; the clock value of the key's last fill or touch.
            flat = key[0] * policy.n_experts + key[1]
            resident.append((policy.frequency(key), int(policy._last_used[flat]), row))
    return empty + [row for _, _, row in sorted(resident)]


def test_large_arena_matches_a_full_sort():
    rng = np.random.default_rng(0)
    n_rows, n_layers, n_experts = 100_000, 100, 1500
    policy = LfuPolicy(n_rows, n_layers, n_experts, decay_interval=10**9)
    keys = rng.choice(n_layers * n_experts, size=n_rows, replace=False)
    for row, flat in enumerate(keys):
        policy.on_filled(row, divmod(int(flat), n_experts))
    for layer in range(n_layers):
        # Few distinct counts, so the ties at the cut are large and recency decides them.
        experts = rng.integers(0, n_experts, size=3000)
        policy.touch_many(layer, experts, rng.integers(0, 3, size=3000))
    for row in rng.choice(n_rows, size=1000, replace=False):
        policy.on_removed(int(row))
    for flat in rng.choice(keys, size=500, replace=False):
        policy.pin(divmod(int(flat), n_experts))
    eligible = rng.random(n_rows) < 0.9
    expected = reference_order(policy, eligible)
    for n in [1, 500, 5000, 40_000, 100_000]:
        assert policy.victims(n, eligible) == expected[:n]


class PolicyMachine(RuleBasedStateMachine):
    """Random event sequences against a plain model of rows, frequencies and pins."""

    N_ROWS, N_LAYERS, N_EXPERTS, INTERVAL = 6, 2, 5, 7

    def __init__(self):
        super().__init__()
        self.policy = LfuPolicy(self.N_ROWS, self.N_LAYERS, self.N_EXPERTS,
                                decay_interval=self.INTERVAL, decay_factor=0.5)
        self.rows = {}  # row -> key
        self.freq = {}  # key -> frequency, mirrored exactly (powers of two)
        self.since_decay = 0
        self.explicit = set()
        self.auto = set()

    keys = st.tuples(st.integers(0, N_LAYERS - 1), st.integers(0, N_EXPERTS - 1))
    row_numbers = st.integers(0, N_ROWS - 1)

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
        holder = next((r for r, k in self.rows.items() if k == key), None)
        if holder is not None and holder != row:
            with pytest.raises(ValueError):
                self.policy.on_filled(row, key)
            return
        self.policy.on_filled(row, key)
        self.rows[row] = key
        self._touched(key, 1)

    @rule(row=row_numbers)
    def remove(self, row):
        self.policy.on_removed(row)
        self.rows.pop(row, None)

    @rule(key=keys, count=st.integers(0, 4))
    def touch(self, key, count):
        self.policy.on_touched(key, count)
        if count:
            self._touched(key, count)

    @rule(layer=st.integers(0, N_LAYERS - 1),
          pairs=st.lists(st.tuples(st.integers(0, N_EXPERTS - 1), st.integers(0, 3)), max_size=6))
    def touch_many(self, layer, pairs):
        experts = np.array([e for e, _ in pairs], dtype=np.int64)
        counts = np.array([c for _, c in pairs], dtype=np.int64)
        self.policy.touch_many(layer, experts, counts)
        total = {}
        for expert, count in pairs:
            total[expert] = total.get(expert, 0) + count
        for expert, count in total.items():
            self.freq[(layer, expert)] = self.freq.get((layer, expert), 0.0) + count
        self.since_decay += sum(total.values())
        if self.since_decay >= self.INTERVAL:
            steps, self.since_decay = divmod(self.since_decay, self.INTERVAL)
            self.freq = {k: v * 0.5 ** steps for k, v in self.freq.items()}
            self.freq = {k: (v if v >= FREQUENCY_FLOOR else 0.0) for k, v in self.freq.items()}

    @rule()
    def decay(self):
        self.policy.decay()
        self._decay()

    @rule(key=keys, on=st.booleans())
    def pin(self, key, on):
        if on:
            self.policy.pin(key)
            self.explicit.add(key)
        else:
            self.policy.unpin(key)
            self.explicit.discard(key)

    @rule(n=st.integers(0, 3))
    def auto_pin(self, n):
        chosen = self.policy.auto_pin(n)
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
        chosen = self.policy.victims(n, eligible)
        pinned = self.explicit | self.auto
        qualify = {r for r in range(self.N_ROWS)
                   if eligible[r] and (r not in self.rows or self.rows[r] not in pinned)}
        assert all(isinstance(r, int) for r in chosen)
        assert len(chosen) == len(set(chosen)) == min(n, len(qualify))
        assert set(chosen) <= qualify
        # Empty rows first, then non-decreasing frequency; nothing left behind is colder.
        empties = [r for r in chosen if r not in self.rows]
        assert chosen[:len(empties)] == empties
        freqs = [self.freq[self.rows[r]] for r in chosen[len(empties):]]
        assert freqs == sorted(freqs)
        for r in qualify - set(chosen):
            if r not in self.rows:
                assert not freqs and all(c < r for c in chosen)
            elif freqs:
                assert self.freq[self.rows[r]] >= freqs[-1]

    @invariant()
    def lookups_agree_with_the_model(self):
        for row in range(self.N_ROWS):
            key = self.policy.key_of(row)
            assert key == self.rows.get(row)
            if key is not None:
                assert self.policy.row_of(key) == row
        resident = set(self.rows.values())
        for layer in range(self.N_LAYERS):
            for expert in range(self.N_EXPERTS):
                key = (layer, expert)
                row = self.policy.row_of(key)
                assert (row is not None) == (key in resident)
                assert self.policy.frequency(key) == self.freq.get(key, 0.0)

    @invariant()
    def pins_agree_with_the_model(self):
        assert self.policy.pinned_keys == self.explicit | self.auto
        assert self.policy.n_pinned_rows == sum(k in self.explicit | self.auto
                                                for k in self.rows.values())


PolicyMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40,
                                           deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_policy_machine = PolicyMachine.TestCase
