"""The whole-file check of a lazy directory: a remote shard's published sha256 (Hugging Face's
LFS hash), computed over the shard's bytes rebuilt from what arrived.

A row's checksum is recorded when it arrives, so later reads from the disk are checked
against it; that checksum cannot tell a wrong byte the network delivered. Once every row a
shard holds has arrived, the shard can be rebuilt (its header as fetched, each expert tensor
from the blob rows, each other tensor from the trunk) and hashed: a match proves every byte.
"""

import hashlib
import os
import time
from pathlib import Path

from .tools.safetensors import parse_header, read_header

HEADERS_DIR = "remote"  # each shard's raw header, written by expertd convert --lazy
_CHUNK = 8 << 20


def shard_sha256(blob_dir: Path, manifest, records, shard: str) -> str | None:
    """The sha256 of ``shard`` rebuilt from ``blob_dir``; None if it cannot be rebuilt yet
    (a row not arrived, a pipeline stage's trunk, a gap between tensors)."""
    blob_dir = Path(blob_dir)
    remote = manifest.remote.files[shard]
    header_file = blob_dir / HEADERS_DIR / f"{shard}.header"
    if manifest.stage is not None or not header_file.is_file():
        return None
    raw = header_file.read_bytes()
    tensors = sorted(parse_header(raw[8:], remote.size, shard).values(), key=lambda t: t.start)
    experts = {f"{layer.module}.{seg.name}": (layer, seg)
               for layer in manifest.layers for seg in layer.segments}
    for layer in manifest.layers:
        if any(f == shard for f, _ in layer.sources) and records.count(layer.index) < \
                layer.num_experts:
            return None
    trunk_path = blob_dir / "trunk" / "model.safetensors"
    trunk = read_header(trunk_path)
    digest = hashlib.sha256(raw)
    pos = len(raw)
    fds = {}
    try:
        for t in tensors:
            if t.start != pos or (t.name not in experts and t.name not in trunk):
                return None
            if t.name in experts:
                layer, seg = experts[t.name]
                fd = fds.get(layer.file) or fds.setdefault(
                    layer.file, os.open(blob_dir / layer.file, os.O_RDONLY))
                for e in range(layer.num_experts):
                    digest.update(os.pread(fd, seg.nbytes, e * manifest.stride + seg.offset))
            else:
                fd = fds.get("trunk") or fds.setdefault("trunk", os.open(trunk_path, os.O_RDONLY))
                src = trunk[t.name]
                for done in range(0, src.nbytes, _CHUNK):
                    digest.update(os.pread(fd, min(_CHUNK, src.nbytes - done), src.start + done))
            pos = t.start + t.nbytes
    finally:
        for fd in fds.values():
            os.close(fd)
    return digest.hexdigest() if pos == remote.size else None


def unchecked_note(manifest) -> str | None:
    """Why no shard of a lazy directory can be checked whole, in one line; None if some can.

    A plain base URL publishes no sha256, and a pipeline stage's trunk holds only its own
    layers' weights, so nothing can be rebuilt: said once (by fetch, verify) rather than the
    check silently skipped.
    """
    if manifest.stage is not None:
        return ("a pipeline stage's directory (--layers): its shards cannot be rebuilt whole, "
                "so no row is checked against a published sha256")
    if all(f.sha256 is None for f in manifest.remote.files.values()):
        return (f"{manifest.remote.source} publishes no sha256 of its shards: the rows are "
                "checked against the checksums recorded when they arrived only")
    return None


def withdraw_shard(blob_dir: Path, manifest, records, shard: str) -> int:
    """Mark absent, durably, every row of the layers whose experts ``shard`` holds.

    A shard that fails its sha256 has a wrong byte in some row, and no row's own checksum
    can say which (it was recorded from the bytes as they arrived). Absent, the rows are
    fetched again (by expertd fetch, or the daemon on demand), and a daemon serving the
    directory sees its records change and stops serving the rows it holds (see
    expertd/serving/remote.py). ``records`` must be writable; they are read again.

    Returns:
        The rows marked absent.
    """
    from .durable import durable_sync
    from .present import RECORD, record_path

    withdrawn = 0
    for layer in manifest.layers:
        if not any(f == shard for f, _ in layer.sources):
            continue
        fd = os.open(record_path(blob_dir, layer), os.O_WRONLY)
        try:
            os.pwrite(fd, bytes(layer.num_experts * RECORD.size), 0)
            durable_sync(fd)
        finally:
            os.close(fd)
        for e in range(layer.num_experts):
            records.refresh(layer.index, e)
        withdrawn += layer.num_experts
    if withdrawn:  # what a daemon serving the directory watches (RemoteFills.withdrawn)
        marker = withdrawn_marker(blob_dir)
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(f"{time.time_ns()}\n")
    return withdrawn


def withdrawn_marker(blob_dir) -> Path:
    """The file rewritten each time rows are marked absent again: a daemon stats it, not the
    record files, which its own fetches rewrite all the time."""
    return Path(blob_dir) / "remote" / "withdrawn"


def check_shards(blob_dir: Path, manifest, records, withdraw: bool = False) -> tuple:
    """Check every complete shard that has a published sha256.

    Args:
        withdraw: mark the rows of a shard that fails absent (:func:`withdraw_shard`), so
            that they are fetched again rather than served on; ``records`` writable then.
    Returns:
        ``(checked, faults)``: the shards whose sha256 matched, and ``[(shard, message)]``
        for those whose did not.
    """
    checked, faults = [], []
    for shard, remote in sorted(manifest.remote.files.items()):
        if remote.sha256 is None:
            continue
        got = shard_sha256(blob_dir, manifest, records, shard)
        if got is None:
            continue
        if got == remote.sha256:
            checked.append(shard)
            continue
        message = (f"{remote.url}: the rows that arrived do not rebuild the file its server "
                   f"published (sha256 {got[:12]}..., expected {remote.sha256[:12]}...)")
        if withdraw:
            n = withdraw_shard(blob_dir, manifest, records, shard)
            message += (f"; its {n} rows were marked absent: run expertd fetch --blobs "
                        f"{blob_dir} to fetch them again")
        faults.append((shard, message))
    return checked, faults
