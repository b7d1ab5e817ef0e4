"""The slot record has one definition, shm/layout.py's ``SLOT_DTYPE`` and ``SlotState``: the
native extension's compile-time copy (``DEF`` constants in cython_ext/_native.pyx, exported as
``SLOT_LAYOUT``) must agree with it, or clients and daemon would read each other's bytes wrong.
The pure-Python twin reads records through ``SLOT_DTYPE`` itself."""

import pytest

from expertd.native import check_layout
from expertd.shm.layout import SLOT_DTYPE, SlotState, cgroup_room, slot_layout

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
    assert layout == slot_layout()
    check_layout(_native)  # what expertd.native checks when it loads the extension


def test_an_extension_built_for_another_layout_is_refused_at_import():
    """expertd.native refuses an extension whose slot record differs from shm/layout.py's (a
    build from other sources), and one that predates the check, naming the remedy."""
    from types import SimpleNamespace

    moved = {**slot_layout(), "hits": slot_layout()["hits"] + 8}
    for stale in (SimpleNamespace(SLOT_LAYOUT=moved), SimpleNamespace()):
        with pytest.raises(ImportError, match="pip install -e"):
            check_layout(stale)


def test_a_cgroups_room_leaves_out_the_file_pages_it_could_drop(tmp_path):
    """In a container with a memory limit, the page cache of the blob files counts in the
    cgroup's use but would be dropped before anything swaps: the room is the limit less what
    is used, less ``inactive_file``; without a limit, or files, there is none to bound by."""
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("900000\n")
    (tmp_path / "memory.stat").write_text("anon 300000\nfile 600000\ninactive_file 500000\n")
    assert cgroup_room(str(tmp_path)) == 1000000 - (900000 - 500000)
    (tmp_path / "memory.current").write_text("2000000\n")  # over the limit
    assert cgroup_room(str(tmp_path)) == 0
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_room(str(tmp_path)) is None
    assert cgroup_room(str(tmp_path / "absent")) is None
