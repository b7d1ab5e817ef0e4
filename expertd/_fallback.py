"""Pure-Python twins of cython_ext/_native.pyx: same signatures, same results, slower.

Python cannot issue memory barriers. On x86-64 (total store order) plain loads and stores
give the seqlock what it needs; on weakly ordered CPUs (arm64) ``remap`` reports every expert
as missing, so the client always goes through the daemon, whose leases keep rows stable.
"""

import os
import platform
import time

import numpy as np

from expertd.shm.layout import SLOT_DTYPE, SlotState

IMPLEMENTATION = "python"
# drain's back-off, the same as in cython_ext/_native.pyx: spin, then yield, then sleeps.
DRAIN_SPINS = 64
DRAIN_YIELDS = 64
DRAIN_FIRST_SLEEP = 1e-5
DRAIN_MAX_SLEEP = 1e-3
STRONGLY_ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _slots(arena, slots_offset):
    n = (len(arena) - slots_offset) // SLOT_DTYPE.itemsize
    return np.frombuffer(arena, dtype=SLOT_DTYPE, count=n, offset=slots_offset)


def remap(arena, slot_of_offset, slots_offset, n_experts, n_rows, layer, experts, out_slots,
          out_versions, out_filling):
    slot_of = np.frombuffer(arena, dtype="<i4", count=(slots_offset - slot_of_offset) // 4,
                            offset=slot_of_offset)
    slots = _slots(arena, slots_offset)
    missing = 0
    for i, e in enumerate(experts):
        out_slots[i] = -1
        out_filling[i] = -1
        row = int(slot_of[layer * n_experts + int(e)])
        if row < 0 or row >= n_rows or not STRONGLY_ORDERED:
            missing += 1
            continue
        rec = slots[row]
        v = int(rec["version"])
        if int(rec["layer"]) != layer or int(rec["expert"]) != int(e):
            missing += 1
            continue
        state = int(rec["state"])
        if v & 1 or state != SlotState.READY:
            if state == SlotState.FILLING:
                out_filling[i] = row
            missing += 1
            continue
        out_slots[i] = row
        out_versions[i] = v
    return missing


def validate(arena, slots_offset, slots, versions):
    table = _slots(arena, slots_offset)
    return all(int(table[int(s)]["version"]) == int(v) for s, v in zip(slots, versions))


def drain(arena, slots_offset, layer, experts, rows, out_slots, out_versions, timeout):
    table = _slots(arena, slots_offset)
    deadline = time.monotonic() + timeout
    left = 0
    for i, row in enumerate(rows):
        out_slots[i] = -1
        row = int(row)
        tries = 0
        pause = DRAIN_FIRST_SLEEP
        while row >= 0 and STRONGLY_ORDERED:
            rec = table[row]
            v = int(rec["version"])
            if int(rec["layer"]) != layer or int(rec["expert"]) != int(experts[i]):
                break
            state = int(rec["state"])
            if not v & 1 and state == SlotState.READY:
                out_slots[i] = row
                out_versions[i] = v
                break
            if state != SlotState.FILLING or time.monotonic() > deadline:
                break
            tries += 1
            if tries <= DRAIN_SPINS:
                pass  # Python has no CPU pause hint; re-reading is the spin
            elif tries <= DRAIN_SPINS + DRAIN_YIELDS:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(2 * pause, DRAIN_MAX_SLEEP)
        if out_slots[i] < 0:
            left += 1
    return left


def copy_segments(arena, rows_offset, stride, slots, seg_offsets, seg_nbytes, dest_bases, dest,
                  positions=None):
    if not len(seg_offsets) == len(seg_nbytes) == len(dest_bases):
        raise ValueError("segment tables differ in length")
    n = len(slots)
    if positions is None:
        positions = range(n)
    elif len(positions) != n:
        raise ValueError("one position per row is needed")
    elif n and min(positions) < 0:
        raise ValueError("negative position")
    top = max((int(p) + 1 for p in positions), default=0)
    for off, nbytes, base in zip(seg_offsets, seg_nbytes, dest_bases):
        if off < 0 or off + nbytes > stride:
            raise ValueError("segment lies outside the row")
        if base < 0 or base + top * nbytes > len(dest):
            raise ValueError("destination too small")
    src = np.frombuffer(arena, dtype=np.uint8)
    for s in slots:
        if s < 0 or rows_offset + (int(s) + 1) * stride > len(src):
            raise ValueError("row outside the arena")
    for off, nbytes, base in zip(seg_offsets, seg_nbytes, dest_bases):
        for p, s in zip(positions, slots):
            start = rows_offset + int(s) * stride + off
            at = base + int(p) * nbytes
            dest[at:at + nbytes] = src[start:start + nbytes]


def bump_hits(arena, slots_offset, slots):
    table = _slots(arena, slots_offset)
    for s in slots:
        table[int(s)]["hits"] += 1


def begin_write(arena, slots_offset, row):
    rec = _slots(arena, slots_offset)[row:row + 1]
    if not int(rec["version"][0]) & 1:
        rec["version"] += 1


def end_write(arena, slots_offset, row):
    rec = _slots(arena, slots_offset)[row:row + 1]
    rec["version"] += 1 if int(rec["version"][0]) & 1 else 2


def publish_u64(arena, offset, value):
    np.frombuffer(arena, "<u8", 1, offset)[0] = value


def read_u64(arena, offset):
    return int(np.frombuffer(arena, "<u8", 1, offset)[0])
