"""The test suite's HTTP server: a directory served with byte ranges, faults on request.

Run in a thread (``RangeServer(root)``) or as its own process (``python range_server.py ROOT
--port-file F --log F``), so that a test can really kill it. Every request is logged (method,
path, range, status), as a list in a thread and one JSON line each in ``--log`` for a process.

Faults, switched per test by ``GET /_fault?mode=M&times=N`` (N requests, default all) or
``RangeServer.fault(M, N)``, applied to range requests only:
``die`` (half the body, then the process SIGKILLs itself; a thread closes the socket),
``truncate`` (the headers announce the whole range, half the body is sent, the connection
closed), ``500``, ``short`` (a byte fewer than asked, with a Content-Length to match),
``stall`` (no answer until the fault is cleared or the server stops), ``ignore-range``
(200 and the whole file). ``/_fault?mode=none`` clears it.

It also answers as a small Hugging Face Hub for the repo ``ROOT/<org>/<name>``: the model
info of ``/api/models/<org>/<name>[/revision/<rev>]`` (files, sizes, LFS sha256) and files at
``/<org>/<name>/resolve/<rev>/<file>``, as ``huggingface_hub`` expects them.
"""

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_API = re.compile(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a CDN
    disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall
    server: "_Server"

    def log_message(self, *args):  # the request log is the server's own
        pass

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def _serve(self, head: bool):
        url = urlsplit(self.path)
        path = unquote(url.path)
        if path == "/_fault":
            query = parse_qs(url.query)
            self.server.set_fault(query.get("mode", ["none"])[0],
                                  int(query.get("times", ["-1"])[0]))
            return self._reply(200, b"ok")
        match = _API.fullmatch(path)
        if match:
            return self._reply(200, json.dumps(self.server.model_info(match[1])).encode(),
                               "application/json")
        match = _RESOLVE.fullmatch(path)
        file = self.server.root / (f"{match[1]}/{match[3]}" if match else path.lstrip("/"))
        if ".." in Path(path).parts or not file.is_file():
            self._log(path, None, 404)
            return self._reply(404, b"not found")
        size = file.stat().st_size
        extra = {"X-Repo-Commit": COMMIT, "ETag": f'"{self.server.sha256(file)}"'} if match else {}
        wanted = self.headers.get("Range")
        range_match = _RANGE.fullmatch(wanted or "")
        if not range_match:
            self._log(path, None, 200)
            return self._send_file(file, 0, size, 200, size, head, extra)
        start = int(range_match[1])
        end = min(int(range_match[2]) if range_match[2] else size - 1, size - 1)
        mode = self.server.take_fault()
        self._log(path, (start, end), 500 if mode == "500" else 206, mode)
        if mode == "500":
            return self._reply(500, b"injected failure")
        if mode == "stall":
            self.server.unstalled.wait()
            self.close_connection = True
            return
        if mode == "ignore-range":
            return self._send_file(file, 0, size, 200, size, head, extra)
        length = end - start + 1
        if mode == "short":
            length -= 1
        self._send_file(file, start, length, 206, size, head, extra, mode, end)

    def _send_file(self, file, start, length, status, size, head, extra, mode=None, end=None):
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        for key, value in extra.items():
            self.send_header(key, value)
        self.end_headers()
        if head:
            return
        with open(file, "rb") as f:
            f.seek(start)
            data = f.read(length)
        if mode in ("die", "truncate"):
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            if mode == "die" and self.server.process:
                os.kill(os.getpid(), signal.SIGKILL)  # a real crash, mid-transfer
            self.close_connection = True
            return
        self.wfile.write(data)

    def _reply(self, status: int, body: bytes, kind: str = "text/plain"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _log(self, path, span, status, fault="none"):
        self.server.record({"method": self.command, "path": path,
                            "range": list(span) if span else None, "status": status,
                            "fault": fault})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, port: int, log_file: Path | None, process: bool):
        super().__init__(("127.0.0.1", port), _Handler)
        self.root = Path(root)
        self.process = process
        self.log_file = log_file
        self.requests: list = []
        self.unstalled = threading.Event()
        self._lock = threading.Lock()
        self._mode, self._times = "none", 0
        self._digests: dict = {}

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)  # a client gone is not news

    def set_fault(self, mode: str, times: int = -1) -> None:
        with self._lock:
            self._mode, self._times = mode, times
            if mode == "stall":
                self.unstalled.clear()
            else:
                self.unstalled.set()

    def take_fault(self) -> str:
        with self._lock:
            mode = self._mode
            if mode != "none" and self._times > 0:
                self._times -= 1
                if self._times == 0:
                    self._mode = "none"
            return mode

    def record(self, entry: dict) -> None:
        with self._lock:
            self.requests.append(entry)
            if self.log_file is not None:
                with open(self.log_file, "a") as f:
                    f.write(json.dumps(entry) + "\n")

    def sha256(self, file: Path) -> str:
        if file not in self._digests:
            self._digests[file] = hashlib.sha256(file.read_bytes()).hexdigest()
        return self._digests[file]

    def model_info(self, repo: str) -> dict:
        files = sorted(p for p in (self.root / repo).iterdir() if p.is_file())
        siblings = []
        for p in files:
            entry = {"rfilename": p.name, "size": p.stat().st_size, "blobId": "0" * 40}
            if p.suffix == ".safetensors":
                entry["lfs"] = {"size": p.stat().st_size, "sha256": self.sha256(p),
                                "pointerSize": 134}
            siblings.append(entry)
        return {"id": repo, "modelId": repo, "sha": COMMIT, "siblings": siblings}


class RangeServer:
    """The server in a thread of the test process, on a free port of 127.0.0.1."""

    def __init__(self, root: Path):
        self._server = _Server(root, 0, None, process=False)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def requests(self) -> list:
        return self._server.requests

    def ranges(self) -> list:
        """``(path, start, end)`` of every range request answered so far."""
        return [(r["path"], *r["range"]) for r in self.requests if r["range"]]

    def fault(self, mode: str, times: int = -1) -> None:
        self._server.set_fault(mode, times)

    def close(self) -> None:
        self._server.unstalled.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RangeServerProcess:
    """The server as its own process (so that a test can SIGKILL it), on ``port`` (0: a free
    one; pass the old one to start it again where clients look for it)."""

    def __init__(self, root: Path, workdir: Path, port: int = 0):
        import subprocess

        from harness import wait_until

        workdir.mkdir(parents=True, exist_ok=True)
        port_file = workdir / f"port-{os.getpid()}-{len(list(workdir.iterdir()))}"
        self.log = workdir / "requests.jsonl"
        self.proc = subprocess.Popen([sys.executable, __file__, str(root), "--port", str(port),
                                      "--port-file", str(port_file), "--log", str(self.log)],
                                     stdin=subprocess.DEVNULL)

        def listening():
            if self.proc.poll() is not None:
                raise AssertionError(f"the range server exited with {self.proc.returncode}")
            return port_file.is_file()

        wait_until(listening, 30, "the range server to listen")
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"

    def requests(self) -> list:
        if not self.log.is_file():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def ranges(self) -> list:
        return [(r["path"], *r["range"]) for r in self.requests() if r["range"]]

    def fault(self, mode: str, times: int = -1) -> None:
        from urllib.request import urlopen

        with urlopen(f"{self.url}/_fault?mode={mode}&times={times}", timeout=30) as reply:
            reply.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    server = _Server(Path(args.root), args.port, Path(args.log), process=True)
    tmp = f"{args.port_file}.tmp"
    Path(tmp).write_text(str(server.server_address[1]))
    os.rename(tmp, args.port_file)  # the port appears whole, once the socket listens
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
