"""The hot set on disk: what a restarted daemon reads back first, and the pin file format."""

import json
import logging
from pathlib import Path

from expertd.runfile import read_private, write_atomically

log = logging.getLogger("expertd")


def save_hot_set(path: Path, blob_dir: Path, state: dict) -> None:
    """Write ``state``, the policy's state and hottest keys (``ExpertCache.policy_state``),
    beside ``blob_dir`` (0600, atomically).

    Through an O_EXCL | O_NOFOLLOW temporary in a directory checked to be the user's own: a
    symlink planted next to the state file is never followed.

    Raises:
        OSError: if the file cannot be written (PermissionError for a directory not ours).
    """
    write_atomically(path, json.dumps({"blob_dir": str(blob_dir), **state}).encode())


def load_hot_set(path: Path, policy) -> list:
    """Load frequencies and pins into ``policy``; the saved hot keys, hottest first.

    A missing file is an empty hot set; an unreadable one (or a symlink) is logged and ignored.
    """
    try:
        text = read_private(path, limit=1 << 30)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("ignoring unreadable state file %s: %s", path, exc)
        return []
    try:
        state = parse_json(text)
        policy.load_state(state["policy"])
        return [tuple(k) for k in state.get("hot", []) if isinstance(k, list) and len(k) == 2]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable state file %s: %s", path, exc)
        return []


class HotSet:
    """A daemon's warm restart: the state file its policy is saved to and its cache warmed
    from, and the pin file's keys, pinned for good.

    Args:
        path: the state file.
        pin_file: the pin file, or None.
        n_experts: experts per layer of the model.
        max_pins: most keys the cache may pin.
        limit: most keys to warm the cache with (its rows).
    Raises:
        ValueError: naming the pin file, if it cannot be read, holds more than ``max_pins``
            keys or names an expert the model does not have.
    """

    def __init__(self, path: Path, pin_file: Path | None, n_experts: list, max_pins: int,
                 limit: int):
        self.path = path
        self.n_experts = n_experts
        self.limit = limit
        self.pins = (read_pins(pin_file, n_experts, max_pins, limit) if pin_file is not None
                     else [])

    def valid(self, layer, expert) -> bool:
        return valid_key(self.n_experts, layer, expert)

    def save(self, blob_dir: Path, state: dict) -> None:
        """Save ``state`` (the cache's ``policy_state(limit)``). Raises OSError as
        :func:`save_hot_set`."""
        save_hot_set(self.path, blob_dir, state)

    def load(self, policy) -> list:
        """Read the state back into ``policy`` and pin the pin file's keys in place of the
        state's (one taken out of the file must not live on); the keys to warm the cache
        with: the pinned ones, then the hottest saved ones."""
        keys = load_hot_set(self.path, policy)
        policy.pins.set_explicit(self.pins)
        keys = list(dict.fromkeys(sorted(policy.pins.pinned_keys) + keys))
        return [key for key in keys if self.valid(*key)][:self.limit]


def parse_json(text: str):
    """``json.loads``, where JSON nested deeper than Python's stack ('[' * 5000) is a
    ValueError like any other malformed JSON, not a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def valid_key(n_experts: list, layer, expert) -> bool:
    """Whether ``(layer, expert)`` names an expert of a model of ``n_experts`` a layer."""
    return (type(layer) is int and type(expert) is int and 0 <= layer < len(n_experts)
            and 0 <= expert < n_experts[layer])


def read_pins(path: Path, n_experts: list, max_pins: int, rows: int) -> list:
    """:func:`read_pin_file`, its keys checked against the model (``n_experts`` a layer) and
    a cache of ``rows`` rows, which pins at most ``max_pins``: the start command checks a pin
    file with this before it starts the daemon, and the daemon again.

    Raises:
        ValueError: naming the file, as :func:`read_pin_file`, or the first expert the model
            does not have, or how many pins it holds past ``max_pins``.
    """
    pins = read_pin_file(path)
    if len(set(pins)) > max_pins:
        raise ValueError(f"{path}: {len(set(pins))} experts to pin, but a cache of {rows} rows "
                         f"can pin at most {max_pins}")
    for layer, expert in pins:
        if not valid_key(n_experts, layer, expert):
            raise ValueError(f"{path}: no expert {expert} in layer {layer}")
    return pins


def read_pin_file(path: Path) -> list:
    """A JSON list of [layer, expert] pairs (or {"pins": [...]}).

    Raises:
        ValueError: naming the file, if it holds anything else.
    """
    try:
        data = parse_json(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the pin file ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: the pin file is not JSON ({exc})") from None
    pins = data.get("pins") if isinstance(data, dict) else data
    if not isinstance(pins, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in pins):
        raise ValueError(f"{path}: expected a JSON list of [layer, expert] pairs")
    return [tuple(p) for p in pins]
