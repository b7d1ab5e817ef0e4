"""The ZeroMQ wire's own guarantees: a client that leaves frees what it held at once, by
whichever way it leaves (its connection closing, seen by the daemon's socket monitor; a
silence past the ZMTP heartbeat, closed by libzmq), with the registry's own timeout kept out
of the way by a clock that never moves; and several clients on the wire at once.

The serving loop runs in this process (``InProcessDaemon``) with a ``FakeClock``: only the
wire can forget a client here.
"""

import json
import os
import signal

import pytest
from harness import (
    TINY_CACHE_GB,
    FakeClock,
    InProcessDaemon,
    RawClient,
    ZmtpPeer,
    expected_bytes,
    read_json_line,
    spawn_client,
    stop_process,
    wait_until,
)

from expertd.protocol import PROTOCOL_VERSION, Op

pytestmark = pytest.mark.timeout(60)

HELD = ("clients", "leases", "leased_rows", "pinned", "epoch_clients")


def _held(stats: dict) -> dict:
    return {key: stats[key] for key in HELD}


def _pack(body: dict) -> bytes:
    import msgpack

    return msgpack.packb(body, use_bin_type=True)


def test_a_client_killed_with_sigkill_frees_everything_when_its_connection_closes(blobs,
                                                                                  isolated_env):
    """A client process holding leases, pins and an epoch record is SIGKILLed: the kernel
    closes its sockets, the monitor reports the connection, and the daemon frees all of it,
    with the registry's clock standing still (so not by its timeout)."""
    with InProcessDaemon(blobs, "--cache-gb", "0.0015", "--client-timeout", "1.5",
                         "--heartbeat", "0.3", clock=FakeClock()) as d:
        holder = spawn_client("hoard", blobs, 4, json.dumps([[0, [3, 7]], [1, [2]]]))
        try:
            assert read_json_line(holder, 60)["leases"] == 4
            wait_until(lambda: d.stats()["pinned"] == 3, 10, "the three pins to be filled")
            assert _held(d.stats()) == dict(clients=1, leases=4, leased_rows=4, pinned=3,
                                            epoch_clients=1)
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
            wait_until(lambda: _held(d.stats()) == dict.fromkeys(HELD, 0), 10,
                       "the killed client's leases, pins and epoch record to be freed")
        finally:
            stop_process(holder)
        stats = d.stats()
        assert stats["clients_disconnected"] == 1 and stats["clients_timed_out"] == 0


def test_a_silent_peer_is_dropped_by_the_zmtp_heartbeat(blobs, isolated_env):
    """A peer that says hello, takes a lease, then neither writes nor reads (nor answers the
    daemon's pings): libzmq closes its connection once it has been silent for the client
    timeout, and the daemon frees its lease then. Another client, heartbeating meanwhile,
    keeps its own."""
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--client-timeout", "1",
                         "--heartbeat", "0.2", clock=FakeClock()) as d, \
            RawClient(blobs) as other, ZmtpPeer(blobs) as silent:
        body = {"version": PROTOCOL_VERSION, "client": silent.identity, "pid": os.getpid()}
        silent.send([b"hello", bytes([Op.HELLO]), _pack(body)])
        assert silent.reply()[2]["ok"]
        silent.send([b"demand", bytes([Op.DEMAND]), _pack({"layer": 0, "experts": [1, 2]})])
        assert silent.reply()[2]["ok"]
        lease = other.demand(1, [3])["lease"]
        assert _held(d.stats())["leases"] == 2

        def dropped():
            assert other.heartbeat()["known"]  # a client that speaks is kept
            return d.stats()["clients_disconnected"] == 1

        wait_until(dropped, 30, "libzmq to close the silent peer's connection")
        assert silent.closed()
        stats = d.stats()
        assert stats["clients"] == 1 and stats["leases"] == 1 and stats["clients_timed_out"] == 0
        other.release(lease)


def test_clients_on_the_wire_at_once_each_get_exact_rows(blobs, isolated_env):
    """Four clients, each with its own DEALER, demand every expert in turn with their requests
    interleaved on the wire: each reply reaches the client that asked, with the exact bytes."""
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB):
        clients = [RawClient(blobs) for _ in range(4)]
        try:
            m = clients[0].manifest
            keys = [(layer.index, e) for layer in m.layers for e in range(layer.num_experts)]
            for start in range(0, len(keys), len(clients)):
                sent = [(c, key, c.conn.send(Op.DEMAND, {"layer": key[0], "experts": [key[1]]}))
                        for c, key in zip(clients, keys[start:start + len(clients)])]
                for c, (layer, e), rid in sent:
                    reply = c.conn.wait(rid, 10.0)
                    got = c.row_bytes(reply["rows"][0], layer)
                    c.release(reply["lease"])
                    assert got == want[(layer, e)], (layer, e)
        finally:
            for c in clients:
                c.close()
