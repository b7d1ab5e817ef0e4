"""The slot record has one definition, shm/layout.py's ``SLOT_DTYPE`` and ``SlotState``: the
native extension's compile-time copy (``DEF`` constants in cython_ext/_native.pyx, exported as
``SLOT_LAYOUT``) must agree with it, or clients and daemon would read each other's bytes wrong.
The pure-Python twin reads records through ``SLOT_DTYPE`` itself."""

import pytest

from expertd.shm.layout import SLOT_DTYPE, SlotState

try:
    from expertd import _native
except ImportError:  # no compiler at install: the twin runs, and has no copy to check
    _native = None


@pytest.mark.skipif(_native is None, reason="expertd._native is not built")
def test_the_native_slot_layout_is_the_dtype():
    layout = getattr(_native, "SLOT_LAYOUT", None)
    assert layout is not None, "expertd._native predates SLOT_LAYOUT: pip install -e . again"
    fields = {name: SLOT_DTYPE.fields[name][1] for name in ("version", "layer", "expert",
                                                            "state", "hits")}
    assert layout == {"size": SLOT_DTYPE.itemsize, **fields,
                      "filling": SlotState.FILLING, "ready": SlotState.READY}
