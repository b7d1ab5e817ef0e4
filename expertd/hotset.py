"""The hot set on disk: what a restarted daemon reads back first, and the pin file format."""

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("expertd")


def save_hot_set(path: Path, blob_dir: Path, policy, limit: int) -> None:
    """Write the policy's frequencies, pins and hottest ``limit`` keys (0600, atomically)."""
    state = {"blob_dir": str(blob_dir), "policy": policy.state(),
             "hot": [list(k) for k in policy.hot_keys(limit)]}
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def load_hot_set(path: Path, policy) -> list:
    """Load frequencies and pins into ``policy``; the saved hot keys, hottest first.

    A missing file is an empty hot set; an unreadable one is logged and ignored.
    """
    if not path.exists():
        return []
    try:
        state = json.loads(path.read_text())
        policy.load_state(state["policy"])
        return [tuple(k) for k in state.get("hot", []) if isinstance(k, list) and len(k) == 2]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable state file %s: %s", path, exc)
        return []


def read_pin_file(path: Path) -> list:
    """A JSON list of [layer, expert] pairs (or {"pins": [...]}).

    Raises:
        ValueError: naming the file, if it holds anything else.
    """
    data = json.loads(Path(path).read_text())
    pins = data.get("pins") if isinstance(data, dict) else data
    if not isinstance(pins, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p) for p in pins):
        raise ValueError(f"{path}: expected a JSON list of [layer, expert] pairs")
    return [tuple(p) for p in pins]
