"""The hot set on disk: what a restarted daemon reads back first, and the pin file format."""

import json
import logging
from pathlib import Path

from expertd.runfile import read_private, write_atomically

log = logging.getLogger("expertd")


def save_hot_set(path: Path, blob_dir: Path, policy, limit: int) -> None:
    """Write the policy's frequencies, pins and hottest ``limit`` keys (0600, atomically).

    Through an O_EXCL | O_NOFOLLOW temporary in a directory checked to be the user's own: a
    symlink planted next to the state file is never followed.

    Raises:
        OSError: if the file cannot be written (PermissionError for a directory not ours).
    """
    state = {"blob_dir": str(blob_dir), "policy": policy.state(),
             "hot": [list(k) for k in policy.hot_keys(limit)]}
    write_atomically(path, json.dumps(state).encode())


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


def parse_json(text: str):
    """``json.loads``, where JSON nested deeper than Python's stack ('[' * 5000) is a
    ValueError like any other malformed JSON, not a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


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
