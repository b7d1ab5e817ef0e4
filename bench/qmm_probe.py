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

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v3
from mlx_lm.models.cache import make_prompt_cache
from resident_probe import poison, twice


def qmm(m: int, k: int, n: int = 192, group: int = 64, bits: int = 4) -> str:
    mx.random.seed(k * 1000 + m)
    w = mx.random.normal((n, k)).astype(mx.bfloat16)
    x = mx.random.normal((1, m, k)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    _, text = twice(lambda *a: mx.quantized_matmul(*a, transpose=True, group_size=group,
                                                   bits=bits), x, wq, s, b)
    return f"qmm M={m} K={k} N={n} group {group}: {text}"


def model_twice(q_lora_rank: int, shared: int) -> str:
    args = deepseek_v3.ModelArgs(
        model_type="deepseek_v3", vocab_size=512, hidden_size=128, intermediate_size=128,
        moe_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=shared, n_routed_experts=16,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=q_lora_rank,
        qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1,
        num_experts_per_tok=4, moe_layer_freq=1, first_k_dense_replace=1)
    mx.random.seed(0)
    model = deepseek_v3.Model(args)
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 64 == 0)
    mx.eval(model.parameters())
    ids = mx.array([[(37 * i + 11) % 496 + 8 for i in range(17)]])
    outs = []
    for _ in range(2):
        poison()
        outs.append(model(ids, cache=make_prompt_cache(model)))
        mx.eval(outs[-1])
    nan = [mx.isnan(o).sum().item() for o in outs]
    return (f"deepseek_v3 q_lora_rank {q_lora_rank}, shared experts {shared}: logits nan {nan}"
            f" of {outs[0].size}, twice equal {mx.array_equal(outs[0], outs[1], equal_nan=True).item()}")


if __name__ == "__main__":
    print(f"mlx {mx.__version__} on {mx.default_device()}", flush=True)
    for k in (64, 128, 256):
        for m in (1, 8, 17, 64):
            print(qmm(m, k), flush=True)
    print(qmm(17, 64, group=32), flush=True)
    # The shared expert's down projection has 64 * shared inputs.
    for rank, shared in ((64, 1), (128, 1), (128, 2)):
        print(model_twice(rank, shared), flush=True)
