"""``load(BLOB_DIR)``: an ordinary mlx-lm model whose routed experts stream through expertd."""

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from expertd.blobstore import check_trunk
from expertd.choices import check_gib, check_wait
from expertd.errors import BlobStoreError
from expertd.protocol import GUESS_WIDTH

from .adapters import apply_adapters
from .backing import Staging
from .layer import StepMode, StreamedLayer
from .pipeline import refuse_stage, split_model, stage_layers
from .pool import POOL_BACKINGS, default_backing, default_free, free_memory, make_pool, plan_rows
from .predict import check_choice, check_mode, make_guessers
from .runtime import Runtime
from .session import Session
from .speculation import check_speculate
from .step import Steps, guarded
from .switch import StreamedSwitch, expert_segments, guard_block

COPY_AHEAD_MIN_BYTES = 512 * 1024  # see load(copy_ahead_bytes=)


def load(blob_dir, *, pool_gb: float | None = None, reconnect_timeout: float = 60.0,
         max_group: int | None = None, prefetch: str = "auto",
         copy_ahead_bytes: int | None = None, pipeline_group=None,
         guess_width: int | None = None, pool_backing: str | None = None,
         speculate: str = "auto", fill_pools: bool | None = None, pull: str = "auto",
         adapter_path=None, trust_remote_code: bool = False, decode_concurrency: int = 1):
    """Build the model of ``blob_dir`` with mlx-lm's classes, experts served by expertd.

    Args:
        blob_dir: a directory written by ``expertd convert``, served by a running daemon.
        pool_gb: GiB of expert pools, split evenly over the MoE layers: this process's own
            copy of the experts it computes with (its expert memory). Default: on a discrete
            GPU (CUDA), every expert that fits in half of its free memory; on unified memory
            (Metal, the CPU), top-k rows a layer for each of the ``decode_concurrency``
            sequences and one more (2 x top-k for one sequence), within half of the host's
            available memory. A budget below the smallest pool (top-k rows a layer) is
            refused.
        reconnect_timeout: seconds to wait for a daemon that died to come back (0: fail at
            once).
        max_group: most experts moved from the daemon's arena at once (default: 64 or
            4 x top-k, within what the daemon allows).
        prefetch: "auto" (default): each MoE layer guesses the next layer's experts at its own
            router sync, writes the resident ones into the next layer's pool in the background
            and asks the daemon to read the rest ahead, and a layer whose guesses are mostly
            wrong stops guessing (and tries again now and then); "on": always guess; "off":
            never.
        copy_ahead_bytes: a layer's guessed rows are written ahead only when they are at
            least this many bytes (default 512 KiB); smaller ones are cheaper to move when
            the layer runs than to hand to another thread.
        guess_width: experts read ahead per expert a token routes to (default 2, see
            ``expertd.serving.config.GUESS_WIDTH``): the daemon fills the absent ones of that many of the next
            router's best-ranked experts into its side rows; the copy ahead stays at the top-k.
        pipeline_group: an ``mx.distributed`` group (under ``mlx.launch``): split the model
            with mlx-lm's own ``pipeline(group)`` and stream only this rank's layers, from
            the daemon of this host (``blob_dir`` may hold only this rank's layer range).
        pool_backing: "device" (rows in GPU memory, written by MLX's scatter; the default
            on CUDA) or "host" (rows the host writes into directly; the default on unified
            memory).
        speculate: "auto" (default): a decode step runs without waiting for the host in each
            MoE layer, its ids are checked at its end and a step that missed a pool is replayed
            exactly; auto stops while replays are frequent and tries again later; "on":
            always where a replay can be exact; "off": one host wait per MoE layer.
        pull: who reads an expert missing from a pool out of the daemon's arena: "auto"
            (default) the device itself where it can (CUDA with the ``cuda`` extra, Metal),
            with no host wait in a decode step; else the host, a layer at a time; "device"
            (an error where the device cannot); "host" (the host copy behind the device's
            interface, one wait per layer: what the CPU tests run); "off" (the per-layer
            path).
        fill_pools: move every expert into the pools at load, so that nothing can miss and
            decode steps need no check at all. Default: when every pool has a row for every
            expert on a discrete GPU (where the pools are the GPU's own memory, as a resident
            model is); otherwise pools fill as experts are routed.
        adapter_path: a folder of LoRA / DoRA adapters written by ``mlx_lm.lora``, loaded as
            ``mlx_lm.load(adapter_path=...)`` loads them; adapters of the routed experts are
            refused (see client/adapters.py).
        trust_remote_code: run the Python code the converted model's directory brings, as
            ``mlx_lm.load(trust_remote_code=True)`` does: a custom model class (the config's
            ``model_file``) and a tokenizer's own code.
        decode_concurrency: the sequences the model will decode together (a batch:
            ``expertd.client.batch``; a server's ``--decode-concurrency``), which the
            default pools on unified memory are sized for.
    Returns:
        ``(model, tokenizer)``, usable with ``mlx_lm.generate`` / ``stream_generate``.
    Raises:
        DaemonNotRunning: no daemon serves ``blob_dir`` (the message says how to start one).
        DaemonError: the daemon serves another directory or another version of it.
        BlobStoreError: the blob directory is not valid, or a trunk file does not match its
            checksum (the message names the file and says to re-run ``expertd convert``), or
            it holds one pipeline stage and no ``pipeline_group`` was given.
        PipelineError: the family cannot be split, or ``blob_dir`` lacks this rank's layers.
        ValueError: a pool budget below the smallest that works, or a bad argument.
    """
    check_wait("reconnect_timeout", reconnect_timeout)
    if pool_gb is not None:
        check_gib("pool_gb", pool_gb)
    check_mode(prefetch)
    check_speculate(speculate)
    if isinstance(decode_concurrency, bool) or not isinstance(decode_concurrency, int) \
            or decode_concurrency < 1:
        raise ValueError(f"decode_concurrency must be a whole number of at least 1, not "
                         f"{decode_concurrency!r}")
    backing = check_choice("pool_backing", pool_backing or default_backing(), POOL_BACKINGS)
    if guess_width is not None and (isinstance(guess_width, bool) or not isinstance(guess_width, int)
                                    or guess_width < 1):
        raise ValueError(f"guess_width must be a whole number of at least 1, not {guess_width!r}")
    tuning = dict(guess_width=guess_width or GUESS_WIDTH,
                  copy_ahead_bytes=(COPY_AHEAD_MIN_BYTES if copy_ahead_bytes is None
                                    else max(0, int(copy_ahead_bytes))))
    session = Session(blob_dir, reconnect_timeout=reconnect_timeout, max_group=max_group,
                      pull=pull)
    try:
        model, tokenizer, runtime = _build(session, prefetch, pipeline_group, pool_gb, backing,
                                           speculate, tuning, trust_remote_code,
                                           decode_concurrency)
        if adapter_path is not None:
            apply_adapters(model, adapter_path)
        if fill_pools is None:
            fill_pools = backing == "device" and all(s.pool.identity for s in runtime.layers)
        if fill_pools:
            _fill(runtime.layers)
    except BaseException:
        session.close()  # its heartbeat thread and the arena mapping go with it
        raise
    model.expertd_session = runtime
    return model, tokenizer


def _fill(states: list) -> None:
    """Every expert into its layer's pool, a layer at a time (a bar on a terminal)."""
    from tqdm import tqdm

    for state in tqdm(states, desc="filling expert pools", unit="layer",
                      disable=None):
        pool = state.pool
        missing = np.flatnonzero(pool.row_of < 0).astype(np.int32)
        for start in range(0, len(missing), pool.rows):
            pool.place(missing[start:start + pool.rows])
        mx.eval(pool.arrays)


def _build(session, prefetch: str, pipeline_group, pool_gb, backing: str, speculate: str,
           tuning: dict, trust_remote_code: bool, sequences: int = 1):
    """The model with its switch modules streamed through ``session``, its tokenizer and its
    :class:`~expertd.client.runtime.Runtime`. ``tuning``: the layers' guess width and
    copy-ahead threshold."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
    from mlx_lm.utils import load_config, load_model, load_tokenizer

    from expertd.tools.safetensors import read_header

    trunk = session.paths.blob_dir / "trunk"
    # Nothing unverified is computed with: the trunk's bytes are checked before mlx reads them.
    check_trunk(session.paths.blob_dir, session.manifest)
    own_code = load_config(trunk).get("model_file")  # a model class of its own, run on trust
    if own_code is not None and not trust_remote_code:
        raise BlobStoreError(f"{trunk}: the model's class is code of its own ({own_code}); "
                             "load it with --trust-remote-code (trust_remote_code=True) if you "
                             "trust it")
    try:
        model, config = load_model(trunk, lazy=True, strict=False,
                                   trust_remote_code=trust_remote_code)
    except Exception as exc:  # the model's own code: whatever it raises
        if own_code is None:
            raise
        raise BlobStoreError(f"{trunk}: the model's own code ({own_code}, run by "
                             f"--trust-remote-code) failed: {type(exc).__name__}: "
                             f"{exc}") from None
    layers = session.manifest.layers
    if pipeline_group is None:
        refuse_stage(session.manifest, session.paths.blob_dir)
    else:
        # mlx-lm's own split; the other ranks' layers are gone, so only ours are streamed, and
        # guesses never cross a stage boundary.
        start, stop = split_model(model, pipeline_group, session.manifest,
                                  session.paths.blob_dir, config["model_type"])
        layers = stage_layers(layers, start, stop)
    modules = dict(model.named_modules())
    default = pool_gb is None
    rows = plan_rows(layers, session.manifest.top_k, pool_gb,
                     default_free(backing) if default else None, sequences,
                     free_memory() if default and backing == "host" and sequences > 1 else None)
    guessers = make_guessers(modules, layers, prefetch)
    staging = Staging()  # one host buffer for every device pool's moves
    streamed = []
    mode = StepMode()
    installed = []  # (path, StreamedSwitch): put in place together, as mlx-lm replaces modules
    for layer, n, guesser, before in zip(layers, rows, guessers, [None] + guessers[:-1]):
        module = modules.get(layer.module)
        if not isinstance(module, (SwitchGLU, SwitchMLP)):
            raise BlobStoreError(f"{trunk}: the model has no switch module at {layer.module}")
        segments = expert_segments(module, layer)
        pool = make_pool(layer, n, [seg[2:] for seg in segments], backing, session.max_group,
                         session, staging)
        state = StreamedLayer(session, mode, layer.index, pool, [seg[:2] for seg in segments],
                              layer.num_experts, guesser,
                              before.guesses if before is not None else None,
                              copier=session.copier,
                              start_early=mx.default_device() == mx.cpu, **tuning)
        if streamed:
            streamed[-1].next, state.previous = state, streamed[-1]
        streamed.append(state)
        installed.append((layer.module, StreamedSwitch(module, state)))
    model.update_modules(tree_unflatten(installed))
    # The switches' parents (mlx-lm's MoE blocks, holding the switches now): a decode's
    # speculative call of a whole block is one compiled graph (layer.StreamedLayer.block_call).
    blocks = []
    for state, (path, _) in zip(streamed, installed):
        parent = path.rpartition(".")[0]
        block = guard_block(modules[parent], state) if parent and parent in modules else None
        if block is not None:
            blocks.append((parent, block))
    model.update_modules(tree_unflatten(blocks))
    steps = Steps(session, streamed, mode, speculate, pipeline=pipeline_group is not None)
    runtime = Runtime(session, streamed, steps, guessers)
    model = guarded(model, steps)
    session.announce_pools(sum(layer.pool.nbytes for layer in streamed))
    stored = set()
    for path in trunk.glob("model*.safetensors"):
        stored.update(read_header(path))
    absent = sorted(set(dict(tree_flatten(model.parameters()))) - stored)
    if absent:
        raise BlobStoreError(f"{trunk}: weights missing from the trunk: {', '.join(absent[:5])}")
    mx.eval(model.parameters())
    if pipeline_group is not None:
        # As mlx-lm's sharded_load: every rank is loaded before the first forward's sends.
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=pipeline_group))
    tokenizer = load_tokenizer(trunk, {"trust_remote_code": True} if trust_remote_code else None,
                               eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, runtime
