"""LoRA adapters in mlx-lm's format (``mlx_lm.lora``'s output) on a streamed model.

The adapters of the trunk's layers (attention, dense MLPs, embeddings) load as mlx-lm loads
them, and compute exactly as on the resident model. Adapters of the routed experts do not: a
LoRA switch layer indexes its per-expert matrices with the ids it is called with, and a
streamed layer calls with pool rows. Those are refused by name.
"""

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from expertd.errors import FlagError

from .switch import StreamedSwitch

LEAVES = ("lora_a", "lora_b", "m")  # what an adapter file may hold (mlx-lm's adapter leaves)


def _inside(path: str, switches: set) -> bool:
    return any(path == s or path.startswith(s + ".") for s in switches)


def apply_adapters(model, adapter_path) -> None:
    """Turn ``model``'s layers that ``adapter_path``'s adapters train into LoRA / DoRA layers
    and load the adapters' weights, as ``mlx_lm.load(adapter_path=...)`` does.

    Raises:
        ValueError: no adapters there, a full fine-tune, adapters of the routed experts, or
            weights that do not fit the model (the message names what and where).
    """
    from mlx_lm.tuner.utils import linear_to_lora_layers

    where = Path(adapter_path).expanduser()
    config_file, weights_file = where / "adapter_config.json", where / "adapters.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise FlagError(f"--adapter-path {where}: no adapter_config.json and "
                        "adapters.safetensors there (mlx_lm.lora writes both)")
    try:
        config = json.loads(config_file.read_text())
        kind = config.get("fine_tune_type", "lora")
        lora = dict(config["lora_parameters"])
        num_layers = int(config["num_layers"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FlagError(f"--adapter-path {where}: adapter_config.json is not mlx-lm's "
                        f"({exc})") from None
    if kind == "full":
        raise FlagError(f"--adapter-path {where}: a full fine-tune is a model of its own, not "
                        "adapters; convert it with expertd convert")
    # Relative to a transformer block, as mlx-lm's keys are: where its streamed switches sit.
    switches = {path for block in model.layers for path, m in block.named_modules()
                if isinstance(m, StreamedSwitch)}
    try:
        weights = mx.load(str(weights_file))
    except (RuntimeError, ValueError, OSError) as exc:
        raise FlagError(f"--adapter-path {where}: adapters.safetensors is not a safetensors "
                        f"file ({exc})") from None
    experts = sorted(name for name in weights
                     if any(f".{s}." in f".{name}" for s in switches))
    keys = lora.get("keys")
    named = [k for k in keys or () if _inside(k, switches)]
    if experts or named:
        raise FlagError(f"--adapter-path {where}: these adapters train the routed experts "
                        f"({(experts or named)[0]}, ...), which expertd streams; adapters of "
                        "the other layers load (train with lora_parameters keys that leave "
                        "out the switch layers, e.g. self_attn.q_proj and self_attn.v_proj)")
    if keys is None:  # mlx-lm's default, less the streamed switches' projections
        lora["keys"] = _default_keys(model, switches)
    try:
        linear_to_lora_layers(model, num_layers, lora, use_dora=kind == "dora")
    except (KeyError, ValueError, TypeError) as exc:  # mlx-lm's own checks, and bad types
        raise FlagError(f"--adapter-path {where}: adapter_config.json does not fit this "
                        f"model ({type(exc).__name__}: {exc})") from None
    params = {name: p for name, p in tree_flatten(model.parameters())
              if name.rsplit(".", 1)[-1] in LEAVES}
    bad = [f"{name} (not an adapter of this model)" if name not in params else
           f"{name} (shape {tuple(w.shape)}, the model's {tuple(params[name].shape)})"
           for name, w in weights.items()
           if name not in params or w.shape != params[name].shape]
    if bad:
        raise FlagError(f"--adapter-path {where}: weights that do not fit: {', '.join(bad[:3])}")
    model.load_weights(list(weights.items()), strict=False)
    model.eval()
    # Evaluated here, on the loading thread's stream: a lazy load is not evaluable from the
    # thread that serve generates on.
    mx.eval(model.parameters())


def _default_keys(model, switches: set) -> set:
    """The layers mlx-lm adapts when its config names none (every linear, switch linear and
    embedding of a block), without those inside a streamed switch."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    kinds = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear, nn.Embedding,
             nn.QuantizedEmbedding)
    return {path for block in model.layers for path, m in block.named_modules()
            if (hasattr(m, "to_lora") or isinstance(m, kinds)) and not _inside(path, switches)}
