"""Split an mlx-lm MoE checkpoint into per-layer expert blobs plus a trunk model directory.

Generic: every parameter under a ``SwitchGLU`` / ``SwitchMLP`` module whose leading dimension is
the number of experts is sliced per expert. The model is never loaded: tensors are streamed
byte range by byte range from the safetensors shards, so memory stays bounded by one expert row
plus one copy chunk. The output appears atomically (written under a temporary name, renamed),
and a lock next to the destination keeps two runs from writing it at once.

``--layers A:B`` writes one pipeline stage's directory (see client/pipeline.py): the blobs of
the MoE layers among transformer layers A:B only, and a trunk with just what that stage runs,
as mlx-lm's ``sharded_load`` fetches only its shard's weights: the embeddings, final norm and
head (every stage keeps them) plus the non-expert weights of layers A:B. So a host stores only
its own stage, trunk included; a whole trunk would not help any stage, and for the largest
models it is tens of GB. The manifest records the range; the MoE layers are numbered 0.. within
the directory (their files keep the model's MoE layer numbers in their names).
"""

import json
import os
import shutil
from pathlib import Path

import xxhash

from expertd.blobstore import file_checksum
from expertd.errors import ConvertError, FlagError, ModelDirError
from expertd.manifest import STRIDE_ALIGN, Manifest, MoeLayer, Segment, Stage, TrunkFile

from .destination import check_destination, pwrite_all, write_blob_dir
from .safetensors import SafetensorsWriter, read_header

_SEGMENT_ALIGN = 64


def find_switch_modules(config: dict) -> list:
    """``[(module_path, num_experts, {proj: input_dims})]`` for every switch module of the model.

    The model is built from mlx-lm's own classes; its parameters stay lazy (never evaluated), so
    this costs no memory whatever the model's size.
    """
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear, SwitchMLP

    from .mlxlm import model_classes

    try:
        model_class, args_class = model_classes(config)
    except ValueError as exc:
        raise ModelDirError(f"mlx-lm does not know this model: {exc}") from None
    model = model_class(args_class.from_dict(config))
    found = []
    for path, module in model.named_modules():
        if isinstance(module, (SwitchGLU, SwitchMLP)):
            projs = [(name, child) for name, child in module.named_modules()
                     if isinstance(child, SwitchLinear)]
            if not projs:
                continue
            num_experts = projs[0][1].weight.shape[0]
            found.append((path, num_experts, {n: c.weight.shape[-1] for n, c in projs}))
    found.sort(key=lambda item: _natural_key(item[0]))
    return found


def _natural_key(path: str):
    return [int(p) if p.isdigit() else p for p in path.split(".")]


def _quant_params(module: str, proj: str, in_dims: int, tensors: dict) -> dict | None:
    """Recover how a projection was quantized from its tensors (as mlx-lm does on load)."""
    scales = tensors.get(f"{module}.{proj}.scales")
    if scales is None:
        return None
    weight = tensors[f"{module}.{proj}.weight"]
    group_size = in_dims // scales.shape[-1]
    bits = weight.shape[-1] * 32 // in_dims
    if scales.dtype != "U8":
        params = {"group_size": group_size, "bits": bits, "mode": "affine"}
    else:
        modes = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}
        if (bits, group_size) not in modes:
            raise ModelDirError(f"cannot tell the quantization of {module}.{proj}: "
                                f"{bits} bits, group size {group_size}")
        params = {"group_size": group_size, "bits": bits, "mode": modes[(bits, group_size)]}
    if f"{module}.{proj}.global_scale" in tensors:
        params["global_scale"] = True
    return params


def plan(model_dir: Path):
    """Read config and shard headers; return (config, tensors, layers, stride, trunk tensors).

    Raises:
        ModelDirError: not a model directory, no MoE layers, or an unknown tensor layout.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if model_dir.is_dir() and not os.access(model_dir, os.R_OK | os.X_OK):
        raise ModelDirError(f"{model_dir}: permission denied: cannot read the model directory")
    try:
        return _plan(model_dir, config_path)
    except OSError as exc:
        raise ModelDirError(f"{exc.filename or model_dir}: cannot read ({exc.strerror})") from None


def _plan(model_dir: Path, config_path: Path):
    if not model_dir.is_dir() or not config_path.is_file():
        raise ModelDirError(f"{model_dir} is not an mlx-lm model directory (no config.json)")
    shards = sorted(model_dir.glob("model*.safetensors"))
    if not shards:
        raise ModelDirError(f"{model_dir} is not an mlx-lm model directory "
                            "(no model*.safetensors)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelDirError(f"{config_path} is not valid JSON: {exc}") from None
    if "model_type" not in config:
        raise ModelDirError(f"{config_path} has no model_type")
    tensors = {}
    for shard in shards:
        try:
            tensors.update(read_header(shard))
        except ValueError as exc:
            raise ModelDirError(str(exc)) from None
    return plan_tensors(config, tensors, model_dir)


def plan_tensors(config: dict, tensors: dict, where):
    """The plan of :func:`plan` from a config and every tensor of the shards (local or
    remote: ``TensorInfo.path`` is whatever names the shard); ``where`` is for messages."""
    switches = find_switch_modules(config)
    if not switches:
        raise ModelDirError(f"{where}: model type {config['model_type']!r} has no MoE "
                            "layers (no SwitchGLU / SwitchMLP module)")
    layers, expert_names = [], set()
    quant_overrides = {}
    for index, (module, num_experts, projections) in enumerate(switches):
        names = sorted(n for n in tensors if n.startswith(module + "."))
        if not names:
            raise ModelDirError(
                f"unknown layout: no tensor under {module}; is this an mlx-lm checkpoint "
                "(made by mlx_lm.convert), with the experts stacked?")
        segments, offset = [], 0
        for name in names:
            t = tensors[name]
            if not t.shape or t.shape[0] != num_experts:
                raise ModelDirError(f"unknown layout: {name} has shape {list(t.shape)}, "
                                    f"expected a leading dimension of {num_experts} experts")
            nbytes = t.nbytes // num_experts
            segments.append(Segment(name[len(module) + 1:], t.dtype, t.shape[1:], offset, nbytes))
            offset += -(-nbytes // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
            expert_names.add(name)
        for proj, in_dims in projections.items():
            params = _quant_params(module, proj, in_dims, tensors)
            if params is not None:
                quant_overrides[f"{module}.{proj}"] = params
        expert_bytes = segments[-1].offset + segments[-1].nbytes
        layers.append(MoeLayer(index, module, f"layer-{index:03d}.blob", num_experts,
                               expert_bytes, tuple(segments), ()))
    stride = -(-max(layer.expert_bytes for layer in layers) // STRIDE_ALIGN) * STRIDE_ALIGN
    trunk = [tensors[n] for n in sorted(tensors) if n not in expert_names]
    if "quantization" in config:
        quant = dict(config["quantization"])
        for path, params in quant_overrides.items():
            quant.setdefault(path, params)
        config = dict(config, quantization=quant, quantization_config=quant)
    return config, tensors, layers, stride, trunk


# What a conversion reads of a Hugging Face snapshot: configs, tokenizer files, weights.
HF_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jsonl",
               "*.jinja"]


def resolve_model(spec) -> Path:
    """The model directory ``spec`` names, as mlx-lm resolves ``--model``.

    ``spec`` is a path (``~`` expanded; a snapshot inside the Hugging Face cache is a path too)
    or a Hugging Face repo id, looked up in the local cache and downloaded if it is not there
    (never with ``HF_HUB_OFFLINE=1``).

    Raises:
        ModelDirError: neither a directory nor a repo id that could be found.
    """
    path = Path(os.path.expanduser(str(spec)))
    if path.exists() or str(spec).startswith((".", "/", "~")) or str(spec).count("/") != 1:
        return path  # a path: plan() says what is wrong with it, if anything
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(str(spec), allow_patterns=HF_PATTERNS))
    except (HFValidationError, OSError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        where = ("in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline
                 else "locally or on the Hugging Face Hub")
        raise ModelDirError(f"{spec}: no such directory, and no Hugging Face repo of that name "
                            f"was found {where} ({type(exc).__name__})") from None


def select_stage(config: dict, layers: list, trunk: list, spec: str):
    """Keep the MoE layers and trunk tensors of the transformer layers ``spec`` ("A:B").

    Returns:
        ``(stage, layers, trunk)``: the :class:`Stage`, its MoE layers renumbered from 0, and
        the trunk tensors it needs (those of no layer, and those of layers A:B).
    Raises:
        ConvertError: the family cannot be split into pipeline stages.
        FlagError: ``spec`` is not a range of the model's layers, or the range holds no MoE
            layer.
    """
    from expertd.client.pipeline import PipelineError, check_pipeline_support, layer_number, parse_layers

    from .mlxlm import model_classes

    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    try:
        check_pipeline_support(model, config["model_type"])
    except PipelineError as exc:
        raise ConvertError(str(exc)) from None
    start, stop = parse_layers(spec, len(model.model.layers))
    stage = Stage(start, stop, len(model.model.layers))
    kept = [layer for layer in layers if start <= layer_number(layer.module) < stop]
    if not kept:
        raise FlagError(f"--layers {spec}: transformer layers {stage} hold no MoE layer; "
                        "such a stage needs no expertd (run it with mlx-lm alone)")
    kept = [MoeLayer(i, layer.module, layer.file, layer.num_experts, layer.expert_bytes,
                     layer.segments, layer.checksums) for i, layer in enumerate(kept)]
    trunk = [t for t in trunk if (n := layer_number(t.name)) is None or start <= n < stop]
    return stage, kept, trunk


def convert(model_dir: Path, blob_dir: Path, progress: bool = True,
            layers: str | None = None) -> Manifest:
    """Convert ``model_dir`` into ``blob_dir`` (which must not exist).

    ``model_dir`` may also be a Hugging Face repo id (see :func:`resolve_model`). With
    ``layers`` ("A:B", transformer layers as a Python slice), only that pipeline stage is
    written (see :func:`select_stage`). ``progress`` draws a bar, on a terminal only.

    A lock file next to the destination (``.NAME.lock``) is held for the whole run. A leftover
    temporary directory from an interrupted run is removed and the work restarts.

    Returns:
        The manifest written.
    Raises:
        ModelDirError: see :func:`plan`.
        FileExistsError: if ``blob_dir`` exists.
        ConvertError: the parent of ``blob_dir`` is not a directory, another run is writing
            ``blob_dir``, the disk is full, or the destination cannot be written; nothing is
            left behind. Or this family cannot be split into stages (see
            :func:`select_stage`).
        FlagError: ``layers`` is not a range of the model's layers, or holds no MoE layer.
    """
    model_dir, blob_dir = resolve_model(model_dir), Path(os.path.expanduser(str(blob_dir)))
    check_destination(blob_dir)
    spec = layers
    config, tensors, layers, stride, trunk = plan(model_dir)
    stage = None
    if spec is not None:
        stage, layers, trunk = select_stage(config, layers, trunk, spec)
    return write_blob_dir(blob_dir, lambda tmp: _convert_into(
        tmp, model_dir, config, tensors, layers, stride, trunk, progress, stage))


def _convert_into(tmp, model_dir, config, tensors, layers, stride, trunk, progress,
                  stage) -> Manifest:
    from tqdm import tqdm

    total = sum(layer.num_experts * layer.expert_bytes for layer in layers)
    total += sum(t.nbytes for t in trunk)
    # disable=None: drawn on a terminal only, never as \r frames into a log.
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
              disable=None if progress else True, desc="convert", dynamic_ncols=True) as bar:
        done_layers = []
        source_fds = {}
        try:
            for i, layer in enumerate(layers):
                bar.set_postfix_str(f"layer {i + 1}/{len(layers)}")
                done_layers.append(_write_layer(tmp, layer, stride,
                                                [tensors[f"{layer.module}.{seg.name}"]
                                                 for seg in layer.segments],
                                                source_fds, bar.update))
        finally:
            for fd in source_fds.values():
                os.close(fd)
        bar.set_postfix_str("trunk")
        trunk_dir = tmp / "trunk"
        copy_small_files(model_dir, trunk_dir, config)
        writer = SafetensorsWriter(trunk_dir / "model.safetensors", trunk)
        writer.copy_all(progress=bar.update)
        writer.close()
        return Manifest(config["model_type"], stride, int(config.get("num_experts_per_tok", 1)),
                        tuple(done_layers), list_trunk(trunk_dir), stage=stage)


def _write_layer(out: Path, layer: MoeLayer, stride: int, sources: list, fds: dict,
                 advance) -> MoeLayer:
    """Assemble each expert's row from its tensor slices, hash it, write it at e * stride."""
    row = bytearray(stride)
    view = memoryview(row)
    checksums = []
    fd_out = os.open(out / layer.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd_out, layer.num_experts * stride)
        for e in range(layer.num_experts):
            for seg, src in zip(layer.segments, sources):
                fd = fds.get(src.path)
                if fd is None:
                    fd = fds[src.path] = os.open(src.path, os.O_RDONLY)
                got = os.preadv(fd, [view[seg.offset:seg.offset + seg.nbytes]],
                                src.start + e * seg.nbytes)
                if got != seg.nbytes:
                    raise ModelDirError(f"{src.path}: short read in {src.name}")
            checksums.append(xxhash.xxh3_64_intdigest(view[:layer.expert_bytes]))
            pwrite_all(fd_out, view, e * stride, out / layer.file)
            advance(layer.expert_bytes)
        os.fsync(fd_out)
    finally:
        os.close(fd_out)
    return MoeLayer(layer.index, layer.module, layer.file, layer.num_experts, layer.expert_bytes,
                    layer.segments, tuple(checksums))


def copy_small_files(model_dir: Path, trunk_dir: Path, config: dict) -> None:
    """Create trunk/ with the model directory's files but the weights, and ``config``."""
    trunk_dir.mkdir()
    for item in model_dir.iterdir():
        if item.name.endswith(".safetensors") or item.name == "model.safetensors.index.json":
            continue
        if item.name == "config.json" or not item.is_file():
            continue
        shutil.copy2(item, trunk_dir / item.name)
    (trunk_dir / "config.json").write_text(json.dumps(config, indent=4))


def list_trunk(trunk_dir: Path) -> tuple:
    """A :class:`TrunkFile` (size, checksum) for each file of ``trunk_dir``, hashed from what
    is on disk (still in the page cache): what a client will check."""
    files = []
    for path in sorted(trunk_dir.iterdir()):
        checksum, size = file_checksum(path)
        files.append(TrunkFile(path.name, checksum, size))
    return tuple(files)


def expert_slice(tensor, expert: int) -> bytes:
    """The bytes of one expert's slice of a stacked tensor (for tests and checks)."""
    nbytes = tensor.nbytes // tensor.shape[0]
    with open(tensor.path, "rb") as f:
        f.seek(tensor.start + expert * nbytes)
        return f.read(nbytes)

