"""Read-side access to a blob directory: validation, one-expert reads, checksums of expert rows
and of the trunk, and the offline check of a whole directory.

One job, over 400 lines: reading a blob directory.
"""

import errno
import mmap
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import xxhash

from .errors import BlobStoreError, ChecksumError
from .manifest import Manifest, reconvert
from .present import PresentRecords

_F_NOCACHE = 48  # macOS fcntl: do not keep the pages of this file in the unified buffer cache
_HASH_CHUNK = 8 << 20  # bytes read at a time when hashing a file: bounds the memory used
_PROBE = 4096  # one page: the smallest O_DIRECT read every file system must take


def open_for_reads(path: Path, direct: bool) -> tuple:
    """Open a blob file for reading and say how its reads will go.

    ``direct`` asks to bypass the page cache (O_DIRECT / F_NOCACHE). Where the file system
    refuses it (ramfs, some FUSE and network file systems) the file is opened for buffered
    reads instead, and the reason says so.

    Returns:
        ``(fd, io_mode, reason)``: ``io_mode`` is ``"direct"`` or ``"buffered"``.
    """
    if not direct:
        return os.open(path, os.O_RDONLY), "buffered", "buffered reads were asked for"
    if sys.platform == "darwin":
        import fcntl

        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.fcntl(fd, _F_NOCACHE, 1)
        except OSError as exc:
            return fd, "buffered", f"F_NOCACHE refused on {path} ({exc.strerror})"
        return fd, "direct", "F_NOCACHE"
    if not hasattr(os, "O_DIRECT"):
        return os.open(path, os.O_RDONLY), "buffered", f"no O_DIRECT on {sys.platform}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return (os.open(path, os.O_RDONLY), "buffered",
                f"O_DIRECT refused by the file system of {path} ({exc.strerror})")
    # Some file systems accept the flag at open and refuse the reads: try one.
    try:
        with mmap.mmap(-1, _PROBE) as page:
            os.preadv(fd, [page], 0)
    except OSError as exc:
        os.close(fd)
        if exc.errno != errno.EINVAL:
            raise
        return (os.open(path, os.O_RDONLY), "buffered",
                f"O_DIRECT reads refused by the file system of {path} ({exc.strerror})")
    return fd, "direct", "O_DIRECT"


def open_blob(path: Path, direct: bool) -> int:
    """Open a blob file for reading (see :func:`open_for_reads`); only the descriptor."""
    return open_for_reads(path, direct)[0]


class BlobStore:
    """An opened, validated blob directory.

    Args:
        blob_dir: the directory written by ``expertd convert``.
        direct: read with O_DIRECT (Linux) / F_NOCACHE (macOS) instead of the page cache.
    Attributes:
        records: a lazy directory's :class:`~expertd.present.PresentRecords` (which rows
            have arrived, and their checksums); None for a converted one, whose rows are all
            there.
        io_mode: how reads really go, ``"direct"`` or ``"buffered"`` (buffered when ``direct``
            was not asked for or a file system refused it); ``io_reason`` says why.
        direct: ``io_mode == "direct"``.
    Raises:
        BlobStoreError: naming the file and what is wrong (missing, wrong size, bad manifest).
    """

    def __init__(self, blob_dir: Path, direct: bool = False):
        self.dir = Path(blob_dir).expanduser().resolve()
        self.manifest = Manifest.load(self.dir)
        self.stride = self.manifest.stride
        self._fds = []
        self.records = None
        modes = []
        try:
            if self.manifest.remote is not None:
                self.records = PresentRecords(self.dir, self.manifest.layers, writable="auto")
            for layer in self.manifest.layers:
                path = self.dir / layer.file
                check_blob_file(path, layer, self.stride)
                fd, mode, reason = open_for_reads(path, direct)
                self._fds.append(fd)
                modes.append((mode, reason))
            if not (self.dir / "trunk" / "config.json").is_file():
                raise BlobStoreError(f"{self.dir / 'trunk'}: trunk model directory is missing")
        except OSError as exc:
            self.close()
            raise BlobStoreError(f"{exc.filename or self.dir}: cannot open ({exc.strerror})"
                                 ) from None
        except BaseException:
            self.close()
            raise
        # One file read buffered makes the store buffered: the rows must be treated alike.
        refused = [reason for mode, reason in modes if mode == "buffered"]
        self.io_mode = "buffered" if refused else "direct"
        self.io_reason = refused[0] if refused else modes[0][1]
        self.direct = self.io_mode == "direct"

    @property
    def layers(self):
        return self.manifest.layers

    def check_index(self, layer: int, expert: int) -> None:
        if not 0 <= layer < len(self.manifest.layers):
            raise IndexError(f"layer {layer} out of range (0..{len(self.manifest.layers) - 1})")
        n = self.manifest.layers[layer].num_experts
        if not 0 <= expert < n:
            raise IndexError(f"expert {expert} out of range for layer {layer} (0..{n - 1})")

    @property
    def lazy(self) -> bool:
        return self.records is not None

    def present(self, layer: int, expert: int) -> bool:
        """Whether the expert's row is on the disk (always, but in a lazy directory)."""
        return self.records is None or self.records.present(layer, expert)

    def checksum(self, layer: int, expert: int) -> int:
        """The checksum the row's bytes must have (a lazy row's is recorded on arrival)."""
        if self.records is not None:
            return self.records.checksum(layer, expert)
        return self.manifest.layers[layer].checksums[expert]

    def read_into(self, layer: int, expert: int, buf) -> int:
        """Read one expert's whole row (``stride`` bytes) into ``buf`` with ``os.preadv``.

        ``buf`` must be writable, at least ``stride`` bytes and, with ``direct``, page-aligned.
        Returns the number of bytes read.
        """
        self.check_index(layer, expert)
        view = memoryview(buf)[:self.stride]
        if view.nbytes < self.stride:
            raise ValueError(f"buffer of {view.nbytes} bytes: a row needs at least "
                             f"{self.stride} bytes")
        got = os.preadv(self._fds[layer], [view], expert * self.stride)
        if got != self.stride:
            raise BlobStoreError(f"{self.dir / self.manifest.layers[layer].file}: short read "
                                 f"of expert {expert} ({got} of {self.stride} bytes)")
        return got

    def verify(self, layer: int, expert: int, buf) -> None:
        """Raise :class:`ChecksumError` unless ``buf`` holds the expert's exact bytes."""
        self.check_index(layer, expert)
        info = self.manifest.layers[layer]
        expected = self.checksum(layer, expert)
        if not self.present(layer, expert) or (
                xxhash.xxh3_64_intdigest(memoryview(buf)[:info.expert_bytes]) != expected):
            raise ChecksumError(layer, expert, str(self.dir / info.file))

    def verify_trunk(self) -> None:
        """Check every file of ``trunk/`` against the manifest (see :func:`check_trunk`)."""
        check_trunk(self.dir, self.manifest)

    def read_expert(self, layer: int, expert: int, verify: bool = True) -> bytes:
        """Convenience: a fresh copy of one expert's bytes (not for hot paths)."""
        buf = bytearray(self.stride)
        if self.direct:
            with mmap.mmap(-1, self.stride) as aligned:
                self.read_into(layer, expert, aligned)
                buf[:] = aligned[:]
        else:
            self.read_into(layer, expert, buf)
        if verify:
            self.verify(layer, expert, buf)
        return bytes(buf[:self.manifest.layers[layer].expert_bytes])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self.records is not None:
            self.records.close()


def check_blob_file(path: Path, layer, stride: int) -> None:
    """A layer's blob file exists at its full size (a lazy one's too: sparse, but full size).

    Raises:
        BlobStoreError: missing or of another size, naming the file.
    """
    if not path.is_file():
        raise BlobStoreError(f"{path}: blob file of layer {layer.index} is missing")
    size = path.stat().st_size
    expected = layer.num_experts * stride
    if size != expected:
        raise BlobStoreError(f"{path}: size {size} bytes, expected {expected} "
                             f"({layer.num_experts} experts x {stride})")


def file_checksum(path: Path, advance=None) -> tuple:
    """xxh3_64 of a whole file, read ``_HASH_CHUNK`` bytes at a time.

    Args:
        advance: called with the number of bytes read after each chunk (a progress bar).
    Returns:
        ``(checksum, size)``.
    Raises:
        OSError: the file cannot be read.
    """
    digest = xxhash.xxh3_64()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
            if advance is not None:
                advance(n)
    return digest.intdigest(), size


class Fault(NamedTuple):
    """One thing wrong in a blob directory: a file, or one expert's row in it."""

    path: Path
    layer: int | None
    expert: int | None
    message: str

    def __str__(self) -> str:
        return self.message


def trunk_faults(blob_dir: Path, manifest: Manifest, advance=None) -> Iterator[Fault]:
    """Every trunk file that is missing, of the wrong size or checksum, or not in the manifest.

    Files whose names start with a dot (``.DS_Store``) are not the model's and are ignored;
    any other unlisted file could change what mlx-lm loads, so it is a fault.
    """
    trunk = Path(blob_dir) / "trunk"
    listed = {f.name for f in manifest.trunk}
    try:
        present = sorted(p.name for p in trunk.iterdir() if p.is_file())
    except OSError as exc:
        yield Fault(trunk, None, None, f"{trunk}: cannot list the trunk ({exc.strerror})")
        present = []
    for name in present:
        if name not in listed and not name.startswith("."):
            yield Fault(trunk / name, None, None,
                        f"{trunk / name}: not written by expertd convert (not in the manifest)")
    for entry in manifest.trunk:
        path = trunk / entry.name
        try:
            size = path.stat().st_size
            if size != entry.size:
                if advance is not None:
                    advance(entry.size)
                yield Fault(path, None, None, f"{path}: size {size} bytes, the manifest says "
                            f"{entry.size}")
                continue
            checksum, _ = file_checksum(path, advance)
        except FileNotFoundError:
            if advance is not None:
                advance(entry.size)
            yield Fault(path, None, None, f"{path}: trunk file is missing")
            continue
        except OSError as exc:
            yield Fault(path, None, None, f"{path}: cannot read ({exc.strerror})")
            continue
        if checksum != entry.checksum:
            yield Fault(path, None, None, f"{path}: checksum mismatch (the file is corrupt)")


def check_trunk(blob_dir: Path, manifest: Manifest) -> None:
    """Hash every file of ``trunk/`` (streaming, bounded memory) and compare with the manifest.

    Raises:
        BlobStoreError: naming the first bad file, and saying to re-run ``expertd convert``.
    """
    for fault in trunk_faults(blob_dir, manifest):
        raise BlobStoreError(f"{fault}; {reconvert(blob_dir)}")


class DirectoryCheck:
    """The offline check of a whole blob directory: every expert row and every trunk file.

    Args:
        blob_dir: the directory to check.
    Raises:
        BlobStoreError: the manifest itself is unusable (nothing else can be checked).
    """

    def __init__(self, blob_dir: Path):
        self.dir = Path(blob_dir).resolve()
        self.manifest = Manifest.load(self.dir)
        self.experts = sum(layer.num_experts for layer in self.manifest.layers)
        # A lazy directory: only the rows that arrived are checked, against their records.
        self.records = (PresentRecords(self.dir, self.manifest.layers)
                        if self.manifest.remote is not None else None)
        if self.records is not None:
            self.records.close()  # read into memory: the descriptors are not needed
        self.present = self.experts if self.records is None else self.records.count()
        self.shards_checked: list = []
        self.shard_faults = self.other_faults = 0
        self.note = None  # a lazy directory's: why no shard can be checked against a sha256
        if self.records is not None:
            from .shardcheck import unchecked_note

            self.note = unchecked_note(self.manifest)
        self.total_bytes = (self.manifest.total_expert_bytes
                            + sum(f.size for f in self.manifest.trunk))

    def faults(self, advance=None) -> Iterator[Fault]:
        """Yield every fault, experts layer by layer and then the trunk.

        Args:
            advance: called with a number of bytes as they are checked (a progress bar).
        """
        for layer in self.manifest.layers:
            for fault in self._layer_faults(layer, advance):
                self.other_faults += 1
                yield fault
        for fault in trunk_faults(self.dir, self.manifest, advance):
            self.other_faults += 1
            yield fault
        if self.records is not None:
            from .shardcheck import check_shards

            self.shards_checked, faults = check_shards(self.dir, self.manifest, self.records)
            for shard, message in faults:
                self.shard_faults += 1
                yield Fault(self.dir / shard, None, None, message)

    def advice(self) -> str:
        """What repairs the faults found: a lazy directory is not made from a MODEL_DIR, and
        rows that fail their shard's sha256 are fetched again by expertd fetch; a damaged
        file or row of it is made again by a new lazy conversion of its source."""
        if self.records is None:
            return reconvert(self.dir)
        fetch = f"expertd fetch --blobs {self.dir} (twice: it marks the rows absent first)"
        if not self.other_faults:
            return f"run {fetch}"
        again = f"re-run expertd convert {self.manifest.remote.source} NEW_DIR --lazy"
        return f"{again}; for a shard that fails its sha256, {fetch}" if self.shard_faults \
            else again

    def _layer_faults(self, layer, advance) -> Iterator[Fault]:
        stride = self.manifest.stride
        path = self.dir / layer.file
        try:
            check_blob_file(path, layer, stride)
        except BlobStoreError as exc:
            yield Fault(path, layer.index, None, str(exc))
            if not path.is_file():
                if advance is not None:
                    advance(layer.num_experts * stride)
                return
        try:
            fd = open_blob(path, direct=True)  # keep a directory scan out of the page cache
        except OSError as exc:
            yield Fault(path, layer.index, None, f"{path}: cannot open ({exc.strerror})")
            return
        batch = max(1, _HASH_CHUNK // stride)
        try:
            with mmap.mmap(-1, batch * stride) as buf:
                for first in range(0, layer.num_experts, batch):
                    count = min(batch, layer.num_experts - first)
                    problem = "row past the end of the file"
                    try:
                        with memoryview(buf) as view:
                            got = os.preadv(fd, [view[:count * stride]], first * stride)
                    except OSError as exc:
                        got, problem = 0, f"read error ({exc.strerror})"
                    for expert in range(first, first + count):
                        if self.records is not None and not self.records.present(layer.index,
                                                                                 expert):
                            continue  # not arrived yet: nothing to check
                        expected = (layer.checksums[expert] if self.records is None
                                    else self.records.checksum(layer.index, expert))
                        start = (expert - first) * stride
                        if got < start + layer.expert_bytes:
                            yield Fault(path, layer.index, expert, f"layer {layer.index} expert "
                                        f"{expert} in {path}: {problem}")
                            continue
                        with memoryview(buf) as view:
                            ok = (xxhash.xxh3_64_intdigest(view[start:start + layer.expert_bytes])
                                  == expected)
                        if not ok:
                            yield Fault(path, layer.index, expert,
                                        str(ChecksumError(layer.index, expert, str(path))))
                    if advance is not None:
                        advance(count * stride)
        finally:
            os.close(fd)
