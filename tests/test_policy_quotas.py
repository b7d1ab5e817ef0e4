"""Per-layer quotas and their ghost lists; and the whole LFU policy (decay, quotas, ghosts, pins,
holds) against a plain model under random event sequences."""

import json

import numpy as np
from harness import A, B, all_rows, auto_pin, frequencies, n_explicit, reference_order
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from expertd.serving.policy import FREQUENCY_FLOOR, LfuPolicy

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
