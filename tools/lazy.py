"""``expertd convert --lazy``: a blob directory whose experts arrive on first use.

The checkpoint stays remote (a Hugging Face repo, or an http(s) base URL of a model
directory). Its shards' safetensors headers are read with range requests and planned as a
local conversion plans them; the trunk (config, tokenizer, every weight but the routed
experts) is downloaded whole; each layer's blob file is created at full size without its rows
(sparse), beside an empty present record (see expertd/present.py). The manifest records
where each segment of each layer lies in the remote shards, so the daemon (or ``expertd
fetch``) fetches a row by range when it is first needed.
"""

import fnmatch
import json
import os
import shutil
from collections import deque
from dataclasses import replace
from pathlib import Path

from expertd.errors import FlagError, ModelDirError
from expertd.manifest import Manifest, Remote, RemoteFile
from expertd.present import create_records
from expertd.remote import FetchSettings, RangeReader
from expertd.shardcheck import HEADERS_DIR

from .convert import HF_PATTERNS, list_trunk, plan_tensors, select_stage
from .destination import check_destination, write_blob_dir
from .fetch import DownloadPool
from .safetensors import SafetensorsWriter, header_length, parse_header

INDEX = "model.safetensors.index.json"
# What a plain base URL offers cannot be listed: the files mlx-lm's tokenizers may read.
URL_SMALL_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
TRUNK_CHUNK = 16 << 20  # bytes of trunk weights per range request


class RemoteModel:
    """A remote checkpoint's files: URLs, sizes, published sha256s, and how to get them.

    Args:
        spec: a Hugging Face repo id (resolved with huggingface_hub: ``HF_ENDPOINT``,
            ``HF_TOKEN`` and ``revision`` honoured) or an http(s) base URL of a model directory.
        revision: a branch, tag or commit of the repo (default: main); resolved to its commit.
    Raises:
        ModelDirError: the repo or URL cannot be read.
        FlagError: a ``revision`` with a URL.
    """

    def __init__(self, spec: str, revision: str | None, settings: FetchSettings):
        self.spec = spec
        self.repo = self.revision = None
        self.sha256: dict = {}
        self.sizes: dict = {}
        if spec.startswith(("http://", "https://")):
            if revision is not None:
                raise FlagError("--revision is for a Hugging Face repo id, not a URL")
            self.reader = RangeReader(settings)
            self.base = spec.rstrip("/") + "/"
            self.small = None
            return
        from huggingface_hub import HfApi
        from huggingface_hub.utils import build_hf_headers

        try:
            info = HfApi().model_info(spec, revision=revision, files_metadata=True)
            headers = build_hf_headers()  # the token of HF_TOKEN or of `hf auth login`
        except Exception as exc:  # huggingface_hub's errors: not found, gated, offline, HTTP
            raise ModelDirError(f"{spec}: cannot read the Hugging Face repo "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
        self.repo, self.revision = spec, info.sha
        self.reader = RangeReader(settings, headers)
        for sibling in info.siblings or []:
            self.sizes[sibling.rfilename] = sibling.size
            if sibling.lfs is not None:
                self.sha256[sibling.rfilename] = sibling.lfs.sha256
        self.small = [name for name in self.sizes if "/" not in name
                      and not name.endswith(".safetensors") and name != INDEX
                      and any(fnmatch.fnmatch(name, p) for p in HF_PATTERNS)]

    def url(self, name: str) -> str:
        if self.repo is None:
            return self.base + name
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo, name, revision=self.revision)

    def text(self, name: str) -> str | None:
        """A small file's text; None if the checkpoint has no such file."""
        if self.repo is not None and name not in self.sizes:
            return None
        data = self.reader.get(self.url(name))
        return None if data is None else data.decode()

    def shards(self) -> list:
        """The safetensors shards' names, as the index (or the file list) gives them."""
        if self.repo is not None:
            names = [n for n in self.sizes if fnmatch.fnmatch(n, "model*.safetensors")]
        else:
            index = self.text(INDEX)
            names = (["model.safetensors"] if index is None
                     else list(json.loads(index)["weight_map"].values()))
        if not names:
            raise ModelDirError(f"{self.spec} is not an mlx-lm model (no model*.safetensors)")
        return sorted(set(names))

    def header(self, shard: str) -> tuple:
        """``(raw header bytes, file size, {name: TensorInfo})`` of one shard, by range."""
        url = self.url(shard)
        first, size = self.reader.head(url, 8)
        size = size if size is not None else self.sizes.get(shard)
        if size is None:
            raise ModelDirError(f"{url}: the server does not say the file's size")
        try:
            n = header_length(bytes(first), size, url)
            raw = self.reader.read(url, 8, n)
            return bytes(first + raw), size, parse_header(bytes(raw), size, shard)
        except ValueError as exc:
            raise ModelDirError(str(exc)) from None

    def download_small(self, trunk_dir: Path) -> None:
        """Every small file (tokenizer, generation config, ...) but config.json into trunk/."""
        if self.repo is not None:
            from huggingface_hub import hf_hub_download

            for name in self.small:
                if name != "config.json":
                    path = hf_hub_download(self.repo, name, revision=self.revision)
                    shutil.copyfile(path, trunk_dir / name)
            return
        for name in URL_SMALL_FILES:
            data = self.reader.get(self.url(name))
            if data is not None:
                (trunk_dir / name).write_bytes(data)

    def close(self) -> None:
        self.reader.close()


def convert_lazy(spec: str, blob_dir: Path, progress: bool = True, layers: str | None = None,
                 revision: str | None = None, settings: FetchSettings | None = None
                 ) -> Manifest:
    """Convert the remote checkpoint ``spec`` lazily into ``blob_dir`` (which must not exist).

    Args:
        spec: a Hugging Face repo id or an http(s) base URL (see :class:`RemoteModel`).
        layers: one pipeline stage only, as for :func:`~expertd.tools.convert.convert`.
        progress: a progress bar for the trunk's download (on a terminal only).
        settings: connections, attempts, timeouts (default: :class:`FetchSettings`'s).
    Returns:
        The manifest written: no row present yet.
    Raises:
        ModelDirError: the checkpoint cannot be read or is not an mlx-lm MoE model.
        RemoteError: a download failed (naming its URL).
        FileExistsError, ConvertError: as for a local conversion; nothing is left behind.
    """
    blob_dir = Path(os.path.expanduser(str(blob_dir)))
    check_destination(blob_dir)
    model = RemoteModel(str(spec), revision, settings or FetchSettings())
    try:
        text = model.text("config.json")
        if text is None:
            raise ModelDirError(f"{spec} is not an mlx-lm model directory (no config.json)")
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelDirError(f"{model.url('config.json')} is not valid JSON: {exc}") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise ModelDirError(f"{model.url('config.json')} has no model_type")
        tensors, headers, files = {}, {}, {}
        for shard in model.shards():
            headers[shard], size, found = model.header(shard)
            tensors.update(found)
            files[shard] = RemoteFile(model.url(shard), size, model.sha256.get(shard))
        config, tensors, moe, stride, trunk = plan_tensors(config, tensors, spec)
        stage = None
        if layers is not None:
            stage, moe, trunk = select_stage(config, moe, trunk, layers)
        moe = [replace(layer, checksums=(0,) * layer.num_experts,
                       sources=tuple((tensors[f"{layer.module}.{s.name}"].path,
                                      tensors[f"{layer.module}.{s.name}"].start)
                                     for s in layer.segments)) for layer in moe]
        remote = Remote(str(spec), files, model.repo, model.revision)
        manifest = Manifest(config["model_type"], stride, int(config.get("num_experts_per_tok", 1)),
                            tuple(moe), (), stage=stage, remote=remote)
        return write_blob_dir(blob_dir, lambda tmp: _write_lazy(
            tmp, model, manifest, config, trunk, headers, progress))
    finally:
        model.close()


def _write_lazy(tmp: Path, model: RemoteModel, manifest: Manifest, config: dict, trunk: list,
                headers: dict, progress: bool) -> Manifest:
    from tqdm import tqdm

    for layer in manifest.layers:
        fd = os.open(tmp / layer.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, layer.num_experts * manifest.stride)  # sparse: no row written
            os.fsync(fd)
        finally:
            os.close(fd)
        create_records(tmp, layer)
    (tmp / HEADERS_DIR).mkdir()
    for shard, raw in headers.items():
        (tmp / HEADERS_DIR / f"{shard}.header").write_bytes(raw)
    trunk_dir = tmp / "trunk"
    trunk_dir.mkdir()
    model.download_small(trunk_dir)
    (trunk_dir / "config.json").write_text(json.dumps(config, indent=4))
    # The trunk's tensors in the shards' order, so that neighbours share a range request.
    trunk = sorted(trunk, key=lambda t: (t.path, t.start))
    writer = SafetensorsWriter(trunk_dir / "model.safetensors", trunk)
    with tqdm(total=sum(t.nbytes for t in trunk), unit="B", unit_scale=True,
              unit_divisor=1024, disable=None if progress else True, desc="trunk",
              dynamic_ncols=True) as bar:
        files = manifest.remote.files
        chunks = trunk_chunks(trunk)
        fetch = lambda c: model.reader.read(files[c[0]].url, c[1], c[2])  # noqa: E731
        for data in in_order(fetch, chunks, model.reader.settings.connections):
            writer.append(data)
            bar.update(len(data))
    writer.close()
    return replace(manifest, trunk=list_trunk(trunk_dir))


def trunk_chunks(tensors: list, chunk: int = TRUNK_CHUNK) -> list:
    """``(file, start, length)`` requests covering ``tensors`` (sorted by file and start) in
    order: neighbours joined, up to ``chunk`` bytes a request, large tensors split."""
    out = []
    for t in tensors:
        done = 0
        while done < t.nbytes:
            start = t.start + done
            if out and out[-1][0] == t.path and out[-1][1] + out[-1][2] == start \
                    and out[-1][2] < chunk:
                n = min(chunk - out[-1][2], t.nbytes - done)
                out[-1] = (t.path, out[-1][1], out[-1][2] + n)
            else:
                n = min(chunk, t.nbytes - done)
                out.append((t.path, start, n))
            done += n
    return out


def in_order(fn, items, workers: int):
    """``fn(item)`` for each item on ``workers`` threads, yielded in order, with at most
    2 x ``workers`` results held at once.

    The threads are a :class:`~expertd.tools.fetch.DownloadPool`'s: stopped early (Ctrl-C, a
    failure), the queued downloads are cancelled and those in the network are not waited
    for, so convert --lazy exits at once (and removes its partial directory)."""
    pool = DownloadPool(workers, "expertd-trunk")
    pending = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.abandon(pending)

