"""The blob directory's manifest: what each blob file and each trunk file holds, and checksums."""

import hashlib
import json
from dataclasses import dataclass
from math import prod
from pathlib import Path

from .errors import BlobStoreError
from .tools.safetensors import DTYPE_SIZES

FORMAT = "expertd-blobs"
# 2: the trunk's files have checksums too ("trunk": {name: {"checksum", "size"}}).
# 3: a pipeline stage's directory: "stage": {"start", "stop", "num_layers"}. A whole model's
#    manifest is still written as version 2, so older expertd versions keep reading it, and
#    refuse a stage's directory (which they could not serve correctly) with "upgrade expertd".
# 4: a lazy directory (expertd convert --lazy): "remote" names the checkpoint's files, each
#    layer's "sources" where its segments lie in them; rows arrive on first use (present.py).
FORMAT_VERSION = 4
READ_VERSIONS = (2, 3, 4)
STRIDE_ALIGN = 16384
CHECKSUM = "xxh3_64"


def reconvert(blob_dir="BLOB_DIR") -> str:
    """What to run when a blob directory is corrupt or of another format."""
    return f"re-run expertd convert MODEL_DIR {blob_dir}"


RECONVERT = reconvert()


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
    # A lazy directory's: per segment, (remote file, absolute offset of expert 0's slice).
    sources: tuple = ()

    def to_json(self) -> dict:
        data = {"index": self.index, "module": self.module, "file": self.file,
                "num_experts": self.num_experts, "expert_bytes": self.expert_bytes,
                "segments": [s.to_json() for s in self.segments],
                "checksums": [f"{c:016x}" for c in self.checksums]}
        if self.sources:
            data["sources"] = [[file, start] for file, start in self.sources]
        return data


@dataclass(frozen=True)
class TrunkFile:
    """One file of ``trunk/`` (weights, config, tokenizer), with its size and checksum."""

    name: str
    checksum: int
    size: int


@dataclass(frozen=True)
class Stage:
    """The transformer layers ``start:stop`` (Python slice) of a model of ``num_layers`` layers:
    what one pipeline stage's blob directory holds (``expertd convert --layers``)."""

    start: int
    stop: int
    num_layers: int

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"

    def covers(self, start: int, stop: int) -> bool:
        return self.start <= start and stop <= self.stop


@dataclass(frozen=True)
class RemoteFile:
    """One file of a remote checkpoint: where it is, its size, and its sha256 if published."""

    url: str
    size: int
    sha256: str | None = None


@dataclass(frozen=True)
class Remote:
    """Where a lazy directory's experts come from (``expertd convert --lazy``).

    ``source`` is what was converted (a Hugging Face repo id or a base URL); ``repo`` and
    ``revision`` (the commit, so every row comes from the files the trunk came from) are set
    for a repo; ``files`` maps each safetensors shard's name to its :class:`RemoteFile`.
    """

    source: str
    files: dict
    repo: str | None = None
    revision: str | None = None

    def to_json(self) -> dict:
        return {"source": self.source, "repo": self.repo, "revision": self.revision,
                "files": {name: {"url": f.url, "size": f.size, "sha256": f.sha256}
                          for name, f in sorted(self.files.items())}}


def blob_dir_problem(blob_dir) -> str | None:
    """Why ``blob_dir`` is not a blob directory (see :func:`_not_blobs`), or None if it has
    its manifest (which :meth:`Manifest.load` checks)."""
    path = Path(blob_dir) / "manifest.json"
    return None if path.is_file() else _not_blobs(Path(blob_dir), path)


def _not_blobs(blob_dir: Path, path: Path) -> str:
    """Why ``blob_dir`` is not a blob directory, said for what it is."""
    if blob_dir.exists() and not blob_dir.is_dir():
        return f"{blob_dir} is a file, not a directory: give the blob directory"
    if not blob_dir.exists():
        return (f"{blob_dir} does not exist: give a blob directory (make one with: expertd "
                "convert MODEL_DIR BLOB_DIR)")
    if (blob_dir / "config.json").is_file() and any(blob_dir.glob("*.safetensors")):
        return (f"{blob_dir} is an mlx-lm checkpoint, not a blob directory: run expertd "
                f"convert first (expertd convert {blob_dir} BLOB_DIR), then use BLOB_DIR")
    return (f"{blob_dir} is not a blob directory: {path} is missing (create one with: "
            "expertd convert MODEL_DIR BLOB_DIR)")


@dataclass(frozen=True)
class Manifest:
    model_type: str
    stride: int
    top_k: int
    layers: tuple
    trunk: tuple = ()  # TrunkFile for every file of trunk/
    checksum: str = CHECKSUM
    digest: str = ""  # sha256 of the manifest file: tells two conversions apart
    stage: Stage | None = None  # None: the whole model
    remote: Remote | None = None  # None: every row was written by the conversion

    @property
    def max_experts(self) -> int:
        return max(layer.num_experts for layer in self.layers)

    @property
    def total_expert_bytes(self) -> int:
        return sum(layer.num_experts * self.stride for layer in self.layers)

    def to_json(self) -> dict:
        version = 4 if self.remote is not None else 2 if self.stage is None else 3
        data = {"format": FORMAT, "version": version,
                "model_type": self.model_type, "stride": self.stride, "top_k": self.top_k,
                "checksum": self.checksum, "layers": [layer.to_json() for layer in self.layers],
                "trunk": {f.name: {"checksum": f"{f.checksum:016x}", "size": f.size}
                          for f in self.trunk}}
        if self.stage is not None:
            data["stage"] = {"start": self.stage.start, "stop": self.stage.stop,
                             "num_layers": self.stage.num_layers}
        if self.remote is not None:
            data["remote"] = self.remote.to_json()
        return data

    def describe(self, blob_dir) -> str:
        """What the directory holds, for messages: "BLOB_DIR (layers 2:4 of 4)"."""
        if self.stage is None:
            return f"{blob_dir} (the whole model)"
        return f"{blob_dir} (transformer layers {self.stage} of {self.stage.num_layers} only)"

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, blob_dir: Path) -> "Manifest":
        """Read and check ``blob_dir/manifest.json``.

        Raises:
            BlobStoreError: naming the file and what is wrong with it (never another exception,
                whatever the file holds).
        """
        path = Path(blob_dir) / "manifest.json"
        if not path.is_file():
            raise BlobStoreError(_not_blobs(Path(blob_dir), path))
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise BlobStoreError(f"{path}: cannot read the manifest ({exc.strerror})") from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested too deep
            raise BlobStoreError(f"{path}: malformed manifest, not JSON ({exc}); "
                                 f"{RECONVERT}") from None
        data = _object(data, str(path))
        if data.get("format") != FORMAT:
            raise BlobStoreError(f"{path}: not an expertd manifest")
        version = data.get("version")
        if version not in READ_VERSIONS:
            advice = ("upgrade expertd" if isinstance(version, int) and version > FORMAT_VERSION
                      else RECONVERT)
            raise BlobStoreError(f"{path}: format version {version}, this expertd reads "
                                 f"versions {READ_VERSIONS[0]} to {FORMAT_VERSION}; {advice}")
        if data.get("checksum") != CHECKSUM:
            raise BlobStoreError(f"{path}: unknown checksum {data.get('checksum')!r}")
        where = str(path)
        stride = _get(data, "stride", int, where)
        if stride <= 0 or stride % STRIDE_ALIGN:
            raise BlobStoreError(f"{path}: stride {stride} is not a multiple of {STRIDE_ALIGN}")
        layers = tuple(_layer_from_json(path, i, raw, stride)
                       for i, raw in enumerate(_get(data, "layers", list, where)))
        if not layers:
            raise BlobStoreError(f"{path}: no MoE layers")
        trunk = _trunk_from_json(path, _get(data, "trunk", dict, where))
        top_k = _get(data, "top_k", int, where)
        if not 1 <= top_k <= min(layer.num_experts for layer in layers):
            raise BlobStoreError(f"{path}: top_k {top_k} is not between 1 and the experts of "
                                 f"a layer; {RECONVERT}")
        stage = _stage_from_json(path, data.get("stage")) if version >= 3 else None
        remote = _remote_from_json(path, data.get("remote"), layers) if version >= 4 else None
        return cls(_get(data, "model_type", str, where), stride, top_k, layers, trunk,
                   digest=hashlib.sha256(text).hexdigest(), stage=stage, remote=remote)


_KINDS = {int: "an integer", str: "a string", list: "a list", dict: "an object"}


def _object(value, where: str) -> dict:
    if not isinstance(value, dict):
        found = "null" if value is None else type(value).__name__
        raise BlobStoreError(f"{where}: malformed manifest, expected a JSON object, "
                             f"found {found}; {RECONVERT}")
    return value


def _get(obj: dict, key: str, kind: type, where: str):
    """``obj[key]`` if it is there and of type ``kind`` (bools are not integers), else an error."""
    if key not in obj:
        raise BlobStoreError(f"{where}: malformed manifest, {key!r} is missing; {RECONVERT}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BlobStoreError(f"{where}: malformed manifest, {key!r} must be {_KINDS[kind]}, "
                             f"not {type(value).__name__}; {RECONVERT}")
    return value


def _hex(value, where: str) -> int:
    if not isinstance(value, str) or len(value) != 16:
        raise BlobStoreError(f"{where}: malformed manifest, checksum {value!r} is not 16 hex "
                             f"digits; {RECONVERT}")
    try:
        return int(value, 16)
    except ValueError:
        raise BlobStoreError(f"{where}: malformed manifest, checksum {value!r} is not 16 hex "
                             f"digits; {RECONVERT}") from None


def _segment_from_json(raw, where: str) -> Segment:
    raw = _object(raw, where)
    shape = _get(raw, "shape", list, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BlobStoreError(f"{where}: malformed manifest, shape {shape} is not a list of "
                             f"sizes; {RECONVERT}")
    return Segment(_get(raw, "name", str, where), _get(raw, "dtype", str, where), tuple(shape),
                   _get(raw, "offset", int, where), _get(raw, "nbytes", int, where))


def _layer_from_json(path: Path, i: int, raw, stride: int) -> MoeLayer:
    where = f"{path}: layer {i}"
    raw = _object(raw, where)
    segments = tuple(_segment_from_json(s, f"{where} segment {j}")
                     for j, s in enumerate(_get(raw, "segments", list, where)))
    sources = []
    for source in raw.get("sources", []):
        if not (isinstance(source, list) and len(source) == 2 and isinstance(source[0], str)
                and type(source[1]) is int and source[1] >= 0):
            raise BlobStoreError(f"{where}: malformed manifest, source {source!r} is not "
                                 f"[file, offset]; {RECONVERT}")
        sources.append((source[0], source[1]))
    layer = MoeLayer(_get(raw, "index", int, where), _get(raw, "module", str, where),
                     _get(raw, "file", str, where), _get(raw, "num_experts", int, where),
                     _get(raw, "expert_bytes", int, where), segments,
                     tuple(_hex(c, where) for c in _get(raw, "checksums", list, where)),
                     tuple(sources))
    where = f"{path}: layer {i} ({layer.module})"
    if layer.index != i:
        raise BlobStoreError(f"{where}: index {layer.index} out of order")
    if not _plain_name(layer.file) or layer.file.startswith("."):
        raise BlobStoreError(f"{where}: file name {layer.file!r} is not allowed")
    if layer.num_experts < 1 or len(layer.checksums) != layer.num_experts:
        raise BlobStoreError(f"{where}: {len(layer.checksums)} checksums for "
                             f"{layer.num_experts} experts")
    if not segments:
        raise BlobStoreError(f"{where}: no segments")
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


def _stage_from_json(path: Path, raw) -> Stage | None:
    if raw is None:
        return None
    where = f"{path}: stage"
    raw = _object(raw, where)
    stage = Stage(_get(raw, "start", int, where), _get(raw, "stop", int, where),
                  _get(raw, "num_layers", int, where))
    if not 0 <= stage.start < stage.stop <= stage.num_layers:
        raise BlobStoreError(f"{where}: layers {stage} are not a range within "
                             f"{stage.num_layers} layers; {RECONVERT}")
    return stage


def _remote_from_json(path: Path, raw, layers: tuple) -> Remote | None:
    if raw is None:
        return None
    where = f"{path}: remote"
    raw = _object(raw, where)
    files = {}
    for name, entry in _get(raw, "files", dict, where).items():
        entry = _object(entry, f"{where} file {name!r}")
        sha = entry.get("sha256")
        if sha is not None and not isinstance(sha, str):
            raise BlobStoreError(f"{where} file {name!r}: sha256 must be a string")
        files[name] = RemoteFile(_get(entry, "url", str, where), _get(entry, "size", int, where),
                                 sha)
    for layer in layers:
        if len(layer.sources) != len(layer.segments):
            raise BlobStoreError(f"{where}: layer {layer.index} has {len(layer.sources)} "
                                 f"sources for {len(layer.segments)} segments; {RECONVERT}")
        for (file, start), seg in zip(layer.sources, layer.segments):
            if file not in files or start + layer.num_experts * seg.nbytes > files[file].size:
                raise BlobStoreError(f"{where}: layer {layer.index} segment {seg.name} lies "
                                     f"outside the remote file {file!r}; {RECONVERT}")
    repo, revision = raw.get("repo"), raw.get("revision")
    if not all(v is None or isinstance(v, str) for v in (repo, revision)):
        raise BlobStoreError(f"{where}: repo and revision must be strings")
    return Remote(_get(raw, "source", str, where), files, repo, revision)


def _trunk_from_json(path: Path, raw: dict) -> tuple:
    files = []
    for name, entry in sorted(raw.items()):
        where = f"{path}: trunk file {name!r}"
        if not _plain_name(name):
            raise BlobStoreError(f"{where}: file name is not allowed")
        entry = _object(entry, where)
        size = _get(entry, "size", int, where)
        if size < 0:
            raise BlobStoreError(f"{where}: negative size {size}")
        files.append(TrunkFile(name, _hex(_get(entry, "checksum", str, where), where), size))
    if "config.json" not in raw:
        raise BlobStoreError(f"{path}: the trunk lists no config.json; {RECONVERT}")
    return tuple(files)


def _plain_name(name: str) -> bool:
    """A file name inside its directory: no path separator, not '.' or '..', not empty."""
    return bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")
