"""Chooses the hot-path implementation: the Cython extension, or its pure-Python twin.

``EXPERTD_PURE_PYTHON=1`` forces the twin (the test suite runs under both). This is the only
place that reads it: others ask ``PURE_PYTHON_FORCED`` (the switch) or ``IMPLEMENTATION``
(what was loaded: ``"cython"`` or ``"python"``, the latter also when the extension is missing).
"""

import os

from expertd.shm.layout import slot_layout

PURE_PYTHON_FORCED = os.environ.get("EXPERTD_PURE_PYTHON", "") not in ("", "0")


def check_layout(extension) -> None:
    """The extension's compile-time copy of the slot record is shm/layout.py's, or it would
    read the daemon's slots wrong: an extension built from other sources is refused.

    Raises:
        ImportError: the copies differ (the message says how to rebuild).
    """
    built = getattr(extension, "SLOT_LAYOUT", None)
    if built != slot_layout():
        raise ImportError(f"expertd._native was built for another slot layout ({built}, "
                          f"shm/layout.py has {slot_layout()}): rebuild it with "
                          "pip install -e . (or run with EXPERTD_PURE_PYTHON=1)")


if PURE_PYTHON_FORCED:
    from expertd import _fallback as _chosen
else:
    try:
        from expertd import _native as _chosen
    except ImportError:
        from expertd import _fallback as _chosen
    else:
        check_layout(_chosen)

IMPLEMENTATION = _chosen.IMPLEMENTATION
remap, validate, drain = _chosen.remap, _chosen.validate, _chosen.drain
copy_segments, bump_hits = _chosen.copy_segments, _chosen.bump_hits
begin_write, end_write = _chosen.begin_write, _chosen.end_write
publish_u64, read_u64 = _chosen.publish_u64, _chosen.read_u64
# The epoch records' step and lost fields are ordered against the arena's other writes: by the
# extension's fences, or by the CPU itself (x86) under the pure twin, which has none.
STEP_RECORDS_FENCED = IMPLEMENTATION != "python" or _chosen.STRONGLY_ORDERED

__all__ = ["IMPLEMENTATION", "PURE_PYTHON_FORCED", "remap", "validate", "drain",
           "copy_segments", "bump_hits", "begin_write", "end_write", "publish_u64", "read_u64",
           "STEP_RECORDS_FENCED"]
