"""HTTP range reads of a remote checkpoint's files: keep-alive connections, retries, checks.

Shared by ``expertd convert --lazy``, ``expertd fetch`` and the daemon's remote workers. Each
thread keeps its own keep-alive connection per host (``http.client``); a read is retried with
exponential backoff on a network error, a timeout, a 5xx / 429, an answer of the wrong size, or
a body that arrives too slowly, and fails for good on any other status. Every error names the
URL and the byte range.

One job, over 400 lines: range reads of a remote checkpoint.
"""

import http.client
import re
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from expertd.errors import RemoteError
from expertd.units import size_text

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_REDIRECTS = (301, 302, 303, 307, 308)
_MAX_REDIRECTS = 5
_RETRIED = (408, 425, 429, 500, 502, 503, 504)
_UNSATISFIABLE = re.compile(r"bytes \*/(\d+)")
_PIECE = 256 << 10  # the most one receive of a body asks for
SMALL_FILE_LIMIT = 64 << 20  # config.json, tokenizer.json: tens of MB at the very most


@dataclass(frozen=True)
class FetchSettings:
    """How remote bytes are fetched.

    Attributes:
        connections: parallel requests (one keep-alive connection per worker thread).
        coalesce: adjacent experts of a layer fetched by one range request, at most.
        attempts: tries per request before it fails.
        backoff: seconds before the first retry, doubled at each next one.
        timeout: seconds a connect or a read of the socket may wait for the server.
        min_rate: bytes per second a response's body must average: it must have arrived
            ``grace + bytes / min_rate`` seconds after its headers, else the request fails (and
            is retried). The socket timeout alone never fires on a server that sends a byte now
            and then, and such an answer would hold a worker (one of ``connections``) for hours
            at a row's size. 256 KiB/s a connection (8 Mbit/s for 4) is far below any link a
            lazy checkpoint is usable over, and a trickle of a 44 MB row lets go in 3 minutes.
        grace: seconds a body may lag behind ``min_rate`` (a stall of TCP, a slow start).
    """

    connections: int = 4
    coalesce: int = 4
    attempts: int = 4
    backoff: float = 0.25
    timeout: float = 30.0
    min_rate: float = 256 << 10
    grace: float = 5.0

    def __post_init__(self):
        for name in ("connections", "coalesce", "attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.backoff < 0 or not self.timeout > 0:
            raise ValueError("backoff must be at least 0 and timeout above 0")
        if not self.min_rate > 0 or self.grace < 0:
            raise ValueError("min_rate must be above 0 and grace at least 0")


class _Permanent(Exception):
    """An answer that retrying will not change (404, 403, a server that ignores Range)."""


class RangeReader:
    """GET whole files or byte ranges of them, from any number of threads.

    Args:
        settings: attempts, backoff and timeout (``connections`` is the caller's business:
            each calling thread gets its own connection).
        headers: sent with every request to the URLs' own host (e.g. a Hugging Face token);
            never sent on to another host a redirect points at.
    Attributes:
        counters: ``requests``, ``bytes`` (body bytes received), ``retries``, ``failures``.
    """

    def __init__(self, settings: FetchSettings = FetchSettings(), headers: dict | None = None):
        self.settings = settings
        self.headers = dict(headers or {})
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list = []  # every connection of every thread, for close()
        self._socks = weakref.WeakSet()  # every socket a request went out on, for close()
        self._closed = False
        self.counters = dict(requests=0, bytes=0, retries=0, failures=0)

    def read(self, url: str, start: int, length: int, size: int | None = None) -> bytearray:
        """Bytes ``start`` to ``start + length - 1`` of ``url``.

        Args:
            size: the file's whole size when the offsets were taken (a manifest's
                ``RemoteFile.size``). A plain URL is not pinned to a version: a file replaced
                since has its tensors elsewhere, and its bytes at the old offsets are not the
                expert. The answer's Content-Range gives the size now; another one fails the
                read, for good.
        Raises:
            RemoteError: naming the URL and the range, after the last attempt.
        """
        buf = bytearray(length)
        self._retrying(url, (start, length), buf, size)
        return buf

    def head(self, url: str, length: int) -> tuple:
        """The first ``length`` bytes of ``url`` and the file's whole size (None if the server
        did not say), e.g. a safetensors header's length.

        Raises:
            RemoteError: as :meth:`read`.
        """
        buf = bytearray(length)
        total = self._retrying(url, (0, length), buf)
        return buf, total

    def get(self, url: str, limit: int = SMALL_FILE_LIMIT) -> bytes | None:
        """The whole (small) file at ``url``; None if the server says it does not exist (404).

        Args:
            limit: the most bytes accepted; the whole body is held in memory, and a server
                that sends an endless one must not grow the process until the OOM killer.
        Raises:
            RemoteError: on any other failure, after the last attempt; for good if the file
                is larger than ``limit``.
        """
        return self._retrying(url, None, None, limit=limit)

    def _retrying(self, url, span, buf, size=None, limit=SMALL_FILE_LIMIT):
        what = url if span is None else f"{url} bytes {span[0]}-{span[0] + span[1] - 1}"
        s = self.settings
        for attempt in range(s.attempts):
            try:
                return self._once(url, span, buf, size, limit)
            except _Permanent as exc:
                if str(exc) == "404" and span is None:
                    return None
                reason, tries = str(exc), ""
                break
            except (OSError, http.client.HTTPException, ValueError) as exc:
                reason, tries = _reason(exc), f" (after {attempt + 1} attempts)"
                self._drop(url)
            if attempt + 1 < s.attempts:
                with self._lock:
                    self.counters["retries"] += 1
                time.sleep(s.backoff * 2 ** attempt)
        with self._lock:
            self.counters["failures"] += 1
        raise RemoteError(f"cannot fetch {what}: {_explain(reason)}{tries if s.attempts > 1 else ''}")

    def _once(self, url, span, buf, size, limit):
        headers = dict(self.headers)
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[0] + span[1] - 1}"
        origin = urlsplit(url).netloc
        for _ in range(_MAX_REDIRECTS + 1):
            conn, path = self._connection(url)
            conn.request("GET", path, headers=headers)
            self._track(conn.sock)
            resp = conn.getresponse()
            with self._lock:
                self.counters["requests"] += 1
            if resp.status not in _REDIRECTS:
                break
            resp.read()
            was = urlsplit(url).scheme
            url = urljoin(url, resp.getheader("Location", ""))
            # A token is for its own host only, and never goes in clear text: a redirect
            # from https to http (a hostile or misconfigured mirror) would show it to anyone
            # on the path.
            now = urlsplit(url)
            if now.netloc != origin or (was == "https" and now.scheme != "https"):
                headers.pop("Authorization", None)
        else:
            raise _Permanent(f"more than {_MAX_REDIRECTS} redirects")
        try:
            if resp.status in _RETRIED:
                raise ValueError(f"HTTP {resp.status} {resp.reason}")
            if span is None:
                if resp.status != 200:
                    raise _Permanent("404" if resp.status == 404 else
                                     f"HTTP {resp.status} {resp.reason}")
                return self._read_whole(resp, limit)
            return self._read_range(resp, span, buf, size)
        finally:
            if not resp.isclosed():
                resp.close()  # a body not read to its end: the connection is not reusable
                self._drop(url)

    def _read_whole(self, resp, limit: int) -> bytes:
        expected = _length(resp)
        if expected is not None and expected > limit:
            raise _Permanent(f"the file is {size_text(expected)}, more than the "
                             f"{size_text(limit)} accepted")
        data = bytearray()
        for piece in self._pieces(resp, limit + 1, limit if expected is None else expected):
            data += piece
        if len(data) > limit:  # no Content-Length (chunked), and endless or too large
            raise _Permanent(f"the file is more than the {size_text(limit)} accepted")
        if expected is not None and len(data) != expected:
            raise ValueError(f"got {len(data)} of {expected} bytes")
        self._finish(resp)
        self._count(len(data))
        return bytes(data)

    def _read_range(self, resp, span, buf, size):
        start, length = span
        total = None
        if resp.status == 200:
            if start != 0 or _length(resp) != length:
                raise _Permanent("the server ignores Range requests (HTTP 200, not 206)")
            total = length
        elif resp.status == 206:
            match = _CONTENT_RANGE.fullmatch(resp.getheader("Content-Range", "").strip())
            if not match or (int(match[1]), int(match[2])) != (start, start + length - 1):
                raise ValueError(f"the server answered Content-Range "
                                 f"{resp.getheader('Content-Range')!r}")
            if _length(resp) not in (None, length):
                raise ValueError(f"the server announced {_length(resp)} bytes, "
                                 f"{length} were asked for")
            total = None if match[3] == "*" else int(match[3])
        else:
            if resp.status == 416:  # past the end: of a file that shrank since convert?
                match = _UNSATISFIABLE.fullmatch(resp.getheader("Content-Range", "").strip())
                _check_size(int(match[1]) if match else None, size)
            raise _Permanent("404" if resp.status == 404 else f"HTTP {resp.status} {resp.reason}")
        _check_size(total, size)
        view = memoryview(buf)
        done = 0
        for piece in self._pieces(resp, length, length):
            view[done:done + len(piece)] = piece
            done += len(piece)
        if done < length:
            raise ValueError(f"the response ended after {done} of {length} bytes")
        self._finish(resp)
        self._count(done)
        return total

    def _pieces(self, resp, most: int, expected: int):
        """The body of ``resp`` as it arrives, one receive a piece, ``most`` bytes at most.

        ``readinto`` (or ``read``) returns only once the whole body is there, and the socket
        timeout bounds one receive, not the body: a server sending a byte at a time would hold
        the request for ever. Here the time is checked between receives, and a body not
        there ``grace + expected / min_rate`` seconds after the headers fails (ValueError:
        retried, as a timeout is).
        """
        s = self.settings
        started = time.monotonic()
        deadline = started + s.grace + expected / s.min_rate
        got = 0
        while got < most:
            if time.monotonic() > deadline:
                raise ValueError(f"too slow: {got} of {expected} bytes in "
                                 f"{time.monotonic() - started:.0f} s (at least "
                                 f"{s.min_rate / 1024:.0f} KiB/s expected)")
            piece = resp.read1(min(most - got, _PIECE))
            if not piece:
                return
            got += len(piece)
            yield piece

    @staticmethod
    def _finish(resp) -> None:
        """Hand a body read to its announced end back to its connection, for the next request
        (``read1`` does not, as ``readinto`` at the end does); any other one is closed by
        :meth:`_once`, with its connection."""
        if not resp.chunked and resp.length == 0:
            resp.read()

    def _count(self, n: int) -> None:
        with self._lock:
            self.counters["bytes"] += n

    def _connection(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise _Permanent(f"not an http(s) URL: {url}")
        if self._closed:
            raise _Permanent("stopping: the connections are closed")
        conns = self._local.__dict__.setdefault("conns", {})
        key = (parts.scheme, parts.netloc)
        conn = conns.get(key)
        if conn is None:
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = conns[key] = kind(parts.netloc, timeout=self.settings.timeout)
            with self._lock:
                self._all.append(conn)
        path = parts.path or "/"
        return conn, path + (f"?{parts.query}" if parts.query else "")

    def _drop(self, url: str) -> None:
        """Close this thread's connection to ``url``'s host: the next request reconnects."""
        parts = urlsplit(url)
        conn = self._local.__dict__.get("conns", {}).pop((parts.scheme, parts.netloc), None)
        if conn is not None:
            conn.close()

    def _track(self, sock) -> None:
        """Remember the socket a request went out on, for :meth:`close` (even once a response
        that closes its connection has taken it from the HTTPConnection)."""
        with self._lock:
            if sock is not None:
                self._socks.add(sock)
            closed = self._closed
        if closed:  # close() ran while this request was connecting
            _shutdown(sock)

    def close(self) -> None:
        """Close every thread's connections, waking a thread still reading one; any request
        after it fails at once.

        A thread blocked in a read holds the lock of its response's buffered reader, and
        ``HTTPConnection.close()`` takes that lock (closing the response): it would wait for
        the read, for ever against a server that trickles. ``shutdown`` of each socket first
        ends the read at once (it returns end of file); then the connections close.
        """
        with self._lock:
            self._closed = True
            conns, self._all = self._all, []
            socks = list(self._socks)
        for sock in socks:
            _shutdown(sock)
        for conn in conns:
            conn.close()


def _shutdown(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already, or never connected
        pass


def _check_size(total: int | None, size: int | None) -> None:
    """A file whose size is not the one recorded at convert is another file: its tensors have
    moved, and no range of it can be taken at the recorded offsets."""
    if total is not None and size is not None and total != size:
        raise _Permanent(f"the file changed since convert: {total} bytes, was {size}; "
                         "convert it again")


def _length(resp) -> int | None:
    value = resp.getheader("Content-Length")
    return int(value) if value is not None else None


def _reason(exc: Exception) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, http.client.IncompleteRead):
        return f"the response ended after {len(exc.partial)} bytes"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _explain(reason: str) -> str:
    return "not found (HTTP 404)" if reason == "404" else reason


def merge_ranges(ranges: list) -> list:
    """Join byte ranges that touch into one request each.

    Args:
        ranges: ``(file, start, length, payload)``; the payload says where the bytes go.
    Returns:
        ``[(file, start, length, [(offset in the merged range, length, payload)...])]``,
        sorted by file and start.
    """
    merged = []
    for file, start, length, payload in sorted(ranges, key=lambda r: (r[0], r[1])):
        if merged and merged[-1][0] == file and merged[-1][1] + merged[-1][2] == start:
            last = merged[-1]
            last[3].append((last[2], length, payload))
            merged[-1] = (file, last[1], last[2] + length, last[3])
        else:
            merged.append((file, start, length, [(0, length, payload)]))
    return merged


def runs(experts, longest: int) -> list:
    """Sorted ``experts`` cut into runs of consecutive ids, ``longest`` at most each."""
    out = []
    for e in sorted(set(experts)):
        if out and out[-1][-1] == e - 1 and len(out[-1]) < longest:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def remote_headers(remote) -> dict:
    """The headers a lazy directory's requests carry: a Hugging Face repo's token (HF_TOKEN
    or the saved login, as huggingface_hub finds it); none for a plain URL."""
    if remote is None or remote.repo is None:
        return {}
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers()
