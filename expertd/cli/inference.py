"""Subcommands that run clients of the daemon: generate, demo, serve, chat (start, stop, restart,
status: daemon_control.py; serve's mlx_lm.server flags: options.py)."""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from expertd.choices import DEFAULT_MIN_TOKENS_TO_KEEP
from expertd.cli import argtypes
from expertd.cli.argtypes import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_PREFILL_STEP_SIZE,
    DEFAULT_QUANTIZED_KV_START,
    KV_BITS,
    KV_GROUP_SIZES,
)
from expertd.cli.options import MLX_SERVER_OPTIONS, add_options, option_values
from expertd.errors import FlagError


def add_subcommands(sub) -> None:
    from expertd.cli.daemon_control import add_subcommands as add_control_subcommands

    add_control_subcommands(sub)
    add_client_subcommands(sub)
    add_serving_subcommands(sub)


def _cmd_generate(args) -> int:
    from expertd.client.generate import KVOptions, generate, summary_line

    # As mlx_lm.generate: "\\n" and "\\t" typed in the prompt are a newline and a tab.
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    if not prompt:
        raise ValueError("the prompt read from stdin is empty")
    kv = KVOptions(max_kv_size=args.max_kv_size, kv_bits=args.kv_bits,
                   kv_group_size=args.kv_group_size,
                   quantized_kv_start=args.quantized_kv_start,
                   prefill_step_size=args.prefill_step_size)
    if args.pipeline and args.draft_model:
        raise FlagError("--draft-model does not go with --pipeline: mlx-lm's speculative "
                        "decoding runs in one process")
    group, out = (_pipeline_group() if args.pipeline else None), sys.stdout
    ensure_daemon(args)  # after the flags' own refusals
    if group is not None and group.rank() != 0:
        out = open(os.devnull, "w")  # rank 0 prints; every rank computes the same tokens
    summary = generate(Path(args.blobs), prompt, max_tokens=args.max_tokens, temp=args.temp,
                       seed=args.seed, prefetch=args.prefetch, top_p=args.top_p,
                       min_p=args.min_p, min_tokens_to_keep=args.min_tokens_to_keep,
                       top_k=args.top_k, system_prompt=args.system_prompt,
                       chat_template=not args.ignore_chat_template, out=out,
                       pipeline_group=group, pool_gb=args.pool_gb,
                       speculate=args.speculate, kv=kv, extra_eos_tokens=args.extra_eos_token,
                       pull=args.pull, reconnect_timeout=args.reconnect_timeout,
                       draft_model=args.draft_model, num_draft_tokens=args.num_draft_tokens,
                       adapter_path=args.adapter_path,
                       trust_remote_code=args.trust_remote_code,
                       xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
                       prefill_response=args.prefill_response,
                       template_kwargs=args.chat_template_config,
                       prompt_cache_file=args.prompt_cache_file,
                       # --verbose True: mlx_lm.generate's rule before the text (once loaded)
                       before_text="=" * 10 + "\n" if args.summary and out is sys.stdout
                       else "")
    if group is not None:
        from expertd.client.pipeline import gather_usage

        summary["ranks"] = gather_usage(summary, group)
        if group.rank() != 0:
            out.close()
            return 0
    print(flush=True)
    if args.summary:  # --verbose True: mlx_lm.generate's block on stdout, then ours on stderr
        if summary["tokens"]:
            print("=" * 10)
            print(f"Prompt: {summary['prompt_tokens']} tokens, "
                  f"{summary['prompt_tps']:.3f} tokens-per-sec")
            print(f"Generation: {summary['generation_tokens']} tokens, "
                  f"{summary['generation_tps']:.3f} tokens-per-sec")
            print(f"Peak memory: {summary['peak_memory_gb']:.3f} GB", flush=True)
        else:
            print("=" * 10)
            print("No text generated for this prompt", flush=True)
        print(summary_line(summary), file=sys.stderr)
        for rank in summary.get("ranks", []):
            print(f"[expertd] rank {rank['rank']}: {rank['hits']} hits, {rank['misses']} "
                  f"misses, read {rank['bytes_read'] / 2**20:.1f} MiB from its own daemon",
                  file=sys.stderr)
        sys.stderr.flush()
    if args.json_summary:
        Path(args.json_summary).write_text(json.dumps(summary))
    return 0


def ensure_daemon(args) -> None:
    """Refuse in one line when no daemon serves ``--blobs``, saying how to start one; with
    ``--start``, start one detached instead, as ``expertd start --blobs DIR`` does (its default
    cache), and say so on stderr. That daemon outlives this command.

    Raises:
        DaemonNotRunning: no daemon serves the directory and ``--start`` was not given.
        DaemonError: the daemon started for ``--start`` did not come up.
    """
    from expertd.cli.daemon_control import start_detached_from
    from expertd.cli.options import add_start_flags
    from expertd.client.attach import check_served
    from expertd.errors import DaemonError, DaemonNotRunning
    from expertd.paths import daemon_paths
    from expertd.runfile import elsewhere

    paths = daemon_paths(Path(args.blobs).expanduser())
    try:
        check_served(paths)
        return
    except DaemonNotRunning as exc:
        if elsewhere(paths):  # served from another runtime directory: --start cannot help
            raise
        if not args.start:
            raise DaemonNotRunning(f"{exc}, or give this command --start") from None
    # `expertd start --blobs DIR`'s flags at their defaults, from the start command's own
    # declaration (options.py), as its parser would read them
    parser = argparse.ArgumentParser(add_help=False)
    add_start_flags(parser)
    start = parser.parse_args(["--blobs", str(paths.blob_dir)])
    start.verbose = args.verbose
    try:
        stats, log_file = start_detached_from(start)
    except DaemonError:
        check_served(paths)  # another command started one meanwhile: use it
        return
    print(f"{_prog(args)}: started expertd (pid {stats['pid']}) for {paths.blob_dir}, log "
          f"{log_file}; it keeps running after this command (expertd stop --blobs "
          f"{paths.blob_dir} stops it)", file=sys.stderr, flush=True)


def _prog(args) -> str:
    return f"expertd {args.command}"


def add_start_flag(p) -> None:
    """--start: a daemon for --blobs when none serves it."""
    p.add_argument("--start", action="store_true",
                   help="if no daemon serves BLOB_DIR, start one first, detached, as `expertd "
                   "start --blobs BLOB_DIR` does (its default cache); it keeps running after "
                   "this command: `expertd stop --blobs BLOB_DIR` stops it (default: off: "
                   "with no daemon, an error says how to start one)")


def _pipeline_group():
    """This process's ``mx.distributed`` group, which ``mlx.launch`` sets up."""
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() < 2:
        raise FlagError("--pipeline runs one pipeline stage per process: start one process "
                        "per stage with mlx.launch (README: Several machines)")
    return group


class _Once(argparse.Action):
    """A flag with two spellings (--blobs, --model) that names one thing: given twice with
    different values, refused (not the last one silently taken)."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        if before is not None and not argtypes.same_dir(before, values):
            parser.error(f"{option_string} {values} and an earlier --blobs/--model {before} "
                         "name two directories; give one")
        setattr(namespace, self.dest, values)


def add_model_flag(p) -> None:
    """--blobs, also spelled --model as in mlx-lm's commands (where -m is --max-tokens)."""
    p.add_argument("--blobs", "--model", dest="blobs", required=True, metavar="BLOB_DIR",
                   action=_Once,
                   help="the blob directory (expertd convert's output) of a running daemon")


def add_sampling_flags(p, top_p: float, seed: int | None) -> None:
    """--temp, --top-p and --seed, checked as generate and chat take them (each with its
    mlx-lm command's defaults)."""
    p.add_argument("--temp", type=argtypes.non_negative_float, default=0.0,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=argtypes.probability, default=top_p,
                   help=f"sampling top-p (0 or 1: off) (default: off (mlx-lm's {top_p}))")
    p.add_argument("--seed", type=argtypes.seed, default=seed,
                   help="random seed for sampling" + (" (default: none, so sampled text differs "
                                                       "from run to run, as in mlx_lm.generate)"
                                                       if seed is None else ""))


def add_xtc_flags(p, threshold: float) -> None:
    """XTC sampling's two flags, with the default threshold of the mlx-lm command they mirror."""
    p.add_argument("--xtc-probability", type=argtypes.probability, default=0.0,
                   help="probability of XTC sampling at each token (0: off)")
    p.add_argument("--xtc-threshold", type=argtypes.xtc_threshold, default=threshold,
                   help="threshold of XTC sampling")


def add_kv_flags(p) -> None:
    """mlx-lm's --max-kv-size and --prefill-step-size."""
    p.add_argument("--max-kv-size", type=argtypes.positive_int, default=None, metavar="N",
                   help="most tokens kept in the KV cache, the oldest dropped first "
                   "(default: unbounded)")
    p.add_argument("--prefill-step-size", type=argtypes.positive_int,
                   default=DEFAULT_PREFILL_STEP_SIZE, metavar="N",
                   help="prompt tokens per prefill step (fewer: less peak memory)")


def add_prefetch_flag(p, help_text: str) -> None:
    """The client's --prefetch and --pool-gb, the same on every subcommand that loads the
    model."""
    from expertd.choices import PREFETCH_MODES, PULL_MODES, SPECULATE_MODES

    p.add_argument("--prefetch", choices=PREFETCH_MODES, default="auto", help=help_text)
    p.add_argument("--pool-gb", type=argtypes.gib, default=None, metavar="G",
                   help="GiB of this process's own expert pools, split over the MoE layers: "
                   "the experts it computes with, moved from the daemon's cache when missing "
                   "(default: on a CUDA GPU every expert that fits in half its free memory; on "
                   "Metal and the CPU 2 x top-k rows a layer; below top-k rows a layer is "
                   "refused)")
    p.add_argument("--speculate", choices=SPECULATE_MODES, default="auto",
                   help="run each decode step without waiting for the host in every MoE layer, "
                   "check the routed experts at the step's end and replay exactly a step that "
                   "missed its pools; auto (default) stops while replays are frequent, off "
                   "waits in every MoE layer")
    p.add_argument("--reconnect-timeout", type=argtypes.wait_seconds, default=None,
                   metavar="S", help="seconds to wait for the daemon when it dies or restarts, "
                   "announced when the wait starts; 0 fails at once (default: 60; serve: a "
                   "day, for a request in flight; serve itself never gives up: while no daemon "
                   "runs it answers 503, and says so once)")
    p.add_argument("--pull", choices=PULL_MODES, default="auto",
                   help="who reads an expert missing from a pool out of the daemon's cache: "
                   "auto (default) the GPU itself where it can (CUDA with the cuda extra, "
                   "Metal), with no host wait in a decode step, else the host a layer at a "
                   "time; device (an error where the GPU cannot); host (host copies, one wait "
                   "a layer); off (the per-layer path)")
    p.add_argument("--adapter-path", metavar="DIR",
                   help="LoRA / DoRA adapters written by mlx_lm.lora, loaded as mlx-lm loads "
                   "them; adapters of the routed experts are refused (default: none)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the Python code a converted model brings (a custom model class, "
                   "a tokenizer's own code), as mlx-lm does with this flag")


def _cmd_demo(args) -> int:
    from expertd.tools.demo import run_demo

    return run_demo(Path(args.workdir) if args.workdir else None, rebuild=args.rebuild)


def add_client_subcommands(sub) -> None:
    p = sub.add_parser("generate", help="generate text through the daemon (a client process)",
                       description="Load the model of BLOB_DIR with its experts served by the "
                       "running expertd, and stream a completion of --prompt to stdout. Unless "
                       "--verbose False, end as mlx_lm.generate does, with its summary on "
                       "stdout (tok/s for prompt and generation, the peak memory), then one "
                       "line of expertd's on stderr (this client's hit rate, the bytes the "
                       "daemon read for it). The flags that mlx_lm.generate also has mean what "
                       "they mean there.")
    add_model_flag(p)
    add_start_flag(p)
    p.add_argument("--prompt", "-p", default=argtypes.DEFAULT_PROMPT,
                   type=argtypes.prompt_text,
                   help="the prompt text ('-' reads it from stdin; \\n and \\t typed in it "
                   "are a newline and a tab, as in mlx_lm.generate). Other users of this "
                   "machine can read a command line, so give a private prompt with '-'")
    p.add_argument("--prefill-response", metavar="TEXT",
                   help="the start of the assistant's reply, continued by the model (with the "
                   "chat template)")
    p.add_argument("--chat-template-config", type=argtypes.json_object, default=None,
                   metavar="JSON", help="arguments for the chat template, e.g. "
                   "'{\"enable_thinking\": false}'")
    p.add_argument("--system-prompt", help="system prompt for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the raw prompt, without the tokenizer's chat template")
    p.add_argument("--use-default-chat-template", action="store_true",
                   help="accepted as mlx_lm.generate accepts it, where it changes nothing "
                   "(mlx-lm 0.32): the tokenizer's own chat template is used whenever it has "
                   "one (default: off)")
    p.add_argument("--max-tokens", "-m", type=argtypes.positive_int, default=100,
                   help="tokens to generate")
    add_sampling_flags(p, top_p=1.0, seed=None)  # mlx_lm.generate's (0.32)
    p.add_argument("--min-p", type=argtypes.probability, default=0.0,
                   help="sampling min-p (0: off)")
    p.add_argument("--min-tokens-to-keep", type=argtypes.positive_int,
                   default=DEFAULT_MIN_TOKENS_TO_KEEP, metavar="N",
                   help="fewest tokens min-p sampling keeps")
    p.add_argument("--top-k", type=argtypes.non_negative_int, default=0,
                   help="sampling top-k (0: off)")
    add_xtc_flags(p, argtypes.DEFAULT_XTC_THRESHOLD)  # mlx_lm.generate's
    p.add_argument("--extra-eos-token", type=argtypes.eos_token, nargs="+", default=(), metavar="TOKEN",
                   help="more tokens that end the generation, each a token's text or id "
                   "(default: none)")
    p.add_argument("--verbose", dest="summary", type=argtypes.true_or_false, default=True,
                   metavar="BOOL", help="True: the summary and the peak memory after the text, "
                   "on stderr; False: only the text (as mlx_lm.generate)")
    add_kv_flags(p)
    p.add_argument("--kv-bits", type=int, choices=KV_BITS, default=None,
                   help="bits of the quantized KV cache (default: not quantized)")
    p.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES,
                   default=DEFAULT_KV_GROUP_SIZE, help="group size of the quantized KV cache")
    p.add_argument("--quantized-kv-start", type=argtypes.non_negative_int,
                   default=DEFAULT_QUANTIZED_KV_START, metavar="N",
                   help="with --kv-bits, quantize the KV cache from this many tokens on")
    add_prefetch_flag(p, "guess each next MoE layer's experts at the router sync, copy the "
                      "resident ones in the background and have the daemon read the others "
                      "ahead; auto stops copying where guesses are mostly wrong and reads "
                      "ahead only what its own hits and the layer's misses pay for")
    p.add_argument("--pipeline", action="store_true",
                   help="run under mlx.launch: split the model into pipeline stages with "
                   "mlx-lm's own split, one per process, each streaming its layers from the "
                   "expertd of its host (README: Several machines); rank 0 prints")
    p.add_argument("--prompt-cache-file", metavar="FILE",
                   help="a KV cache saved by mlx_lm.cache_prompt for the same model: --prompt "
                   "is what follows the cached prefix (default: none)")
    p.add_argument("--draft-model", metavar="MODEL",
                   help="a small resident mlx-lm model (a directory or a Hugging Face id) that "
                   "drafts tokens for mlx-lm's speculative decoding: the streamed model checks "
                   "several drafted tokens in one call, so its misses cost once a call; the "
                   "text is what the model alone would give under the same draft (default: "
                   "no draft)")
    p.add_argument("--num-draft-tokens", type=argtypes.positive_int, action=argtypes.Given,
                   default=DEFAULT_DRAFT_TOKENS, metavar="N",
                   help=f"tokens drafted at a time (default: {DEFAULT_DRAFT_TOKENS})")
    p.add_argument("--json-summary", metavar="FILE", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("demo", help="the whole job on a built-in synthetic model",
                       description="Build a synthetic MoE model (cached), convert it, start a "
                       "daemon whose cache is smaller than the experts, run two client "
                       "processes generating at the same time, show their text and speed and "
                       "the shared cache's statistics, and stop the daemon.")
    p.add_argument("--workdir", help="where the model and blobs are cached "
                   "(default: ~/.cache/expertd/demo)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the model and blobs")
    p.set_defaults(func=_cmd_demo)


def _cmd_serve(args) -> int:
    from expertd.client.serve import serve
    from expertd.client.serve_auth import read_api_key

    api_key = read_api_key(args.api_key_file)
    group = _pipeline_group() if args.pipeline else None
    ensure_daemon(args)
    status = serve(Path(args.blobs), host=args.host, port=args.port, prefetch=args.prefetch,
                   options=serve_options(args), pool_gb=args.pool_gb, speculate=args.speculate,
                   pull=args.pull, reconnect_timeout=args.reconnect_timeout,
                   adapter_path=args.adapter_path, trust_remote_code=args.trust_remote_code,
                   api_key=api_key, pipeline_group=group)
    # Everything is closed (the daemon got its goodbye): skip the C++ static destructors. With
    # MLX 0.32 on Linux they abort ("terminate called without an active exception") once
    # mlx-lm has decoded requests in a batch; `mlx_lm.server` itself exits that way.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def serve_options(args) -> dict:
    """The mlx_lm.server settings of ``expertd serve``'s flags, by their mlx-lm names."""
    return option_values(args, MLX_SERVER_OPTIONS)


def _cmd_chat(args) -> int:
    from expertd.client.chat import chat

    group = _pipeline_group() if args.pipeline else None
    ensure_daemon(args)
    return chat(Path(args.blobs), system_prompt=args.system_prompt, max_tokens=args.max_tokens,
                temp=args.temp, top_p=args.top_p, seed=args.seed, max_kv_size=args.max_kv_size,
                prefill_step_size=args.prefill_step_size, prefetch=args.prefetch,
                pool_gb=args.pool_gb, speculate=args.speculate, pull=args.pull,
                reconnect_timeout=args.reconnect_timeout, adapter_path=args.adapter_path,
                trust_remote_code=args.trust_remote_code,
                xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
                pipeline_group=group)


def add_serving_subcommands(sub) -> None:
    prefetch_help = "guess each next MoE layer's experts (see expertd generate --help)"
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (mlx_lm.server) on the "
                       "shared cache",
                       description="Serve the model of BLOB_DIR with mlx_lm.server's OpenAI-"
                       "compatible API (/v1/chat/completions, /v1/completions, /v1/models, "
                       "/health), its experts streamed through the running expertd, plus "
                       "/metrics in the Prometheus text format. Several servers, generate "
                       "runs and Python clients share one daemon. Like mlx_lm.server, it "
                       "only implements basic security checks: keep it on a trusted network, "
                       "and give it an API key (--api-key-file) where other users of this "
                       "machine or network could reach its port.")
    add_model_flag(p)
    add_start_flag(p)
    p.add_argument("--host", type=argtypes.host, default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=argtypes.port, default=8080, help="port to listen on, 0 to 65535 "
                   "(0: any free port, printed at start)")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="a file (mode 600) holding the key every request but /health must "
                   "bear, as 'Authorization: Bearer KEY' (OpenAI clients: api_key=KEY); "
                   "default: $EXPERTD_API_KEY, else no key (whoever reaches the port, any user "
                   "of this machine included, may use the model)")
    add_prefetch_flag(p, prefetch_help)
    p.add_argument("--pipeline", action="store_true",
                   help="run under mlx.launch, one pipeline stage per rank, each rank's BLOB_DIR "
                   "holding its stage (expertd convert --layers); rank 0 answers HTTP, as "
                   "mlx_lm.server --pipeline does (README: Several machines)")
    add_options(p, MLX_SERVER_OPTIONS)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("chat", help="interactive chat (like mlx_lm.chat) on the shared cache",
                       description="Chat with the model of BLOB_DIR in the terminal, its "
                       "experts streamed through the running expertd. Type q (or /q, or end "
                       "the input) to quit, r to reset the conversation, h for help; the "
                       "conversation's KV cache is kept across turns, as in mlx_lm.chat. "
                       "Ctrl-C stops a reply and forgets its turn; at the prompt it quits.")
    add_model_flag(p)
    add_start_flag(p)
    p.add_argument("--system-prompt", help="system prompt for the chat template")
    p.add_argument("--max-tokens", "-m", type=argtypes.positive_int, default=256,
                   help="most tokens generated per reply")
    add_sampling_flags(p, top_p=1.0, seed=0)  # mlx_lm.chat's
    add_xtc_flags(p, argtypes.CHAT_XTC_THRESHOLD)  # mlx_lm.chat's
    add_kv_flags(p)
    add_prefetch_flag(p, prefetch_help)
    p.add_argument("--pipeline", action="store_true",
                   help="run under mlx.launch, one pipeline stage per rank, each rank's BLOB_DIR "
                   "holding its stage (expertd convert --layers), as mlx_lm.chat --pipeline "
                   "does: every rank reads the same input (mlx.launch gives each its copy), "
                   "rank 0 prints; Ctrl-C ends every rank, as it ends mlx_lm.chat (README: "
                   "Several machines)")
    p.set_defaults(func=_cmd_chat)
