"""Capped cache: the LFU policy's hit rate ÷ Belady's (optimal offline) on a recorded trace.

The trace is the routing of a real forward pass: a synthetic model generating text, recorded
layer by layer from mlx-lm's own switch modules.
"""

import numpy as np
from belady import belady_hits, policy_hits
from common import ensure_model


def record_trace(model_dir, prompts: list, tokens: int) -> np.ndarray:
    """(N, 2) array of (moe layer, expert), in the order a decode would request them."""
    import mlx_lm
    from mlx_lm import stream_generate
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = mlx_lm.load(str(model_dir))
    trace = []
    switches = [m for _, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]
    for index, module in enumerate(switches):
        cls = type(module)

        def recording_call(self, x, indices, _index=index, _cls=cls):
            for expert in np.unique(np.array(indices)):
                trace.append((_index, int(expert)))
            return _cls.__call__(self, x, indices)

        module.__class__ = type(f"Recording{cls.__name__}{index}", (cls,),
                                {"__call__": recording_call})
    for seed, prompt in enumerate(prompts):
        import mlx.core as mx

        mx.random.seed(seed)
        for _ in stream_generate(model, tokenizer, prompt, max_tokens=tokens,
                                 sampler=make_sampler(1.0)):
            pass
    return np.array(trace, dtype=np.int64)


def run(name: str, spec: dict, fractions=(0.1, 0.25, 0.5, 0.75), tokens: int = 200) -> dict:
    model_dir, _ = ensure_model(name, spec)
    prompts = ["Tell me a story about a fox", "def fibonacci(n):", "The weather today is"]
    trace = record_trace(model_dir, prompts, tokens)
    n_keys = spec["layers"] * spec["experts"]
    rows = []
    for f in fractions:
        capacity = max(1, int(n_keys * f))
        best = belady_hits(trace, capacity)
        lfu = policy_hits(trace, capacity)
        rows.append(dict(fraction=f, capacity=capacity, belady=best / len(trace),
                         lfu=lfu / len(trace), ratio=lfu / best))
    return dict(name=name, trace_len=len(trace), rows=rows)
