"""Chooses the hot-path implementation: the Cython extension, or its pure-Python twin.

``EXPERTD_PURE_PYTHON=1`` forces the twin (the test suite runs under both).
"""

import os

if os.environ.get("EXPERTD_PURE_PYTHON", "") not in ("", "0"):
    from expertd._fallback import *  # noqa: F401,F403
    from expertd._fallback import IMPLEMENTATION
else:
    try:
        from expertd._native import *  # noqa: F401,F403
        from expertd._native import IMPLEMENTATION
    except ImportError:
        from expertd._fallback import *  # noqa: F401,F403
        from expertd._fallback import IMPLEMENTATION

__all__ = ["IMPLEMENTATION", "remap", "validate", "drain", "copy_segments", "bump_hits",
           "begin_write", "end_write"]
