"""Synthetic MoE checkpoints in mlx-lm format, built with mlx-lm's own model classes.

Nothing is downloaded: the weights are random (deterministic by seed), the tokenizer is trained
offline on a built-in text. The result loads with ``mlx_lm.load(DIR)``.
"""

import errno
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from expertd.paths import missing_parent

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
MODES = ("affine", "mxfp4", "mxfp8", "nvfp4", "none")
# Group sizes that each quantization mode allows (mlx.core.quantize).
_MODE_GROUP = {"affine": 64, "mxfp4": 32, "mxfp8": 32, "nvfp4": 16}
# The test suite's models (tests/conftest.py) and bench/resident_probe.py's: small enough to
# build in a second, big enough that routing spreads over many experts.
TINY = dict(layers=3, experts=16, top_k=4, hidden=128, moe_inter=64)
_MODE_BITS = {"mxfp4": 4, "mxfp8": 8, "nvfp4": 4}  # the one width each allows


def mode_bits(mode: str) -> int:
    """The bits ``mode`` quantizes to when none are given: its own width, 4 for affine."""
    return _MODE_BITS.get(mode, 4)


@dataclass(frozen=True)
class SynthConfig:
    family: str = "qwen3_moe"
    layers: int = 4
    experts: int = 16
    top_k: int = 4
    hidden: int = 128
    moe_inter: int = 64
    bits: int = 4
    mode: str = "affine"
    dtype: str = "bfloat16"
    vocab: int = 512
    seed: int = 0

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.layers < 1:
            raise ValueError("layers must be at least 1")
        if self.family == "deepseek_v3" and self.layers < 2:
            raise ValueError("deepseek_v3 needs at least 2 layers (the first one is dense)")
        if self.experts < 2:
            raise ValueError("experts must be at least 2")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top-k must be between 1 and the number of experts "
                             f"({self.experts}), not {self.top_k}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError("dtype must be bfloat16, float16 or float32")
        if self.mode == "affine" and self.bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError("affine bits must be one of 2, 3, 4, 5, 6, 8")
        if self.mode in _MODE_BITS and self.bits != _MODE_BITS[self.mode]:
            raise ValueError(f"{self.mode} uses {_MODE_BITS[self.mode]} bits, not {self.bits}")
        group = _MODE_GROUP.get(self.mode, 1)
        for name, dim in (("hidden", self.hidden), ("moe-inter", self.moe_inter)):
            if dim < 1 or dim % max(group, 32) != 0:
                raise ValueError(f"{name} must be a positive multiple of {max(group, 32)}, "
                                 f"not {dim}")
        if not 0 <= self.seed < 2**64:  # what mx.random.seed takes
            raise ValueError(f"seed must be between 0 and {2**64 - 1}, not {self.seed}")

    def model_config(self, vocab_size: int) -> dict:
        heads = max(2, self.hidden // 32)
        common = {
            "model_type": self.family,
            "vocab_size": vocab_size,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "num_experts_per_tok": self.top_k,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": 4096,
        }
        if self.family == "qwen3_moe":
            return common | {
                "intermediate_size": self.moe_inter * 2,
                "num_experts": self.experts,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "moe_intermediate_size": self.moe_inter,
                "head_dim": self.hidden // heads,
                "norm_topk_prob": True,
            }
        if self.family == "mixtral":
            return common | {"intermediate_size": self.moe_inter, "num_local_experts": self.experts}
        if self.family == "deepseek_v3":
            return common | {
                "intermediate_size": self.moe_inter * 2,
                "moe_intermediate_size": self.moe_inter,
                # No dense quantized linear of fewer than 128 inputs (q_b_proj's, the shared
                # experts' down projection): on MLX CUDA 0.32.4 q_b_proj of 64 inputs read
                # memory it never wrote, so resident mlx-lm was unrepeatable there
                # (bench/RESULTS.md, ninth session). The routed experts' down projections
                # (gather_qmm, another kernel) keep moe_inter inputs: repeatable there.
                "n_shared_experts": max(1, -(-128 // self.moe_inter)),
                "n_routed_experts": self.experts,
                "routed_scaling_factor": 2.5,
                "kv_lora_rank": 32,
                "q_lora_rank": max(self.hidden, 128),
                "qk_rope_head_dim": 16,
                "v_head_dim": 32,
                "qk_nope_head_dim": 32,
                "topk_method": "noaux_tc",
                "scoring_func": "sigmoid",
                "norm_topk_prob": True,
                "n_group": 1,
                "topk_group": 1,
                "moe_layer_freq": 1,
                "first_k_dense_replace": 1,
            }
        # gpt_oss: alternating sliding and full attention, biases on every expert projection.
        return common | {
            "num_local_experts": self.experts,
            "intermediate_size": self.moe_inter,
            "head_dim": 32,
            "sliding_window": 64,
            "layer_types": [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.layers)
            ],
        }


def synthesize(cfg: SynthConfig, out_dir: Path, progress: bool = True) -> Path:
    """Write a random-weight MoE checkpoint for ``cfg`` into ``out_dir`` (which must not exist).

    The checkpoint appears atomically: it is written into a hidden temporary directory next to
    ``out_dir`` and renamed at the end; any failure, Ctrl-C included, removes it. ``progress``
    draws a bar over the weights, on a terminal only.

    Returns:
        The output directory.
    Raises:
        ValueError: on an invalid configuration.
        FileExistsError: if ``out_dir`` already exists and is not empty.
        FileNotFoundError: if the parent of ``out_dir`` is not a directory.
        OSError: if the checkpoint cannot be written (a full disk, ...), in one line.
    """
    cfg.validate()
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists and is not empty")
    if missing_parent(out_dir):
        raise FileNotFoundError(missing_parent(out_dir))
    # Imported before anything is written: a Ctrl-C landing while MLX's extension module
    # initialises is swallowed there, and once the directory exists a Ctrl-C must stop the run.
    import mlx.core  # noqa: F401
    import mlx_lm.utils  # noqa: F401

    tmp = out_dir.parent / f".{out_dir.name}.partial-{secrets.token_hex(8)}"
    try:
        try:
            os.mkdir(tmp)  # inside the try: a Ctrl-C just after it still removes it
            _write_checkpoint(cfg, tmp, progress)
        except Exception as exc:
            failure = _write_failure(exc, tmp)
            if failure is None:
                raise
            remedy = "free some space and re-run" if failure == NO_SPACE else "re-run"
            raise OSError(f"{out_dir}: {failure}; the partial output was removed: {remedy} "
                          "expertd synth") from None
        try:
            os.rename(tmp, out_dir)  # replaces an empty directory, never a filled one
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
            raise FileExistsError(f"{out_dir} already exists and is not empty (another "
                                  "run wrote it meanwhile)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


NO_SPACE = "no space left on the device, the disk is full"  # convert's words


def _write_failure(exc: Exception, where: Path) -> str | None:
    """Why writing the checkpoint into ``where`` failed, in words for one line, or None if
    ``exc`` is not a failed write.

    MLX ("[write] Unable to write N bytes") and the tokenizer library ("... (os error 28)")
    give no errno: writing into ``where`` again finds it, failing the same way on a full disk.
    """
    error = exc if isinstance(exc, OSError) else _probe_write(where)
    if error is None:  # the disk takes writes: not a failed write
        return None
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return NO_SPACE
    return f"{error.strerror or error} (while writing the checkpoint)"


def _probe_write(where: Path, nbytes: int = 1 << 20) -> OSError | None:
    """The error of writing ``nbytes`` into a new file in ``where`` (removed after), or None."""
    probe = where / ".write-probe"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(nbytes))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc
    finally:
        probe.unlink(missing_ok=True)
    return None


def _write_checkpoint(cfg: SynthConfig, out_dir: Path, progress: bool) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import quantize_model, save_config, save_model
    from tqdm import tqdm

    from .mlxlm import model_classes

    vocab_size = build_tokenizer_into(out_dir, cfg.vocab)
    config = cfg.model_config(vocab_size)
    mx.random.seed(cfg.seed)
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    dtype = getattr(mx, cfg.dtype)
    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))
    # The weights are lazy: the bars count the bytes as they are computed, first the random
    # weights (each checked for zeros), then the quantized ones that are written.
    bar = dict(unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
               disable=None if progress else True)  # None: on a terminal only
    drawn = sum(p.nbytes for _, p in tree_flatten(model.parameters()) if _checked(p))
    with tqdm(total=drawn, desc="synth: random weights", **bar) as done:
        # Random values where mlx-lm starts at zero (expert biases, deepseek's router), so
        # that a lost bias changes the output and routing spreads over the experts.
        _randomize_zeros(model, done.update)
    if cfg.mode != "none":
        model, config = quantize_model(
            model, config, _MODE_GROUP[cfg.mode], cfg.bits, mode=cfg.mode
        )
        weights = [p for _, p in tree_flatten(model.parameters())]
        with tqdm(total=sum(p.nbytes for p in weights), desc="synth: quantize", **bar) as done:
            for p in weights:
                mx.eval(p)
                done.update(p.nbytes)
    mx.eval(model.parameters())
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    (out_dir / "expertd-synth.json").write_text(json.dumps(cfg.__dict__, indent=2))


def build_tokenizer_into(out_dir: Path, vocab: int) -> int:
    from .tokenizer import build_tokenizer

    return build_tokenizer(out_dir, vocab)


def _checked(p) -> bool:
    """Whether :func:`_randomize_zeros` looks at ``p`` (and so computes it)."""
    import mlx.core as mx

    return p.ndim >= 2 and mx.issubdtype(p.dtype, mx.floating)


def _randomize_zeros(model, advance=lambda nbytes: None) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models.switch_layers import SwitchLinear

    updates = []
    for name, p in tree_flatten(model.parameters()):
        if not _checked(p):
            continue
        if not mx.any(p).item():
            scale = p.shape[-1] ** -0.5
            updates.append((name, mx.random.uniform(-scale, scale, p.shape).astype(p.dtype)))
        advance(p.nbytes)
    model.update(tree_unflatten(updates))
    for _, module in model.named_modules():
        if isinstance(module, SwitchLinear) and "bias" in module:
            module.bias = (mx.random.normal(module.bias.shape) * 0.02).astype(module.bias.dtype)
