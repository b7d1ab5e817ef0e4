"""Which quantized matmul gives NaN on MLX's CUDA backend (bench/resident_probe.py found
deepseek_v3's q_b_proj, a 4-bit linear of 64 inputs, unrepeatable there): ``mx.quantized_matmul``
of M tokens and K inputs, twice with NaN in MLX's buffer cache before each, against the CPU
stream; then deepseek_v3's tiny model (tools.synth's shapes) with 64 or 128 inputs to q_b_proj
and to the shared expert's down projection, run twice.

    python bench/qmm_probe.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
from common import no_arguments
from mlx_lm.models import deepseek_v3
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import quantize_model
from resident_probe import probe_ids, twice

from tools.synth import TINY, SynthConfig


def qmm(m: int, k: int, n: int = 192, group: int = 64, bits: int = 4) -> str:
    mx.random.seed(k * 1000 + m)
    w = mx.random.normal((n, k)).astype(mx.bfloat16)
    x = mx.random.normal((1, m, k)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    _, text = twice(lambda *a: mx.quantized_matmul(*a, transpose=True, group_size=group,
                                                   bits=bits), x, wq, s, b)
    return f"qmm M={m} K={k} N={n} group {group}: {text}"


def model_twice(q_lora_rank: int, shared: int) -> str:
    """The suite's tiny deepseek_v3 (tools.synth's config, random weights, 4-bit) with
    ``q_lora_rank`` and ``shared`` experts, run twice and on the CPU (resident_probe.twice)."""
    config = SynthConfig(**{**TINY, "family": "deepseek_v3"}).model_config(512) | {
        "q_lora_rank": q_lora_rank, "n_shared_experts": shared}
    mx.random.seed(0)
    model = deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)  # synth's default dtype
    model, _ = quantize_model(model, config, 64, 4)
    _, text = twice(lambda t: model(t, cache=make_prompt_cache(model)), probe_ids(512, 17))
    return f"deepseek_v3 q_lora_rank {q_lora_rank}, shared experts {shared}: logits {text}"


if __name__ == "__main__":
    no_arguments(__doc__)
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    for k in (64, 128, 256):
        for m in (1, 8, 17, 64):
            print(qmm(m, k), flush=True)
    print(qmm(17, 64, group=32), flush=True)
    # The shared expert's down projection has 64 * shared inputs.
    for rank, shared in ((64, 1), (128, 1), (128, 2)):
        print(model_twice(rank, shared), flush=True)
