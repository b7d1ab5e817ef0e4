"""Hostile-remote and careless-user attacks on lazy remote checkpoints (expertd convert --lazy).

Each test is a break found by attacking the feature: it fails against the code it was written
for and states the behaviour expected. The hostile server is the suite's own range server
(range_server.py) with its handler swapped for one that lies (right length, wrong bytes) or
trickles (one byte at a time, never long enough silent for a socket timeout).
"""

import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest
from harness import (
    SMALL_CACHE_GB,
    Daemon,
    RawClient,
    expected_bytes,
    expertd_cli,
    sigint_as_usual,
    wait_until,
)
from range_server import RangeServer, _Handler

from expertd.errors import DaemonError
from expertd.protocol import Op
from expertd.tools.lazy import convert_lazy


class _Hostile(_Handler):
    """Range answers per ``server.hostile``: ``flip`` (every byte XOR 0x5a, right headers),
    ``trickle`` (one byte per ``server.delay`` s); ``server.left`` answers, then honest."""

    def _send_file(self, file, start, length, status, size, head, extra, mode=None, end=None):
        srv = self.server
        with srv.hostile_lock:
            kind = getattr(srv, "hostile", "none")
            if status != 206 or kind == "none" or (kind == "trickle" and length < srv.min_len):
                kind = "none"
            elif srv.left > 0:
                srv.left -= 1
                if srv.left == 0:
                    srv.hostile = "none"
        if kind == "none":
            return super()._send_file(file, start, length, status, size, head, extra, mode, end)
        with open(file, "rb") as f:
            f.seek(start)
            data = f.read(length)
        self.send_response(206)
        self.send_header("Content-Length", str(length))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        for key, value in extra.items():
            self.send_header(key, value)
        self.end_headers()
        if kind == "flip":
            self.wfile.write(bytes(b ^ 0x5A for b in data))
            return
        self.wfile.flush()
        with srv.hostile_lock:
            srv.trickling += 1  # what a test waits for: an answer is under way
        try:
            for i in range(len(data)):
                if srv.trickle_stop.is_set():
                    break
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
                time.sleep(srv.delay)
        except OSError:
            pass
        self.close_connection = True


class HostileServer(RangeServer):
    def __init__(self, root):
        super().__init__(root)
        s = self._server
        s.RequestHandlerClass = _Hostile
        s.hostile_lock = threading.Lock()
        s.hostile, s.left, s.delay, s.min_len = "none", -1, 0.2, 0
        s.trickling = 0  # trickled answers begun
        s.trickle_stop = threading.Event()

    def lie(self, kind: str, times: int = -1, delay: float = 0.2, min_len: int = 0) -> None:
        s = self._server
        with s.hostile_lock:
            s.hostile, s.left, s.delay, s.min_len = kind, times, delay, min_len

    def trickling(self) -> int:
        with self._server.hostile_lock:
            return self._server.trickling

    def close(self) -> None:
        self._server.trickle_stop.set()
        super().close()


@pytest.fixture
def tiny(models):
    model_dir = models.model(family="qwen3_moe", mode="affine", bits=4)
    return model_dir, expected_bytes(models.blobs(family="qwen3_moe", mode="affine", bits=4))


def test_a_shard_that_fails_its_sha256_is_not_served_on(tiny, isolated_env, tmp_path,
                                                        monkeypatch):
    """A Hub repo; one range answer lies (right length, wrong bytes). Once every row arrived,
    fetch says the shard does not match its published sha256, yet the daemon keeps serving the
    wrong row, a new daemon too, and nothing can repair it short of a whole new conversion.
    Expected: a shard that fails its sha256 is not served from (its rows re-fetched or marked
    absent)."""
    from range_server import COMMIT

    model_dir, want = tiny
    root = tmp_path / "hub"
    shutil.copytree(model_dir, root / "tiny-org" / "tiny-moe")
    with HostileServer(root) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        out = tmp_path / "lazy"
        done = expertd_cli("convert", "tiny-org/tiny-moe", out, "--lazy", "-q")
        assert done.returncode == 0, done.stderr
        assert COMMIT in (out / "manifest.json").read_text()
        with Daemon(out, isolated_env, "--cache-gb", SMALL_CACHE_GB), RawClient(out) as client:
            hub.lie("flip", times=1)
            assert client.fetch(1, [3]) != [want[(1, 3)]]  # the honest limit: no row hash
            done = expertd_cli("fetch", "--blobs", out, "-q")
            assert done.returncode == 1 and "published" in done.stderr
            try:
                got = client.fetch(1, [3])
            except DaemonError:
                got = None
            assert got in (None, [want[(1, 3)]]), \
                "the daemon still serves a row of a shard known not to match its sha256"


def test_a_replaced_remote_file_is_noticed(tiny, isolated_env, tmp_path):
    """A plain base URL is not pinned. The publisher replaces model.safetensors (4 KiB more
    metadata: every offset moves, the size changes). The Content-Range of each answer says
    the new size, the manifest has the old one; the daemon serves the bytes at the old offsets
    as the expert, and verify passes. Expected: an answer whose total size is not the
    manifest's fails the demand (and an ETag recorded at convert, sent as If-Range, would catch
    a same-size replacement)."""
    model_dir, want = tiny
    www = tmp_path / "www"
    shutil.copytree(model_dir, www)
    with HostileServer(www) as server:
        out = tmp_path / "lazy"
        convert_lazy(server.url, out, progress=False)
        shard = www / "model.safetensors"
        shard.write_bytes(bytes(4096) + shard.read_bytes())
        with Daemon(out, isolated_env, "--cache-gb", SMALL_CACHE_GB), RawClient(out) as client:
            try:
                got = client.fetch(0, [1])
            except DaemonError as exc:
                assert "size" in str(exc) or "changed" in str(exc), str(exc)
                return
            assert got == [want[(0, 1)]], "bytes of a replaced remote file served as expert 1"


def test_sigterm_stops_the_daemon_while_a_fetch_trickles(tiny, isolated_env, tmp_path):
    """A server that sends one byte every 0.2 s never lets the 30 s socket timeout fire. A
    demand waits on it; SIGTERM then leaves the daemon hung in RangeReader.close(): the main
    thread's HTTPConnection.close() waits for the buffered reader's lock the worker holds in
    readinto(). Expected: stopped within the grace period (shut the sockets down with
    socket.shutdown, or leave the daemon threads' connections alone)."""
    model_dir, _ = tiny
    with HostileServer(model_dir) as server:
        out = tmp_path / "lazy"
        convert_lazy(server.url, out, progress=False)
        daemon = Daemon(out, isolated_env, "--cache-gb", SMALL_CACHE_GB)
        try:
            with RawClient(out) as client:
                server.lie("trickle", delay=0.2)
                client.conn.send(Op.DEMAND, {"layer": 2, "experts": [9]})
                wait_until(lambda: server.trickling() == 1, 30, "the fetch's answer to begin")
                status = daemon.stop()  # SIGTERM, and SIGKILL if it does not stop
        finally:
            daemon.close(check=False)
    assert status == 0, f"SIGTERM did not stop the daemon (exit status {status})"


def test_four_trickling_fetches_do_not_starve_every_other_absent_row(tiny, isolated_env,
                                                                     tmp_path):
    """Four demands whose answers trickle take the four remote workers; a fifth demand for an
    absent row the server would answer at once waits behind them (for hours at a real row's
    size). Expected: a bound on a request's whole duration (or a minimum rate) so that a
    worker is given back; at least the fifth demand answered within seconds."""
    model_dir, want = tiny
    with HostileServer(model_dir) as server:
        out = tmp_path / "lazy"
        convert_lazy(server.url, out, progress=False)
        with Daemon(out, isolated_env, "--cache-gb", SMALL_CACHE_GB), \
                RawClient(out) as slow, RawClient(out) as other:
            server.lie("trickle", times=4, delay=0.5)
            for layer, expert in [(0, 2), (0, 9), (1, 2), (2, 2)]:
                slow.conn.send(Op.DEMAND, {"layer": layer, "experts": [expert]})
            wait_until(lambda: server.trickling() == 4, 30, "4 trickling answers")
            rid = other.conn.send(Op.DEMAND, {"layer": 1, "experts": [12]})
            try:  # without a bound on a request, it waits for all 4 (hours at a real size)
                reply = other.conn.wait(rid, 120)
            except Exception as exc:
                pytest.fail(f"a demand the server answers at once waited 120 s behind four "
                            f"trickling fetches ({type(exc).__name__})")
            assert other.row_bytes(reply["rows"][0], 1) == want[(1, 12)]
            server._server.trickle_stop.set()


def test_ctrl_c_of_fetch_is_prompt_while_the_server_hangs(tiny, tmp_path):
    """expertd fetch against a server that never answers: Ctrl-C waited for every download
    already submitted to run its whole retry schedule (4 attempts x 30 s + backoff: minutes).
    Expected: Ctrl-C exits without waiting for them, keeping what arrived (cancel the pending
    futures, do not wait for the ones in the network)."""
    model_dir, _ = tiny
    with RangeServer(model_dir) as server:
        out = tmp_path / "lazy"
        convert_lazy(server.url, out, progress=False)
        before = len(server.requests)
        server.fault("stall")
        proc = subprocess.Popen([sys.executable, "-m", "expertd", "fetch", "--blobs", str(out),
                                 "-q"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=sigint_as_usual)
        try:
            wait_until(lambda: any(r["fault"] == "stall" for r in server.requests[before:]),
                       60, "a download to hang")
            proc.send_signal(signal.SIGINT)
            # With --timeout 30 and its retries, waiting out the downloads takes minutes.
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail("Ctrl-C of expertd fetch waited for the hung downloads")
            # Ended by the Ctrl-C, not by its downloads' own timeouts.
            assert proc.returncode == 130 and "interrupted" in err, (proc.returncode, err)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            server.fault("none")


def test_ctrl_c_of_convert_lazy_is_prompt_while_the_trunk_trickles(tiny, tmp_path):
    """Ctrl-C while a trunk range trickles: the ThreadPoolExecutor of in_order() waits for the
    download (and any queued one) at its exit, so convert --lazy does not exit (three SIGINTs
    do not help). Expected: exits within seconds, leaving nothing behind."""
    model_dir, _ = tiny
    with HostileServer(model_dir) as server:
        server.lie("trickle", delay=0.05, min_len=10000)  # headers pass, the trunk trickles
        out = tmp_path / "lazy"
        proc = subprocess.Popen([sys.executable, "-m", "expertd", "convert", server.url,
                                 str(out), "--lazy", "-q"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=sigint_as_usual)
        try:
            wait_until(lambda: server.trickling() >= 1, 30, "the trunk's download")
            proc.send_signal(signal.SIGINT)
            try:  # the trunk trickles for hours
                proc.communicate(timeout=60)
                exited = True
            except subprocess.TimeoutExpired:
                exited = False
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert exited, "Ctrl-C of convert --lazy waited for the trickling download"
    assert not out.exists()


def test_fetch_does_not_report_complete_on_a_truncated_blob(tiny, tmp_path):
    """A lazy directory's layer-000.blob cut to 3 rows after its rows arrived: expertd fetch
    answers 0 and "48/48 rows present", while verify fails and the daemon refuses to start.
    Expected: fetch checks the blob files as BlobStore does (refuses naming the file, or
    re-fetches the rows past the end)."""
    model_dir, _ = tiny
    with RangeServer(model_dir) as server:
        out = tmp_path / "lazy"
        manifest = convert_lazy(server.url, out, progress=False)
        assert expertd_cli("fetch", "--blobs", out, "-q", "--layers", "0:1").returncode == 0
        os.truncate(out / manifest.layers[0].file, 3 * manifest.stride)
        done = expertd_cli("fetch", "--blobs", out, "-q")
        verify = expertd_cli("verify", "--blobs", out, "-q")
    assert done.returncode != 0 or verify.returncode == 0, \
        f"fetch said {done.stdout.strip()!r} but verify: {verify.stdout.strip()[-200:]!r}"


@pytest.mark.parametrize("header", [{"a": 1}, {"a": {"shape": [1], "data_offsets": [0, 4]}},
                                    {"a": {"dtype": "F32", "shape": 5,
                                           "data_offsets": [0, 4]}}],
                         ids=["entry-not-object", "no-dtype", "shape-not-list"])
def test_a_malformed_remote_header_is_one_line_not_a_traceback(tiny, tmp_path, header):
    import json

    model_dir, _ = tiny
    www = tmp_path / "www"
    www.mkdir()
    shutil.copy(model_dir / "config.json", www)
    raw = json.dumps(header).encode()
    (www / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(64))
    with RangeServer(www) as server:
        done = expertd_cli("convert", server.url, tmp_path / "lazy", "--lazy", "-q")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr[-300:]
    assert done.stderr.startswith("expertd convert: error:"), done.stderr[-300:]


def test_the_demand_that_brings_the_last_row_does_not_wait_for_the_shard_hash(tiny, tmp_path,
                                                                             monkeypatch):
    """RemoteFills._work runs _check_shards (the sha256 of every shard, rebuilt from the
    disk: the whole model, hundreds of GB for the checkpoints this is for) before it calls
    done() for the run that brought the last row: that demand waits for the whole hash.
    A 2 s check stands for it here. Expected: the waiters hear first, the check runs after
    (or on its own thread)."""
    import hashlib

    import expertd.serving.remote as remote_mod
    from expertd.manifest import Manifest
    from expertd.present import RECORD, PresentRecords, record_path
    from expertd.remote import FetchSettings, RangeReader
    from expertd.rowfetch import RowFetcher

    model_dir, _ = tiny
    with RangeServer(model_dir) as server:
        out = tmp_path / "lazy"
        convert_lazy(server.url, out, progress=False)
        assert expertd_cli("fetch", "--blobs", out, "-q").returncode == 0
        manifest = Manifest.load(out)
        last = manifest.layers[-1]
        with open(record_path(out, last), "r+b") as f:  # all but one row present
            f.seek((last.num_experts - 1) * RECORD.size)
            f.write(bytes(RECORD.size))
        digest = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
        for file in manifest.remote.files.values():
            object.__setattr__(file, "sha256", digest)
        real = remote_mod.check_shards
        release = threading.Event()  # the whole-shard hash, held until the waiters heard

        def slow_check(*args):
            release.wait(60)
            return real(*args)

        monkeypatch.setattr(remote_mod, "check_shards", slow_check)
        records = PresentRecords(out, manifest.layers, writable=True)
        fetcher = RowFetcher(out, manifest, records, RangeReader(FetchSettings()))
        heard = threading.Event()
        fills = remote_mod.RemoteFills(fetcher, lambda *_: heard.set(), 1, 4)
        try:
            fills.request(last.index, last.num_experts - 1, urgent=True)
            heard_first = heard.wait(30)  # while the check is held
            release.set()
            wait_until(lambda: fills.counters["shards_checked"] == 1, 30, "the shard check")
        finally:
            release.set()
            fills.close(timeout=5)
            records.close()
    assert heard_first, "the last row's demand waited for the shard check"


def test_rows_can_be_stored_where_python_has_no_fdatasync(tiny, tmp_path, monkeypatch):
    """Python's os.fdatasync does not exist on macOS (its documentation: "Availability: Unix,
    not macOS"; cpython#83821 declined a fallback), the platform MLX clients run on. rowfetch
    and present.py call it unconditionally: every row that arrives fails to be stored.
    Simulated here by removing the attribute. Expected: a fallback (fcntl F_FULLFSYNC on
    macOS, else os.fsync)."""
    from expertd.manifest import Manifest
    from expertd.present import PresentRecords
    from expertd.remote import FetchSettings, RangeReader
    from expertd.rowfetch import RowFetcher

    model_dir, want = tiny
    with RangeServer(model_dir) as server:
        out = tmp_path / "lazy"
        convert_lazy(server.url, out, progress=False)
        manifest = Manifest.load(out)
        monkeypatch.delattr(os, "fdatasync")
        records = PresentRecords(out, manifest.layers, writable=True)
        fetcher = RowFetcher(out, manifest, records, RangeReader(FetchSettings(attempts=1)))
        try:
            fetcher.fetch(0, 0, 2)
        finally:
            fetcher.reader.close()
            fetcher.close()
            records.close()
    again = PresentRecords(out, manifest.layers)
    again.close()
    assert again.present(0, 0) and again.present(0, 1)


def test_an_endless_small_file_does_not_grow_convert_without_bound(tmp_path):
    """RangeReader.get() reads a whole answer into memory (resp.read()): a server that
    answers config.json (or tokenizer.json) with an endless chunked body grows convert --lazy
    by about 500 MB a second until the OOM killer. Expected: small files capped (tens of MB)
    and refused in one line past the cap."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Endless(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b" " * (1 << 20)
            try:
                while not stop.is_set():
                    self.wfile.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            except OSError:
                pass

    stop = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    proc = subprocess.Popen([sys.executable, "-m", "expertd", "convert", url,
                             str(tmp_path / "lazy"), "--lazy", "-q"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0

    def grown_or_gone() -> bool:
        """The kernel's own peak (VmHWM) past the bar, or the process gone (a zombie has
        none left to read: the last reading stands)."""
        nonlocal peak
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                hwm = next((int(line.split()[1]) for line in f if line.startswith("VmHWM")), 0)
        except FileNotFoundError:
            hwm = 0
        peak = max(peak, hwm // 1024)
        return peak >= 400 or proc.poll() is not None

    try:
        wait_until(grown_or_gone, 60, "convert --lazy to refuse the endless file")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        stop.set()
        server.shutdown()
        server.server_close()
    assert peak < 400, f"convert --lazy grew to {peak} MB reading one endless config.json"
