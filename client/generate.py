"""``expertd generate``: a client process that streams text through the daemon."""

import sys
import time
from dataclasses import asdict, dataclass

from expertd.choices import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_MIN_TOKENS_TO_KEEP,
    DEFAULT_PREFILL_STEP_SIZE,
    DEFAULT_QUANTIZED_KV_START,
)
from expertd.errors import FlagError


@dataclass(frozen=True)
class KVOptions:
    """mlx-lm's KV cache and prefill options, passed to ``stream_generate`` as they are."""

    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE

    def __post_init__(self):
        # mlx-lm cannot quantize the rotating cache that --max-kv-size makes: it would fail
        # in mid-generation.
        if self.kv_bits is not None and self.max_kv_size is not None:
            raise FlagError("--kv-bits and --max-kv-size do not go together: mlx-lm cannot "
                            "quantize a rotating KV cache")


def xtc_special_tokens(tokenizer) -> list:
    """The tokens XTC never drops, as mlx_lm.generate and mlx_lm.chat give them: a newline and
    every end of sequence."""
    return tokenizer.encode("\n") + list(tokenizer.eos_token_ids)


def generate(blob_dir, prompt: str, max_tokens: int = 100, temp: float = 0.0,
             seed: int | None = None,
             out=sys.stdout, prefetch: str = "auto", top_p: float = 0.0, min_p: float = 0.0,
             top_k: int = 0, min_tokens_to_keep: int = DEFAULT_MIN_TOKENS_TO_KEEP,
             system_prompt: str | None = None,
             chat_template: bool = True, pipeline_group=None, pool_gb: float | None = None,
             speculate: str = "auto", kv: KVOptions = KVOptions(),
             extra_eos_tokens=(), pull: str = "auto",
             reconnect_timeout: float | None = None, draft_model: str | None = None,
             num_draft_tokens: int = DEFAULT_DRAFT_TOKENS, xtc_probability: float = 0.0,
             xtc_threshold: float = 0.0, prefill_response: str | None = None,
             template_kwargs: dict | None = None, prompt_cache_file: str | None = None,
             adapter_path: str | None = None, trust_remote_code: bool = False,
             before_text: str = "") -> dict:
    """Stream a completion of ``prompt`` to ``out``; return a summary of the run.

    Sampling (``temp``, ``top_p``, ``min_p``, ``min_tokens_to_keep``, ``top_k``, ``xtc_*``),
    the KV cache (``kv``),
    the extra tokens that end the generation and the chat template (applied unless
    ``chat_template`` is False, with ``system_prompt`` first, ``template_kwargs`` passed to
    it, and ``prefill_response`` as the start of the reply) are mlx-lm's. With ``pipeline_group`` (under
    ``mlx.launch``), this process runs its rank's pipeline stage (see ``load``); every rank
    computes the same tokens. ``pool_gb`` sizes the expert pools and ``speculate`` sets the
    one-wait-a-step mode (see ``load``). ``draft_model`` (an mlx-lm checkpoint's directory or
    Hugging Face id, resident) drafts ``num_draft_tokens`` tokens at a time for mlx-lm's own
    speculative decoding, which the streamed model checks several at a call.
    ``prompt_cache_file`` (mlx_lm.cache_prompt's file, made for the same model) holds the KV
    cache of a prefix: ``prompt`` is what follows it, as in mlx_lm.generate. ``before_text``
    goes to ``out`` once the model is loaded, before the first token (mlx_lm.generate's rule).

    Returns:
        dict with prompt/generation token counts and tok/s, the tokens, the peak memory, this
        client's hits, misses, hit rate and bytes read for it, and the whole daemon's during
        the run.
    Raises:
        ValueError: an extra EOS token that the tokenizer does not have; a draft model that
            is not found, or whose vocabulary differs from the model's; ``min_tokens_to_keep``
            below 1.
    """
    if isinstance(min_tokens_to_keep, bool) or not isinstance(min_tokens_to_keep, int) \
            or min_tokens_to_keep < 1:  # mlx-lm would refuse it only at the first token
        raise ValueError(f"min_tokens_to_keep must be an integer of at least 1, not "
                         f"{min_tokens_to_keep!r}")
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from expertd.client import load

    from .counters import REPLAY_COUNTERS
    from .decode import stream_generate

    if seed is not None:  # as mlx_lm.generate: no seed, no seeding; seeded before the load
        mx.random.seed(seed)  # (adapters draw their initial values from it)
    draft = load_draft(draft_model) if draft_model is not None else None
    model, tokenizer = load(blob_dir, prefetch=prefetch, pipeline_group=pipeline_group,
                            adapter_path=adapter_path, trust_remote_code=trust_remote_code,
                            pool_gb=pool_gb, speculate=speculate, pull=pull,
                            **({} if reconnect_timeout is None
                               else {"reconnect_timeout": reconnect_timeout}))
    session = model.expertd_session
    try:  # the session says goodbye whatever happens, a bad EOS token or Ctrl-C included
        extra = {}
        if draft is not None:
            check_draft(draft, tokenizer, draft_model)
            extra = dict(draft_model=draft[0], num_draft_tokens=num_draft_tokens)
        if prompt_cache_file is not None:
            extra["prompt_cache"] = load_prompt_cache(prompt_cache_file, model, kv)
        for token in extra_eos_tokens:
            tokenizer.add_eos_token(token)
        clash = set(template_kwargs or {}) & TEMPLATE_OWN
        if clash:
            raise FlagError(f"--chat-template-config: {', '.join(sorted(clash))} "
                            "is set by generate itself")
        if template_kwargs and not (chat_template and getattr(tokenizer, "chat_template", None)):
            raise FlagError("--chat-template-config needs the chat template (the tokenizer "
                            "has none, or --ignore-chat-template was given)")
        if chat_template and getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            messages.append({"role": "user", "content": prompt})
            prefill = prefill_response is not None
            if prefill:
                messages.append({"role": "assistant", "content": prefill_response})
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=not prefill,
                                                   continue_final_message=prefill,
                                                   tokenize=False, **(template_kwargs or {}))
            if prompt_cache_file is not None:  # the cached prefix is the template's start
                messages[-1]["content"] = "<query>"
                probe = tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=not prefill,
                                                      continue_final_message=prefill)
                prompt = prompt[probe.index("<query>"):]
        elif prefill_response is not None:
            raise FlagError("--prefill-response needs the chat template (the tokenizer has "
                            "none, or --ignore-chat-template was given)")
        before = session.stats()
        tokens, last, drafted = [], None, 0
        # The rule goes out with the first text: a failure before it (an expert that fails its
        # checksum, the daemon gone) leaves no half-printed block above its message.
        pending = before_text
        started = time.perf_counter()
        sampler = make_sampler(temp, top_p=top_p, min_p=min_p,
                               min_tokens_to_keep=min_tokens_to_keep, top_k=top_k,
                               xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                               xtc_special_tokens=xtc_special_tokens(tokenizer))
        for response in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                        sampler=sampler, **asdict(kv), **extra):
            out.write(pending + response.text)
            out.flush()
            pending = ""
            tokens.append(response.token)
            drafted += response.from_draft
            last = response
        out.write(pending)  # nothing generated: the rule alone, as mlx_lm.generate prints it
        out.flush()
        elapsed = time.perf_counter() - started
        mine = session.usage()
        counters = session.all_counters()
        after = session.stats()
        speculation = _speculation(session)  # before close: the puller goes with it
    finally:
        session.close()
    return dict(
        prompt_tokens=last.prompt_tokens if last else 0,
        prompt_tps=last.prompt_tps if last else 0.0,
        generation_tokens=last.generation_tokens if last else 0,
        generation_tps=last.generation_tps if last else 0.0,
        seconds=elapsed, tokens=tokens, peak_memory_gb=mx.get_peak_memory() / 1e9,
        # Tokens the draft model proposed and the streamed model accepted (None: no draft).
        draft_accepted=drafted if draft is not None else None,
        # This client's own: experts it used, the ones read from the disk for it, and the bytes
        # read for it (its misses and the prefetches it asked for).
        hits=mine["hits"], misses=mine["misses"], hit_rate=mine["hit_rate"],
        bytes_read=mine["bytes_read"], prefetch_reads=mine["prefetch_reads"],
        # The whole daemon's during the run (other clients included).
        daemon_hits=after["hits"] - before["hits"],
        daemon_misses=after["misses"] - before["misses"],
        daemon_bytes_read=after["bytes_read"] - before["bytes_read"],
        **{k: counters[k] for k in ("fast_hits", "demanded", "pool_hits", "pool_moved",
                                    "ahead_used", "steps",
                                    "host_waits", "speculative_steps", "unchecked_steps",
                                    "replays", *REPLAY_COUNTERS, "pulled_rows",
                                    "pulled_bytes", "pull_s", "pull_timed_bytes")},
        pool_bytes=session.pool_bytes, timing=dict(session.timing),
        speculation=speculation,
        prediction=session.prediction(),
    )


# The chat template's arguments that generate passes itself (--chat-template-config may not).
TEMPLATE_OWN = {"conversation", "messages", "tokenize", "add_generation_prompt",
                "continue_final_message", "return_dict", "tools"}


def _speculation(runtime) -> dict:
    """How the one-wait-a-step mode went: its mode, whether it speculates at the end, how
    often auto paused it and how often for cost (waiting per layer measured cheaper), and
    whether it waits, with the host copy, for steps that would not miss their pools."""
    s = runtime.steps.speculation
    return dict(mode=s.mode, active=s.active, paused=s.stopped,
                paused_for_cost=s.stopped_by_cost,
                waiting=s.waiting(replays_misses=runtime.puller is None))


def load_prompt_cache(path: str, model, kv) -> list:
    """The KV cache saved by mlx_lm.cache_prompt at ``path``, checked against ``model`` (one
    cache per layer, as its own) and the KV options ``kv`` (a quantized cache's bits and group
    size, as mlx_lm.generate checks them)."""
    import os

    from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache
    from mlx_lm.models.cache import load_prompt_cache as load

    if not os.path.isfile(path):
        raise FlagError(f"--prompt-cache-file {path}: no such file")
    try:
        cache = load(path)
    except Exception as exc:  # mlx's readers raise RuntimeError on a malformed file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise FlagError(f"--prompt-cache-file {path}: not a prompt cache mlx-lm can read "
                        f"({first})") from None
    want = make_prompt_cache(model)
    shape = _kv_shape(model)
    if len(cache) != len(want) or (shape is not None and any(
            getattr(c, "keys", None) is not None and getattr(c.keys, "ndim", 0) == 4
            and (c.keys.shape[1], c.keys.shape[3]) != shape for c in cache)):
        raise FlagError(f"--prompt-cache-file {path}: made for another model ({len(cache)} "
                        f"layer caches of other shapes; this model has {len(want)})")
    if isinstance(cache[0], QuantizedKVCache):
        if kv.kv_bits is not None and kv.kv_bits != cache[0].bits:
            raise FlagError("--kv-bits does not match the KV cache of --prompt-cache-file")
        if kv.kv_group_size != cache[0].group_size:
            raise FlagError("--kv-group-size does not match the KV cache of "
                            "--prompt-cache-file")
    return cache


def _kv_shape(model):
    """(KV heads, head size) of the model's attention where its args say, else None."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_key_value_heads", None)
    size = getattr(args, "head_dim", None)
    if size is None and isinstance(getattr(args, "num_attention_heads", None), int):
        size = args.hidden_size // args.num_attention_heads
    return (heads, size) if isinstance(heads, int) and isinstance(size, int) else None


def load_draft(name: str) -> tuple:
    """``(model, tokenizer)`` of a draft model, resident: a local mlx-lm checkpoint or a
    Hugging Face id (as mlx_lm.generate takes). A path that does not exist is refused before
    anything is asked of the network."""
    import os

    import mlx_lm

    path = os.path.expanduser(name)
    local = os.path.exists(path)
    # A Hugging Face id reads ORG/NAME: anything else that is not here is a mistyped path.
    if not local and (os.path.isabs(path) or name.startswith((".", "~"))
                      or name.strip("/").count("/") != 1):
        raise FlagError(f"--draft-model {name}: no such directory (nor a Hugging Face id, "
                        "which reads ORG/NAME)")
    try:
        model, tokenizer = mlx_lm.load(path)[:2]
    except (OSError, MemoryError) as exc:  # the machine's or the network's: not the flag's
        raise OSError(f"cannot load the draft model {name}: {exc}") from None
    except Exception as exc:  # mlx-lm's own errors: not a model, no such repo
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        where = "" if local else "no such directory here, and as a Hugging Face id "
        raise FlagError(f"--draft-model {name}: {where}mlx-lm cannot load it: {why}") from None
    return model, tokenizer


def check_draft(draft: tuple, tokenizer, name: str) -> None:
    """Refuse a draft ``(model, tokenizer)`` whose vocabulary is not the model's."""
    if draft[1].vocab_size != tokenizer.vocab_size:
        raise FlagError(f"--draft-model {name}: its vocabulary ({draft[1].vocab_size} tokens) "
                        f"is not the model's ({tokenizer.vocab_size})")


def summary_line(s: dict) -> str:
    from expertd.units import pull_rate, replay_causes

    line = (f"[expertd] prompt {s['prompt_tokens']} tok @ {s['prompt_tps']:.1f} tok/s | "
            f"generation {s['generation_tokens']} tok @ {s['generation_tps']:.1f} tok/s | "
            f"hit rate {s['hit_rate']:.1%} | read {s['bytes_read'] / 2**20:.1f} MiB")
    if s.get("draft_accepted") is not None:
        line += (f" | {s['draft_accepted']}/{s['generation_tokens']} tokens drafted and "
                 f"accepted in {s['steps']} model calls")
    if s.get("steps"):
        line += (f" | {s['host_waits'] / s['steps']:.2f} host waits a step, "
                 f"{s['replays']} replayed")
        spec = s.get("speculation") or {}
        if spec.get("mode") == "off":
            line += " (--speculate off: a wait per MoE layer)"
        elif spec.get("paused"):
            cost = spec["paused_for_cost"]
            why = ("waiting per layer measured cheaper here" if cost == spec["paused"] else
                   "too many replays" if not cost else
                   f"{cost} for cost, {spec['paused'] - cost} for replays")
            line += (f" (speculation paused {spec['paused']} time"
                     f"{'s' * (spec['paused'] != 1)}: {why}; paused steps wait per layer)")
        elif spec.get("waiting"):
            line += (" (speculation waiting: the last steps missed their pools, where a "
                     "speculative step would be computed twice; they wait per MoE layer)")
        line += replay_causes(s)
    if s.get("pulled_rows"):
        rate = pull_rate(s.get("pull_timed_bytes", 0), s.get("pull_s", 0.0))
        line += (f" | pulled {s['pulled_rows'] / max(1, s['steps']):.1f} rows "
                 f"({s['pulled_bytes'] / max(1, s['steps']) / 2**20:.1f} MiB) a step{rate}")
    scored = [p for p in s.get("prediction", []) if p and p["guessed"]]
    if scored:
        right = sum(p["right"] for p in scored) / sum(p["guessed"] for p in scored)
        active = sum(p["active"] for p in scored)
        line += f" | next-layer guesses {right:.0%} right, {active}/{len(scored)} layers guessing"
    return line
