"""Attacks that the daemon withstands: a hostile client's random op sequences, heartbeats
forged for another client, another client's lease ids, files changed under a serving daemon,
unreadable state files, a SIGKILL in the middle of a shutdown.

Daemons on temporary directories: the serving loop in this process, with a clock the test moves
where a test waits out a timeout, or a process where the test kills it or uses the command
line. Each test is a regression guard for something that held when it was tried by hand (see
the attack report for what did not).
"""

import json
import os
import random
import re
import signal

import numpy as np
import pytest
from harness import (
    TINY_CACHE_GB,
    Daemon,
    FakeClock,
    InProcessDaemon,
    RawClient,
    expected_bytes,
    expertd_cli,
    kill_serving_daemon,
    shm_exists,
    wait_until,
)

from expertd import native
from expertd.connection import Connection
from expertd.errors import DaemonError
from expertd.manifest import Manifest
from expertd.paths import daemon_paths
from expertd.protocol import PROTOCOL_VERSION, ErrorCode, Op, request
from expertd.shm.layout import SlotState

pytestmark = pytest.mark.timeout(60)


def _counters(stats: dict, *names) -> dict:
    return {name: stats[name] for name in names}


class Identity:
    """A raw connection with its own routing id, driven by the random op sequence."""

    def __init__(self, blob_dir):
        self.id = os.urandom(16)
        self.conn = Connection(blob_dir, client_id=self.id)
        self.token = None
        self.leases = []


def test_random_op_sequences_from_many_identities_leave_nothing_behind(blobs, isolated_env):
    """Eight identities send 4000 random requests (hello again with other pids, demands past the
    cap, releases of others' and unknown lease ids, pins past the cap, unpins, prefetches,
    heartbeats with wrong tokens or for other clients, goodbye in the middle): no handler
    fails, and once every identity says goodbye no client, lease, queued demand or pin is
    left."""
    rng = random.Random(7)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB) as d:
        n_layers = len(Manifest.load(blobs).layers)
        peers = [Identity(blobs) for _ in range(8)]
        try:
            ops = [Op.HELLO, Op.HELLO, Op.DEMAND, Op.DEMAND, Op.DEMAND, Op.RELEASE, Op.RELEASE,
                   Op.PIN, Op.UNPIN, Op.GOODBYE, Op.PREFETCH, Op.HEARTBEAT]
            for n in range(4000):
                p = rng.choice(peers)
                op = rng.choice(ops)
                if op is Op.HELLO:
                    body = {"version": PROTOCOL_VERSION, "client": p.id,
                            "pid": rng.randint(0, 10**6)}
                elif op is Op.RELEASE:
                    other = rng.choice(peers)
                    body = {"lease": rng.choice(other.leases) if other.leases and rng.random() < .8
                            else rng.randint(0, n + 5)}
                elif op is Op.HEARTBEAT:
                    body = {"client": p.id if rng.random() < .7 else rng.choice(peers).id,
                            "token": p.token if p.token and rng.random() < .7 else os.urandom(16)}
                elif op is Op.GOODBYE:
                    body = {}
                else:
                    body = {"layer": rng.randrange(n_layers + 1),  # one past the last, too
                            "experts": rng.sample(range(17), rng.choice([1, 2, 4, 4, 5]))}
                p.conn.send_frames(request(b"%d" % n, op, body))
                for q in peers:
                    while q.conn.poll(0):
                        _, _, reply = q.conn.recv()
                        if reply.get("ok") and "token" in reply:
                            q.token = reply["token"]
                        if reply.get("ok") and "lease" in reply:
                            q.leases.append(reply["lease"])
            stats = d.stats()
            assert stats["internal_errors"] == 0, d.log_text()
            assert stats["bad_requests"] > 0  # the sequence did reach the error paths
            for p in peers:
                p.conn.send_frames(request(b"bye", Op.GOODBYE, {}))
            wait_until(lambda: _counters(d.stats(), "clients", "leases", "leased_rows",
                                         "queued") == dict(clients=0, leases=0, leased_rows=0,
                                                           queued=0),
                       10, "every identity's clients, leases and queued demands to go")
            assert d.stats()["pinned"] == 0  # a fresh state dir: no pin outlives its client
            assert d.stats()["internal_errors"] == 0
        finally:
            for p in peers:
                p.conn.close()


def test_forged_heartbeats_do_not_keep_a_silent_client_alive(blobs, isolated_env):
    """A client that holds a lease and goes silent is timed out even while another peer sends
    heartbeats naming it (with a wrong token) and tries to release its lease by id."""
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--client-timeout", "1.5",
                         "--heartbeat", "0.3", clock=FakeClock()) as d:
        victim = RawClient(blobs)
        attacker = RawClient(blobs)
        try:
            lease = victim.demand(0, [0, 1])["lease"]
            for guess in range(lease + 5):
                attacker.release(guess)
            assert d.stats()["leases"] == 1  # the victim's lease is the victim's alone
            forged = {"client": victim.conn.client_id, "token": os.urandom(16)}
            deadline = d.clock() + 15
            while d.stats()["clients"] > 1:
                reply = attacker.request(Op.HEARTBEAT, forged)
                assert reply["known"] is False
                attacker.heartbeat()  # the attacker itself stays alive
                assert d.clock() < deadline, "the silent client was never timed out"
                d.advance(0.1)
            stats = d.stats()
            assert stats["leases"] == 0 and stats["clients_timed_out"] == 1
        finally:
            victim.close()
            attacker.close()


def test_a_blob_truncated_under_a_serving_daemon_fails_by_name(blob_dir, isolated_env):
    """A blob file cut short while the daemon serves: a demand for an expert past the new end
    fails with an I/O error naming the file and the expert, never a row of zeros, and the
    daemon keeps serving the other layers."""
    with InProcessDaemon(blob_dir, "--cache-gb", TINY_CACHE_GB) as d, RawClient(blob_dir) as c:
        m = c.manifest
        last = m.layers[-1]
        os.truncate(blob_dir / last.file, 2 * m.stride + 5)
        experts = list(range(last.num_experts - 2, last.num_experts))
        with pytest.raises(DaemonError) as err:
            c.demand(last.index, experts)
        assert err.value.code == ErrorCode.IO
        assert last.file in str(err.value) and "short read" in str(err.value)
        # Both reads fail; the pool reports whichever failed first, by its number.
        assert re.search(rf"expert ({'|'.join(map(str, experts))})\b", str(err.value))
        assert len(c.fetch(0, [0, 1])) == 2
        stats = d.stats()
        assert stats["fill_errors"] >= 1 and stats["internal_errors"] == 0
        assert stats["leases"] == 0  # the failed demand's lease was dropped


@pytest.mark.parametrize("content", [
    b"not json at all",
    b"[]",
    b"null",
    b'{"policy": {"format": "expertd-policy", "version": 1, "frequencies": [[0, 0, "x"]], '
    b'"pins": []}}',
    b'{"policy": {"format": "expertd-policy", "version": 1, "frequencies": [], '
    b'"pins": [[true, 0]]}, "hot": 5}',
    b'{"policy": {"format": "expertd-policy", "version": 1, "frequencies": [], "pins": []}, '
    b'"hot": [[-1, 0], [0, "a"], [99999, 0], [0, 1e400]]}',
    "directory",
], ids=["garbage", "list", "null", "bad-frequency", "bad-pin", "bad-hot", "directory"])
def test_an_unreadable_state_file_never_stops_a_start(blobs, isolated_env, tmp_path, content):
    state = tmp_path / "state.json"
    if content == "directory":
        state.mkdir()
    else:
        state.write_bytes(content)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB,
                         "--state-file", state) as d, RawClient(blobs) as c:
        assert len(c.fetch(0, [0, 1, 2])) == 3
        assert d.stats()["pinned"] == 0


def test_a_default_state_file_nested_too_deeply_is_ignored_with_one_log_line(blobs, isolated_env):
    """'[' * 5000 + ']' * 5000 as the default state file (RecursionError in json): expertd start
    serves, and its log says so in one line."""
    paths = daemon_paths(blobs)
    paths.state_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths.state_file.write_bytes(b"[" * 5000 + b"]" * 5000)
    try:
        started = expertd_cli("start", "--blobs", blobs, "--cache-gb", TINY_CACHE_GB)
        assert started.returncode == 0 and "Traceback" not in started.stderr, started
        with RawClient(blobs) as c:
            assert len(c.fetch(0, [0, 1])) == 2
        lines = [line for line in paths.log.read_text().splitlines() if "state file" in line]
        assert len(lines) == 1 and lines[0].endswith(
            f"ignoring unreadable state file {paths.state_file}: nested too deeply"), lines
    finally:
        kill_serving_daemon(blobs)


def test_sigkill_in_the_middle_of_a_shutdown_is_cleaned_by_the_next_start(blobs, isolated_env):
    """SIGTERM and, right after it, SIGKILL (a shutdown cut short, demands in flight): the next
    start removes the arena and socket that were left and serves."""
    first = Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB)
    try:
        with RawClient(blobs) as c:
            for layer in range(len(c.manifest.layers)):
                c.fetch(layer, [0, 1, 2, 3])
            c.conn.send(Op.DEMAND, {"layer": 0, "experts": [4, 5, 6, 7]})
            first.proc.send_signal(signal.SIGTERM)
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(10)
        assert first.proc.returncode in (-signal.SIGKILL, 0, 128 + signal.SIGTERM)
        with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as second:
            assert second.arena != first.arena
            assert not shm_exists(first.arena)
            with RawClient(blobs) as c:
                assert len(c.fetch(0, [0, 1])) == 2
    finally:
        first.close(check=False)


def test_state_file_left_by_a_stopped_daemon_holds_no_client_pin(blobs, isolated_env, tmp_path):
    """A client pins the most it may and vanishes without a goodbye; after its timeout and a
    clean stop, the saved hot set lists no pin."""
    state = tmp_path / "state.json"
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--state-file", state,
                         "--client-timeout", "1.5", "--heartbeat", "0.3", clock=FakeClock()) as d:
        c = RawClient(blobs)
        try:
            pins = c.hello["cache_rows"] // 4
            assert c.request(Op.PIN, {"layer": 0, "experts": list(range(pins))})["pinned"] == pins
            with pytest.raises(DaemonError):
                c.request(Op.PIN, {"layer": 1, "experts": [0]})
        finally:
            c.close()  # no goodbye: the daemon must notice the silence
        d.advance(1.5 + 0.1)
        wait_until(lambda: d.stats()["clients"] == 0, 10, "the silent client to time out")
        assert d.stats()["pinned"] == 0
        assert d.stop() == 0
    assert json.loads(state.read_text())["policy"]["pins"] == []


@pytest.mark.timeout(120)
def test_a_client_scribbling_on_the_slot_table_stops_no_daemon_and_misleads_no_lookup(
        blobs, isolated_env):
    """Every client maps the arena read-write (its use counters, its epoch record), so a buggy
    one can write anywhere in it. The daemon decides from its own copy of the slot table, and
    a client's lookup bounds the row numbers it reads: a key out of range with a use counted
    (it stopped the daemon at its next harvest), a use counter moved back (2**64 - 1 uses:
    every STATS reply failed), a row number past the records in slot_of (a DEMAND failed
    inside the daemon; the native lookup read past the records), every row marked filling
    (nothing was evictable: demands waited for good). Each misleads nothing."""
    want = expected_bytes(blobs)
    with Daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d, \
            RawClient(blobs) as hostile, RawClient(blobs) as honest:
        honest.fill_cache(0)
        g = hostile.arena.geometry
        recs = hostile.arena.slots[:g.total_rows]
        ready = np.flatnonzero(recs["state"] == SlotState.READY)
        uses = d.stats()["client_hits"]
        recs["layer"][ready[0]] = 999
        recs["hits"][ready[0]] += 1  # a use of a row whose key is out of range
        back = recs["hits"][ready[1]]
        recs["hits"][ready[1]] = back - 1 if back else 2**64 - 1  # a counter moved back
        wait_until(lambda: d.stats()["client_hits"] == uses + 1, 30,
                   "the use to be harvested (the daemon's own key credits it)")

        layer, expert = 1, 3
        hostile.arena.slot_of[layer * g.n_experts + expert] = 2**31 - 1
        slots, versions, filling = (np.empty(1, t) for t in (np.int32, np.uint64, np.int32))
        missing = native.remap(honest.raw, g.slot_of_offset, g.slots_offset, g.n_experts,
                               g.total_rows, layer, np.array([expert], np.int32), slots,
                               versions, filling)
        assert (missing, slots[0], filling[0]) == (1, -1, -1)  # a miss, nothing read
        recs["state"][:] = SlotState.FILLING  # every row, as if being filled for good
        for layer in range(1, len(honest.manifest.layers)):  # more experts than rows
            for e in range(honest.manifest.layers[layer].num_experts):
                assert honest.fetch(layer, [e]) == [want[(layer, e)]], (layer, e)
        stats = d.stats()
        assert stats["internal_errors"] == 0 and d.proc.poll() is None
        assert stats["client_hits"] < 2**32
