"""The one test harness: a real daemon process, a raw protocol client, client processes.

``Daemon`` (also named ``running_daemon``) starts ``python -m expertd start --foreground`` and
stops it with SIGTERM, then SIGKILL, each step bounded; its teardown checks that the process
is gone and its arena removed. ``wait_until`` is the one poll-until helper, ``spawn_client``
the one client-process spawner (the processes run ``daemon_helpers.py``), ``shm_exists`` checks
a POSIX shared-memory segment through posix_ipc, so the same tests run where ``/dev/shm`` does
not exist (macOS). Every arena name a daemon reports is recorded in ``SEEN_ARENAS``; conftest
checks at the end of the session that none of them is left.
"""

import fcntl
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import msgpack
import numpy as np
import posix_ipc

from expertd import native
from expertd.blobstore import BlobStore
from expertd.connection import Connection
from expertd.errors import DaemonError
from expertd.manifest import Manifest
from expertd.protocol import PROTOCOL_VERSION, Op
from expertd.shm.layout import Arena, SlotState, unlink_arena

START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
# Row counts that --cache-gb gives with the session's tiny model (stride 16 KiB, 48 experts).
TINY_CACHE_GB = "0.0003"  # 10 rows: demands of 4 (top_k), one client holds at most 4
SMALL_CACHE_GB = "0.0015"  # 64 rows, capped at the 48 experts of the model
CLIENT_SCRIPT = Path(__file__).resolve().with_name("daemon_helpers.py")

# Every arena name a daemon reported to this test process (stats or hello).
SEEN_ARENAS: set = set()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until it returns something true; that value.

    Raises:
        AssertionError: naming ``what`` when ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def shm_exists(name: str) -> bool:
    """Whether the POSIX shared-memory segment ``name`` exists (asked through posix_ipc)."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except posix_ipc.ExistentialError:
        return False
    except posix_ipc.PermissionsError:
        return True  # someone else's: it exists all the same
    shm.close_fd()
    return True


def arena_owner(name: str) -> int | None:
    """The pid an existing arena's header names as its daemon; None if there is no arena."""
    try:
        arena = Arena.attach(name)
    except (posix_ipc.Error, OSError, ValueError):
        return None
    try:
        return arena.pid
    finally:
        arena.close()


def shm_mode(name: str) -> int:
    """The permission bits of the shared-memory segment ``name``."""
    shm = posix_ipc.SharedMemory(name, read_only=True)
    try:
        return os.fstat(shm.fd).st_mode & 0o777
    finally:
        shm.close_fd()


def query_stats(blob_dir, timeout: float = 5.0) -> dict:
    """The STATS reply of the daemon serving ``blob_dir`` (its arena name recorded)."""
    with Connection(blob_dir) as conn:
        stats = conn.request(Op.STATS, timeout=timeout)
    SEEN_ARENAS.add(stats["arena"])
    return stats


def try_stats(blob_dir, timeout: float = 1.0) -> dict | None:
    """The daemon's stats, or None if none answers."""
    try:
        return query_stats(blob_dir, timeout)
    except DaemonError:
        return None


def expertd_cli(*args, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run the ``expertd`` command line in a child process (environment inherited).

    Returns:
        the CompletedProcess, with the child's ``pid`` added.
    """
    with subprocess.Popen([sys.executable, "-m", "expertd", *map(str, args)],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid
    return done


# ---- the daemon ----------------------------------------------------------------------------

class Daemon:
    """A real ``expertd start --foreground`` process serving ``blob_dir``, ready when built.

    Use it as a context manager (``with Daemon(...) as d``) or call :meth:`close`. Attributes:
    ``proc``, ``pid``, ``blob_dir``, ``log`` (the file of its output), ``ready`` (its first
    stats) and ``arena`` (its arena's name).

    Args:
        env: the test's XDG_RUNTIME_DIR / XDG_STATE_HOME (the ``isolated_env`` fixture).
        flags: extra ``expertd start`` flags, e.g. ``"--cache-gb", "0.00028"``.
        log: file for the daemon's output (default: in the runtime directory).
    Raises:
        AssertionError: if it exits or does not answer STATS within ``START_TIMEOUT``.
    """

    def __init__(self, blob_dir, env: dict | None = None, *flags, log: Path | None = None):
        self.blob_dir = Path(blob_dir)
        env = {**os.environ, **(env or {})}
        runtime = env.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        self.log = Path(log or Path(runtime) / f"daemon-{time.monotonic_ns()}.log")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "expertd", "start", "--blobs", str(self.blob_dir),
               "--foreground", *map(str, flags)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        self.arena = None
        self._term_ignored = False
        try:
            self.ready = wait_until(self._answered, START_TIMEOUT,
                                    f"expertd pid {self.pid} to answer STATS for {blob_dir}")
        except BaseException:
            self.close(check=False)
            raise
        self.arena = self.ready["arena"]

    def _answered(self) -> dict | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"expertd exited with {self.proc.returncode} during start-up:\n"
                                 f"{self.log_text()}")
        stats = try_stats(self.blob_dir)
        # Another daemon's answer (one being replaced) does not count.
        return stats if stats and stats["pid"] == self.pid else None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        # A failing test's own error says more than a teardown complaint would.
        self.close(check=exc_type is None)

    def stats(self, timeout: float = 5.0) -> dict:
        return query_stats(self.blob_dir, timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, as a crash would (the arena stays behind, as after a real crash)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(STOP_TIMEOUT)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL past ``STOP_TIMEOUT``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self._term_ignored = True
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
        return self.proc.returncode

    def close(self, check: bool = True) -> None:
        """Stop the daemon; check that its process is gone and its arena removed.

        A daemon that was SIGKILLed cannot remove its arena: the harness does, as the next
        start would. Anything else left behind is removed too, then reported.

        Raises:
            AssertionError: (with ``check``) if SIGTERM did not stop it or it left its arena.
        """
        self.stop()
        problems = []
        if self._term_ignored:
            problems.append(f"did not stop within {STOP_TIMEOUT:g} s of SIGTERM")
        if self.proc.returncode is None:
            problems.append("is still running")
        # The owner check: never remove a live daemon's arena that happens to bear the name.
        if self.arena and arena_owner(self.arena) == self.pid:
            if self.proc.returncode != -signal.SIGKILL or self._term_ignored:
                problems.append(f"left its arena {self.arena} behind")
            unlink_arena(self.arena)
        if check and problems:
            raise AssertionError(f"expertd pid {self.pid} " + " and ".join(problems) +
                                 f"; its log:\n{self.log_text()}")


# The name the daemon tests use: ``with running_daemon(blob_dir, env, *flags) as d``.
running_daemon = Daemon


def kill_serving_daemon(blob_dir) -> None:
    """Teardown for daemons started detached by the CLI: stop whatever still serves the dir
    (SIGTERM, SIGKILL past ``STOP_TIMEOUT``) and remove its arena if it left it."""
    from expertd.cli.lifecycle import serving_pid
    from expertd.paths import daemon_paths

    paths = daemon_paths(blob_dir)
    pid = serving_pid(paths)
    if pid is None or pid <= 0:
        return
    stats = try_stats(blob_dir)
    os.kill(pid, signal.SIGTERM)
    try:
        wait_until(lambda: serving_pid(paths) is None, STOP_TIMEOUT, "the detached expertd to stop")
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: serving_pid(paths) is None, STOP_TIMEOUT, "the detached expertd to die")
    if stats:
        unlink_arena(stats["arena"])


# ---- a protocol-level client -----------------------------------------------------------------

class RawClient:
    """A protocol-level client: HELLO, DEMAND, RELEASE, and the arena the hello names, mapped."""

    def __init__(self, blob_dir):
        self.blob_dir = Path(blob_dir)
        self.manifest = Manifest.load(self.blob_dir)
        self.conn = Connection(blob_dir)
        self.hello = self.request(Op.HELLO, {"version": PROTOCOL_VERSION,
                                              "client": self.conn.client_id, "pid": os.getpid()})
        SEEN_ARENAS.add(self.hello["arena"])
        self.arena = Arena.attach(self.hello["arena"])
        self.raw = self.arena.raw
        self.slots_offset = self.arena.geometry.slots_offset

    def request(self, op: Op, body: dict | None = None, timeout: float = 10.0) -> dict:
        return self.conn.request(op, body, timeout=timeout)

    def demand(self, layer: int, experts, timeout: float = 20.0) -> dict:
        return self.request(Op.DEMAND, {"layer": int(layer), "experts": [int(e) for e in experts]},
                            timeout=timeout)

    def release(self, lease: int) -> None:
        self.conn.send(Op.RELEASE, {"lease": lease})

    def heartbeat(self) -> dict:
        return self.request(Op.HEARTBEAT, {"client": self.conn.client_id,
                                           "token": self.hello["token"]})

    def row_bytes(self, row: int, layer: int) -> bytes:
        return bytes(self.arena.row(row)[:self.manifest.layers[layer].expert_bytes])

    def fetch(self, layer: int, experts) -> list:
        """Demand, copy the rows, check their seqlock versions, release; the experts' bytes."""
        reply = self.demand(layer, experts)
        try:
            got = [self.row_bytes(row, layer) for row in reply["rows"]]
            if not validate(self.raw, self.slots_offset, reply["rows"], reply["versions"]):
                raise AssertionError(f"a leased row of layer {layer} changed while it was copied")
            return got
        finally:
            self.release(reply["lease"])

    def fill_cache(self, layer: int) -> None:
        """Demand experts 0, 1, ... of ``layer`` until every LFU cache row holds one. While a
        cache row is empty, the daemon moves prefetched rows into it rather than rewrite
        them, so tests of the side rows' own turnover start from a full cache."""
        rows = self.hello["cache_rows"]
        for start in range(0, rows, 2):
            self.fetch(layer, range(start, min(start + 2, rows)))

    def evict(self, layer: int, expert: int, untouched=()) -> None:
        """Fetch every other expert, of every layer, until (layer, expert) has left the cache
        (the policy's per-layer quotas may make a layer evict its own experts first). The
        (layer, expert) keys in ``untouched`` are never fetched."""
        step = self.hello["max_demand"]
        skip = {(layer, expert), *untouched}
        for _ in range(4):
            for other in self.manifest.layers:
                keys = [e for e in range(other.num_experts) if (other.index, e) not in skip]
                for start in range(0, len(keys), step):
                    self.fetch(other.index, keys[start:start + step])
            if self.slot(layer, expert)[0] < 0:
                return
        raise AssertionError(f"layer {layer} expert {expert} stayed in the cache")

    def slot(self, layer: int, expert: int) -> tuple:
        """(row, state, version) of a key as the shared table shows it; row -1 if absent."""
        g = self.arena.geometry
        row = int(self.arena.slot_of[layer * g.n_experts + expert])
        if row < 0:
            return -1, SlotState.EMPTY, 0
        rec = self.arena.slots[row]
        if int(rec["layer"]) != layer or int(rec["expert"]) != expert:
            return -1, SlotState.EMPTY, 0
        return row, int(rec["state"]), int(rec["version"])

    def close(self) -> None:
        self.raw = None
        self.arena.close()
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def validate(raw, slots_offset: int, rows, versions) -> bool:
    """The seqlock check of leased rows, by whichever implementation this process runs."""
    return native.validate(raw, slots_offset, np.asarray(rows, np.int32),
                           np.asarray(versions, np.uint64))


def expected_bytes(blob_dir) -> dict:
    """{(layer, expert): exact bytes} read straight from the blob files."""
    store = BlobStore(blob_dir)
    try:
        return {(layer.index, e): store.read_expert(layer.index, e)
                for layer in store.layers for e in range(layer.num_experts)}
    finally:
        store.close()


# ---- client processes --------------------------------------------------------------------------

def sigint_as_usual() -> None:
    """``preexec_fn`` for children that are sent SIGINT: a shell runs background jobs with
    SIGINT ignored, and an ignored signal stays ignored across exec, so a test suite started
    in the background would otherwise see its children shrug Ctrl-C off."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_client(mode: str, *args, env: dict | None = None, pure: bool | None = None,
                 script: Path | None = None, stdin: bool = False) -> subprocess.Popen:
    """A client process running ``daemon_helpers.py MODE ARGS...`` (text pipes).

    Args:
        env: variables added to this process's environment.
        pure: True forces the pure-Python twins in the child, False the Cython extension,
            None inherits this process's choice.
        script: another script to run instead (a test file that is its own client).
        stdin: give the child a pipe to read commands from (else /dev/null).
    """
    full = {**os.environ, **(env or {})}
    if pure is not None:
        full["EXPERTD_PURE_PYTHON"] = "1" if pure else "0"
    return subprocess.Popen([sys.executable, str(script or CLIENT_SCRIPT), mode,
                             *map(str, args)], env=full,
                            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_usual)


def stop_process(proc: subprocess.Popen | None, timeout: float = STOP_TIMEOUT) -> None:
    """Stop a child that may still run (stopped ones too): SIGTERM, then SIGKILL past
    ``timeout``; its pipes are drained and closed."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)  # a SIGSTOPped child only acts on SIGTERM once resumed
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.communicate(timeout=timeout)


def read_json_line(proc: subprocess.Popen, timeout: float) -> dict:
    """The next line a client process prints, parsed; fails after ``timeout`` s."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"client pid {proc.pid} printed nothing within {timeout:g} s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"client pid {proc.pid} exited ({proc.wait()}): {proc.stderr.read()}")
    return json.loads(line)


def finish_client(proc: subprocess.Popen, out: Path, timeout: float) -> dict:
    """Wait for a client that writes its JSON result to ``out``; that result, plus its stderr.

    Raises:
        AssertionError: if it fails or does not finish in time.
    """
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        raise AssertionError(f"client pid {proc.pid} did not finish within {timeout:g} s:\n"
                             f"{stderr}") from None
    assert proc.returncode == 0, f"client pid {proc.pid} exited with {proc.returncode}:\n{stderr}"
    result = json.loads(Path(out).read_text())
    result["stderr"] = stderr
    return result


def terminal() -> tuple:
    """A pseudo-terminal of 24 x 100 characters: (master, slave)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    return master, slave


def drawn(master: int) -> str:
    """Everything written to the terminal, once every writer has closed it (EIO on Linux)."""
    data = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


def read_replies(sock, n: int) -> list:
    """The first ``n`` replies on a raw connection to the daemon (greeted by the caller), as
    ``(request id, op, body)``; waits on the socket's own timeout."""
    from expertd.wire import decode, message_length

    data, replies = b"", []
    while len(replies) < n:
        chunk = sock.recv(1 << 16)
        assert chunk, f"the daemon closed the connection after {len(replies)} replies"
        data += chunk
        while (size := message_length(data)) is not None and len(data) >= 4 + size:
            frames, count = decode(data[4:4 + size], 3)
            assert count == 3, data
            replies.append((frames[0], frames[1], msgpack.unpackb(frames[2], raw=False)))
            data = data[4 + size:]
    return replies
