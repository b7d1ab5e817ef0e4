"""Subcommands that run clients of the daemon: generate, demo (start/stop/status: control.py)."""

import argparse
import json
from pathlib import Path


def add_subcommands(sub) -> None:
    from .control import add_subcommands as add_control_subcommands

    add_control_subcommands(sub)
    add_client_subcommands(sub)


def _cmd_generate(args) -> int:
    from expertd.client.generate import generate, summary_line

    summary = generate(Path(args.blobs), args.prompt, max_tokens=args.max_tokens,
                       temp=args.temp, seed=args.seed, prefetch=args.prefetch)
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
                       "with a one-line summary: tok/s for prompt and generation, the daemon's "
                       "hit rate and bytes read during the run.")
    p.add_argument("--blobs", required=True, metavar="BLOB_DIR")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
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
