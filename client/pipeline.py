"""Pipeline stages over ``mx.distributed``: mlx-lm's own split, one expertd per host.

mlx-lm splits a model whose family has ``PipelineMixin`` with ``model.model.pipeline(group)``:
rank r keeps the transformer layers ``start_idx:end_idx`` (rank 0 the last ones, the last rank
the first ones), every rank keeps the embeddings, the final norm and the head, and the hidden
state goes from rank to rank with ``mx.distributed.send`` / ``recv_like``. expertd adds nothing
to that engine: each rank streams the experts of its own layers from the expertd of its own
host, whose blob directory may hold only that range (``expertd convert --layers A:B``).
"""

import re
from pathlib import Path

from expertd.errors import BlobStoreError, ExpertdError, FlagError

# How mlx-lm's sharded_load finds a weight's transformer layer ("model.layers.12.mlp...").
_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class PipelineError(ExpertdError):
    """A pipeline stage cannot be built (a family without pipeline support, a wrong range)."""


def layer_number(name: str) -> int | None:
    """The transformer layer a module or weight path belongs to, or None (embeddings, head)."""
    match = _LAYER_NUMBER.search(name + ".")
    return int(match.group(1)) if match else None


def pipeline_families() -> list:
    """The mlx-lm model types whose models can be split into pipeline stages.

    Read from mlx-lm's sources (a model file that uses ``PipelineMixin``), so no model module
    is imported and the list follows the installed mlx-lm.
    """
    import mlx_lm.models

    folder = Path(mlx_lm.models.__file__).parent
    return sorted(p.stem for p in folder.glob("*.py")
                  if p.stem != "pipeline" and "PipelineMixin" in p.read_text(errors="ignore"))


def check_pipeline_support(model, model_type: str) -> None:
    """Raise a one-line error if mlx-lm cannot split ``model`` into pipeline stages.

    Raises:
        PipelineError: naming the families that can.
    """
    if not (hasattr(model, "model") and hasattr(model.model, "pipeline")):
        raise PipelineError(f"mlx-lm cannot split a {model_type} model into pipeline stages; "
                            f"the families it can split are: {', '.join(pipeline_families())}")


def parse_layers(spec: str, num_layers: int) -> tuple:
    """``"A:B"`` (Python slice of the transformer layers, either end may be left out) as
    ``(start, stop)`` within ``num_layers``.

    Raises:
        FlagError: not of the form A:B, or an empty or out-of-range slice.
    """
    start, sep, stop = str(spec).partition(":")
    try:
        if not sep:
            raise ValueError
        a = int(start) if start.strip() else 0
        b = int(stop) if stop.strip() else num_layers
    except ValueError:
        raise FlagError(f"--layers {spec}: expected A:B, a range of transformer layers as a "
                        f"Python slice (e.g. 0:{num_layers // 2})") from None
    if not 0 <= a < b <= num_layers:
        raise FlagError(f"--layers {spec}: the model has transformer layers 0:{num_layers}; "
                        "give a non-empty range within it")
    return a, b


def split_model(model, group, manifest, blob_dir, model_type: str) -> tuple:
    """Apply mlx-lm's ``pipeline(group)`` to ``model`` and check the blob directory covers it.

    Returns:
        ``(start, stop)``: the transformer layers this rank runs.
    Raises:
        PipelineError: the family has no pipeline support, or the blob directory does not hold
            every layer this rank runs (the message gives the ``--layers`` to convert).
    """
    check_pipeline_support(model, model_type)
    num_layers = len(model.model.layers)
    model.model.pipeline(group)
    start, stop = model.model.start_idx, model.model.end_idx
    stage = manifest.stage
    if stage is not None and (stage.num_layers != num_layers or not stage.covers(start, stop)):
        raise PipelineError(
            f"rank {group.rank()} of {group.size()} runs transformer layers {start}:{stop}, but "
            f"{manifest.describe(blob_dir)} does not hold them; convert this host's stage "
            f"with: expertd convert MODEL {blob_dir} --layers {start}:{stop}")
    return start, stop


def refuse_stage(manifest, blob_dir) -> None:
    """A stage's directory cannot run a whole model: say how to run it.

    Raises:
        BlobStoreError: if ``manifest`` is a pipeline stage's.
    """
    if manifest.stage is not None:
        raise BlobStoreError(
            f"{manifest.describe(blob_dir)} is one pipeline stage of a model: run it under "
            "mlx.launch with load(..., pipeline_group=mx.distributed.init()) or expertd "
            "generate --pipeline (README: Several machines)")


def stage_layers(layers, start: int, stop: int) -> list:
    """The manifest's MoE layers inside the transformer layers ``start:stop``."""
    return [layer for layer in layers
            if (n := layer_number(layer.module)) is not None and start <= n < stop]


USAGE_KEYS = ("hits", "misses", "bytes_read", "prefetch_reads")


def gather_usage(summary: dict, group) -> list:
    """Every rank's own hits, misses and bytes read (``expertd generate``'s summary), in rank
    order, on every rank: each rank streams from its own daemon, so each has its own."""
    import importlib

    import mlx.core as mx

    # Generation evaluates the step after the last token ahead of time, on mlx-lm's own
    # generation stream: its sends and gather between stages may still be in flight there, and
    # must finish before this gather uses the same connections (else one rank reads the other's
    # hidden state as numbers).
    mx.synchronize()
    mx.synchronize(importlib.import_module("mlx_lm.generate").generation_stream)
    mine = mx.array([int(summary[k]) for k in USAGE_KEYS], dtype=mx.int64)
    rows = mx.distributed.all_gather(mine[None], group=group, stream=mx.cpu).tolist()
    leave_together(group)
    return [dict(zip(USAGE_KEYS, row), rank=r) for r, row in enumerate(rows)]


def leave_together(group) -> None:
    """A token passed once around the ring (0 -> 1 -> ... -> 0) before the ranks exit.

    A rank that returns from a collective may still be the target of a peer's send in that
    collective (MLX's ring sends both ways); exiting then closes its sockets under the peer,
    whose send fails with EPIPE and aborts the collective on the rank still in it. In the token
    pass each rank writes only to the next one, which reads before it writes or exits, so no
    write ever meets a closed socket.
    """
    import mlx.core as mx

    rank, size = group.rank(), group.size()
    token = mx.zeros((1,), dtype=mx.int32)
    if rank != 0:
        token = mx.distributed.recv_like(token, rank - 1, group=group, stream=mx.cpu)
        mx.eval(token)
    mx.eval(mx.distributed.send(token, (rank + 1) % size, group=group, stream=mx.cpu))
    if rank == 0:
        mx.eval(mx.distributed.recv_like(token, size - 1, group=group, stream=mx.cpu))
