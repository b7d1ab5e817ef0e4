"""Chooses the hot-path implementation: the Cython extension, or its pure-Python twin.

``EXPERTD_PURE_PYTHON=1`` forces the twin (the test suite runs under both). This is the only
place that reads it: others ask ``PURE_PYTHON_FORCED`` (the switch) or ``IMPLEMENTATION``
(what was loaded: ``"cython"`` or ``"python"``, the latter also when the extension is missing).
"""

import os

PURE_PYTHON_FORCED = os.environ.get("EXPERTD_PURE_PYTHON", "") not in ("", "0")

if PURE_PYTHON_FORCED:
    from expertd._fallback import (
        IMPLEMENTATION,
        begin_write,
        bump_hits,
        copy_segments,
        drain,
        end_write,
        remap,
        validate,
    )
else:
    try:
        from expertd._native import (
            IMPLEMENTATION,
            begin_write,
            bump_hits,
            copy_segments,
            drain,
            end_write,
            remap,
            validate,
        )
    except ImportError:
        from expertd._fallback import (
            IMPLEMENTATION,
            begin_write,
            bump_hits,
            copy_segments,
            drain,
            end_write,
            remap,
            validate,
        )

__all__ = ["IMPLEMENTATION", "PURE_PYTHON_FORCED", "remap", "validate", "drain",
           "copy_segments", "bump_hits", "begin_write", "end_write"]
