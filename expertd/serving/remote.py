"""The daemon's remote workers: rows of a lazy directory fetched once, on their own threads.

The fill pool hands over a fill whose row is not on the disk yet; the remote workers fetch it
(see expertd/rowfetch.py: written durably, then marked present) and hand it back, and the
pool's own workers then read it into the arena as any other row. Remote reads never hold a
local worker, so rows already on the disk keep filling while the network is slow or gone.

An expert is fetched once however many fills wait for it; demands go before prefetches; a
worker takes up to ``coalesce`` queued adjacent experts of one layer into one fetch (one range
request per segment).
"""

import logging
import os
import threading
import time
from collections import deque

from expertd.present import record_path
from expertd.remote import runs
from expertd.rowfetch import RowFetcher
from expertd.shardcheck import check_shards, withdrawn_marker

WATCH_INTERVAL = 1.0  # seconds between two looks at the withdrawn marker, at most, on ticks

log = logging.getLogger("expertd")


class RemoteFills:
    """Fetches absent rows on ``connections`` threads; ``done(layer, expert, error)`` is called
    from a worker thread when one is on the disk (error None) or failed (a one-line message).

    Args:
        fetcher: the :class:`~expertd.rowfetch.RowFetcher` of the blob directory.
        done: the completion callback.
        connections: worker threads, each with its own keep-alive connection.
        coalesce: adjacent experts of a layer fetched together, at most.
    """

    def __init__(self, fetcher: RowFetcher, done, connections: int, coalesce: int):
        self.fetcher = fetcher
        self._done = done
        self.coalesce = coalesce
        self._lock = threading.Condition()
        self._urgent: deque = deque()
        self._later: deque = deque()
        self._wanted: set = set()  # keys queued or being fetched
        self._closed = False
        self.counters = dict(fetch_errors=0, fetches=0, rows_refreshed=0, shards_checked=0,
                             shard_faults=0, rows_arrived=0)
        self._rows = sum(layer.num_experts for layer in fetcher.manifest.layers)
        self._checked = False  # the whole-file check runs once, when the last row arrives
        # Rows marked absent again (a shard failed its sha256, here or in expertd fetch):
        # the keys not handed to withdrawn() yet, and the record files' last seen mtimes.
        self._withdrawn: list = []
        self._marker = _mtime(withdrawn_marker(fetcher.dir))  # as it was at start
        self._next_watch = 0.0
        self._record_mtimes = [_mtime(record_path(fetcher.dir, layer))
                               for layer in fetcher.manifest.layers]
        self._threads = [threading.Thread(target=self._work, name=f"expertd-remote-{i}",
                                          daemon=True) for i in range(connections)]
        for thread in self._threads:
            thread.start()

    def request(self, layer: int, expert: int, urgent: bool) -> None:
        """Fetch ``(layer, expert)`` unless it is wanted already (then a demand expedites it)."""
        key = (layer, expert)
        with self._lock:
            if key in self._wanted:
                if urgent and key in self._later:
                    self._later.remove(key)
                    self._urgent.append(key)
                return
            self._wanted.add(key)
            (self._urgent if urgent else self._later).append(key)
            self._lock.notify()

    def expedite(self, layer: int, expert: int) -> None:
        self.request(layer, expert, urgent=True)

    def pending(self) -> int:
        """Experts queued or being fetched."""
        with self._lock:
            return len(self._wanted)

    def _take(self) -> list | None:
        """The next run of adjacent experts of one layer, or None once closed."""
        with self._lock:
            while not self._closed and not (self._urgent or self._later):
                self._lock.wait()
            if self._closed:
                return None
            layer, expert = (self._urgent or self._later).popleft()
            run = [expert]
            for step in (1, -1):  # grow the run upwards, then downwards, from what is queued
                nxt = expert + step
                while len(run) < self.coalesce:
                    key = (layer, nxt)
                    queue = (self._urgent if key in self._urgent else
                             self._later if key in self._later else None)
                    if queue is None:
                        break
                    queue.remove(key)
                    run.append(nxt)
                    nxt += step
            return layer, sorted(run)

    def _work(self) -> None:
        records = self.fetcher.records
        while True:
            job = self._take()
            if job is None:
                return
            layer, run = job
            # Another process (expertd fetch) may have brought some of them meanwhile.
            arrived = [e for e in run if records.refresh(layer, e)]
            todo = [e for e in run if e not in arrived]
            errors = {}
            if todo:
                try:
                    # A run with a hole (fetched by another process) is fetched in pieces.
                    for piece in runs(todo, len(todo)):
                        self.fetcher.fetch(layer, piece[0], len(piece))
                except Exception as exc:  # every waiter must hear, whatever went wrong
                    for e in todo:
                        if not records.present(layer, e):
                            errors[e] = self.fetcher.describe_failure(layer, e, exc)
            last = todo and not errors and not self._checked and records.count() == self._rows
            with self._lock:
                self.counters["fetches"] += bool(todo)
                self.counters["rows_refreshed"] += len(arrived)
                self.counters["fetch_errors"] += len(errors)
                for e in run:
                    self._wanted.discard((layer, e))
                closed = self._closed
            if not closed:
                for e in run:
                    self._done(layer, e, errors.get(e))
            if last:
                self._start_check()

    def _start_check(self) -> None:
        """Every row has arrived: check the shards, once, on a thread of its own.

        The check hashes every shard rebuilt from the disk (the whole model: hundreds of GB
        for the checkpoints this is for), so it runs after the waiters of the last run heard
        (done() above) and off the remote workers, which go on serving other fetches.
        """
        with self._lock:
            if self._checked or self._closed:
                return
            self._checked = True
        threading.Thread(target=self._check_shards, name="expertd-shardcheck",
                         daemon=True).start()

    def _check_shards(self) -> None:
        """Check each shard against its published sha256 (see :meth:`_start_check`)."""
        f = self.fetcher
        try:
            # A shard that fails has its rows marked absent: withdrawn() hands the cache
            # those it holds, and they are fetched again on their next demand. (withdraw is
            # passed by position: a test stands a slower check(*args) in for it.)
            checked, faults = check_shards(f.dir, f.manifest, f.records, True)
        except (OSError, ValueError) as exc:
            log.error("could not check the shards of %s against their sha256: %s", f.dir, exc)
            return
        for _, message in faults:
            log.error("%s", message)
        with self._lock:
            self.counters["shards_checked"] += len(checked)
            self.counters["shard_faults"] += len(faults)
            if faults:
                self._checked = False  # checked again once the rows have arrived again
                bad = {shard for shard, _ in faults}
                self._withdrawn += [(layer.index, e) for layer in f.manifest.layers
                                    if any(file in bad for file, _ in layer.sources)
                                    for e in range(layer.num_experts)]

    def arrivals(self) -> int:
        """Rows another process marked present since the last call (expertd fetch beside the
        daemon), taken in: one stat per record file on each tick, a layer's records read
        again only when its file changed (this daemon's own fetches change it too, and
        reading them again costs a pread of 16 bytes an expert). For the serving thread."""
        f, new = self.fetcher, 0
        for i, layer in enumerate(f.manifest.layers):
            mtime = _mtime(record_path(f.dir, layer))
            if mtime != self._record_mtimes[i]:
                self._record_mtimes[i] = mtime
                new += f.records.arrived(layer.index)
        self.counters["rows_arrived"] += new
        return new

    def withdrawn(self, layer: int | None = None) -> list:
        """``(layer, expert)`` of rows that were present and are absent now: their bytes
        failed a shard's sha256 (this daemon's check, or expertd fetch's in another process),
        so a copy in the arena must not be served any more. For the serving thread: on ticks
        (once a second at most) and before each demand (``layer`` given: looked at now). One
        stat of the withdrawn marker (shardcheck.withdrawn_marker), not of the record files
        this daemon's own fetches rewrite; the records are read again only when it changed."""
        f = self.fetcher
        if layer is None:
            now = time.monotonic()
            if now < self._next_watch:
                return []
            self._next_watch = now + WATCH_INTERVAL
        records, found = f.records, []
        marker = _mtime(withdrawn_marker(f.dir))
        if marker != self._marker:
            self._marker = marker
            # A row marked present by this daemon is on the disk before it is in memory, so
            # present in memory and absent on the disk is a row marked absent since.
            found += [(info.index, e) for info in f.manifest.layers
                      for e in range(info.num_experts)
                      if records.present(info.index, e) and not records.refresh(info.index, e)]
        with self._lock:
            found += self._withdrawn
            self._withdrawn = []
        if found:
            log.warning("%d rows of %s were marked absent (a shard failed its sha256): not "
                        "served any more, fetched again on demand", len(found), f.dir)
        return found

    def close(self, timeout: float = 1.0) -> None:
        """Stop the workers: queued fetches are dropped, none is reported any more."""
        with self._lock:
            self._closed = True
            self._urgent.clear()
            self._later.clear()
            self._lock.notify_all()
        deadline = time.monotonic() + timeout
        for thread in self._threads:  # a fetch stuck in the network ends at its socket timeout
            thread.join(max(0.0, deadline - time.monotonic()))
        self.fetcher.reader.close()
        if not any(thread.is_alive() for thread in self._threads):
            self.fetcher.close()


def _mtime(path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None
