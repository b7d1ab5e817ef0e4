"""Streaming access to safetensors files: headers and byte ranges, never whole tensors.

The format: an 8-byte little-endian header length, a JSON header mapping tensor names to
dtype, shape and data offsets, then the raw data.
"""

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple
    path: Path
    start: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: Path) -> dict:
    """Every tensor of one safetensors file, as ``{name: TensorInfo}``.

    Raises:
        ValueError: if the file is not a well-formed safetensors file.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        n = header_length(raw, size, path)
        return parse_header(f.read(n), size, path)


def header_length(raw: bytes, size: int, where) -> int:
    """The JSON header's length from a file's first 8 bytes (``size``: the file's size)."""
    if len(raw) != 8:
        raise ValueError(f"{where}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw)
    if n > min(_MAX_HEADER, size - 8):
        raise ValueError(f"{where}: safetensors header length {n} is not plausible")
    return n


def parse_header(raw: bytes, size: int, path) -> dict:
    """Every tensor of a header ``raw`` (the JSON after the length) of a file of ``size``
    bytes, as ``{name: TensorInfo}`` with ``path`` as each tensor's file.

    Raises:
        ValueError: if the header is not well-formed.
    """
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    base = 8 + len(raw)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = _entry(info, name, path)
        if end - begin != prod(shape) * DTYPE_SIZES[dtype] or base + end > size:
            raise ValueError(f"{path}: tensor {name} has inconsistent offsets")
        tensors[name] = TensorInfo(name, dtype, shape, path, base + begin, end - begin)
    return tensors


class SafetensorsWriter:
    """Writes a safetensors file whose tensor list is known up front, data streamed in order."""

    def __init__(self, path: Path, tensors: list, metadata: dict | None = None):
        header = {"__metadata__": metadata or {"format": "mlx"}}
        offset = 0
        for t in tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        self._tensors = tensors

    def copy_all(self, chunk: int = 64 << 20, progress=None) -> None:
        """Copy every tensor's bytes from its source file, ``chunk`` bytes at a time."""
        fds = {}
        try:
            for t in self._tensors:
                fd = fds.get(t.path)
                if fd is None:
                    fd = fds[t.path] = os.open(t.path, os.O_RDONLY)
                done = 0
                while done < t.nbytes:
                    data = os.pread(fd, min(chunk, t.nbytes - done), t.start + done)
                    if not data:
                        raise ValueError(f"{t.path}: unexpected end of file in {t.name}")
                    self._file.write(data)
                    done += len(data)
                    if progress is not None:
                        progress(len(data))
        finally:
            for fd in fds.values():
                os.close(fd)

    def append(self, data) -> None:
        """Write the next bytes of the data, in the order of the tensor list."""
        self._file.write(data)

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def _entry(info, name: str, path) -> tuple:
    """``(dtype, shape, (begin, end))`` of one header entry, checked for type: a header from
    a remote server (convert --lazy) is anyone's JSON, and a malformed entry must be the
    one-line ValueError of a bad header, never a TypeError or KeyError from deep inside.

    Raises:
        ValueError: not an object with a known dtype, a list of sizes and two offsets.
    """
    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(info, dict):
        raise ValueError(f"{path}: tensor {name}'s header entry is not a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise ValueError(f"{path}: tensor {name} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(count(d) for d in shape):
        raise ValueError(f"{path}: tensor {name}'s shape is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise ValueError(f"{path}: tensor {name}'s data_offsets are not two offsets")
    return dtype, tuple(shape), tuple(offsets)
