"""Keys of the arena's experts: (layer, expert) pairs, stored flat as ``layer * n_experts +
expert``, and the checks that every part of the policy applies to its arguments."""

import operator

import numpy as np


def positive_int(name: str, value) -> int:
    """``value`` as an int of at least 1, else a ValueError naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def non_negative_int(name: str, value) -> int:
    """``value`` as a non-negative int, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


class KeySpace:
    """The keys of ``n_layers`` layers of ``n_experts`` experts (the largest layer's count).

    Raises:
        ValueError: on a size that is not a positive integer.
    """

    def __init__(self, n_layers: int, n_experts: int):
        self.n_layers = positive_int("n_layers", n_layers)
        self.n_experts = positive_int("n_experts", n_experts)
        self.size = self.n_layers * self.n_experts

    def flat(self, key) -> int:
        """The flat index of ``key``, a pair of integers (layer, expert) in range."""
        try:
            layer, expert = key
            layer, expert = operator.index(layer), operator.index(expert)
        except (TypeError, ValueError):
            raise ValueError(f"key must be a pair of integers (layer, expert), got {key!r}") from None
        if not (0 <= layer < self.n_layers and 0 <= expert < self.n_experts):
            raise ValueError(f"key ({layer}, {expert}) out of range "
                             f"(layers 0..{self.n_layers - 1}, experts 0..{self.n_experts - 1})")
        return layer * self.n_experts + expert

    def key(self, flat: int) -> tuple[int, int]:
        return divmod(int(flat), self.n_experts)

    def keys(self, flats) -> list[tuple[int, int]]:
        return [self.key(flat) for flat in flats]

    def layer(self, layer) -> int:
        """``layer`` as an int in range, else a ValueError."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise ValueError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} out of range (0..{self.n_layers - 1})")
        return int(layer)

    def saved_key(self, layer, expert) -> int | None:
        """The flat index of a key read from a saved state; None if out of range (a state of
        another model), a ValueError if it is not a pair of integers."""
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (layer, expert)):
            raise ValueError(f"bad key [{layer!r}, {expert!r}]: layer and expert must be integers")
        if 0 <= layer < self.n_layers and 0 <= expert < self.n_experts:
            return layer * self.n_experts + expert
        return None
