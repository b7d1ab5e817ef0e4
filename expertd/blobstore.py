"""Read-side access to a blob directory: validation, one-expert reads, checksums."""

import os
import sys
from pathlib import Path

import xxhash

from .errors import BlobStoreError, ChecksumError
from .manifest import Manifest

_F_NOCACHE = 48  # macOS fcntl: do not keep the pages of this file in the unified buffer cache


def open_blob(path: Path, direct: bool) -> int:
    """Open a blob file for reading; ``direct`` bypasses the page cache (O_DIRECT / F_NOCACHE).

    Falls back to buffered reads where the file system refuses O_DIRECT (e.g. tmpfs).
    """
    if direct and sys.platform == "darwin":
        import fcntl

        fd = os.open(path, os.O_RDONLY)
        fcntl.fcntl(fd, _F_NOCACHE, 1)
        return fd
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            pass
    return os.open(path, os.O_RDONLY)


class BlobStore:
    """An opened, validated blob directory.

    Args:
        blob_dir: the directory written by ``expertd convert``.
        direct: read with O_DIRECT (Linux) / F_NOCACHE (macOS) instead of the page cache.
    Raises:
        BlobStoreError: naming the file and what is wrong (missing, wrong size, bad manifest).
    """

    def __init__(self, blob_dir: Path, direct: bool = False):
        self.dir = Path(blob_dir).resolve()
        self.manifest = Manifest.load(self.dir)
        self.stride = self.manifest.stride
        self.direct = direct
        self._fds = []
        try:
            for layer in self.manifest.layers:
                path = self.dir / layer.file
                if not path.is_file():
                    raise BlobStoreError(f"{path}: blob file of layer {layer.index} is missing")
                size = path.stat().st_size
                expected = layer.num_experts * self.stride
                if size != expected:
                    raise BlobStoreError(f"{path}: size {size} bytes, expected {expected} "
                                         f"({layer.num_experts} experts x {self.stride})")
                self._fds.append(open_blob(path, direct))
            if not (self.dir / "trunk" / "config.json").is_file():
                raise BlobStoreError(f"{self.dir / 'trunk'}: trunk model directory is missing")
        except BaseException:
            self.close()
            raise

    @property
    def layers(self):
        return self.manifest.layers

    def check_index(self, layer: int, expert: int) -> None:
        if not 0 <= layer < len(self.manifest.layers):
            raise IndexError(f"layer {layer} out of range (0..{len(self.manifest.layers) - 1})")
        n = self.manifest.layers[layer].num_experts
        if not 0 <= expert < n:
            raise IndexError(f"expert {expert} out of range for layer {layer} (0..{n - 1})")

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
        if xxhash.xxh3_64_intdigest(memoryview(buf)[:info.expert_bytes]) != info.checksums[expert]:
            raise ChecksumError(layer, expert, str(self.dir / info.file))

    def read_expert(self, layer: int, expert: int, verify: bool = True) -> bytes:
        """Convenience: a fresh copy of one expert's bytes (not for hot paths)."""
        buf = bytearray(self.stride)
        if self.direct:
            self._read_aligned(layer, expert, buf)
        else:
            self.read_into(layer, expert, buf)
        if verify:
            self.verify(layer, expert, buf)
        return bytes(buf[:self.manifest.layers[layer].expert_bytes])

    def _read_aligned(self, layer: int, expert: int, out: bytearray) -> None:
        import mmap

        with mmap.mmap(-1, self.stride) as aligned:
            self.read_into(layer, expert, aligned)
            out[:] = aligned[:]

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
