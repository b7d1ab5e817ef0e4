"""Helpers for the client tests: cache sizes in rows, prompts, logits compared step by step,
and several ``generate`` client processes released at once.

The daemon, the poll helper and the client-process spawner are the harness's (``harness/``);
what the client processes run is in ``daemon_helpers.py``.
"""

import hashlib
import time
from pathlib import Path

from harness import Daemon, finish_client, spawn_client, stop_process, wait_until

PROMPT_LENGTHS = (1, 17, 300)
DECODE_STEPS = 20
# Cache sizes in rows: fewer than one layer's 16 experts (layers run in groups), fewer than the
# 3 x 16 experts of TINY (evictions within a run), and all of them.
ROWS_TINY = 8
ROWS_MEDIUM = 24
ROWS_ALL = 64


def cache_gb(blob_dir, rows: int) -> str:
    """The ``--cache-gb`` whose arena holds ``rows`` cache rows (capped at every expert)."""
    from expertd.manifest import Manifest
    from expertd.shm.layout import SLOT_DTYPE, Geometry

    m = Manifest.load(blob_dir)
    probe = Geometry(len(m.layers), m.max_experts, 1, m.top_k, m.stride)
    # The fixed part as Geometry.for_budget counts it, plus half a row against rounding.
    fixed = probe.rows_offset + m.stride * 2 * m.top_k + SLOT_DTYPE.itemsize * 64
    budget = fixed + rows * (m.stride + SLOT_DTYPE.itemsize) + m.stride // 2
    return repr(budget / 2**30)


def pool_gb(blob_dir, rows: int) -> float:
    """The ``pool_gb`` that gives each MoE layer's pool ``rows`` rows (capped at its experts)."""
    from expertd.manifest import Manifest

    layers = Manifest.load(blob_dir).layers
    per_layer = max(layer.expert_bytes for layer in layers) * rows
    # Half a row more, against rounding and the segments' alignment; the budget is split
    # evenly over the layers.
    return (per_layer + layers[0].expert_bytes // 2) * len(layers) / 2**30


def client_flags(blob_dir, rows: int, state_file: Path, workers: int = 2,
                 client_timeout: float = 3.0, heartbeat: float = 0.5) -> list:
    """The ``expertd start`` flags of the client tests: a cache of ``rows`` rows, short
    timeouts, and a hot-set file of the test's own (so each daemon starts cold)."""
    return ["--cache-gb", cache_gb(blob_dir, rows), "--workers", workers,
            "--client-timeout", client_timeout, "--heartbeat", heartbeat,
            "--state-file", state_file]


def client_daemon(blob_dir, env: dict, tmp_path: Path, rows: int = ROWS_ALL,
                  state: str = "state.json") -> Daemon:
    """A daemon process with the client tests' flags (:func:`client_flags`): a cache of
    ``rows`` rows, its hot set in ``tmp_path / state``."""
    return Daemon(blob_dir, env, *client_flags(blob_dir, rows, Path(tmp_path) / state))


def routed_model(models, family: str, mode: str, bits: int) -> tuple:
    """``(model_dir, blob_dir)`` of the conftest model of one family and quantization."""
    return (models.model(family=family, mode=mode, bits=bits),
            models.blobs(family=family, mode=mode, bits=bits))


def greedy_tokens(model, prompt: list, n: int) -> list:
    """``n`` tokens of mlx-lm's own decoding loop, greedy, without stopping at end-of-text."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def prompt_ids(length: int, vocab: int, seed: int = 0) -> list:
    """A deterministic prompt of ``length`` token ids, spread over the vocabulary."""
    return [(seed * 7919 + 37 * i + 11) % (vocab - 16) + 8 for i in range(length)]


def require_repeatable(resident, length: int) -> None:
    """Resident mlx-lm gives the same logits twice for a prompt of ``length`` (see
    :func:`prompt_ids`), or the test cannot compare streamed logits with anything. On CUDA that
    is an expected failure: MLX CUDA 0.32.4 gave the earlier tiny deepseek_v3's resident
    attention NaN rows that changed from call to call, from a 4-bit linear of 64 inputs
    (bench/resident_probe.py, bench/RESULTS.md 2026-12-05; tools.synth no longer makes one, not
    yet run there). On any other backend it fails the test: this CPU and Metal have always been
    repeatable."""
    import mlx.core as mx
    import pytest
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.array([prompt_ids(length, resident.args.vocab_size)])
    first, second = (resident(ids, cache=make_prompt_cache(resident)) for _ in range(2))
    if mx.array_equal(first, second, equal_nan=True).item():
        return
    text = (f"resident mlx-lm's logits differ between two calls on {mx.default_device()} "
            f"({mx.isnan(first).sum().item()} and {mx.isnan(second).sum().item()} NaN)")
    cuda = mx.default_device() == mx.gpu and not mx.metal.is_available()
    (pytest.xfail if cuda else pytest.fail)(text)


def read_tokens(path: Path) -> list:
    """The tokens a ``generate`` client has written so far (one per line, complete lines)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [int(t) for t in text.split("\n")[:-1]]


def run_together(blob_dir, env: dict, workdir: Path, prompts: list, max_tokens: int,
                 timeout: float = 120.0, prefetch: str = "auto") -> list:
    """Run one ``generate`` client process per ``(prompt_len, seed)`` of ``prompts``, all
    released at once when every one has loaded (a file barrier); their results, in order."""
    barrier = Path(workdir) / "barrier"
    barrier.mkdir(parents=True)
    procs = []
    try:
        for i, (length, seed) in enumerate(prompts):
            out = Path(workdir) / f"client{i}.json"
            procs.append((spawn_client("generate", "--blobs", blob_dir, "--prompt-len", length,
                                       "--seed", seed, "--max-tokens", max_tokens,
                                       "--barrier", barrier, "--prefetch", prefetch,
                                       "--copy-ahead-bytes", 0,
                                       "--out", out, env=env), out))

        def all_ready():
            for proc, _ in procs:
                if proc.poll() is not None:
                    raise AssertionError(f"a client exited before the barrier:\n"
                                         f"{proc.communicate()[1]}")
            return len(list(barrier.glob("ready-*"))) == len(procs)

        wait_until(all_ready, timeout, "every client to load")
        (barrier / "go").touch()
        deadline = time.monotonic() + timeout
        return [finish_client(proc, out, max(1.0, deadline - time.monotonic()))
                for proc, out in procs]
    finally:
        for proc, _ in procs:
            stop_process(proc)


# ---- logits compared step by step (also run inside ``parity`` client processes) -------------

def logits_digest(logits) -> str:
    import mlx.core as mx
    import numpy as np

    # float32 holds every bfloat16 / float16 value exactly.
    return hashlib.sha256(np.array(logits.astype(mx.float32)).tobytes()).hexdigest()[:16]


def compare_runs(resident, streamed, vocab: int, lengths=PROMPT_LENGTHS,
                 steps: int = DECODE_STEPS) -> list:
    """Prompt then ``steps`` greedy decode steps on both models, comparing logits each step.

    Returns:
        one dict per prompt length: ``steps`` compared, ``mismatch`` (first unequal step or
        None), the greedy tokens and a digest of the last logits of each model.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    results = []
    for length in lengths:
        ids = mx.array([prompt_ids(length, vocab)])
        caches = make_prompt_cache(resident), make_prompt_cache(streamed)
        x_ref = x_str = ids
        tokens, mismatch = [], None
        for step in range(steps + 1):
            ref = resident(x_ref, cache=caches[0])[:, -1, :]
            got = streamed(x_str, cache=caches[1])[:, -1, :]
            mx.eval(ref, got)
            if mismatch is None and not (ref.dtype == got.dtype and ref.shape == got.shape
                                         and mx.array_equal(ref, got).item()):
                mismatch = step
            tok_ref = mx.argmax(ref, axis=-1)
            tokens.append(int(tok_ref.item()))
            # Each model continues from its own choice, so a divergence cannot hide.
            x_ref, x_str = tok_ref[:, None], mx.argmax(got, axis=-1)[:, None]
        results.append(dict(length=length, steps=steps + 1, mismatch=mismatch, tokens=tokens,
                            ref_digest=logits_digest(ref), got_digest=logits_digest(got)))
    return results


def replay_causes_shown(counts: dict) -> str:
    """The replays by cause as status and generate's summary write them ("1 absent, 2
    epoch"), written here apart from expertd.units.replay_causes, which they test."""
    from expertd.client.counters import REPLAY_COUNTERS

    return ", ".join(f"{counts[k]} {k[8:]}" for k in REPLAY_COUNTERS if counts[k])


def parse_metrics(text: str) -> tuple[dict, dict]:
    """Prometheus text format: ``({name: value}, {name: type})``; malformed lines fail."""
    values, types, families = {}, {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line and not line.startswith("#"):
            name, value = line.split()
            values[name] = float(value)
            family = name.split("{")[0]
            if family not in types:  # a histogram's _bucket{le=...}, _sum and _count
                family = family.rsplit("_", 1)[0]
                assert types.get(family) == "histogram", f"{name} has no # TYPE line"
            families.add(family)
    assert families == set(types), "every sample has its # TYPE line, every type a sample"
    return values, types
