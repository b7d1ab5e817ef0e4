"""HTTP range reads of a remote checkpoint's files: keep-alive connections, retries, checks.

Shared by ``expertd convert --lazy``, ``expertd fetch`` and the daemon's remote workers. Each
thread keeps its own keep-alive connection per host (``http.client``); a read is retried with
exponential backoff on a network error, a timeout, a 5xx / 429, or an answer of the wrong size,
and fails for good on any other status. Every error names the URL and the byte range.
"""

import http.client
import re
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from expertd.errors import RemoteError

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_REDIRECTS = (301, 302, 303, 307, 308)
_MAX_REDIRECTS = 5
_RETRIED = (408, 425, 429, 500, 502, 503, 504)


@dataclass(frozen=True)
class FetchSettings:
    """How remote bytes are fetched.

    Attributes:
        connections: parallel requests (one keep-alive connection per worker thread).
        coalesce: adjacent experts of a layer fetched by one range request, at most.
        attempts: tries per request before it fails.
        backoff: seconds before the first retry, doubled at each next one.
        timeout: seconds a connect or a read of the socket may wait for the server.
    """

    connections: int = 4
    coalesce: int = 4
    attempts: int = 4
    backoff: float = 0.25
    timeout: float = 30.0

    def __post_init__(self):
        for name in ("connections", "coalesce", "attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.backoff < 0 or not self.timeout > 0:
            raise ValueError("backoff must be at least 0 and timeout above 0")


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
        self.counters = dict(requests=0, bytes=0, retries=0, failures=0)

    def read(self, url: str, start: int, length: int) -> bytearray:
        """Bytes ``start`` to ``start + length - 1`` of ``url``.

        Raises:
            RemoteError: naming the URL and the range, after the last attempt.
        """
        buf = bytearray(length)
        self._retrying(url, (start, length), buf)
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

    def get(self, url: str) -> bytes | None:
        """The whole file at ``url``; None if the server says it does not exist (404).

        Raises:
            RemoteError: on any other failure, after the last attempt.
        """
        return self._retrying(url, None, None)

    def _retrying(self, url, span, buf):
        what = url if span is None else f"{url} bytes {span[0]}-{span[0] + span[1] - 1}"
        s = self.settings
        for attempt in range(s.attempts):
            try:
                return self._once(url, span, buf)
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

    def _once(self, url, span, buf):
        headers = dict(self.headers)
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[0] + span[1] - 1}"
        origin = urlsplit(url).netloc
        for _ in range(_MAX_REDIRECTS + 1):
            conn, path = self._connection(url)
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            with self._lock:
                self.counters["requests"] += 1
            if resp.status not in _REDIRECTS:
                break
            resp.read()
            url = urljoin(url, resp.getheader("Location", ""))
            if urlsplit(url).netloc != origin:  # a token is for its own host only
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
                data = resp.read()
                expected = resp.getheader("Content-Length")
                if expected is not None and len(data) != int(expected):
                    raise ValueError(f"got {len(data)} of {expected} bytes")
                self._count(len(data))
                return data
            return self._read_range(resp, span, buf)
        finally:
            if not resp.isclosed():
                resp.close()  # a body not read to its end: the connection is not reusable
                self._drop(url)

    def _read_range(self, resp, span, buf):
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
            raise _Permanent("404" if resp.status == 404 else f"HTTP {resp.status} {resp.reason}")
        view = memoryview(buf)
        done = 0
        while done < length:
            n = resp.readinto(view[done:])
            if not n:
                raise ValueError(f"the response ended after {done} of {length} bytes")
            done += n
        self._count(done)
        return total

    def _count(self, n: int) -> None:
        with self._lock:
            self.counters["bytes"] += n

    def _connection(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise _Permanent(f"not an http(s) URL: {url}")
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

    def close(self) -> None:
        """Close every thread's connections (call when no request runs any more)."""
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


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
