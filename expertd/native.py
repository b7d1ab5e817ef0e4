"""Chooses the hot-path implementation: the Cython extension, or its pure-Python twin.

``EXPERTD_PURE_PYTHON=1`` forces the twin (the test suite runs under both).
"""

import os

if os.environ.get("EXPERTD_PURE_PYTHON", "") not in ("", "0"):
    from expertd._fallback import (IMPLEMENTATION, begin_write, bump_hits, copy_segments, drain,
                                   end_write, remap, validate)
else:
    try:
        from expertd._native import (IMPLEMENTATION, begin_write, bump_hits, copy_segments, drain,
                                     end_write, remap, validate)
    except ImportError:
        from expertd._fallback import (IMPLEMENTATION, begin_write, bump_hits, copy_segments,
                                       drain, end_write, remap, validate)

__all__ = ["IMPLEMENTATION", "remap", "validate", "drain", "copy_segments", "bump_hits",
           "begin_write", "end_write"]
