"""``expertd fetch``: complete a lazy blob directory ahead of time, resumably.

The rows not arrived yet (of every layer, or of some) are fetched as the daemon fetches them,
in runs of adjacent experts, on several connections, each run written durably before it is
marked present: an interrupted fetch keeps what arrived, and the next one fetches the rest.
A daemon serving the directory meanwhile sees the new rows before it fetches one itself.
"""

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from expertd.errors import BlobStoreError, RemoteError
from expertd.manifest import Manifest
from expertd.present import PresentRecords
from expertd.remote import FetchSettings, RangeReader, remote_headers, runs
from expertd.rowfetch import RowFetcher
from expertd.runfile import take_lock
from expertd.shardcheck import check_shards

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
        raise ValueError(f"--layers {spec!r} is not A:B (MoE layers, a Python slice)") from None
    chosen = range(n_layers)[slice(start, stop)]
    if not chosen:
        raise ValueError(f"--layers {spec}: no MoE layer of the {n_layers} of this directory")
    return chosen


def _pipeline(fetcher: RowFetcher, jobs: list, connections: int, advance):
    """Download the runs ``jobs`` (``(layer, first, count)``) on ``connections`` threads and
    store each on as many writer threads (a write and its fdatasync take about as long as the
    download), so that the network and the disk work at once; at most 2 x ``connections`` runs
    are held in memory. The first failure stops new downloads; what
    was downloaded before it is still stored.

    Returns:
        None, or ``(job, exception)`` of the first failure.
    """
    layers = fetcher.manifest.layers
    failure = None
    with ThreadPoolExecutor(connections, thread_name_prefix="expertd-fetch") as net, \
            ThreadPoolExecutor(connections, thread_name_prefix="expertd-store") as disk:
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

        for job in jobs:
            if failure is not None:
                break
            downloads.append((job, net.submit(fetcher.download, layers[job[0]], job[1], job[2])))
            settle(connections, connections)
        settle(0, 0)
    return failure


def fetch_missing(blob_dir: Path, layers: str | None = None, progress: bool = True,
                  settings: FetchSettings | None = None) -> dict:
    """Fetch every absent row of ``layers`` ("A:B"; default: all) of the lazy ``blob_dir``.

    Returns:
        ``rows_fetched``, ``bytes_fetched``, ``fetch_requests``, ``rows_present``,
        ``rows_total`` and ``shards_checked`` (complete shards whose sha256 matched).
    Raises:
        BlobStoreError: not a lazy directory, another fetch runs on it, or a complete
            shard's sha256 is not the published one.
        RemoteError: a fetch failed (naming the URL); what arrived before it stays.
    """
    from tqdm import tqdm

    blob_dir = Path(blob_dir).expanduser().resolve()
    manifest = Manifest.load(blob_dir)
    if manifest.remote is None:
        raise BlobStoreError(f"{blob_dir} was converted whole: every row is there already")
    chosen = parse_moe_layers(layers, len(manifest.layers))
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
        checked, faults = check_shards(blob_dir, manifest, records)
        if faults:
            raise BlobStoreError(faults[0][1])
        return dict(fetcher.counters, rows_present=records.count(),
                    rows_total=sum(layer.num_experts for layer in manifest.layers),
                    shards_checked=len(checked))
    finally:
        fetcher.reader.close()
        fetcher.close()
        records.close()
        os.close(lock)
