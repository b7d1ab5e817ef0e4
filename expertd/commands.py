"""Subcommands that run clients of the daemon: generate, demo (start/stop/status: control.py)."""

import argparse
import json
from pathlib import Path


def add_subcommands(sub) -> None:
    from .control import add_subcommands as add_control_subcommands

    add_control_subcommands(sub)
    add_client_subcommands(sub)


def _cmd_generate(args) -> int:
    import sys

    from expertd.client.generate import generate, summary_line

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    summary = generate(Path(args.blobs), prompt, max_tokens=args.max_tokens, temp=args.temp,
                       seed=args.seed, prefetch=args.prefetch, top_p=args.top_p,
                       min_p=args.min_p, top_k=args.top_k, system_prompt=args.system_prompt,
                       chat_template=not args.ignore_chat_template)
    print()
    print(summary_line(summary))
    if args.json_summary:
        Path(args.json_summary).write_text(json.dumps(summary))
    return 0


def _cmd_demo(args) -> int:
    from .tools.demo import run_demo

    return run_demo(Path(args.workdir) if args.workdir else None, rebuild=args.rebuild)


def add_client_subcommands(sub) -> None:
    p = sub.add_parser("generate", help="generate text through the daemon (a client process)",
                       description="Load the model of BLOB_DIR with its experts served by the "
                       "running expertd, stream a completion of --prompt to stdout, and end "
                       "with a one-line summary: tok/s for prompt and generation, this client's "
                       "hit rate and the bytes the daemon read for it. The flags that mlx_lm."
                       "generate also has mean what they mean there.")
    p.add_argument("--blobs", required=True, metavar="BLOB_DIR")
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads it from stdin)")
    p.add_argument("--system-prompt", help="system prompt for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the raw prompt, without the tokenizer's chat template")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=0.0, help="sampling top-p (0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="sampling min-p (0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k (0: off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--prefetch", choices=("auto", "on", "off"), default="auto",
                   help="guess each next MoE layer's experts at the router sync, copy the "
                   "resident ones in the background and have the daemon read the others ahead; "
                   "auto (default) stops guessing in a layer whose guesses are mostly wrong")
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
