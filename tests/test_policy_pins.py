"""The pin book on its own (explicit pins, automatic pins, client holds, the cap) and the
warm-restart state (what is saved, what loads, what is refused), through the events and
questions the cache uses."""

import json
import logging

import numpy as np
import pytest
from harness import A, B, all_rows, auto_pin, filled, frequencies, frequency, n_explicit

from expertd.serving.hotset import load_hot_set
from expertd.serving.policy import KeySpace, LfuPolicy, PinBook


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


def test_holding_a_key_only_auto_pinned_counts_against_the_cap():
    """An auto-pin is not counted by the cap; held, the same key is: a hold that would take
    the counted pins past the cap is refused, whatever else pins the key."""
    keys = KeySpace(2, 8)
    policy = LfuPolicy(4, 2, 8, pins=PinBook(keys, 4, cap=1))
    pins, rows = policy.pins, np.arange(4, dtype=np.int64)
    for expert, count in enumerate([4, 3, 2, 1]):
        policy.on_touched((0, expert), count)
    assert auto_pin(policy, 1, rows) == [(0, 0)]
    assert pins.hold(A, [(0, 1)]) == [(0, 1)]  # the cap's one place
    assert pins.hold(B, [(0, 0)]) is None  # auto-pinned, yet a second counted pin
    assert pins.n_capped == 1


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
