"""What a replay demands (client/step_check.needed_absent): only the experts it will route to.

A step's statuses say, per layer and pair, which experts the arena lacked. A sequence that met
an absent row computed without that expert's share from that layer on, and its later layers
routed on that: their absent experts are a guess at the replay's, and reading a wrong guess
evicts rows the replay needs from an arena too small for them all. Pure logic over the decoded
statuses.
"""

import numpy as np

from expertd.client.layer import StepRecord
from expertd.client.pull import ABSENT, PULLED
from expertd.client.step_check import _parts, needed_absent

HIT = -1  # decode_status's kind of a pool hit


def statuses(layers: list) -> tuple:
    """``(parts, kinds, experts)`` of a step whose layers' pairs are ``layers``: per layer, a
    list of ``(expert, kind)`` in the ids' row order (a batch's sequences one after another)."""
    records = [StepRecord(layer=f"layer {i}", ids=np.zeros(len(pairs)), status=0)
               for i, pairs in enumerate(layers)]
    experts = np.array([e for pairs in layers for e, _ in pairs])
    kinds = np.array([k for pairs in layers for _, k in pairs])
    return _parts(records), kinds, experts


def demanded(layers: list, sequences: int) -> dict:
    parts, kinds, experts = statuses(layers)
    return {layer: e.tolist() for layer, e in needed_absent(parts, kinds, experts, sequences)}


def test_a_sequence_demands_up_to_its_first_layer_that_lacked_a_row():
    # Two sequences, two pairs each a layer. Sequence 0 lacks expert 5 in layer 0, then routes
    # without it: its absent 7 (layer 1) and 9 (layer 2) are not demanded. Sequence 1 is exact
    # until layer 1, where it lacks 3 and 4 (and pulls 6): demanded; its 8 in layer 2 is not.
    layers = [
        [(5, ABSENT), (1, HIT), (2, HIT), (6, PULLED)],
        [(7, ABSENT), (1, HIT), (3, ABSENT), (4, ABSENT)],
        [(9, ABSENT), (2, HIT), (8, ABSENT), (1, HIT)],
    ]
    assert demanded(layers, sequences=2) == {"layer 0": [5], "layer 1": [3, 4]}


def test_one_sequence_demands_its_first_layer_that_lacked_a_row_alone():
    layers = [[(1, HIT), (2, PULLED)], [(4, ABSENT), (3, ABSENT), (4, ABSENT)],
              [(6, ABSENT)]]
    assert demanded(layers, sequences=1) == {"layer 1": [3, 4]}


def test_parts_that_do_not_split_into_the_sequences_count_as_one():
    # Three pairs a layer cannot be two sequences' rows: the whole step is one sequence.
    layers = [[(1, HIT), (2, ABSENT), (3, HIT)], [(5, ABSENT), (1, HIT), (2, HIT)]]
    assert demanded(layers, sequences=2) == {"layer 0": [2]}


def test_a_step_with_nothing_absent_demands_nothing():
    layers = [[(1, HIT), (2, PULLED)], [(3, PULLED), (4, HIT)]]
    assert demanded(layers, sequences=2) == {}
