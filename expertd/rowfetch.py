"""Fetch a lazy directory's expert rows from the remote checkpoint and write them durably.

One call fetches a run of adjacent experts of one layer: per segment one range request (the
run's slices of a stacked tensor are adjacent in the shard), ranges that touch merged into one.
The rows are assembled as ``expertd convert`` assembles them (segments at their offsets, zero
padding), so their checksums are the ones a full conversion records. Order: the rows are
written and flushed (:func:`~expertd.durable.durable_sync`), then their present records (see
present.py).
"""

import os
import threading
from typing import NamedTuple

import xxhash

from expertd.durable import durable_sync
from expertd.errors import BlobStoreError, RemoteError
from expertd.manifest import Manifest
from expertd.present import PresentRecords
from expertd.remote import RangeReader, merge_ranges


class Rows(NamedTuple):
    """Downloaded rows of a run, and what their download took."""

    data: bytearray
    requests: int
    payload: int


class RowFetcher:
    """Fills absent rows of a lazy blob directory; safe to call from several threads at once.

    Args:
        blob_dir: the directory.
        manifest: its manifest (with ``remote``).
        records: its present records, opened writable.
        reader: the HTTP range reader.
    Attributes:
        counters: ``rows_fetched``, ``bytes_fetched`` (payload bytes of expert rows),
            ``fetch_requests`` (range requests of expert rows).
    """

    def __init__(self, blob_dir, manifest: Manifest, records: PresentRecords,
                 reader: RangeReader):
        if manifest.remote is None:
            raise ValueError(f"{blob_dir} is not a lazy blob directory")
        self.dir = blob_dir
        self.manifest = manifest
        self.records = records
        self.reader = reader
        self._lock = threading.Lock()
        self.counters = dict(rows_fetched=0, bytes_fetched=0, fetch_requests=0)
        self._fds = []
        try:
            for layer in manifest.layers:
                self._fds.append(os.open(os.path.join(blob_dir, layer.file), os.O_WRONLY))
        except OSError as exc:
            self.close()
            raise BlobStoreError(f"{exc.filename}: cannot open for writing the rows that "
                                 f"arrive ({exc.strerror})") from None

    def url(self, layer: int) -> str:
        """The URL of the file holding ``layer``'s first segment (for messages)."""
        file = self.manifest.layers[layer].sources[0][0]
        return self.manifest.remote.files[file].url

    def fetch(self, layer: int, first: int, count: int = 1) -> None:
        """Fetch experts ``first .. first + count - 1`` of ``layer``, write them, mark them.

        Raises:
            RemoteError: a request failed (naming its URL and range).
            OSError: the blob or record file could not be written.
        """
        self.store(layer, [(first, self.download(self.manifest.layers[layer], first, count))])

    def store(self, layer: int, runs: list) -> None:
        """Write ``[(first, rows)]`` runs of ``layer`` (from :meth:`download`), one flush
        (:func:`durable_sync`) of the blob file for all, then their present records (one
        flush). What was written but not marked when a failure stops it reads as absent, and
        is fetched again."""
        info = self.manifest.layers[layer]
        stride = self.manifest.stride
        fd = self._fds[layer]
        marks = []
        for first, rows in runs:
            count = len(rows.data) // stride
            if os.pwrite(fd, rows.data, first * stride) != len(rows.data):
                raise OSError(f"short write of layer {layer} experts {first}..{first + count - 1}")
            view = memoryview(rows.data)
            marks.append((first, [xxhash.xxh3_64_intdigest(view[k * stride:k * stride +
                                                                 info.expert_bytes])
                                  for k in range(count)]))
        durable_sync(fd)
        if hasattr(os, "posix_fadvise"):  # the arena is the one copy in memory
            for first, rows in runs:
                os.posix_fadvise(fd, first * stride, len(rows.data), os.POSIX_FADV_DONTNEED)
        self.records.mark(layer, marks)
        with self._lock:
            c = self.counters
            c["rows_fetched"] += sum(len(rows.data) // stride for _, rows in runs)
            c["bytes_fetched"] += sum(rows.payload for _, rows in runs)
            c["fetch_requests"] += sum(rows.requests for _, rows in runs)

    def download(self, info, first: int, count: int) -> "Rows":
        """Experts ``first .. first + count - 1`` of the layer ``info``, assembled as convert
        assembles them (segments at their offsets, zero padding); nothing written yet."""
        files = self.manifest.remote.files
        stride = self.manifest.stride
        rows = bytearray(count * stride)
        view = memoryview(rows)
        wanted = [(file, start + first * seg.nbytes, count * seg.nbytes, seg)
                  for seg, (file, start) in zip(info.segments, info.sources)]
        requests = merge_ranges(wanted)
        for file, start, length, parts in requests:
            # The size convert recorded: an answer from a file of another size (replaced
            # since) fails, rather than bytes at the old offsets being stored as the expert.
            data = memoryview(self.reader.read(files[file].url, start, length,
                                               size=files[file].size))
            for offset, _, seg in parts:
                for k in range(count):
                    at = offset + k * seg.nbytes
                    row = k * stride + seg.offset
                    view[row:row + seg.nbytes] = data[at:at + seg.nbytes]
        return Rows(rows, len(requests), sum(r[2] for r in requests))

    def describe_failure(self, layer: int, expert: int, exc: Exception) -> str:
        """One line for a client whose demand needed the row: the expert and the URL."""
        if isinstance(exc, RemoteError):
            return f"layer {layer} expert {expert} is not fetched yet and {exc}"
        return (f"layer {layer} expert {expert} is not fetched yet and could not be written "
                f"to {self.dir}: {exc} (fetching from {self.url(layer)})")

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
