"""No lease leaks from a client, however it is interrupted; a dead or stuck daemon is noticed
at once; drain waits without burning a core.

The lease tests run real client processes (this file run as a script, see ``main``) on the
serving loop in this process, and deliver real SIGINTs; a daemon that is killed or stuck is a
process; the drain tests run both implementations side by side.
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from client_helpers import cache_gb
from harness import (
    Daemon,
    InProcessDaemon,
    RawClient,
    query_stats,
    read_json_line,
    spawn_client,
    wait_until,
)

from expertd import _fallback
from expertd.shm.layout import SLOT_DTYPE, SlotState

try:
    from expertd import _native
except ImportError:  # the extension is optional; its twin is always there
    _native = None

IMPLEMENTATIONS = [pytest.param(_fallback, id="python"),
                   pytest.param(_native, id="cython", marks=pytest.mark.skipif(
                       _native is None, reason="expertd._native is not built"))]
# Long enough that no test here can pass by a client or a lease timing out.
PATIENT = ("--client-timeout", "60", "--lease-timeout", "60", "--heartbeat", "0.2")
REAP_BOUND = 5.0  # seconds a late lease may take to be released (it takes ~10 ms)


ROWS = 10  # the smallest cache the tiny model accepts: demands of 4, 4 rows per client


def tiny_cache(blobs) -> tuple:
    return ("--cache-gb", cache_gb(blobs, ROWS))


def spawn(mode: str, *args) -> subprocess.Popen:
    """This file as a client process; commands on its stdin, JSON lines on its stdout."""
    return spawn_client(mode, *args, script=Path(__file__), stdin=True)


def finish(proc: subprocess.Popen) -> str:
    """Close the client's stdin (it says goodbye and exits); its stderr."""
    try:
        _, err = proc.communicate(timeout=20.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"client pid {proc.pid} did not exit:\n{err}") from None
    assert proc.returncode == 0, f"client pid {proc.pid} exited with {proc.returncode}:\n{err}"
    return err


def command(proc: subprocess.Popen, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


# ---- leases ----------------------------------------------------------------------------------

def test_interrupted_wait_on_a_blocked_demand_leaks_no_lease(blobs, isolated_env):
    """SIGINT while the client waits on a demand that cannot be served yet (two other clients
    hold 8 of the 10 rows): the client lives on, and when the demand is served later its lease
    is released by the idle client, long before any timeout."""
    with InProcessDaemon(blobs, *tiny_cache(blobs), *PATIENT) as daemon:
        ready = daemon.ready
        assert (ready["arena_rows"], ready["max_demand"], ready["client_cap"]) == (ROWS, 4, 4)
        with RawClient(blobs) as a, RawClient(blobs) as b:
            held = [a.demand(0, [0, 1, 2, 3])["lease"], b.demand(0, [4, 5, 6, 7])["lease"]]
            client = spawn("session", blobs, 0, "8,9,10,11")
            try:
                assert read_json_line(client, 30.0) == {"attached": True}
                command(client, "fetch")
                wait_until(lambda: query_stats(blobs)["demands"] == 3, 10.0,
                           "the client's demand to reach the daemon")
                client.send_signal(signal.SIGINT)
                got = read_json_line(client, 10.0)
                assert "interrupted" in got, got
                assert client.poll() is None
                assert query_stats(blobs)["leases"] == 2  # only the holders' so far
                a.release(held[0])
                # The queued demand is served now; nobody reads its reply but the idle client.
                wait_until(lambda: query_stats(blobs)["leases"] == 1, REAP_BOUND,
                           "the interrupted demand's late lease to be released")
                b.release(held[1])
                wait_until(lambda: query_stats(blobs)["leases"] == 0, REAP_BOUND, "no lease")
                stats = query_stats(blobs)
                assert stats["clients"] == 3, stats  # nobody timed out
                command(client, "fetch")  # still usable after the interrupt
                # The late reply was read and released by the client, not dropped by the daemon.
                assert read_json_line(client, 20.0) == {"fetched": True, "late_leases": 1}
                wait_until(lambda: query_stats(blobs)["leases"] == 0, REAP_BOUND, "no lease")
            finally:
                err = finish(client)
            # Its goodbye made the daemon forget it at once, not after the client timeout.
            wait_until(lambda: query_stats(blobs)["clients"] == 2, REAP_BOUND, "the goodbye")
        assert daemon.poll() is None
    assert "Traceback" not in err, err


def test_sigint_anywhere_in_fetch_leaks_no_lease(models, isolated_env):
    """A client fetching on a 10-row cache (demands, fills, copies, releases all the time) is
    interrupted by SIGINT at random moments; after each, the daemon holds no lease within a
    few milliseconds while the client only waits. Rows of 432 KiB make the copies long
    enough to be hit too."""
    blobs = models.blobs(hidden=512, moe_inter=512)
    with InProcessDaemon(blobs, *tiny_cache(blobs), *PATIENT):
        # 600 fetches: about 290 interrupts, 28-35 of them while leases were held in four
        # runs (300 fetches landed 9-20 there: at the edge of the bound below, a flaky test).
        client = spawn("interrupts", blobs, 600, 7)
        try:
            result = read_json_line(client, 240.0)
        finally:
            err = finish(client)
        assert not result["errors"], result
        assert result["interrupted"] >= 100, result
        # SIGINT came while demands waited for their reply, and while leases were in use
        # (reply read, rows copied, leases released).
        assert result["arrived"]["waiting"] >= 10 and result["arrived"]["leased"] >= 10, result
        assert result["max_reap_s"] < REAP_BOUND, result
        assert query_stats(blobs)["leases"] == 0
    assert "Traceback" not in err, err



# ---- a step's absent rows, every layer's demanded at once ---------------------------------------

def _no_leases_left(blobs) -> None:
    wait_until(lambda: query_stats(blobs)["leases"] == 0, REAP_BOUND,
               "every lease of the demands to be released")


@pytest.mark.timeout(60)
def test_absent_rows_of_every_layer_are_demanded_at_once_and_none_stays_leased(blobs,
                                                                              isolated_env):
    """demand_absent_all sends one demand a layer (chunked by the daemon's demand limit)
    before it reads any reply, and returns once every one was answered: each row is then in
    the arena, each demand was one the daemon saw, and no lease is kept, in an arena that
    holds every expert and in one that holds far fewer rows than were demanded (the client
    releases each lease as its reply comes: demands queued behind its own leases finish)."""
    from expertd.client.session import DEMANDS_AT_ONCE, Session

    groups = [(layer, np.arange(layer, 16, 2, dtype=np.int32)) for layer in range(3)]
    for cache in ((), tiny_cache(blobs)):
        with Daemon(blobs, isolated_env, *cache, *PATIENT):
            session = Session(blobs, reconnect_timeout=5.0)
            try:
                before = query_stats(blobs)
                session.demand_absent_all(groups)
                after = query_stats(blobs)
                chunks = sum(-(-len(e) // session.demand_limit) for _, e in groups)
                assert after["demands"] - before["demands"] == chunks
                assert chunks > len(groups) or not cache  # the small arena's limit chunks them
                # sent together, before any reply was read (up to a wave's 16)
                assert session.requester.most_at_once == min(chunks, DEMANDS_AT_ONCE)
                assert session.counters["demanded"] == sum(len(e) for _, e in groups)
                assert session.counters["late_leases"] == 0
                assert not session.requester.leases and not session.requester.demands
                if not cache:  # every row demanded is there to be read
                    for layer, experts in groups:
                        assert (session.lookup(layer, experts).slots >= 0).all()
                    assert after["misses"] - before["misses"] == sum(len(e) for _, e in groups)
                _no_leases_left(blobs)
            finally:
                session.close()


@pytest.mark.timeout(60)
def test_a_refused_demand_among_several_raises_and_leaks_no_lease(blobs, isolated_env):
    """One group of a step's demands is refused (an expert out of range): the call raises the
    daemon's error naming it, the other groups' late replies are released when they come, and
    the session demands again as before."""
    from expertd.client.session import Session
    from expertd.errors import DaemonError

    with Daemon(blobs, isolated_env, *PATIENT):
        session = Session(blobs, reconnect_timeout=5.0)
        try:
            good = np.arange(4, dtype=np.int32)
            with pytest.raises(DaemonError, match="expert 99 out of range for layer 1"):
                session.demand_absent_all([(0, good), (1, np.array([3, 99], np.int32)),
                                           (2, good)])
            _no_leases_left(blobs)
            wait_until(lambda: not session.requester.demands, REAP_BOUND,
                       "the late replies to be read")
            # The good groups' replies, read then or late, are counted as demands, not as
            # leases of interrupted ones.
            assert session.counters["demanded"] == 2 * len(good)
            assert session.counters["late_leases"] == 0
            session.demand_absent_all([(2, good + 4)])
            assert (session.lookup(2, good + 4).slots >= 0).all()
            _no_leases_left(blobs)
        finally:
            session.close()

@pytest.mark.timeout(60)
def test_demands_refused_as_busy_are_sent_again_until_the_daemon_has_room(blobs, isolated_env):
    """Every row of the arena is leased by hoarders and the daemon's queue for all clients
    together is full (the real daemon's queue shortened to two, so that a hoarder fills it,
    as many clients waiting at once would fill its 256): a step's demands are refused as
    BUSY, sent again one at a time while they are, and all read once the hoarders say
    goodbye."""
    from expertd.client.session import Session
    from expertd.protocol import Op

    with InProcessDaemon(blobs, *tiny_cache(blobs), "--client-timeout", "60") as d, \
            RawClient(blobs) as a, RawClient(blobs) as b, RawClient(blobs) as c:
        d.server.cache.book.max_queued_total = 2
        keys = iter([(layer, e) for layer in range(3) for e in range(16)])
        for hoarder in (a, b, c):  # each to its cap: more rows than the arena has
            for _ in range(hoarder.hello["client_cap"]):
                layer, e = next(keys)
                hoarder.conn.send(Op.DEMAND, {"layer": layer, "experts": [e]})
        # Demands within their clients' caps queue only when rows are short: every row leased.
        wait_until(lambda: d.stats()["queued"] == 2, 10, "the daemon's queue to fill")
        session = Session(blobs, reconnect_timeout=5.0)
        groups = [(2, np.arange(12, 16, dtype=np.int32))]  # not asked for by the hoarders
        failed = []

        def demand():
            try:
                session.demand_absent_all(groups)
            except BaseException as exc:
                failed.append(exc)

        worker = threading.Thread(target=demand)
        try:
            worker.start()
            wait_until(lambda: session.counters["retries"] >= 2 or failed, 10,
                       "the step's demands to be refused as busy and sent again")
            assert not failed and worker.is_alive()  # still trying: nothing was read
            assert d.stats()["busy"] >= 2
            for hoarder in (a, b, c):  # their leases and queued demands go
                hoarder.conn.send(Op.GOODBYE, {})
            worker.join(30)
            assert not worker.is_alive() and not failed
            for layer, experts in groups:
                assert (session.lookup(layer, experts).slots >= 0).all()
            assert session.counters["demanded"] >= sum(len(e) for _, e in groups)
            assert not session.requester.leases
        finally:
            worker.join(30)
            session.close()


# ---- a daemon that is gone or stuck ----------------------------------------------------------

@pytest.mark.timeout(60)  # well inside the 300 s request bound
def test_reused_pid_does_not_stall_the_client(blobs, isolated_env):
    """The daemon is SIGKILLed and its pid and run files then name a live, unrelated process:
    the client gives up by its reconnect timeout (the error says so), while the impostor still
    lives, not by the 300 s request bound (which raises another error)."""
    from expertd.client.session import Session
    from expertd.errors import DaemonNotRunning
    from expertd.paths import daemon_paths
    from expertd.runfile import RunInfo, read_run_info, write_run_info

    paths = daemon_paths(blobs)
    # Lives until the test kills it: the client cannot be let go by its end.
    impostor = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        with Daemon(blobs, isolated_env, *tiny_cache(blobs), *PATIENT) as daemon:
            session = Session(blobs, reconnect_timeout=1.0)
            try:
                assert session.stats()["pid"] == daemon.pid
                info = read_run_info(paths)
                daemon.kill()
                write_run_info(paths, RunInfo(impostor.pid, info.arena, info.epoch, True))
                paths.pidfile.write_text(str(impostor.pid))
                with pytest.raises(DaemonNotRunning, match="is gone and did not come back "
                                   "within 1 s"):
                    session.stats()
                assert impostor.poll() is None  # given up on while the pid still lives
                # A client living on hits learns it from its heartbeat as quickly.
                wait_until(lambda: session._heartbeat is None or session._heartbeat.lost, 5.0,
                           "the heartbeat to notice")
            finally:
                session.close()
    finally:
        impostor.kill()
        impostor.wait()


@pytest.mark.timeout(60)  # well inside the 300 s request bound
def test_stuck_daemon_is_reported_after_its_time_to_dead(blobs, isolated_env):
    """A daemon that holds its lock but answers nothing (SIGSTOP) is waited for as a daemon
    gone, once no heartbeat has been answered for the time-to-dead (not after the 300 s
    request bound, which raises another error), then reported as stuck; resumed, it serves
    the session again, through one new attach."""
    from expertd.client.session import Session
    from expertd.errors import DaemonError

    with Daemon(blobs, isolated_env, *tiny_cache(blobs), "--client-timeout", "2",
                "--heartbeat", "0.2") as daemon:
        session = Session(blobs, reconnect_timeout=1.0)
        try:
            assert session._heartbeat.time_to_dead == 2.0
            reconnects = session.counters["reconnects"]
            os.kill(daemon.pid, signal.SIGSTOP)
            try:
                with pytest.raises(DaemonError, match="answered no heartbeat for 2 s, and it did "
                                   "not answer within 1 s .stopped, or stuck.*expertd restart"):
                    session.stats()
                assert session.counters["reconnects"] == reconnects  # given up, not attached
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            # Answers again: the session attaches again (once) at its next request.
            assert session.stats()["pid"] == daemon.pid
            assert session.counters["reconnects"] == reconnects + 1
        finally:
            session.close()


# ---- drain -----------------------------------------------------------------------------------

class FakeArena:
    """A slot table in plain memory: drain reads nothing else."""

    SLOTS_OFFSET = 64

    def __init__(self, rows: int = 4):
        self.raw = np.zeros(self.SLOTS_OFFSET + rows * SLOT_DTYPE.itemsize, np.uint8)
        self.slots = self.raw[self.SLOTS_OFFSET:].view(SLOT_DTYPE)
        self.slots["layer"] = self.slots["expert"] = -1

    def filling(self, row: int, layer: int, expert: int) -> None:
        rec = self.slots[row:row + 1]
        rec["version"] += 1  # odd while written
        rec["layer"], rec["expert"], rec["state"] = layer, expert, SlotState.FILLING

    def publish(self, row: int, state=SlotState.READY) -> None:
        rec = self.slots[row:row + 1]
        rec["state"] = state
        rec["version"] += 1

    def drain(self, impl, layer: int, experts: list, rows: list, timeout: float):
        out_slots = np.empty(len(rows), np.int32)
        out_versions = np.zeros(len(rows), np.uint64)
        left = impl.drain(self.raw, self.SLOTS_OFFSET, layer, np.array(experts, np.int32),
                          np.array(rows, np.int32), out_slots, out_versions, timeout)
        return left, out_slots.tolist(), out_versions.tolist()


# A drain timeout no test reaches: a drain that returns before it did so by the mechanism
# under test (a fill landing, a row that cannot land, a signal), never by its deadline.
NEVER = 60.0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_drain_returns_rows_as_their_fills_land(impl):
    arena = FakeArena()
    arena.filling(1, 2, 5)
    arena.filling(3, 2, 6)
    arena.publish(3)
    landing = threading.Event()

    def land():
        landing.set()  # before the row is READY: drain cannot have seen it READY earlier
        arena.publish(1)

    # The stimulus: a fill that lands while drain waits (or, on a slow machine, before).
    timer = threading.Timer(0.1, land)
    timer.start()
    try:
        assert arena.drain(impl, 2, [5, 6], [1, 3], NEVER) == (0, [1, 3], [2, 2])
        assert landing.is_set()  # the landing had begun when drain returned
    finally:
        timer.cancel()
        timer.join()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_drain_gives_up_on_failed_moved_or_late_rows(impl):
    arena = FakeArena()
    arena.filling(0, 0, 1)
    arena.publish(0, SlotState.EMPTY)  # what a failed fill leaves
    arena.filling(1, 0, 2)
    arena.publish(1)  # READY, but it holds expert 2, not the 3 asked for
    arena.filling(2, 0, 4)  # never lands
    start = time.monotonic()
    assert arena.drain(impl, 0, [1, 3], [0, 1], NEVER)[:2] == (2, [-1, -1])
    assert time.monotonic() - start < NEVER  # at once: a failed or moved row is not waited on
    timeout = 0.3
    start = time.monotonic()
    assert arena.drain(impl, 0, [4], [2], timeout)[:2] == (1, [-1])
    # Waits its whole timeout for a late row, then gives up (not at some later bound).
    assert timeout <= time.monotonic() - start < timeout + 10.0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_drain_backs_off_instead_of_spinning(impl):
    """Half a second of waiting on a slow fill sleeps, a millisecond at a time at most: it
    does not burn a core spinning or yielding (sched_yield returns at once on an idle core),
    nor wake thousands of times. Counted in the kernel's voluntary context switches of this
    thread (a sleep is one; spinning, yielding and preemption are not), which a busy machine
    can only make fewer; the CPU it used is a small share of the time it waited."""
    import resource

    timeout = 0.5
    arena = FakeArena()
    arena.filling(0, 0, 0)
    thread = getattr(resource, "RUSAGE_THREAD", None)  # Linux
    before = resource.getrusage(thread) if thread is not None else None
    cpu, start = time.thread_time(), time.monotonic()
    assert arena.drain(impl, 0, [0], [0], timeout)[0] == 1
    cpu, waited = time.thread_time() - cpu, time.monotonic() - start
    assert cpu < waited / 4, (cpu, waited)
    if thread is not None:
        sleeps = resource.getrusage(thread).ru_nvcsw - before.ru_nvcsw
        # ~500 here (0 spinning or yielding); at most one per DRAIN_MAX_SLEEP, with slack.
        assert 10 <= sleeps <= 2 * timeout / _fallback.DRAIN_MAX_SLEEP, sleeps


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_drain_is_interruptible(impl):
    """A signal handler's exception (KeyboardInterrupt, here a stand-in) ends a long wait."""
    def interrupt(*_):
        raise Interrupted

    arena = FakeArena()
    arena.filling(0, 0, 0)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        start = time.monotonic()
        with pytest.raises(Interrupted):
            arena.drain(impl, 0, [0], [0], NEVER)
        # Cut short by the signal: a drain that ignored it would raise only at its deadline.
        assert time.monotonic() - start < NEVER
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_native_reads_the_switch_once():
    from expertd import native

    assert native.IMPLEMENTATION == ("python" if native.PURE_PYTHON_FORCED or _native is None
                                     else "cython")


# ---- the client processes --------------------------------------------------------------------

def _say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def session_client(blob_dir: str, layer: int, experts: str) -> None:
    """Fetch ``experts`` of ``layer`` on each "fetch" line; report interrupts; until EOF."""
    from expertd.client.session import Session

    session = Session(blob_dir, reconnect_timeout=5.0)
    group = np.array(sorted(int(e) for e in experts.split(",")), np.int32)
    dest = np.empty(session.staging_bytes(), np.uint8)
    _say(attached=True)
    try:
        for _ in sys.stdin:
            try:
                session.fetch(layer, group, dest)
                _say(fetched=True, late_leases=session.counters["late_leases"])
            except KeyboardInterrupt:
                _say(interrupted=True)
    finally:
        session.close()


def interrupts_client(blob_dir: str, iterations: int, seed: int) -> None:
    """Fetch random groups; SIGINT (raised by this process) at a random moment of each fetch;
    after each interrupt, wait without touching the session until the daemon holds no lease."""
    from expertd.client.session import Session
    from expertd.connection import Connection
    from expertd.protocol import Op

    rng = random.Random(seed)
    session = Session(blob_dir, reconnect_timeout=5.0)
    manifest = session.manifest
    dest = np.empty(session.staging_bytes(), np.uint8)
    observer = Connection(blob_dir)
    arrived = {"waiting": 0, "leased": 0, "other": 0}  # what the client did when SIGINT came

    def interrupt(*_):
        # A real SIGINT, delivered as a user's would be; noted by the phase it falls in.
        arrived["waiting" if session.requester.demands else "leased" if session._leases else "other"] += 1
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGALRM, interrupt)
    errors, max_reap, interrupted = [], 0.0, 0
    demand_time = None  # how long the last uninterrupted fetch that demanded took
    for i in range(iterations):
        layer = rng.randrange(len(manifest.layers))
        n = rng.randint(1, session.max_group)
        group = np.array(sorted(rng.sample(range(manifest.layers[layer].num_experts), n)),
                         np.int32)
        demanded = session.counters["demanded"]
        if demand_time is None or i % 4 == 0:
            start = time.perf_counter()
            session.fetch(layer, group, dest)  # not interrupted: it measures a fetch
            if session.counters["demanded"] > demanded:
                demand_time = time.perf_counter() - start
            continue
        # Every other interrupt aims at the end of a fetch (reply read, copy, release).
        delay = demand_time * (rng.uniform(0.7, 1.1) if i % 2 else rng.uniform(0.0, 1.0))
        try:
            signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-5))
            session.fetch(layer, group, dest)
            signal.setitimer(signal.ITIMER_REAL, 0)
            continue
        except KeyboardInterrupt:
            signal.setitimer(signal.ITIMER_REAL, 0)
            interrupted += 1
        start = time.monotonic()
        while observer.request(Op.STATS, timeout=5.0)["leases"]:
            if time.monotonic() - start > REAP_BOUND:
                errors.append(f"iteration {i}: a lease still held {REAP_BOUND} s after an "
                              f"interrupt")
                break
            time.sleep(0.002)
        max_reap = max(max_reap, time.monotonic() - start)
    observer.close()
    session.close()
    _say(interrupted=interrupted, arrived=arrived, errors=errors[:10], max_reap_s=max_reap,
         counters=session.counters)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "session":
        session_client(rest[0], int(rest[1]), rest[2])
    elif mode == "interrupts":
        interrupts_client(rest[0], int(rest[1]), int(rest[2]))
    else:
        raise SystemExit(f"unknown mode {mode}")
