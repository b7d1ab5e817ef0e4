"""Shared-memory arena layout: header, slot index, slot table and rows.

```
[ header 4 KiB ][ epochs: EPOCH_DTYPE[EPOCH_SLOTS] ][ slot_of: int32[layers * experts] ]
[ slots: SLOT_DTYPE[rows] ][ pad ][ rows ]
```
``epochs`` is the reclamation table of device reads (docs/ARCHITECTURE.md, "Epochs"): the daemon gives each
attached client one record; the client publishes in ``step`` the step it is in (odd while a step
that reads arena rows from a device runs, even between steps) and the daemon writes the step it
revoked into ``lost`` (a client that stayed in one step longer than the lease bound). Only the
record's client writes ``step``; only the daemon writes ``lost`` and ``pid``.
``slot_of[layer * experts + expert]`` is the row that holds an expert, or -1. Each slot record
carries a seqlock ``version`` (odd while the daemon rewrites the row), the (layer, expert) key it
holds, its state and a hit counter that clients bump for the daemon's LFU. Only the daemon writes
anything but ``hits``. Rows start on a 16 KiB boundary and are ``stride`` bytes long, so O_DIRECT
and F_NOCACHE reads land in them directly.

The first ``cache_rows`` rows belong to the LFU cache; the next ``2 * side_rows`` are the two
generations of double-buffered prefetch rows.

One job, over 400 lines: the arena's one definition.
"""

import enum
import errno
import mmap
import os
import sys
from dataclasses import dataclass

import numpy as np
import posix_ipc
import psutil

from ..errors import DaemonError

ARENA_MAGIC = 0x3144505845545845  # "EXTEXPD1" little-endian
LAYOUT_VERSION = 2
HEADER_SIZE = 4096
ROW_ALIGN = 16384
SHM_DIR = "/dev/shm"  # Linux: the tmpfs behind POSIX shared memory

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
        ("epoch_slots", "<u4"),
        ("epochs_offset", "<u8"),
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
assert SLOT_DTYPE.itemsize == 32  # the native extension's copy: cython_ext/_native.pyx

EPOCH_DTYPE = np.dtype(
    [
        ("step", "<u8"),  # the client's step: odd while inside a device-reading step
        ("lost", "<u8"),  # a step of the client's that the daemon revoked (0: none)
        ("pid", "<u8"),  # the client's pid while the record is given out, else 0
        ("pad", "<u8"),
    ]
)
EPOCH_SLOTS = 256  # clients that may read rows from a device at once; others copy on the host


class SlotState(enum.IntEnum):
    EMPTY = 0
    FILLING = 1
    READY = 2


def slot_layout() -> dict:
    """The slot record as the native extension's compile-time copy (cython_ext/_native.pyx's
    ``SLOT_LAYOUT``) must hold it: its size, fields' offsets and the states it tests."""
    fields = {name: SLOT_DTYPE.fields[name][1] for name in ("version", "layer", "expert",
                                                            "state", "hits")}
    return {"size": SLOT_DTYPE.itemsize, **fields, "filling": int(SlotState.FILLING),
            "ready": int(SlotState.READY)}


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
    def epochs_offset(self) -> int:
        return HEADER_SIZE

    @property
    def slot_of_offset(self) -> int:
        return HEADER_SIZE + EPOCH_DTYPE.itemsize * EPOCH_SLOTS

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
    def smallest_budget(cls, n_layers: int, n_experts: int, stride: int, side_rows: int = 0,
                        cache_rows: int = 1) -> int:
        """The smallest budget for which :meth:`for_budget` gives ``cache_rows`` cache rows."""
        probe = cls(n_layers, n_experts, 1, side_rows, stride)
        fixed = probe.rows_offset + stride * 2 * side_rows + SLOT_DTYPE.itemsize * 64
        return fixed + cache_rows * (stride + SLOT_DTYPE.itemsize)

    @classmethod
    def default_side_rows(cls, n_layers: int, n_experts: int, stride: int, budget_bytes: int,
                          top_k: int, width: int = 2) -> int:
        """Prefetch rows per generation when ``expertd start`` is not told: ``width`` x top_k
        (what one client reads ahead per layer) if the budget still leaves at least 16 times
        as many cache rows, so the two generations take at most 1/8 of the arena; else top_k.
        """
        wide = width * top_k
        try:
            g = cls.for_budget(n_layers, n_experts, stride, budget_bytes, side_rows=wide)
        except ValueError:
            return top_k
        return wide if g.cache_rows >= 16 * wide else top_k

    @classmethod
    def for_budget(cls, n_layers: int, n_experts: int, stride: int, budget_bytes: int,
                   side_rows: int = 0) -> "Geometry":
        """The largest arena whose total size stays within ``budget_bytes``.

        Raises:
            ValueError: if the budget cannot hold one cache row beside the side rows.
        """
        least = cls.smallest_budget(n_layers, n_experts, stride, side_rows)
        rows = (budget_bytes - least) // (stride + SLOT_DTYPE.itemsize) + 1
        if rows < 1:
            raise ValueError(
                f"a budget of {budget_bytes} bytes is too small: an arena needs at least "
                f"{least} bytes (one cache row of {stride} bytes beside 2 x {side_rows} "
                "prefetch side rows, and the slot tables)"
            )
        rows = min(rows, n_layers * n_experts)
        return cls(n_layers, n_experts, int(rows), side_rows, stride)


class ArenaSpaceError(DaemonError):
    """Shared memory or RAM cannot hold the arena."""


def available_memory() -> int | None:
    """Memory that can still be used without swapping, as psutil reads the host's (Linux's
    MemAvailable; macOS's free and inactive pages, which leave out its file cache and so read
    low), within the cgroup's limit on Linux (its reclaimable file pages not counted as used);
    None if unknown."""
    available = _virtual_memory("available")
    room = cgroup_room()
    if room is not None:
        available = room if available is None else min(available, room)
    return available


def physical_memory() -> int | None:
    """The host's RAM, None if unknown."""
    return _virtual_memory("total")


def _virtual_memory(field: str) -> int | None:
    """One field of psutil's ``virtual_memory()``, None where psutil cannot read it."""
    try:
        return int(getattr(psutil.virtual_memory(), field))
    except (psutil.Error, OSError, RuntimeError):
        return None


def cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's cgroup (v2, its files under ``root``) may still take before its
    limit: the limit less what it uses, less the file pages it could drop (``inactive_file``);
    None without a limit."""
    try:
        with open(os.path.join(root, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(root, "memory.current")) as f:
            used = int(f.read())
        with open(os.path.join(root, "memory.stat")) as f:
            stat = dict(line.split() for line in f if line.count(" ") == 1)
        used -= int(stat.get("inactive_file", 0))
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def check_room(size: int, name: str = "the arena") -> None:
    """Check that shared memory and RAM can hold ``size`` more bytes, before reserving them.

    Raises:
        ArenaSpaceError: naming what is short, by how much, and what to do.
    """
    gib = 2**30
    if sys.platform.startswith("linux") and os.path.isdir(SHM_DIR):
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise ArenaSpaceError(
                f"{name} needs {size / gib:.3f} GiB but {SHM_DIR} has only {free / gib:.3f} "
                f"GiB free; lower --cache-gb, or enlarge {SHM_DIR} (in a container: "
                "docker run --shm-size)")
    # macOS's available figure leaves out its file cache: there, only more than the RAM is
    # refused (an arena the pager must make room for pages, it does not fail).
    available = (available_memory() if sys.platform.startswith("linux") else physical_memory())
    if available is not None and size > available:
        raise ArenaSpaceError(
            f"{name} needs {size / gib:.3f} GiB but only {available / gib:.3f} GiB of memory "
            "is available; lower --cache-gb")


def reserve(fd: int, size: int, name: str = "the arena") -> None:
    """Give the shared-memory object ``fd`` its size, with memory behind it where possible.

    Linux: posix_fallocate allocates the tmpfs pages now, so a shortfall is an error here
    rather than a SIGBUS on first touch. macOS has no shm filesystem: ftruncate sizes the
    object and :meth:`Arena.populate` touches the pages.

    Raises:
        ArenaSpaceError: if the memory is not there.
    """
    if not sys.platform.startswith("linux"):
        os.ftruncate(fd, size)
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise ArenaSpaceError(
                f"could not reserve {size / 2**30:.3f} GiB for {name} in {SHM_DIR}: "
                f"{exc.strerror}; lower --cache-gb") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # no fallocate here: populate() touches the pages instead


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
        self.epochs = self.raw[g.epochs_offset:g.epochs_offset + EPOCH_DTYPE.itemsize * EPOCH_SLOTS
                               ].view(EPOCH_DTYPE)
        self.rows_offset = g.rows_offset

    @classmethod
    def create(cls, name: str, geometry: Geometry, pid: int, epoch: int) -> "Arena":
        """Create (exclusively, mode 0600), reserve and initialise a new arena.

        Raises:
            ArenaSpaceError: if shared memory or RAM cannot hold it (nothing is left behind).
            posix_ipc.ExistentialError: if the name is taken.
        """
        check_room(geometry.total_size, f"arena {name}")
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        try:
            reserve(shm.fd, geometry.total_size, f"arena {name}")
        except BaseException:
            shm.close_fd()
            unlink_arena(name)
            raise
        arena = cls(name, shm, geometry, owner=True)
        arena.slot_of[:] = -1
        arena.slots[:] = 0
        arena.epochs[:] = 0
        h = arena.header
        g = geometry
        for key, value in (
            ("layout_version", LAYOUT_VERSION), ("header_size", HEADER_SIZE), ("pid", pid),
            ("epoch", epoch), ("n_layers", g.n_layers), ("n_experts", g.n_experts),
            ("cache_rows", g.cache_rows), ("side_rows", g.side_rows), ("stride", g.stride),
            ("slot_of_offset", g.slot_of_offset), ("slots_offset", g.slots_offset),
            ("rows_offset", g.rows_offset), ("total_size", g.total_size), ("serving", 1),
            ("epoch_slots", EPOCH_SLOTS), ("epochs_offset", g.epochs_offset),
        ):
            h[key] = value
        h["magic"] = ARENA_MAGIC  # last: a reader that sees the magic sees a whole header
        return arena

    @classmethod
    def attach(cls, name: str) -> "Arena":
        """Map an existing arena read-write (clients bump hit counters) and check its header.

        Raises:
            FileNotFoundError: no arena has that name (its daemon has exited).
            ValueError: the memory is not a whole expertd arena of this layout version.
        """
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            # Its daemon exited between its hello and this: an OSError, which callers that
            # wait for a daemon to come back already wait through.
            raise FileNotFoundError(f"no arena {name}: the daemon that made it has exited") from None
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
        self.header = self.slot_of = self.slots = self.epochs = self.raw = None
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
