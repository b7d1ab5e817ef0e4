# cython: boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Hot paths shared by the daemon and the client: seqlock remap, drain, row copies.

Every function has a pure-Python twin in expertd/_fallback.py with the same signature; see
expertd/native.py for the choice between them. The atomics are real acquire/release operations
(GCC/Clang builtins), which Apple Silicon's weak memory ordering needs.
"""

from libc.stdint cimport int32_t, uint32_t, uint64_t, uint8_t
from libc.string cimport memcpy
from cpython.exc cimport PyErr_CheckSignals

cdef extern from *:
    """
    #include <sched.h>
    #include <time.h>
    static inline unsigned long long xd_load_acquire(const void *p) {
        return __atomic_load_n((const unsigned long long *)p, __ATOMIC_ACQUIRE);
    }
    static inline unsigned long long xd_load_relaxed(const void *p) {
        return __atomic_load_n((const unsigned long long *)p, __ATOMIC_RELAXED);
    }
    static inline void xd_store_release(void *p, unsigned long long v) {
        __atomic_store_n((unsigned long long *)p, v, __ATOMIC_RELEASE);
    }
    static inline void xd_store_relaxed(void *p, unsigned long long v) {
        __atomic_store_n((unsigned long long *)p, v, __ATOMIC_RELAXED);
    }
    static inline void xd_add_relaxed(void *p, unsigned long long v) {
        __atomic_fetch_add((unsigned long long *)p, v, __ATOMIC_RELAXED);
    }
    static inline void xd_store_seq_cst(void *p, unsigned long long v) {
        __atomic_store_n((unsigned long long *)p, v, __ATOMIC_SEQ_CST);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
    static inline void xd_fence_seq_cst(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    static inline void xd_fence_acquire(void) { __atomic_thread_fence(__ATOMIC_ACQUIRE); }
    static inline void xd_fence_release(void) { __atomic_thread_fence(__ATOMIC_RELEASE); }
    static inline double xd_now(void) {
        struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec + ts.tv_nsec * 1e-9;
    }
    static inline void xd_yield(void) { sched_yield(); }
    static inline void xd_sleep(double seconds) {
        struct timespec ts;
        ts.tv_sec = (time_t)seconds;
        ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
        nanosleep(&ts, NULL);
    }
    /* A hint to the core that this is a spin-wait (frees the sibling hyper-thread). */
    static inline void xd_cpu_relax(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__) || defined(__arm__)
        __asm__ __volatile__("yield");
    #endif
    }
    """
    unsigned long long xd_load_acquire(const void *p) nogil
    unsigned long long xd_load_relaxed(const void *p) nogil
    void xd_store_release(void *p, unsigned long long v) nogil
    void xd_store_relaxed(void *p, unsigned long long v) nogil
    void xd_add_relaxed(void *p, unsigned long long v) nogil
    void xd_store_seq_cst(void *p, unsigned long long v) nogil
    void xd_fence_seq_cst() nogil
    void xd_fence_acquire() nogil
    void xd_fence_release() nogil
    double xd_now() nogil
    void xd_yield() nogil
    void xd_sleep(double seconds) nogil
    void xd_cpu_relax() nogil

# Slot record layout: shm/layout.py's SLOT_DTYPE and SlotState are the definition; these
# compile-time copies are exported as SLOT_LAYOUT, which expertd/native.py checks at import.
DEF SLOT_SIZE = 32
DEF OFF_VERSION = 0
DEF OFF_LAYER = 8
DEF OFF_EXPERT = 12
DEF OFF_STATE = 16
DEF OFF_HITS = 24
DEF STATE_FILLING = 1
DEF STATE_READY = 2

IMPLEMENTATION = "cython"
SLOT_LAYOUT = dict(size=SLOT_SIZE, version=OFF_VERSION, layer=OFF_LAYER, expert=OFF_EXPERT,
                   state=OFF_STATE, hits=OFF_HITS, filling=STATE_FILLING, ready=STATE_READY)

# drain's back-off, the same in expertd/_fallback.py: a fill usually lands within microseconds
# of being seen FILLING (spin), a slow one frees the core (yield), then the CPU (sleeps).
DEF DRAIN_SPINS = 64
DEF DRAIN_YIELDS = 64
DEF DRAIN_FIRST_SLEEP = 1e-5
DEF DRAIN_MAX_SLEEP = 1e-3


cdef int _check_signals() except -1 with gil:
    # A KeyboardInterrupt raised while drain sleeps, as time.sleep raises it in the twin.
    return PyErr_CheckSignals()


cdef inline uint8_t* _slot(uint8_t* base, Py_ssize_t slots_offset, Py_ssize_t row) nogil:
    return base + slots_offset + row * SLOT_SIZE


def remap(uint8_t[::1] arena, Py_ssize_t slot_of_offset, Py_ssize_t slots_offset,
          Py_ssize_t n_experts, Py_ssize_t n_rows, int layer, const int32_t[::1] experts,
          int32_t[::1] out_slots, uint64_t[::1] out_versions, int32_t[::1] out_filling):
    """Look experts of one layer up in the slot table, lock-free.

    A row number in ``slot_of`` outside ``[0, n_rows)`` (no daemon writes one; a client may
    scribble on the arena it maps read-write) is a miss, never a read past the records.

    For each expert: its row and the even seqlock version seen, or -1 when it is not READY.
    ``out_filling`` gets the row of an expert that is being filled right now (else -1), so the
    caller can drain it instead of asking the daemon. Returns the number of experts not READY.
    """
    cdef uint8_t* base = &arena[0]
    cdef const int32_t* slot_of = <const int32_t*>(base + slot_of_offset)
    cdef Py_ssize_t i, n = experts.shape[0]
    cdef int32_t e, row
    cdef uint8_t* rec
    cdef unsigned long long v
    cdef int missing = 0
    with nogil:
        for i in range(n):
            e = experts[i]
            out_filling[i] = -1
            row = (<volatile int32_t*>slot_of)[layer * n_experts + e]
            out_slots[i] = -1
            if row < 0 or row >= n_rows:
                missing += 1
                continue
            rec = _slot(base, slots_offset, row)
            v = xd_load_acquire(rec + OFF_VERSION)
            if ((<volatile int32_t*>(rec + OFF_LAYER))[0] != layer
                    or (<volatile int32_t*>(rec + OFF_EXPERT))[0] != e):
                missing += 1
                continue
            if (v & 1) or (<volatile uint32_t*>(rec + OFF_STATE))[0] != STATE_READY:
                if (<volatile uint32_t*>(rec + OFF_STATE))[0] == STATE_FILLING:
                    out_filling[i] = row
                missing += 1
                continue
            out_slots[i] = row
            out_versions[i] = v
    return missing


def validate(uint8_t[::1] arena, Py_ssize_t slots_offset, const int32_t[::1] slots,
             const uint64_t[::1] versions):
    """True if no row in ``slots`` changed since its version was read (seqlock check)."""
    cdef uint8_t* base = &arena[0]
    cdef Py_ssize_t i, n = slots.shape[0]
    cdef bint ok = True
    with nogil:
        xd_fence_acquire()
        for i in range(n):
            if xd_load_relaxed(_slot(base, slots_offset, slots[i]) + OFF_VERSION) != versions[i]:
                ok = False
                break
    return ok


def drain(uint8_t[::1] arena, Py_ssize_t slots_offset, int layer, const int32_t[::1] experts,
          const int32_t[::1] rows, int32_t[::1] out_slots, uint64_t[::1] out_versions,
          double timeout):
    """Wait until in-flight fills of ``rows`` (holding ``experts`` of ``layer``) are READY.

    Rows that become READY with the right key go to ``out_slots``/``out_versions``; a row that
    fails, changes hands or is not ready within ``timeout`` seconds is left at -1. Returns the
    number left at -1. Waits by spinning, then yielding the core, then sleeping up to 1 ms at a
    time (GIL released throughout).

    Raises:
        KeyboardInterrupt: (or whatever a signal handler raises) while it sleeps.
    """
    cdef uint8_t* base = &arena[0]
    cdef Py_ssize_t i, n = rows.shape[0]
    cdef uint8_t* rec
    cdef unsigned long long v
    cdef uint32_t state
    cdef double deadline, pause
    cdef int left = 0, tries
    with nogil:
        deadline = xd_now() + timeout
        for i in range(n):
            out_slots[i] = -1
            if rows[i] < 0:
                left += 1
                continue
            rec = _slot(base, slots_offset, rows[i])
            tries = 0
            pause = DRAIN_FIRST_SLEEP
            while True:
                v = xd_load_acquire(rec + OFF_VERSION)
                if ((<volatile int32_t*>(rec + OFF_LAYER))[0] != layer
                        or (<volatile int32_t*>(rec + OFF_EXPERT))[0] != experts[i]):
                    break
                state = (<volatile uint32_t*>(rec + OFF_STATE))[0]
                if not (v & 1) and state == STATE_READY:
                    out_slots[i] = rows[i]
                    out_versions[i] = v
                    break
                if state != STATE_FILLING or xd_now() > deadline:
                    break
                tries += 1
                if tries <= DRAIN_SPINS:
                    xd_cpu_relax()
                elif tries <= DRAIN_SPINS + DRAIN_YIELDS:
                    xd_yield()
                else:
                    xd_sleep(pause)
                    pause = min(2 * pause, DRAIN_MAX_SLEEP)
                    _check_signals()
            if out_slots[i] < 0:
                left += 1
    return left


def copy_segments(uint8_t[::1] arena, Py_ssize_t rows_offset, Py_ssize_t stride,
                  const int32_t[::1] slots, const Py_ssize_t[::1] seg_offsets,
                  const Py_ssize_t[::1] seg_nbytes, const Py_ssize_t[::1] dest_bases,
                  uint8_t[::1] dest, const int32_t[::1] positions=None):
    """Gather each segment of each row into ``dest``, GIL released.

    Segment ``s`` of row ``slots[i]`` lands at ``dest_bases[s] + p * seg_nbytes[s]``, where
    ``p`` is ``positions[i]`` if given, else ``i``.
    """
    cdef uint8_t* base = &arena[0]
    cdef Py_ssize_t i, s, p, top = 0, n = slots.shape[0], m = seg_offsets.shape[0]
    cdef bint placed = positions is not None
    if seg_nbytes.shape[0] != m or dest_bases.shape[0] != m:
        raise ValueError("segment tables differ in length")
    if placed:
        if positions.shape[0] != n:
            raise ValueError("one position per row is needed")
        for i in range(n):
            if positions[i] < 0:
                raise ValueError("negative position")
            top = max(top, positions[i] + 1)
    else:
        top = n
    for s in range(m):
        if seg_offsets[s] < 0 or seg_offsets[s] + seg_nbytes[s] > stride:
            raise ValueError("segment lies outside the row")
        if dest_bases[s] < 0 or dest_bases[s] + top * seg_nbytes[s] > dest.shape[0]:
            raise ValueError("destination too small")
    for i in range(n):
        if slots[i] < 0 or rows_offset + (slots[i] + 1) * stride > arena.shape[0]:
            raise ValueError("row outside the arena")
    with nogil:
        for s in range(m):
            for i in range(n):
                p = positions[i] if placed else i
                memcpy(&dest[dest_bases[s] + p * seg_nbytes[s]],
                       base + rows_offset + slots[i] * stride + seg_offsets[s], seg_nbytes[s])


def bump_hits(uint8_t[::1] arena, Py_ssize_t slots_offset, const int32_t[::1] slots):
    """Count one use of each row for the daemon's LFU (relaxed atomic add)."""
    cdef uint8_t* base = &arena[0]
    cdef Py_ssize_t i, n = slots.shape[0]
    with nogil:
        for i in range(n):
            xd_add_relaxed(_slot(base, slots_offset, slots[i]) + OFF_HITS, 1)


def begin_write(uint8_t[::1] arena, Py_ssize_t slots_offset, Py_ssize_t row):
    """Daemon side: make the row's version odd before its key or bytes change."""
    cdef uint8_t* rec = _slot(&arena[0], slots_offset, row)
    cdef unsigned long long v = xd_load_relaxed(rec + OFF_VERSION)
    if not (v & 1):
        xd_store_relaxed(rec + OFF_VERSION, v + 1)
    xd_fence_release()


def end_write(uint8_t[::1] arena, Py_ssize_t slots_offset, Py_ssize_t row):
    """Daemon side: publish the row's key, state and bytes with an even version (release)."""
    cdef uint8_t* rec = _slot(&arena[0], slots_offset, row)
    cdef unsigned long long v = xd_load_relaxed(rec + OFF_VERSION)
    xd_store_release(rec + OFF_VERSION, v + 1 if (v & 1) else v + 2)


def publish_u64(uint8_t[::1] arena, Py_ssize_t offset, unsigned long long value):
    """Store ``value`` at ``offset`` and fence (sequentially consistent): a client's step
    published before any read of the step, or the daemon's unmapping before it reads the steps.
    """
    xd_store_seq_cst(&arena[offset], value)


def read_u64(uint8_t[::1] arena, Py_ssize_t offset):
    """Load the u64 at ``offset`` after a full fence (acquire and after every earlier store)."""
    xd_fence_seq_cst()
    return xd_load_acquire(&arena[offset])
