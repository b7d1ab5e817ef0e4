"""``expertd fetch``: complete a lazy blob directory ahead of time, resumably.

The rows not arrived yet (of every layer, or of some) are fetched as the daemon fetches them,
in runs of adjacent experts, on several connections, each run written durably before it is
marked present: an interrupted fetch keeps what arrived, and the next one fetches the rest.
A daemon serving the directory meanwhile sees the new rows before it fetches one itself.
"""

import os
import queue
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from expertd.blobstore import check_blob_file
from expertd.errors import BlobStoreError, FlagError, RemoteError
from expertd.manifest import Manifest
from expertd.present import PresentRecords
from expertd.remote import FetchSettings, RangeReader, remote_headers, runs
from expertd.rowfetch import RowFetcher
from expertd.runfile import take_lock
from expertd.shardcheck import check_shards, unchecked_note

LOCK = ".fetch.lock"


def parse_moe_layers(spec: str | None, n_layers: int) -> range:
    """``--layers A:B`` (MoE layers of the directory, a Python slice); None: every one.

    Raises:
        ValueError: not a non-empty range of the directory's layers.
    """
    if spec is None:
        return range(n_layers)
    try:
        start, stop = (int(p) if p else None for p in spec.split(":"))
    except ValueError:
        raise FlagError(f"--layers {spec!r} is not A:B (MoE layers, a Python slice)") from None
    chosen = range(n_layers)[slice(start, stop)]
    if not chosen:
        raise FlagError(f"--layers {spec}: no MoE layer of the {n_layers} of this directory")
    return chosen


class DownloadPool:
    """``submit(fn, *args)`` -> Future, run on ``workers`` daemon threads.

    For downloads a Ctrl-C must not wait for: ThreadPoolExecutor's threads are joined at
    its exit and again at the interpreter's, so a download stuck in the network (its whole
    retry schedule: attempts x --timeout, minutes by default) would hold the process.
    :meth:`abandon` cancels what has not started and leaves the running ones behind; the
    process exits without them (a row is marked present only once stored, so nothing half
    done is kept).
    """

    def __init__(self, workers: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = workers
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def abandon(self, futures=()) -> None:
        """Cancel ``futures`` not started yet and stop the threads once idle; no waiting."""
        for future in futures:
            future.cancel()
        for _ in range(self._workers):
            self._jobs.put(None)


def _pipeline(fetcher: RowFetcher, jobs: list, connections: int, advance):
    """Download the runs ``jobs`` (``(layer, first, count)``) on ``connections`` threads and
    store each on as many writer threads (a write and its flush, durable_sync, take about as
    long as the download), so that the network and the disk work at once; at most
    2 x ``connections`` runs are held in memory. The first failure stops new downloads; what
    was downloaded before it is still stored. Interrupted (Ctrl-C), it returns at once: see
    :class:`DownloadPool`.

    Returns:
        None, or ``(job, exception)`` of the first failure.
    """
    layers = fetcher.manifest.layers
    failure = None
    net = DownloadPool(connections, "expertd-fetch")
    disk = ThreadPoolExecutor(connections, thread_name_prefix="expertd-store")
    downloads, writes = deque(), deque()

    def settle(limit_downloads: int, limit_writes: int) -> None:
        nonlocal failure
        while len(downloads) > limit_downloads:
            job, future = downloads.popleft()
            try:
                rows = future.result()
            except Exception as exc:
                failure = failure or (job, exc)
                continue
            writes.append((job, disk.submit(fetcher.store, job[0], [(job[1], rows)])))
        while len(writes) > limit_writes:
            job, future = writes.popleft()
            try:
                future.result()
                advance(layers[job[0]].expert_bytes * job[2])
            except Exception as exc:
                failure = failure or (job, exc)

    try:
        for job in jobs:
            if failure is not None:
                break
            downloads.append((job, net.submit(fetcher.download, layers[job[0]], job[1], job[2])))
            settle(connections, connections)
        settle(0, 0)
    finally:
        # An interruption (Ctrl-C) cancels the queued downloads and leaves those in the
        # network (see DownloadPool); the writes running finish: what arrived stays stored.
        net.abandon(future for _, future in downloads)
        disk.shutdown(wait=True, cancel_futures=True)
    return failure


def fetch_missing(blob_dir: Path, layers: str | None = None, progress: bool = True,
                  settings: FetchSettings | None = None) -> dict:
    """Fetch every absent row of ``layers`` ("A:B"; default: all) of the lazy ``blob_dir``.

    Returns:
        ``rows_fetched``, ``bytes_fetched``, ``fetch_requests``, ``rows_present``,
        ``rows_total``, ``shards_checked`` (complete shards whose sha256 matched) and
        ``note`` (why no shard can be checked, or None: see ``unchecked_note``).
    Raises:
        BlobStoreError: not a lazy directory, a blob file missing or cut, another fetch
            runs on it, or a complete shard's sha256 is not the published one (its rows
            are marked absent then, for the next run to fetch again).
        RemoteError: a fetch failed (naming the URL); what arrived before it stays.
    """
    from tqdm import tqdm

    blob_dir = Path(blob_dir).expanduser().resolve()
    manifest = Manifest.load(blob_dir)
    if manifest.remote is None:
        raise BlobStoreError(f"{blob_dir} was converted whole: every row is there already")
    chosen = parse_moe_layers(layers, len(manifest.layers))
    for layer in manifest.layers:  # as the daemon and verify do: a cut file is no row's home
        check_blob_file(blob_dir / layer.file, layer, manifest.stride)
    settings = settings or FetchSettings()
    lock = take_lock(blob_dir / LOCK)
    if lock is None:
        raise BlobStoreError(f"another expertd fetch is completing {blob_dir}; wait for it")
    records = PresentRecords(blob_dir, manifest.layers, writable=True)
    fetcher = RowFetcher(blob_dir, manifest, records,
                         RangeReader(settings, remote_headers(manifest.remote)))
    try:
        jobs = []
        for index in chosen:
            layer = manifest.layers[index]
            absent = [e for e in range(layer.num_experts) if not records.present(index, e)]
            jobs += [(index, run[0], len(run)) for run in runs(absent, settings.coalesce)]
        total = sum(manifest.layers[i].expert_bytes * n for i, _, n in jobs)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                  disable=None if progress else True, desc="fetch", dynamic_ncols=True) as bar:
            failure = _pipeline(fetcher, jobs, settings.connections, bar.update)
        if failure is not None:
            (layer, first, _), exc = failure
            raise RemoteError(f"{fetcher.describe_failure(layer, first, exc)}; the "
                              f"{fetcher.counters['rows_fetched']} rows that arrived are kept: "
                              f"run expertd fetch again to fetch the rest") from None
        # A shard that fails its sha256 has its rows marked absent: not served on, and
        # fetched again by the next run.
        checked, faults = check_shards(blob_dir, manifest, records, withdraw=True)
        if faults:
            raise BlobStoreError(faults[0][1])
        return dict(fetcher.counters, rows_present=records.count(),
                    rows_total=sum(layer.num_experts for layer in manifest.layers),
                    shards_checked=len(checked), note=unchecked_note(manifest))
    finally:
        fetcher.reader.close()
        fetcher.close()
        records.close()
        os.close(lock)
