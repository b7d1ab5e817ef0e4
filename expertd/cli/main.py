"""The ``expertd`` command: one entry point, one subcommand per job."""

import argparse
import difflib
import logging
import os
import sys
from pathlib import Path

from expertd.cli import argtypes
from expertd.cli.output import answer, mute_stdout
from expertd.errors import ExpertdError, FlagError

DESCRIPTION = """\
expertd runs Mixture-of-Experts models larger than memory by streaming the routed experts from
the SSD. One daemon per blob directory keeps the warm experts in shared memory for every client.

Typical use:
  expertd convert ~/models/Qwen3-30B-A3B-4bit ~/blobs/qwen3-30b    # once
  expertd start --blobs ~/blobs/qwen3-30b --cache-gb 8
  expertd generate --blobs ~/blobs/qwen3-30b --prompt "Hello"
  expertd stop --blobs ~/blobs/qwen3-30b
"""


def _cmd_synth(args) -> int:
    from expertd.tools.synth import SynthConfig, mode_bits, synthesize

    cfg = SynthConfig(family=args.family, layers=args.layers, experts=args.experts,
                      top_k=args.top_k, hidden=args.hidden, moe_inter=args.moe_inter,
                      bits=mode_bits(args.mode) if args.bits is None else args.bits,
                      mode=args.mode, dtype=args.dtype, seed=args.seed)
    out = synthesize(cfg, Path(args.out))
    print(f"wrote a synthetic {cfg.family} checkpoint to {out}")
    return 0


def _cmd_convert(args) -> int:
    from expertd.tools.convert import convert

    if args.lazy:
        from expertd.tools.lazy import convert_lazy

        manifest = convert_lazy(args.model_dir, Path(args.blob_dir), progress=not args.quiet,
                                layers=args.layers, revision=args.revision)
    elif str(args.model_dir).startswith(("http://", "https://")):
        raise ValueError(f"{args.model_dir} is a URL: convert it with --lazy (experts "
                         "fetched on first use)")
    else:
        manifest = convert(Path(args.model_dir), Path(args.blob_dir), progress=not args.quiet,
                           layers=args.layers)
    from expertd.units import size_text

    if args.lazy:
        return answer(f"wrote {len(manifest.layers)} MoE layers of {args.model_dir} lazily "
                      f"(no expert fetched yet, {size_text(manifest.total_expert_bytes)} on "
                      f"first use) and trunk/ to {args.blob_dir}", 0)

    stage = "" if manifest.stage is None else (f" of transformer layers {manifest.stage} "
                                               f"(of {manifest.stage.num_layers})")
    print(f"wrote {len(manifest.layers)} MoE layers{stage} "
          f"({size_text(manifest.total_expert_bytes)} of experts, stride "
          f"{manifest.stride} bytes) and trunk/ to {args.blob_dir}")
    return 0


def _cmd_verify(args) -> int:
    from tqdm import tqdm

    from expertd.blobstore import DirectoryCheck

    given = [d for d in (args.blob_dir, args.blobs) if d is not None]
    why = None
    if not given:
        why = "give the blob directory: expertd verify BLOB_DIR, or expertd verify --blobs BLOB_DIR"
    elif len(given) == 2 and not argtypes.same_dir(*given):
        why = f"{args.blob_dir} and --blobs {args.blobs} name two directories; give one"
    if why is not None:  # an argument error: argparse's status
        print(f"expertd verify: error: {why}", file=sys.stderr)
        return 2
    check = DirectoryCheck(Path(given[0]).expanduser())
    bad = 0
    with tqdm(total=check.total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
              disable=True if args.quiet else None,  # None: on a terminal only
              desc="verify", dynamic_ncols=True) as bar:
        for fault in check.faults(bar.update):
            bad += 1
            bar.write(str(fault), file=sys.stdout)  # above the bar, not through it
    manifest = check.manifest
    lazy = check.records is not None
    experts = (f"{check.present} of {check.experts} experts fetched (a lazy directory)" if lazy
               else f"{check.experts} experts")
    shards = f", {len(check.shards_checked)} whole shards" if check.shards_checked else ""
    what = (f"{experts} in {len(manifest.layers)} layers{shards} and "
            f"{len(manifest.trunk)} trunk files")
    note = f" ({check.note})" if check.note else ""  # said once: why no sha256 was checked
    if bad:
        return answer(f"{check.dir}: {bad} problem{'s' if bad > 1 else ''} found checking "
                      f"{what}; {check.advice()}{note}", 1)
    matched = f"{what}: all match" if lazy else f"all {what} match"
    return answer(f"{check.dir}: {matched} their checksums{note}", 0)


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows every optional flag's default (as its type writes one: seconds as 10, not 10.0),
    unless its help already names it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and not action.required and "default" not in text
                and action.default is not argparse.SUPPRESS
                and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            default = action.default
            if default is None or default is False:
                default = "off" if action.nargs == 0 else "none"
            else:
                default = getattr(action.type, "show", str)(default)
            text += f" (default: {default.replace('%', '%%')})"
        return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("expertd")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _set_formatter(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand's parser, however deep, the defaults-showing help."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _set_formatter(child)


# mlx-lm's flags that a user may type where expertd has no such flag, and what to do instead.
MLX_LM_ONLY = {
    "--prompt-cache-file": "only generate takes a saved prompt cache",
    "--quantize-activations": "the trunk runs as converted",
    "--image": "expertd streams text models",
    "--draft-model": "only generate and serve take a draft model",
    "--num-draft-tokens": "only generate and serve take a draft model",
    "--min-tokens-to-keep": "only generate takes it (chat has no --min-p)",
    "--xtc-probability": "generate and chat take XTC sampling (serve: a request's "
                         "xtc_probability)",
    "--xtc-threshold": "generate and chat take XTC sampling (serve: a request's xtc_threshold)",
    "--use-default-chat-template": "serve and generate take it; chat uses the tokenizer's "
                                   "own template",
    "--pipeline": "generate, chat and serve run pipeline stages (README: Several machines)",
}
# A flag that means nothing without another: its dest (its add_argument has
# action=argtypes.Given), its flag, the other's dest and flag.
NEEDS = [("num_draft_tokens", "--num-draft-tokens", "draft_model", "--draft-model")]


class OneLineParser(argparse.ArgumentParser):
    """argparse with errors in one line, without the usage block: the command, the flag and
    what it takes; an unknown flag gets the closest one, and an mlx-lm flag that expertd
    lacks says so."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        args, extra = self.parse_known_args(args, namespace)
        if extra:
            prog = f"expertd {args.command}" if getattr(args, "command", None) else self.prog
            flag = next((a.split("=", 1)[0] for a in extra if a.startswith("-")), None)
            if flag in ("-v", "--verbose"):
                self.exit(2, f"{prog}: error: {flag} goes before the subcommand: "
                          f"expertd -v {args.command} ...\n")
            if flag in MLX_LM_ONLY:
                self.exit(2, f"{prog}: error: {flag} is mlx-lm's, and {prog} does not take it: "
                          f"{MLX_LM_ONLY[flag]} (see {prog} --help)\n")
            what = f"no flag {flag}" if flag else f"unexpected {' '.join(extra)!r}"
            close = difflib.get_close_matches(flag, self._flags_of(args), 1) if flag else []
            hint = f"; did you mean {close[0]}?" if close else ""
            self.exit(2, f"{prog}: error: {what}{hint} (see {prog} --help)\n")
        given = getattr(args, "given_flags", set())
        for dest, flag, needed, other in NEEDS:
            if dest in given and hasattr(args, needed) and not getattr(args, needed):
                prog = f"expertd {args.command}" if getattr(args, "command", None) else self.prog
                self.exit(2, f"{prog}: error: {flag} needs {other} (see {prog} --help)\n")
        return args

    def _flags_of(self, args) -> list:
        """The flags of the subcommand that ``args`` ran (this parser's own without one)."""
        parser = self
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                parser = action.choices.get(getattr(args, "command", None), self)
        return [flag for flag in parser._option_string_actions if flag.startswith("--")]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="expertd", description=DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"expertd {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("synth", help="write a synthetic MoE checkpoint (random weights)",
                       description="Write a random-weight MoE checkpoint in mlx-lm format, built "
                       "with mlx-lm's own model classes, with an offline tokenizer. "
                       "`mlx_lm.load(OUT)` loads it.")
    p.add_argument("--family", default="qwen3_moe",
                   choices=("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"),
                   help="mlx-lm model family (default: qwen3_moe)")
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--layers", type=argtypes.positive_int, default=4, help="transformer layers (default: 4)")
    p.add_argument("--experts", type=argtypes.positive_int, default=16,
                   help="routed experts per layer (default: 16)")
    p.add_argument("--top-k", type=argtypes.positive_int, default=4, help="experts per token (default: 4)")
    p.add_argument("--hidden", type=argtypes.positive_int, default=128,
                   help="hidden size: a multiple of 64 for affine quantization (the default), "
                   "else of 32 (default: 128)")
    p.add_argument("--moe-inter", type=argtypes.positive_int, default=64,
                   help="expert intermediate size: a multiple of 64 for affine quantization (the "
                   "default), else of 32 (default: 64)")
    p.add_argument("--bits", type=argtypes.positive_int, default=None,
                   help="quantization bits: 2, 3, 4, 5, 6 or 8 for affine, 4 for mxfp4 and "
                   "nvfp4, 8 for mxfp8 (default: the mode's own, 4 for affine)")
    p.add_argument("--mode", default="affine",
                   choices=("affine", "mxfp4", "mxfp8", "nvfp4", "none"),
                   help="quantization mode; 'none' keeps --dtype weights (default: affine)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the unquantized weights (default: bfloat16)")
    p.add_argument("--seed", type=argtypes.seed, default=0, help="random seed (default: 0)")
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser("convert", help="split an mlx-lm MoE checkpoint into expert blobs + trunk",
                       description="Split an mlx-lm MoE checkpoint into one blob file per MoE "
                       "layer (each expert at expert * stride) plus trunk/, an mlx-lm model "
                       "directory without the routed experts. Streams tensor by tensor: memory "
                       "stays small whatever the model size. The output appears atomically.")
    p.add_argument("model_dir", metavar="MODEL",
                   help="mlx-lm model directory (config.json + *.safetensors) or Hugging Face "
                   "repo id; with --lazy, a repo id or an http(s) base URL of a model directory")
    p.add_argument("blob_dir", help="output blob directory (must not exist)")
    p.add_argument("--lazy", action="store_true",
                   help="leave the experts remote: read the shards' headers and download the "
                   "trunk now; each expert is fetched by HTTP range the first time it is "
                   "routed (or by expertd fetch) and kept in the blob files. A repo id honours "
                   "HF_ENDPOINT and HF_TOKEN as huggingface_hub does")
    p.add_argument("--revision", help="with --lazy and a repo id: the branch, tag or commit "
                   "(default: main; pinned to its commit)")
    p.add_argument("--layers", metavar="A:B",
                   help="write one pipeline stage only: the transformer layers A:B (a Python "
                   "slice, as mlx-lm's pipeline split gives a rank; see README 'Several "
                   "machines'), their experts and the trunk that stage needs (default: the "
                   "whole model)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("verify", help="check every expert and trunk file of a blob directory",
                       description="Check a blob directory offline: every expert row of every "
                       "layer and every trunk file against the checksums in its manifest, and "
                       "every file's size. Prints one line per bad expert or file and a summary; "
                       "exits with status 1 if anything is corrupt.")
    p.add_argument("blob_dir", nargs="?", metavar="BLOB_DIR",
                   help="blob directory written by expertd convert (as convert names it)")
    p.add_argument("--blobs", help="the same, as the other commands take it")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_verify)

    from expertd.cli import fetch, inference, service

    fetch.add_subcommands(sub)
    inference.add_subcommands(sub)
    service.add_subcommands(sub)
    _set_formatter(parser)
    return parser


def main(argv=None) -> int:
    # A reader that has gone (`| head`, `| true`) ends the command quietly, as it does git's:
    # a command that finished (or knew its answer: see answer()) keeps its exit code, one cut
    # short while writing exits 1.
    code = 1
    open_closed_streams()
    try:
        code = _run(argv)
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's exit
    except BrokenPipeError:
        mute_stdout()
    except KeyboardInterrupt:  # before the command ran (building the parser: its imports)
        print("expertd: interrupted", file=sys.stderr)
        return 130
    return code


def open_closed_streams() -> None:
    """A command started with stdin, stdout or stderr closed (``<&-``, ``>&-``) runs as with
    /dev/null there: Python leaves such a stream None (every read, print and flush of it
    would raise), and the descriptor free, so that the next file or socket opened would take
    it and receive what is printed. Each closed one is opened on /dev/null."""
    import io

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:  # closed: the lowest free one (those below it were opened before)
            os.open(os.devnull, os.O_RDWR)
        if getattr(sys, name) is None:
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, mode, closefd=False),
                                                line_buffering=mode == "w"))


def deliver_lost_interrupts() -> None:
    """Ctrl-C is never lost. A SIGINT whose KeyboardInterrupt is raised inside a callback
    Python runs for itself (an import lock's weakref callback, a finalizer) is only printed as
    "Exception ignored", and the command would go on as if never interrupted (synth did, in
    CI). Such a one is sent again, from a helper thread a moment later, so that it lands in
    the command's own code (sending it from the hook would raise it in the hook, lost again)."""
    import _thread
    import threading

    fallback = sys.unraisablehook

    def hook(unraisable):
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type,
                                                          KeyboardInterrupt):
            threading.Timer(0.005, _thread.interrupt_main).start()
        else:
            fallback(unraisable)

    sys.unraisablehook = hook


USAGE = 2  # argparse's exit status for a bad argument


def _prog(args) -> str:
    """The command as its messages name it: ``expertd start``, ``expertd service install``."""
    action = getattr(args, "action", None)
    return f"expertd {args.command}" + (f" {action}" if isinstance(action, str) else "")


def _run(argv) -> int:
    deliver_lost_interrupts()
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv_all = argv
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s expertd %(levelname)s %(message)s")
    try:
        return args.func(args)
    except BrokenPipeError:
        raise  # not an error of the command: main() exits quietly
    except (ExpertdError, OSError, ValueError) as exc:
        print(f"{_prog(args)}: error: {exc}", file=sys.stderr)
        # A flag's value found wrong once the command knew more (the model, a file, the
        # network) ends as argparse ends one it refuses while parsing: status 2.
        return USAGE if isinstance(exc, FlagError) else 1
    except KeyboardInterrupt:
        print(f"{_prog(args)}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
