"""Shared-memory arena layout: header, slot index, slot table and rows.

```
[ header 4 KiB ][ slot_of: int32[layers * experts] ][ slots: SLOT_DTYPE[rows] ][ pad ][ rows ]
```
``slot_of[layer * experts + expert]`` is the row that holds an expert, or -1. Each slot record
carries a seqlock ``version`` (odd while the daemon rewrites the row), the (layer, expert) key it
holds, its state and a hit counter that clients bump for the daemon's LFU. Only the daemon writes
anything but ``hits``. Rows start on a 16 KiB boundary and are ``stride`` bytes long, so O_DIRECT
and F_NOCACHE reads land in them directly.

The first ``cache_rows`` rows belong to the LFU cache; the next ``2 * side_rows`` are the two
generations of double-buffered prefetch rows.
"""

import enum
import mmap
import os
import sys
from dataclasses import dataclass

import numpy as np
import posix_ipc

ARENA_MAGIC = 0x3144505845545845  # "EXTEXPD1" little-endian
LAYOUT_VERSION = 1
HEADER_SIZE = 4096
ROW_ALIGN = 16384

HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u8"),
        ("layout_version", "<u4"),
        ("header_size", "<u4"),
        ("pid", "<u8"),
        ("epoch", "<u8"),
        ("n_layers", "<u4"),
        ("n_experts", "<u4"),
        ("cache_rows", "<u4"),
        ("side_rows", "<u4"),
        ("stride", "<u8"),
        ("slot_of_offset", "<u8"),
        ("slots_offset", "<u8"),
        ("rows_offset", "<u8"),
        ("total_size", "<u8"),
        ("serving", "<u4"),
        ("reserved", "<u4"),
    ]
)

SLOT_DTYPE = np.dtype(
    [
        ("version", "<u8"),
        ("layer", "<i4"),
        ("expert", "<i4"),
        ("state", "<u4"),
        ("pad", "<u4"),
        ("hits", "<u8"),
    ]
)
SLOT_VERSION_OFFSET = 0
SLOT_LAYER_OFFSET = 8
SLOT_EXPERT_OFFSET = 12
SLOT_STATE_OFFSET = 16
SLOT_HITS_OFFSET = 24
assert SLOT_DTYPE.itemsize == 32


class SlotState(enum.IntEnum):
    EMPTY = 0
    FILLING = 1
    READY = 2
    FAILED = 3


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Geometry:
    """Sizes of an arena; everything else (offsets, total size) derives from them."""

    n_layers: int
    n_experts: int
    cache_rows: int
    side_rows: int
    stride: int

    def __post_init__(self):
        if self.n_layers < 1 or self.n_experts < 1:
            raise ValueError("an arena needs at least one layer and one expert")
        if self.cache_rows < 1:
            raise ValueError("cache_rows must be at least 1")
        if self.side_rows < 0:
            raise ValueError("side_rows must not be negative")
        if self.stride <= 0 or self.stride % ROW_ALIGN:
            raise ValueError(f"stride must be a positive multiple of {ROW_ALIGN}")

    @property
    def total_rows(self) -> int:
        return self.cache_rows + 2 * self.side_rows

    @property
    def slot_of_offset(self) -> int:
        return HEADER_SIZE

    @property
    def slots_offset(self) -> int:
        return _round_up(self.slot_of_offset + 4 * self.n_layers * self.n_experts, 64)

    @property
    def rows_offset(self) -> int:
        return _round_up(self.slots_offset + SLOT_DTYPE.itemsize * self.total_rows, ROW_ALIGN)

    @property
    def total_size(self) -> int:
        return self.rows_offset + self.stride * self.total_rows

    @classmethod
    def for_budget(cls, n_layers: int, n_experts: int, stride: int, budget_bytes: int,
                   side_rows: int = 0) -> "Geometry":
        """The largest arena whose total size stays within ``budget_bytes``."""
        probe = cls(n_layers, n_experts, 1, side_rows, stride)
        fixed = probe.rows_offset + stride * 2 * side_rows + SLOT_DTYPE.itemsize * 64
        rows = (budget_bytes - fixed) // (stride + SLOT_DTYPE.itemsize)
        if rows < 1:
            raise ValueError(
                f"a budget of {budget_bytes} bytes holds no expert row of {stride} bytes"
            )
        rows = min(rows, n_layers * n_experts)
        return cls(n_layers, n_experts, int(rows), side_rows, stride)


class Arena:
    """A mapped arena: numpy views on the header, slot index, slot table and rows.

    Use :meth:`create` in the daemon and :meth:`attach` in clients.
    """

    def __init__(self, name: str, shm: "posix_ipc.SharedMemory", geometry: Geometry, owner: bool):
        self.name = name
        self.geometry = geometry
        self.owner = owner
        self._mmap = mmap.mmap(shm.fd, geometry.total_size)
        shm.close_fd()
        self.buffer = memoryview(self._mmap)
        g = geometry
        self.raw = np.frombuffer(self._mmap, dtype=np.uint8)
        self.header = self.raw[:HEADER_DTYPE.itemsize].view(HEADER_DTYPE)[0:1]
        n_index = g.n_layers * g.n_experts
        self.slot_of = self.raw[g.slot_of_offset:g.slot_of_offset + 4 * n_index].view("<i4")
        self.slots = self.raw[g.slots_offset:g.slots_offset + SLOT_DTYPE.itemsize * g.total_rows
                              ].view(SLOT_DTYPE)
        self.rows_offset = g.rows_offset

    @classmethod
    def create(cls, name: str, geometry: Geometry, pid: int, epoch: int) -> "Arena":
        """Create (exclusively, mode 0600) and initialise a new arena."""
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=geometry.total_size)
        arena = cls(name, shm, geometry, owner=True)
        arena.slot_of[:] = -1
        arena.slots[:] = 0
        h = arena.header
        g = geometry
        for key, value in (
            ("layout_version", LAYOUT_VERSION), ("header_size", HEADER_SIZE), ("pid", pid),
            ("epoch", epoch), ("n_layers", g.n_layers), ("n_experts", g.n_experts),
            ("cache_rows", g.cache_rows), ("side_rows", g.side_rows), ("stride", g.stride),
            ("slot_of_offset", g.slot_of_offset), ("slots_offset", g.slots_offset),
            ("rows_offset", g.rows_offset), ("total_size", g.total_size), ("serving", 1),
        ):
            h[key] = value
        h["magic"] = ARENA_MAGIC  # last: a reader that sees the magic sees a whole header
        return arena

    @classmethod
    def attach(cls, name: str) -> "Arena":
        """Map an existing arena read-write (clients bump hit counters) and check its header."""
        shm = posix_ipc.SharedMemory(name)
        size = os.fstat(shm.fd).st_size
        if size < HEADER_SIZE:
            shm.close_fd()
            raise ValueError(f"shared memory {name} is too small to be an expertd arena")
        with mmap.mmap(shm.fd, HEADER_SIZE) as m:
            header = np.frombuffer(m, dtype=HEADER_DTYPE, count=1).copy()[0]
        if int(header["magic"]) != ARENA_MAGIC:
            shm.close_fd()
            raise ValueError(f"shared memory {name} is not an expertd arena")
        if int(header["layout_version"]) != LAYOUT_VERSION:
            shm.close_fd()
            raise ValueError(
                f"arena {name} has layout version {int(header['layout_version'])}, "
                f"this expertd speaks {LAYOUT_VERSION}"
            )
        geometry = Geometry(int(header["n_layers"]), int(header["n_experts"]),
                            int(header["cache_rows"]), int(header["side_rows"]),
                            int(header["stride"]))
        if geometry.total_size != int(header["total_size"]) or size < geometry.total_size:
            shm.close_fd()
            raise ValueError(f"arena {name} has an inconsistent geometry")
        return cls(name, shm, geometry, owner=False)

    def populate(self) -> None:
        """Back every row with memory now, so that fills never take page faults.

        The arena is the memory budget: reserving it up front keeps page zeroing out of the
        fill path (an O_DIRECT read into a page never touched first faults it in and zeroes it).
        """
        start = self.rows_offset
        try:
            if not sys.platform.startswith("linux"):
                raise OSError("no MADV_POPULATE_WRITE")
            self._mmap.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), start,
                               self.geometry.total_size - start)
        except OSError:
            self.raw[start::mmap.PAGESIZE] = 0  # touch one byte per page

    @property
    def epoch(self) -> int:
        return int(self.header["epoch"][0])

    @property
    def pid(self) -> int:
        return int(self.header["pid"][0])

    def row_offset(self, row: int) -> int:
        return self.rows_offset + row * self.geometry.stride

    def row(self, row: int) -> memoryview:
        """A writable view on one row's bytes."""
        start = self.row_offset(row)
        return self.buffer[start:start + self.geometry.stride]

    def close(self) -> None:
        """Unmap; views handed out earlier must be gone."""
        self.header = self.slot_of = self.slots = self.raw = None
        self.buffer.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a numpy view still alive somewhere; the mapping goes with the process

    def unlink(self) -> None:
        unlink_arena(self.name)


def unlink_arena(name: str) -> bool:
    """Remove a named arena; False if there was none."""
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False
