"""Reclamation by epochs, against the real serving loop (docs/ARCHITECTURE.md, "Epochs").

A client publishes in its epoch record, through the arena mapping, the step it is in; a row
evicted while that step is odd keeps its old bytes (its refill is held back, the row FILLING
for its new key) until the step changes, the client loses its epoch (a step longer than the
lease bound) or the client goes away (a step it was inside is revoked then). The tests write
the record as a client would (``native.publish_u64``) and read it as the daemon does
(``native.read_u64``).
"""

import os

import pytest
from harness import (
    TINY_CACHE_GB,
    FakeClock,
    InProcessDaemon,
    RawClient,
    expected_bytes,
    read_json_line,
    spawn_client,
    stop_process,
    validate,
)

from expertd import native
from expertd.errors import DaemonError
from expertd.protocol import PROTOCOL_VERSION, ErrorCode, Op
from expertd.shm.layout import EPOCH_DTYPE, SlotState

FIELDS = [EPOCH_DTYPE.fields[name][1] for name in ("step", "lost", "pid")]
EVICTING = (1, [0, 1, 2, 3])  # a demand for 4 experts of layer 1 once layer 0 fills the cache


def record(client: RawClient, slot: int) -> tuple:
    """``(step, lost, pid)`` of epoch record ``slot``, as the daemon reads it."""
    base = client.arena.geometry.epochs_offset + slot * EPOCH_DTYPE.itemsize
    return tuple(native.read_u64(client.raw, base + field) for field in FIELDS)


def publish_step(client: RawClient, step: int) -> None:
    """Publish ``step`` in the client's own record, as a client entering or leaving a step."""
    base = client.arena.geometry.epochs_offset + client.hello["epoch_slot"] * EPOCH_DTYPE.itemsize
    native.publish_u64(client.raw, base + FIELDS[0], step)


def evict_held(client: RawClient, want: dict) -> tuple:
    """With layer 0 filling every cache row, send the EVICTING demand and check that its
    refills were held back: no read started, each row FILLING for its new key inside a
    seqlock write, and still holding the bytes of the layer-0 expert it had.

    Returns:
        ``(request id, rows taken, the STATS after the demand was handled)``.
    """
    old = {client.slot(0, e)[0]: e for e in range(client.hello["cache_rows"])}
    assert -1 not in old
    before = client.request(Op.STATS)
    layer, experts = EVICTING
    rid = client.conn.send(Op.DEMAND, {"layer": layer, "experts": experts})
    stats = client.request(Op.STATS)  # same connection: answered after the demand was handled
    assert stats["deferred_fills"] - before["deferred_fills"] == len(experts), stats
    assert (stats["in_flight"], stats["fills"]) == (0, before["fills"]), stats
    rows = []
    for e in experts:
        row, state, version = client.slot(layer, e)
        assert row in old and state == SlotState.FILLING and version % 2 == 1
        assert client.row_bytes(row, 0) == want[(0, old[row])], "a held row was rewritten"
        rows.append(row)
    return rid, rows, stats


def check_reply(client: RawClient, reply: dict, want: dict) -> None:
    layer, experts = EVICTING
    assert validate(client.raw, client.slots_offset, reply["rows"], reply["versions"])
    assert [client.row_bytes(r, layer) for r in reply["rows"]] == [want[(layer, e)] for e in experts]


@pytest.mark.timeout(60)
def test_a_row_evicted_inside_a_step_is_refilled_only_once_that_step_ends(blobs, isolated_env):
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB), RawClient(blobs) as reader, \
            RawClient(blobs) as other, RawClient(blobs) as third:
        slot = reader.hello["epoch_slot"]
        assert slot >= 0 and len({slot, other.hello["epoch_slot"], third.hello["epoch_slot"]}) == 3
        assert record(reader, slot) == (0, 0, os.getpid())
        other.fill_cache(0)
        publish_step(reader, 1)  # inside a step: its device may read any row it looked up
        rid, rows, stats = evict_held(other, want)
        assert (stats["epoch_clients"], stats["epochs_lost"]) == (3, 0)
        # Another client's demand for a key being held waits on the same fill.
        rid3 = third.conn.send(Op.DEMAND, {"layer": EVICTING[0], "experts": EVICTING[1][:1]})
        assert third.request(Op.STATS)["deferred_fills"] == 4
        assert not other.conn.poll(0) and not third.conn.poll(0)
        publish_step(reader, 2)  # the step is over
        reply = other.conn.wait(rid, 20)
        assert reply["rows"] == rows
        check_reply(other, reply, want)
        assert third.conn.wait(rid3, 20)["rows"] == rows[:1]
        stats = other.request(Op.STATS)
        assert (stats["deferred_fills"], stats["epochs_lost"], stats["fill_errors"]) == (4, 0, 0)
        assert record(reader, slot) == (2, 0, os.getpid())  # the daemon writes no step


@pytest.mark.timeout(60)
def test_a_step_past_the_lease_bound_loses_its_epoch_and_the_refill_proceeds(blobs, isolated_env):
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--lease-timeout", "2",
                         "--client-timeout", "5", "--heartbeat", "0.5", clock=FakeClock()) as d, \
            RawClient(blobs) as reader, RawClient(blobs) as other:
        slot = reader.hello["epoch_slot"]
        other.fill_cache(0)
        publish_step(reader, 7)
        rid, rows, _ = evict_held(other, want)
        d.advance(1.5)  # within the bound: still held
        stats = other.request(Op.STATS)
        assert (stats["in_flight"], stats["epochs_lost"]) == (0, 0), stats
        assert record(reader, slot) == (7, 0, os.getpid())
        assert all(other.slot(EVICTING[0], e)[1] == SlotState.FILLING for e in EVICTING[1])
        d.advance(0.6)  # 2.1 s in step 7 since the row waited for it
        reply = other.conn.wait(rid, 20)
        check_reply(other, reply, want)
        assert record(reader, slot) == (7, 7, os.getpid())  # the client will replay step 7
        stats = other.request(Op.STATS)
        assert (stats["epochs_lost"], stats["deferred_fills"]) == (1, 4), stats
        # A lost step protects nothing any more: the next eviction is not held back.
        other.release(reply["lease"])
        other.fetch(2, [0, 1, 2, 3])
        stats = other.request(Op.STATS)
        assert (stats["epochs_lost"], stats["deferred_fills"]) == (1, 4), stats
        # The client's next step protects its reads again.
        publish_step(reader, 9)
        rid = other.conn.send(Op.DEMAND, {"layer": 1, "experts": [4, 5]})
        assert other.request(Op.STATS)["deferred_fills"] == 6
        publish_step(reader, 10)
        other.conn.wait(rid, 20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["goodbye", "timeout"])
def test_a_client_that_leaves_frees_its_record_and_the_refills_it_held(blobs, isolated_env, how):
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--client-timeout", "1.5",
                         "--heartbeat", "0.3", clock=FakeClock()) as d, RawClient(blobs) as other:
        with RawClient(blobs) as reader:
            slot = reader.hello["epoch_slot"]
            publish_step(reader, 1)
            again = reader.request(Op.HELLO, {"version": PROTOCOL_VERSION,
                                              "client": reader.conn.client_id, "pid": os.getpid()})
            assert again["epoch_slot"] == slot and record(other, slot) == (1, 0, os.getpid())
            other.fill_cache(0)
            rid, _, _ = evict_held(other, want)
            if how == "goodbye":
                reader.conn.send(Op.GOODBYE, {})
            else:  # the reader goes silent; the other client heartbeats
                d.advance(1.0)
                other.heartbeat()
                d.advance(0.6)
            check_reply(other, other.conn.wait(rid, 20), want)
            assert record(other, slot) == (0, 1, 0)  # its step 1 revoked, the record free
        stats = other.request(Op.STATS)
        assert (stats["clients"], stats["epoch_clients"], stats["epochs_lost"]) == (1, 1, 0)
        with RawClient(blobs) as newcomer:  # a freed record is given out last
            assert newcomer.hello["epoch_slot"] not in (slot, other.hello["epoch_slot"], -1)


@pytest.mark.timeout(60)
def test_a_client_killed_inside_a_step_holds_no_refill_back(blobs, isolated_env):
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB), RawClient(blobs) as other:
        other.fill_cache(0)
        proc = spawn_client("step", blobs, 1)
        try:
            slot = read_json_line(proc, 20)["slot"]
            assert record(other, slot) == (1, 0, proc.pid)
            rid, _, _ = evict_held(other, want)
            proc.kill()
            proc.wait(10)
            check_reply(other, other.conn.wait(rid, 20), want)
        finally:
            stop_process(proc)
        assert record(other, slot) == (0, 1, 0)  # its step 1 revoked, the record free
        stats = other.request(Op.STATS)
        assert (stats["clients_disconnected"], stats["epoch_clients"]) == (1, 1)


@pytest.mark.timeout(60)
def test_stopping_with_refills_held_back_fails_their_demands_and_ends_them(blobs, isolated_env):
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB) as d, RawClient(blobs) as reader, \
            RawClient(blobs) as other:
        other.fill_cache(0)
        publish_step(reader, 1)
        rid, rows, _ = evict_held(other, want)
        assert d.stop() == 0
        with pytest.raises(DaemonError) as err:
            other.conn.wait(rid, 20)
        assert err.value.code == ErrorCode.SHUTTING_DOWN
        for row in rows:  # ended as failed fills: empty, out of their seqlock write
            rec = other.arena.slots[row]
            assert int(rec["state"]) == SlotState.EMPTY and int(rec["version"]) % 2 == 0
