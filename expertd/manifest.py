"""The blob directory's manifest: what each blob file holds and where."""

import hashlib
import json
from dataclasses import dataclass
from math import prod
from pathlib import Path

from .errors import BlobStoreError
from .tools.safetensors import DTYPE_SIZES

FORMAT = "expertd-blobs"
FORMAT_VERSION = 1
STRIDE_ALIGN = 16384
CHECKSUM = "xxh3_64"


@dataclass(frozen=True)
class Segment:
    """One per-expert slice of a stacked tensor, e.g. ``gate_proj.scales``."""

    name: str
    dtype: str
    shape: tuple
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes}


@dataclass(frozen=True)
class MoeLayer:
    """One ``SwitchGLU`` / ``SwitchMLP`` module and its blob file."""

    index: int
    module: str
    file: str
    num_experts: int
    expert_bytes: int
    segments: tuple
    checksums: tuple

    def to_json(self) -> dict:
        return {"index": self.index, "module": self.module, "file": self.file,
                "num_experts": self.num_experts, "expert_bytes": self.expert_bytes,
                "segments": [s.to_json() for s in self.segments],
                "checksums": [f"{c:016x}" for c in self.checksums]}


@dataclass(frozen=True)
class Manifest:
    model_type: str
    stride: int
    top_k: int
    layers: tuple
    checksum: str = CHECKSUM
    digest: str = ""  # sha256 of the manifest file: tells two conversions apart

    @property
    def max_experts(self) -> int:
        return max(layer.num_experts for layer in self.layers)

    @property
    def total_expert_bytes(self) -> int:
        return sum(layer.num_experts * self.stride for layer in self.layers)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": FORMAT_VERSION, "model_type": self.model_type,
                "stride": self.stride, "top_k": self.top_k, "checksum": self.checksum,
                "layers": [layer.to_json() for layer in self.layers]}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, blob_dir: Path) -> "Manifest":
        """Read and check ``blob_dir/manifest.json``.

        Raises:
            BlobStoreError: naming the file and what is wrong with it.
        """
        path = Path(blob_dir) / "manifest.json"
        if not path.is_file():
            raise BlobStoreError(f"{blob_dir} is not a blob directory: {path} is missing "
                                 "(create one with: expertd convert MODEL_DIR BLOB_DIR)")
        try:
            text = path.read_bytes()
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise BlobStoreError(f"{path}: not an expertd manifest")
            if data.get("version") != FORMAT_VERSION:
                raise BlobStoreError(f"{path}: format version {data.get('version')}, "
                                     f"this expertd reads version {FORMAT_VERSION}")
            if data.get("checksum") != CHECKSUM:
                raise BlobStoreError(f"{path}: unknown checksum {data.get('checksum')!r}")
            stride = int(data["stride"])
            layers = tuple(_layer_from_json(path, i, raw, stride)
                           for i, raw in enumerate(data["layers"]))
            manifest = cls(str(data["model_type"]), stride, int(data["top_k"]), layers,
                           digest=hashlib.sha256(text).hexdigest())
        except BlobStoreError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise BlobStoreError(f"{path}: malformed manifest ({exc!r})") from None
        if stride <= 0 or stride % STRIDE_ALIGN:
            raise BlobStoreError(f"{path}: stride {stride} is not a multiple of {STRIDE_ALIGN}")
        if not layers:
            raise BlobStoreError(f"{path}: no MoE layers")
        return manifest


def _layer_from_json(path: Path, i: int, raw: dict, stride: int) -> MoeLayer:
    segments = tuple(Segment(s["name"], s["dtype"], tuple(int(d) for d in s["shape"]),
                             int(s["offset"]), int(s["nbytes"])) for s in raw["segments"])
    layer = MoeLayer(int(raw["index"]), str(raw["module"]), str(raw["file"]),
                     int(raw["num_experts"]), int(raw["expert_bytes"]), segments,
                     tuple(int(c, 16) for c in raw["checksums"]))
    where = f"{path}: layer {i} ({layer.module})"
    if layer.index != i:
        raise BlobStoreError(f"{where}: index {layer.index} out of order")
    if "/" in layer.file or layer.file.startswith("."):
        raise BlobStoreError(f"{where}: file name {layer.file!r} is not allowed")
    if layer.num_experts < 1 or len(layer.checksums) != layer.num_experts:
        raise BlobStoreError(f"{where}: {len(layer.checksums)} checksums for "
                             f"{layer.num_experts} experts")
    end = 0
    for seg in sorted(segments, key=lambda s: s.offset):
        if seg.dtype not in DTYPE_SIZES:
            raise BlobStoreError(f"{where}: segment {seg.name} has unknown dtype {seg.dtype}")
        if seg.nbytes != prod(seg.shape) * DTYPE_SIZES[seg.dtype]:
            raise BlobStoreError(f"{where}: segment {seg.name} size does not match its shape")
        if seg.offset < end:
            raise BlobStoreError(f"{where}: segment {seg.name} overlaps the one before it")
        end = seg.offset + seg.nbytes
    if end > layer.expert_bytes or layer.expert_bytes > stride:
        raise BlobStoreError(f"{where}: segments do not fit in {layer.expert_bytes} bytes "
                             f"within a stride of {stride}")
    return layer
