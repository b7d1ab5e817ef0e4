"""The epoch table attacked by hostile or careless local clients (docs/ARCHITECTURE.md, "Epochs").

Every client maps the arena read-write, so any of them can write any record. What must hold
whatever they write: the daemon keeps serving the others, and a refill waits at most the lease
bound for a step that does not end. What must hold for a careless client (one stopped long
enough to be forgotten, whose record may then go to someone else): its step's end must not take
a step the daemon stopped protecting for a good one, and it must not unprotect the record's new
owner. The daemon admits fewer clients than the table has records; should records run out all
the same, a client without one copies rows on the host.
"""

import os

import numpy as np
import pytest
from client_helpers import ROWS_MEDIUM, client_flags, pool_gb, routed_model
from harness import (
    TINY_CACHE_GB,
    FakeClock,
    InProcessDaemon,
    RawClient,
    expected_bytes,
    read_json_line,
    spawn_client,
    stop_process,
    wait_until,
)
from test_daemon_epochs import EVICTING, check_reply, evict_held, record
from test_step import Lockstep, resident_model

from expertd import native
from expertd.client import load
from expertd.client.arena_view import StepEpoch
from expertd.client.session import Session
from expertd.errors import DaemonError
from expertd.protocol import ErrorCode, Op
from expertd.serving.clients import MAX_CLIENTS
from expertd.shm.layout import EPOCH_DTYPE, EPOCH_SLOTS

HUGE = 2**64 - 1  # the largest u64, odd
STEP, LOST, PID = (EPOCH_DTYPE.fields[name][1] for name in ("step", "lost", "pid"))
# Timeouts of the FakeClock tests: a client silent for 1.5 s is forgotten, a step that holds a
# refill for 2 s loses its epoch.
FORGETFUL = ("--client-timeout", "1.5", "--heartbeat", "0.3", "--lease-timeout", "30")
BOUNDED = ("--client-timeout", "60", "--heartbeat", "0.5", "--lease-timeout", "2")


def at(client: RawClient, slot: int, field: int) -> int:
    return client.arena.geometry.epochs_offset + slot * EPOCH_DTYPE.itemsize + field


def scribble(client: RawClient, field: int, value: int) -> None:
    """Write ``value`` into ``field`` of every record of the table."""
    for slot in range(EPOCH_SLOTS):
        native.publish_u64(client.raw, at(client, slot, field), value)


def step_epoch(client: RawClient) -> StepEpoch:
    """The client's record as a pulling session holds it (client/pull.py)."""
    return StepEpoch(client.raw, at(client, client.hello["epoch_slot"], 0))


def forget(d: InProcessDaemon, alive: list) -> None:
    """Move the clock past the client timeout while the clients of ``alive`` heartbeat: every
    other client is forgotten."""
    d.advance(1.0)
    for client in alive:
        client.heartbeat()
    d.advance(0.6)


def serving(d: InProcessDaemon, client: RawClient) -> dict:
    """The daemon still serves: its loop runs, it answers, it raised nothing."""
    assert d.poll() is None
    stats = client.request(Op.STATS)
    assert stats["internal_errors"] == 0, stats
    return stats


# ---- hostile writes -------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_odd_steps_written_into_every_record_hold_refills_back_only_to_the_lease_bound(
        blobs, isolated_env):
    """A client writes the largest odd step into every record (its own, the other clients',
    the free ones), garbage into ``lost`` and ``pid``, and never ends: each refill it holds
    back waits at most the lease bound, the others' demands for present rows are served
    meanwhile, and a newcomer's record is clean."""
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, *BOUNDED, clock=FakeClock()) as d, \
            RawClient(blobs) as victim, RawClient(blobs) as hostile, RawClient(blobs) as other:
        other.fill_cache(0)
        for field, value in ((STEP, HUGE), (LOST, HUGE - 2), (PID, HUGE)):
            scribble(hostile, field, value)
        rid, rows, stats = evict_held(other, want)
        # Held back, the daemon serves the rest: present rows, stats, the victim's requests.
        present = [e for e in range(other.hello["cache_rows"]) if other.slot(0, e)[0] >= 0]
        assert present and all(other.slot(0, e)[0] not in rows for e in present)
        reply = victim.demand(0, present[:2])
        assert reply["rows"] == [other.slot(0, e)[0] for e in present[:2]]
        victim.release(reply["lease"])
        assert serving(d, victim)["epochs_lost"] == 0
        d.advance(1.5)
        assert not other.conn.poll(0)
        d.advance(0.6)
        reply = other.conn.wait(rid, 20)
        check_reply(other, reply, want)
        other.release(reply["lease"])
        attached = sorted(c.hello["epoch_slot"] for c in (victim, hostile, other))
        assert serving(d, other)["epochs_lost"] == len(attached)
        for slot in attached:  # each record given out lost the step written into it
            assert record(other, slot)[:2] == (HUGE, HUGE)
        # The same step again holds nothing back; a later odd one (wrapped past 2**64) holds
        # again, to the bound. (One just below the lost step is covered by that loss.)
        other.release(other.conn.wait(other.conn.send(Op.DEMAND, {"layer": 2, "experts": [0, 1]}),
                                      20)["lease"])
        assert serving(d, other)["deferred_fills"] == 4
        scribble(hostile, STEP, (HUGE + 4) % 2**64)
        rid = other.conn.send(Op.DEMAND, {"layer": 2, "experts": [2, 3]})
        assert serving(d, other)["deferred_fills"] > 4
        d.advance(2.1)
        other.conn.wait(rid, 20)
        assert serving(d, other)["epochs_lost"] == 2 * len(attached)
        with RawClient(blobs) as newcomer:  # a record given out is zeroed, whatever was in it
            assert record(newcomer, newcomer.hello["epoch_slot"]) == (0, 0, os.getpid())


def test_a_record_no_longer_ours_is_never_written_and_its_steps_are_lost():
    """StepEpoch on a bare record: while the daemon's pid and the last step it published are
    in it, steps end well; once either changes (the record zeroed by a detach, given to
    another client, or scribbled on), the step in progress and every later one are lost and
    the record is never written again."""
    for field, value in ((PID, 0), (PID, 4242), (STEP, 0), (STEP, 8)):
        raw = np.zeros(EPOCH_DTYPE.itemsize, np.uint8)
        native.publish_u64(raw, PID, 1234)  # as the daemon gives a record out
        epoch = StepEpoch(raw, 0)
        epoch.begin()
        assert epoch.owned() and not epoch.end() and epoch.owned()
        epoch.begin()
        native.publish_u64(raw, field, value)  # the record stops being ours mid-step
        assert epoch.end() and not epoch.owned()
        epoch.begin()
        assert epoch.end()
        assert native.read_u64(raw, field) == value
        assert native.read_u64(raw, STEP) == (value if field == STEP else 3)


# ---- careless clients: forgotten while stopped ------------------------------------------------

@pytest.mark.timeout(60)
def test_a_client_forgotten_between_steps_does_not_trust_its_next_step(blobs, isolated_env):
    """A client stopped between steps longer than the client timeout is forgotten: its record
    is free, the daemon protects nothing it reads. Resumed, it begins a step (it has not made a
    request, so nothing told it) and reads rows that are refilled under it: that step's end
    must say so, and the client must not write the free record."""
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, *FORGETFUL, clock=FakeClock()) as d, \
            RawClient(blobs) as stale, RawClient(blobs) as other:
        other.fill_cache(0)
        slot = stale.hello["epoch_slot"]
        epoch = step_epoch(stale)
        epoch.begin()
        assert not epoch.end()  # a step while attached
        forget(d, [other])
        assert record(other, slot) == (0, 0, 0)  # forgotten: the record is free
        epoch.begin()  # resumed: the next step begins
        looked_up = {stale.slot(0, e)[0]: e for e in range(stale.hello["cache_rows"])}
        before = serving(d, other)
        layer, experts = EVICTING
        reply = other.demand(layer, experts)  # nothing holds it back: nobody is inside a step
        assert serving(d, other)["deferred_fills"] == before["deferred_fills"]
        check_reply(other, reply, want)
        assert set(reply["rows"]) <= set(looked_up)  # rows the stale client may be reading
        assert epoch.end(), "a step the daemon did not protect was taken for a good one"
        assert record(other, slot)[0] == 0, "the forgotten client wrote a free record"


@pytest.mark.timeout(120)
def test_a_client_whose_record_went_to_another_neither_trusts_its_step_nor_unprotects_it(
        blobs, isolated_env):
    """A client stopped inside a step is forgotten (its step revoked); clients come and go
    until its record is given to a newcomer, another process inside a step. Resumed, the
    stale client's step end must still see the revocation, and must not write the newcomer's
    record, whose step protects the newcomer's rows."""
    want = expected_bytes(blobs)
    newcomer = None
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, *FORGETFUL, clock=FakeClock()) as d, \
            RawClient(blobs) as stale, RawClient(blobs) as other:
        try:
            slot = stale.hello["epoch_slot"]
            other.fill_cache(0)
            epoch = step_epoch(stale)
            epoch.begin()
            forget(d, [other])
            assert record(other, slot) == (0, epoch.step, 0)  # revoked, free
            # A freed record is given out last: every other free one goes first.
            given = []
            while len(given) < EPOCH_SLOTS - 2:
                with RawClient(blobs) as passing:
                    given.append(passing.hello["epoch_slot"])
            assert slot not in given
            newcomer = spawn_client("step", blobs, 1)  # another process, inside its step 1
            got = read_json_line(newcomer, 20)
            assert got["slot"] == slot and record(other, slot) == (1, 0, newcomer.pid)
            lost = epoch.end()
            assert record(other, slot) == (1, 0, newcomer.pid), \
                "the stale client wrote the newcomer's record"
            assert lost, "the revoked step was taken for a good one (its revocation was wiped)"
            # The newcomer's step still holds back the refills of rows evicted under it.
            rid, _, _ = evict_held(other, want)
            stop_process(newcomer)
            check_reply(other, other.conn.wait(rid, 20), want)
            assert serving(d, other)["epochs_lost"] == 0
        finally:
            stop_process(newcomer)


# ---- more clients than records ------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_every_client_the_daemon_admits_gets_a_record(blobs, isolated_env):
    """The daemon admits MAX_CLIENTS at once, fewer than the table's records: each admitted
    client gets a record of its own, the next is refused (busy) while the others are served,
    and 300 clients coming and going never run the table out."""
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB,
                         "--clients-per-process", str(2 * MAX_CLIENTS)) as d:
        clients = []
        try:
            while True:
                try:
                    clients.append(RawClient(blobs))
                except DaemonError as exc:
                    assert exc.code == ErrorCode.BUSY
                    break
            assert len(clients) == MAX_CLIENTS < EPOCH_SLOTS
            slots = [c.hello["epoch_slot"] for c in clients]
            assert min(slots) >= 0 and len(set(slots)) == len(slots)
            assert clients[-1].fetch(1, [0, 1])
            assert serving(d, clients[0])["epoch_clients"] == MAX_CLIENTS
        finally:
            for client in clients:
                client.close()
        wait_until(lambda: d.stats()["clients"] == 0, 20, "the clients to be gone")
        for _ in range(300):
            with RawClient(blobs) as passing:
                assert passing.hello["epoch_slot"] >= 0
        # Each goodbye is handled in its own time (the stats come over another connection):
        # the registry empties, it does not keep the 300.
        wait_until(lambda: d.stats()["clients"] == 0, 20, "the passing clients to be gone")


@pytest.mark.timeout(120)
def test_a_client_without_a_record_copies_on_the_host_exactly(models, isolated_env, tmp_path,
                                                              monkeypatch):
    """Records run out (a daemon whose table gives out two): the third client's hello says
    -1, its session has no puller and no record, and it decodes exactly as resident mlx-lm on
    the per-layer path, its demands served; once a record is free, a new session pulls."""
    import expertd.serving.epoch_fills as epoch_fills

    book = epoch_fills.EpochBook
    monkeypatch.setattr(epoch_fills, "EpochBook", lambda hold, slots: book(hold, slots=2))
    model_dir, blob_dir = routed_model(models, "qwen3_moe", "affine", 4)
    flags = client_flags(blob_dir, ROWS_MEDIUM, tmp_path / "s.json", client_timeout=600.0)
    with InProcessDaemon(blob_dir, *flags) as d, RawClient(blob_dir) as first, \
            RawClient(blob_dir) as second:
        assert sorted([first.hello["epoch_slot"], second.hello["epoch_slot"]]) == [0, 1]
        model, _ = load(blob_dir, pool_gb=pool_gb(blob_dir, 4), prefetch="off",
                        pool_backing="device", pull="host", speculate="on")
        session = model.expertd_session
        try:
            assert session.session.hello["epoch_slot"] == -1
            assert session.puller is None and session.step_epoch is None
            run = Lockstep(resident_model(model_dir), model, prompt_len=5)
            for _ in range(8):
                run.step()
            assert session.counters["pulled_steps"] == 0 and session.counters["steps"] == 9
        finally:
            session.close()
        second.conn.send(Op.GOODBYE, {})
        wait_until(lambda: serving(d, first)["epoch_clients"] == 1, 20,
                   "the record of the client that left to be free")
        pulling = Session(blob_dir, pull="host")
        try:
            assert pulling.hello["epoch_slot"] == second.hello["epoch_slot"]
            assert pulling.puller is not None and pulling.step_epoch is not None
        finally:
            pulling.close()
