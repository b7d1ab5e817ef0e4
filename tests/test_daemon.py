"""End-to-end tests of the expertd daemon: real shared memory, real sockets, real processes
where a test needs one.

Each test starts its own daemon on the session's tiny model (3 MoE layers of 16 experts, 16 KiB
rows) in per-test runtime and state directories: the serving loop in this process
(``InProcessDaemon``) for the protocol, an ``expertd start --foreground`` process for what
needs one (a daemon killed, the command line, file permissions). Faults are injected by killing
processes and corrupting blob files.
"""

import json
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_helpers import FAST_TIMEOUTS
from harness import (
    SMALL_CACHE_GB,
    TINY_CACHE_GB,
    FakeClock,
    InProcessDaemon,
    RawClient,
    arena_owner,
    expected_bytes,
    expertd_cli,
    kill_serving_daemon,
    query_stats,
    read_json_line,
    running_daemon,
    shm_exists,
    shm_mode,
    spawn_client,
    stop_process,
    wait_until,
)

from expertd.errors import DaemonError
from expertd.manifest import Manifest
from expertd.paths import daemon_paths
from expertd.protocol import PROTOCOL_VERSION, ErrorCode, Op
from expertd.shm.layout import SlotState


def _groups(experts, size):
    return [experts[i:i + size] for i in range(0, len(experts), size)]


def _pressure(client, skip=(), rounds=2, group=4):
    """Demand every expert of every layer but ``skip``, in groups, ``rounds`` times."""
    for _ in range(rounds):
        for layer in client.manifest.layers:
            experts = [e for e in range(layer.num_experts) if (layer.index, e) not in skip]
            for chunk in _groups(experts, group):
                client.fetch(layer.index, chunk)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---- exact bytes ---------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("cache_gb", [SMALL_CACHE_GB, TINY_CACHE_GB], ids=["fits", "evicts"])
def test_demand_returns_the_exact_bytes_of_every_expert(blobs, isolated_env, cache_gb):
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", cache_gb), RawClient(blobs) as c:
        rows = c.hello["cache_rows"]
        group = min(4, c.hello["max_demand"])
        # Forward, then backward: with a tiny cache the second pass refills evicted rows.
        for order in (1, -1):
            for layer in c.manifest.layers:
                for chunk in _groups(list(range(layer.num_experts))[::order], group):
                    for e, data in zip(chunk, c.fetch(layer.index, chunk)):
                        assert data == want[(layer.index, e)], f"layer {layer.index} expert {e}"
        stats = c.request(Op.STATS)
    assert stats["arena_rows"] == rows
    assert stats["fill_errors"] == 0
    if rows >= len(want):
        assert stats["fills"] == stats["misses"] == len(want)  # the second pass only hit
    else:
        assert rows == 10
        # At most `rows` experts can survive from the first pass to the second.
        assert stats["fills"] >= 2 * len(want) - rows
        assert stats["rows_used"] <= rows


# ---- several client processes under eviction pressure ----------------------------------------

@pytest.mark.timeout(120)
def test_concurrent_clients_under_eviction_never_read_torn_rows(blobs, isolated_env, tmp_path):
    n_clients, iterations = 4, 400
    stop_file = tmp_path / "stop-readers"
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, "--workers", "4"):
        with RawClient(blobs) as probe:
            assert probe.hello["cache_rows"] == 10  # far less than 4 clients x 2-4 experts
        reader = spawn_client("lockfree", blobs, stop_file, 7, 60)
        clients = [spawn_client("leased", blobs, iterations, seed) for seed in range(n_clients)]
        deadline = time.monotonic() + 60
        results = []
        try:
            for proc in clients:
                try:
                    out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pytest.fail(f"client pid {proc.pid} did not finish {iterations} demands "
                                "within 60 s (livelock or lost reply)")
                assert proc.returncode == 0, f"client failed: {out}\n{err}"
                results.append(json.loads(out))
        finally:
            stop_file.touch()
            for proc in clients:
                stop_process(proc)
        out, err = reader.communicate(timeout=20)
        assert reader.returncode == 0, f"lock-free reader failed: {out}\n{err}"
        lockfree = json.loads(out)
        stats = wait_until(lambda: (s := query_stats(blobs))["leases"] == 0 and s,
                           10, "every lease to be released")

    for r in results:
        assert r["errors"] == []
        assert r["verified"] >= 2 * iterations
    assert lockfree["errors"] == []
    assert lockfree["accepted"] > 100, lockfree  # the lock-free path really was exercised
    assert stats["misses"] > 10 * stats["arena_rows"]  # rows really were evicted and refilled
    assert stats["fill_errors"] == 0


# ---- client death --------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_sigkilled_clients_leave_no_lease_behind(blobs, isolated_env):
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, *FAST_TIMEOUTS,
                         clock=FakeClock()) as d:
        procs = []
        try:
            # Two clients lease 8 of the 10 rows; a third one's demand for 4 more must queue.
            for layer in (0, 1):
                procs.append(spawn_client("hold", blobs, layer, "0,1,2,3", "wait"))
                assert read_json_line(procs[-1], 20)["lease"] > 0
            procs.append(spawn_client("hold", blobs, 2, "0,1,2,3", "nowait"))
            read_json_line(procs[-1], 20)
            wait_until(lambda: query_stats(blobs)["demands"] == 3, 10, "the third demand")
            # Heartbeats keep all three alive well past the client timeout: the daemon's clock
            # moves on by less than the timeout at a time (each move ends with a tick at the new
            # time), and again only once every client has been heard from since.
            timeout = float(FAST_TIMEOUTS[FAST_TIMEOUTS.index("--client-timeout") + 1])
            registry = d.server.clients
            for _ in range(3):  # 3 x 2/3 of the timeout: twice the timeout in all
                d.advance(timeout * 2 / 3)
                s = query_stats(blobs)
                assert (s["clients"], s["leases"], s["clients_timed_out"]) == (3, 2, 0), s
                now = d.clock()
                wait_until(lambda: all(c.last_seen >= now
                                       for c in list(registry._clients.values())),
                           10, "every client's heartbeat at the daemon's new time")
            for proc in procs:
                proc.kill()
                proc.wait(5)
            wait_until(lambda: (s := query_stats(blobs))["leases"] == 0 and s["clients"] == 0,
                       10, "the daemon to reclaim the killed clients' leases")
        finally:
            for proc in procs:
                stop_process(proc)
        # The rows are free again: a demand for 4 experts (the queued one's) is served.
        with RawClient(blobs) as c:
            got = c.fetch(2, [0, 1, 2, 3])
            assert got == [want[(2, e)] for e in range(4)]
        assert d.poll() is None


@pytest.mark.timeout(60)
def test_a_second_hello_keeps_the_clients_leases_reclaimable(blobs, isolated_env):
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB, *FAST_TIMEOUTS,
                         clock=FakeClock()) as d:
        with RawClient(blobs) as c:
            c.demand(0, [1, 2])  # leased, never released
            c.request(Op.HELLO, {"version": PROTOCOL_VERSION, "client": c.conn.client_id, "pid": 1})
            assert query_stats(blobs)["leases"] == 1
        # The client went silent: its lease goes once its heartbeat times out.
        d.advance(1.5 + 0.1)
        wait_until(lambda: (s := query_stats(blobs))["clients"] == 0 and s["leases"] == 0,
                   10, "the silent client's lease to be reclaimed")


@pytest.mark.timeout(60)
def test_a_client_cannot_release_another_clients_lease(blobs, isolated_env):
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB) as d:
        with RawClient(blobs) as owner, RawClient(blobs) as other:
            lease = owner.demand(0, [1, 2, 3])["lease"]
            other.release(lease)
            other.request(Op.STATS)  # the release was handled before this reply
            assert query_stats(blobs)["leases"] == 1
            owner.release(lease)
            wait_until(lambda: query_stats(blobs)["leases"] == 0, 10, "the owner's release")
        assert d.poll() is None


# ---- daemon death and the command line ------------------------------------------------------

@pytest.mark.timeout(120)
def test_sigkilled_daemon_is_cleaned_up_by_the_next_start(blobs, isolated_env):
    want = expected_bytes(blobs)
    paths = daemon_paths(blobs)
    # Everything happens inside the block: the killed daemon's teardown would remove its
    # arena, and the next start must be the one to do it.
    with running_daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as dead:
        with RawClient(blobs) as c:
            c.fetch(0, [1, 2])
        dead.kill()
        assert shm_exists(dead.arena), "SIGKILL should leave the arena behind"
        assert paths.socket.exists(), "SIGKILL should leave the socket behind"
        try:
            started = expertd_cli("start", "--blobs", blobs, "--cache-gb", TINY_CACHE_GB)
            assert started.returncode == 0, started.stderr
            log = paths.log.read_text()
            assert "removed a stale arena" in log and "removed a stale socket" in log, log
            stats = query_stats(blobs)
            assert stats["arena"] != dead.arena, "a new start should take a new arena name"
            assert not shm_exists(dead.arena), "the next start should remove the stale arena"
            pid = stats["pid"]
            assert pid != dead.pid and f"pid {pid}" in started.stdout
            with RawClient(blobs) as c:
                assert c.fetch(1, [3, 4]) == [want[(1, 3)], want[(1, 4)]]

            for extra in ((), ("--foreground",)):
                again = expertd_cli("start", "--blobs", blobs, "--cache-gb", TINY_CACHE_GB,
                                    *extra, timeout=30)
                assert again.returncode == 1, again
                assert f"pid {pid}" in again.stderr and "already serves" in again.stderr
            assert query_stats(blobs)["pid"] == pid

            stopped = expertd_cli("stop", "--blobs", blobs)
            assert stopped.returncode == 0, stopped.stderr
            assert f"pid {pid}" in stopped.stdout
            assert not shm_exists(stats["arena"])
            assert not paths.socket.exists()
            again = expertd_cli("stop", "--blobs", blobs)
            assert again.returncode == 0 and "nothing to stop" in again.stdout
        finally:
            kill_serving_daemon(blobs)


@pytest.mark.timeout(60)
def test_status_reports_the_daemon_and_fails_without_one(blobs, isolated_env):
    stride = Manifest.load(blobs).stride
    with running_daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        with RawClient(blobs) as c:
            c.fetch(0, [0, 1, 2])
            got = expertd_cli("status", "--blobs", blobs, "--json")
            assert got.returncode == 0, got.stderr
            s, = json.loads(got.stdout)  # a list, one daemon
            types = dict(endpoint=str, pid=int, arena_bytes=int, rows_used=int, arena_rows=int,
                         hits=int, misses=int, bytes_read=int, fill_gbps=float, pinned=int,
                         clients=int, uptime_s=float)
            assert {k: type(s.get(k)) for k in types} == types
            assert s["endpoint"] == daemon_paths(blobs).endpoint
            assert s["pid"] == d.proc.pid
            assert (s["arena_rows"], s["rows_used"], s["misses"]) == (10, 3, 3)
            assert s["bytes_read"] == 3 * stride
            assert s["arena_bytes"] >= 9 * stride
            assert s["clients"] == 1 and s["pinned"] == 0
            assert s["uptime_s"] > 0 and s["fill_gbps"] >= 0

        plain = expertd_cli("status", "--blobs", blobs)
        assert plain.returncode == 0, plain.stderr
        assert f"expertd pid {d.proc.pid} serving" in plain.stdout
        assert "3/10 rows used" in plain.stdout
        every = expertd_cli("status")
        assert every.returncode == 0 and f"expertd pid {d.proc.pid}" in every.stdout

    none = expertd_cli("status", "--blobs", blobs)
    assert none.returncode == 3 and "no expertd serves" in none.stderr  # 3: as pg_ctl status
    none = expertd_cli("status", "--blobs", blobs, "--json")
    assert none.returncode == 3 and json.loads(none.stdout)[0]["running"] is False


@pytest.mark.timeout(60)
def test_plain_status_separates_daemons(models, isolated_env):
    """Issue 26 item 15: status without --blobs shows each running daemon, a blank line between
    them (and --json one list of the same daemons)."""
    first, second = models.blobs(), models.blobs(seed=11)
    with running_daemon(first, isolated_env, "--cache-gb", TINY_CACHE_GB) as a, \
            running_daemon(second, isolated_env, "--cache-gb", TINY_CACHE_GB) as b:
        plain = expertd_cli("status")
        listed = json.loads(expertd_cli("status", "--json").stdout)
    assert plain.returncode == 0, plain.stderr
    blocks = plain.stdout.rstrip("\n").split("\n\n")
    assert sorted(block.splitlines()[0] for block in blocks) == sorted(
        f"expertd pid {d.proc.pid} serving {blob.resolve()}" for d, blob in ((a, first),
                                                                            (b, second)))
    assert all("\n  arena " in block for block in blocks)
    assert sorted(d["pid"] for d in listed) == sorted((a.proc.pid, b.proc.pid))


def test_a_clients_kind_is_the_expertd_command_it_runs():
    """status names each client by the expertd command its process runs (issue 26 item 15):
    read from a real process's command line, the console script's and ``python -m``'s."""
    from expertd.cli.daemon_control import process_kind

    sleep = "import time; print('up', flush=True); time.sleep(60)"
    shapes = {"generate": ["expertd", "generate", "--blobs", "b"],
              "chat": ["-m", "expertd", "-v", "chat", "--blobs", "b"],
              "serve": ["/usr/local/bin/expertd", "serve", "--port", "0"]}
    procs = {kind: subprocess.Popen([sys.executable, "-c", sleep, *argv], stdout=subprocess.PIPE,
                                    text=True) for kind, argv in shapes.items()}
    try:
        for p in procs.values():  # each one running its own command line
            assert p.stdout.readline() == "up\n"
        assert {kind: process_kind(p.pid) for kind, p in procs.items()} == \
            {kind: kind for kind in shapes}
    finally:
        for p in procs.values():
            stop_process(p)
    assert process_kind(procs["chat"].pid) == "a process"  # gone: nothing to read


# ---- warm restart, pins ----------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_warm_restart_refills_the_hot_experts(blobs, isolated_env):
    want = expected_bytes(blobs)
    hot = {0: [1, 2], 1: [5, 9], 2: [7, 8]}
    hot_keys = [(layer, e) for layer, experts in hot.items() for e in experts]
    with running_daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        with RawClient(blobs) as c:
            for _ in range(10):
                for layer, experts in hot.items():
                    c.fetch(layer, experts)
            _pressure(c, skip=set(hot_keys), rounds=1)
        stopped = expertd_cli("stop", "--blobs", blobs)
        assert stopped.returncode == 0, stopped.stderr
        assert d.proc.wait(10) == 0
    saved = json.loads(daemon_paths(blobs).state_file.read_text())
    assert set(hot_keys) <= {tuple(k) for k in saved["hot"]}

    with running_daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        with RawClient(blobs) as c:
            wait_until(lambda: all(c.slot(*k)[1] == SlotState.READY for k in hot_keys), 20,
                       "the hot experts to be read back")
            for key in hot_keys:
                assert c.row_bytes(c.slot(*key)[0], key[0]) == want[key]
            stats = c.request(Op.STATS)
        assert stats["demands"] == 0 and stats["misses"] == 0
        assert stats["rows_used"] >= len(hot_keys)
        assert "warming" in d.log_text()


@pytest.mark.timeout(60)
def test_pinned_experts_survive_eviction_and_unpinned_ones_do_not(blobs, isolated_env):
    pins = [(0, 3), (0, 7)]
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB), RawClient(blobs) as c:
        assert c.hello["cache_rows"] == 10  # so at most 10 // 4 = 2 pins
        assert c.request(Op.PIN, {"layer": 0, "experts": [3, 7]})["pinned"] == 2
        wait_until(lambda: all(c.slot(*k)[1] == SlotState.READY for k in pins), 10,
                   "the pinned experts to be filled")
        before = {k: c.slot(*k) for k in pins}
        _pressure(c, skip=set(pins))
        # Same row, same seqlock version: the pinned rows were never rewritten.
        assert {k: c.slot(*k) for k in pins} == before
        assert c.request(Op.STATS)["pinned"] == 2

        with pytest.raises(DaemonError) as refused:
            c.request(Op.PIN, {"layer": 1, "experts": [0]})
        assert refused.value.code == ErrorCode.OUT_OF_RANGE
        assert "at most 2" in str(refused.value)
        assert c.request(Op.STATS)["pinned"] == 2

        assert c.request(Op.UNPIN, {"layer": 0, "experts": [3, 7]})["pinned"] == 0
        _pressure(c, skip=set(pins))
        assert all(c.slot(*k)[0] == -1 for k in pins), "unpinned experts should be evicted"


@pytest.mark.timeout(60)
def test_debug_lines_name_each_fill_and_what_it_evicts(blobs, isolated_env, caplog):
    """-v (issue 26 item 11): a fill's line says what it evicted; at INFO nothing is said."""
    import logging

    caplog.set_level(logging.DEBUG, logger="expertd")
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB), RawClient(blobs) as c:
        _pressure(c)  # every expert, twice, through 10 rows: fills evict
    fills = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fill row ")]
    evicting = [m for m in fills if ", evicting layer " in m]
    assert evicting and len(evicting) < len(fills), fills[:3]  # the first fills evict nothing
    assert re.fullmatch(r"fill row \d+ with layer \d+ expert \d+ \(demanded\), evicting "
                        r"layer \d+ expert \d+", evicting[0]), evicting[0]
    caplog.clear()
    caplog.set_level(logging.INFO, logger="expertd")
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB), RawClient(blobs) as c:
        _pressure(c, rounds=1)
    assert not [r for r in caplog.records if r.levelno < logging.INFO]


@pytest.mark.timeout(60)
def test_pin_file_pins_experts_at_start(blobs, isolated_env, tmp_path):
    pins = [(1, 4), (2, 11)]
    pin_file = tmp_path / "pins.json"
    pin_file.write_text(json.dumps([list(k) for k in pins]))
    want = expected_bytes(blobs)
    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB,
                         "--pin-file", pin_file), RawClient(blobs) as c:
        wait_until(lambda: all(c.slot(*k)[1] == SlotState.READY for k in pins), 10,
                   "the experts of the pin file to be filled")
        stats = c.request(Op.STATS)
        assert stats["pinned"] == 2 and stats["misses"] == 0
        before = {k: c.slot(*k) for k in pins}
        _pressure(c, skip=set(pins))
        assert {k: c.slot(*k) for k in pins} == before
        for key in pins:
            assert c.row_bytes(before[key][0], key[0]) == want[key]


@pytest.mark.timeout(60)
def test_pin_file_with_more_pins_than_the_cache_allows_is_refused(blobs, isolated_env, tmp_path):
    pin_file = tmp_path / "pins.json"
    pin_file.write_text(json.dumps([[0, e] for e in range(9)]))  # the whole 9-row cache
    refused = expertd_cli("start", "--blobs", blobs, "--cache-gb", TINY_CACHE_GB, "--foreground",
                          "--pin-file", pin_file, timeout=30)
    assert refused.returncode == 2  # bad input, refused before anything is created
    assert "9 experts to pin" in refused.stderr and "at most 2" in refused.stderr
    assert not _segments_created_by(refused.pid)


def _segments_created_by(pid: int) -> list:
    """Names of the expertd arenas whose header names ``pid`` as their daemon.

    A refused start never tells its random arena name, so only a listing can find a leftover;
    POSIX has none, and Linux shows the segments in /dev/shm. Elsewhere this finds nothing.
    """
    if not sys.platform.startswith("linux"):
        return []
    return [path.name for path in Path("/dev/shm").glob("expertd-*")
            if arena_owner("/" + path.name) == pid]


# ---- bad blobs ---------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_corrupt_expert_is_refused_by_name_and_the_rest_served(models, blob_dir, isolated_env):
    src, blobs = models.blobs(), blob_dir
    manifest = Manifest.load(blobs)
    layer, expert = 1, 5
    with open(blobs / manifest.layers[layer].file, "r+b") as f:
        f.seek(expert * manifest.stride + 100)
        byte = f.read(1)[0]
        f.seek(expert * manifest.stride + 100)
        f.write(bytes([byte ^ 0xFF]))
    want = expected_bytes(src)

    with InProcessDaemon(blobs, "--cache-gb", TINY_CACHE_GB) as d, RawClient(blobs) as c:
        for experts in ([expert], [expert - 1, expert, expert + 1]):
            with pytest.raises(DaemonError) as err:
                c.demand(layer, experts)
            message = str(err.value)
            assert err.value.code == ErrorCode.CHECKSUM, message
            assert re.search(rf"\blayer {layer}\b", message), message
            assert re.search(rf"\bexpert {expert}\b", message), message
        stats = c.request(Op.STATS)
        assert stats["leases"] == 0 and stats["fill_errors"] == 2
        for key in [(layer, expert - 1), (layer, expert + 1), (0, expert), (2, expert)]:
            assert c.fetch(key[0], [key[1]]) == [want[key]]
        assert d.poll() is None


# ---- permissions -------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_daemon_files_are_owner_only(blobs, isolated_env):
    paths = daemon_paths(blobs)
    with running_daemon(blobs, isolated_env, "--cache-gb", TINY_CACHE_GB) as d:
        wait_until(paths.state_file.exists, 10, "the state file")
        assert shm_mode(d.arena) == 0o600
        assert _mode(paths.socket) == 0o600
        assert _mode(paths.socket.parent) == 0o700
        assert _mode(paths.lock) == 0o600
        assert _mode(paths.state_file) == 0o600
        assert _mode(paths.state_file.parent) == 0o700
