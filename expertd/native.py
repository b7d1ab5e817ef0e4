"""Chooses the hot-path implementation: the Cython extension, or its pure-Python twin.

``EXPERTD_PURE_PYTHON=1`` forces the twin (the test suite runs under both). This is the only
place that reads it: others ask ``PURE_PYTHON_FORCED`` (the switch) or ``IMPLEMENTATION``
(what was loaded: ``"cython"`` or ``"python"``, the latter also when the extension is missing).
"""

import os

PURE_PYTHON_FORCED = os.environ.get("EXPERTD_PURE_PYTHON", "") not in ("", "0")

if PURE_PYTHON_FORCED:
    from expertd import _fallback as _chosen
else:
    try:
        from expertd import _native as _chosen
    except ImportError:
        from expertd import _fallback as _chosen

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
