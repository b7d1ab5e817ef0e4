"""Which rows of a lazily converted blob directory have arrived, and their checksums.

Each blob file ``layer-NNN.blob`` of a lazy directory has a record file ``layer-NNN.blob.rows``
beside it: 16 bytes per expert, ``<QQ``: the row's xxh3_64 checksum and a tag, the xxh3_64 of
(expert, checksum) under a fixed seed. All zeros (as created, sparse) means absent. A row is
marked present only after its bytes are on the disk (written, then flushed by
:func:`~expertd.durable.durable_sync`), and the record is written in one 16-byte ``pwrite``
(then flushed too): a crash leaves either the old record or the new one, and a torn record
fails its tag, so it reads as absent and the row is fetched again. Never a row marked present
with wrong bytes.
"""

import os
import struct
import threading
from pathlib import Path

import numpy as np
import xxhash

from expertd.durable import durable_sync
from expertd.errors import BlobStoreError

RECORD = struct.Struct("<QQ")
_TAG_SEED = 0x65787065727464  # "expertd"


def record_path(blob_dir: Path, layer) -> Path:
    return Path(blob_dir) / f"{layer.file}.rows"


def _tag(expert: int, checksum: int) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", expert, checksum), seed=_TAG_SEED)


def create_records(blob_dir: Path, layer) -> None:
    """Write an empty (all absent) record file for ``layer``: sparse, no row present."""
    with open(record_path(blob_dir, layer), "xb") as f:
        f.truncate(layer.num_experts * RECORD.size)
        durable_sync(f.fileno())


class PresentRecords:
    """The present records of every layer of a lazy blob directory, in memory and on disk.

    Reads (``present``, ``checksum``) are plain array lookups, for any thread; ``mark`` makes
    rows durable and may run in several threads at once (for different rows).

    Args:
        blob_dir: the directory.
        layers: its manifest's MoE layers.
        writable: open the record files for writing too (``mark``); "auto": where the
            permissions allow it.
    Raises:
        BlobStoreError: a record file is missing or of the wrong size.
    """

    def __init__(self, blob_dir: Path, layers, writable=False):
        self.dir = Path(blob_dir)
        self.present_rows = [np.zeros(layer.num_experts, dtype=bool) for layer in layers]
        self.checksums = [np.zeros(layer.num_experts, dtype=np.uint64) for layer in layers]
        self._fds = []
        self._lock = threading.Lock()
        try:
            for layer in layers:
                path = record_path(self.dir, layer)
                expected = layer.num_experts * RECORD.size
                try:
                    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
                except PermissionError:
                    if writable != "auto":
                        raise
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise BlobStoreError(f"{path}: the present record of layer {layer.index} "
                                         "is missing") from None
                self._fds.append(fd)
                size = os.fstat(fd).st_size
                if size != expected:
                    raise BlobStoreError(f"{path}: size {size} bytes, expected {expected} "
                                         f"({layer.num_experts} records of {RECORD.size})")
                self._load(layer.index, os.pread(fd, expected, 0))
        except BaseException:
            self.close()
            raise

    def _load(self, layer: int, raw: bytes, first: int = 0) -> None:
        for i, (checksum, tag) in enumerate(RECORD.iter_unpack(raw)):
            expert = first + i
            ok = tag != 0 and tag == _tag(expert, checksum)
            self.present_rows[layer][expert] = ok
            self.checksums[layer][expert] = checksum if ok else 0

    def present(self, layer: int, expert: int) -> bool:
        return bool(self.present_rows[layer][expert])

    def checksum(self, layer: int, expert: int) -> int:
        return int(self.checksums[layer][expert])

    def arrived(self, layer: int) -> int:
        """Read ``layer``'s record file again and take the rows another process (expertd
        fetch beside the daemon) marked present since: how many. Never the other way: a row
        present here and absent on the disk was withdrawn, which the withdrawn marker's
        watcher finds and reports (refresh)."""
        raw = os.pread(self._fds[layer], len(self.present_rows[layer]) * RECORD.size, 0)
        new = 0
        with self._lock:
            rows, sums = self.present_rows[layer], self.checksums[layer]
            for expert, (checksum, tag) in enumerate(RECORD.iter_unpack(raw)):
                if not rows[expert] and tag != 0 and tag == _tag(expert, checksum):
                    sums[expert] = checksum
                    rows[expert] = True
                    new += 1
        return new

    def refresh(self, layer: int, expert: int) -> bool:
        """Read one record again from the disk (another process may have fetched the row);
        whether the row is present now."""
        self._load(layer, os.pread(self._fds[layer], RECORD.size, expert * RECORD.size), expert)
        return self.present(layer, expert)

    def mark(self, layer: int, runs: list) -> None:
        """Record rows of ``layer`` as present: ``runs`` is ``[(first, checksums)]``, the
        checksums of experts ``first, first + 1, ...``.

        Call only once their rows are durable in the blob file. Each record is one 16-byte
        write at a 16-byte boundary; the file is flushed (:func:`durable_sync`) once, after all
        of them.
        """
        fd = self._fds[layer]
        for first, checksums in runs:
            raw = b"".join(RECORD.pack(c, _tag(first + i, c)) for i, c in enumerate(checksums))
            if os.pwrite(fd, raw, first * RECORD.size) != len(raw):
                raise OSError(f"short write of the present record of layer {layer}")
        durable_sync(fd)
        for first, checksums in runs:
            for i, c in enumerate(checksums):
                self.checksums[layer][first + i] = c
                self.present_rows[layer][first + i] = True

    def count(self, layer: int | None = None) -> int:
        """Rows present, in ``layer`` or in every layer."""
        rows = self.present_rows if layer is None else [self.present_rows[layer]]
        return int(sum(int(r.sum()) for r in rows))

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
