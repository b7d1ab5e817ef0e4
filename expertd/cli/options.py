"""The options of ``expertd start`` and of mlx_lm.server, each declared once.

One :class:`Option` names a flag, its type, default, help and bounds; the parsers, the daemon's
:class:`~expertd.serving.config.ServerConfig`, the command line a detached daemon or a service
is started with, and the namespace mlx_lm.server reads are all generated from these tables, so
that a new option is one line here rather than four edits that must agree. A start option that
sets a ``ServerConfig`` field takes that field's default: the daemon's defaults are the
configuration's own, whoever builds it.
"""

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from expertd.cli import argtypes
from expertd.errors import FlagError
from expertd.serving.config import IO_MODES, PREFETCH_MODES, ServerConfig
from expertd.serving.preads import VERIFY_MODES

MAX_WORKERS = 256  # --workers: pread threads, at most


@dataclass(frozen=True)
class Option:
    """One ``--flag``: what argparse needs to parse it, and what it means beyond the parser."""

    flag: str  # "--cache-gb"; its argparse dest is "cache_gb"
    help: str  # argparse help ("%%" for a percent sign), the default left out: it is generated
    default: object = None
    type: object = None  # an argparse type (see argtypes), or None for the text as given
    choices: tuple | None = None
    metavar: str | None = None
    action: object = None  # "store_true" for a switch, or an argparse.Action class
    shown: str | None = None  # the default in words, where its value says too little
    hidden: bool = False  # accepted but left out of --help (for tests)
    field: str | None = None  # the ServerConfig field it sets as given (start options)
    is_path: bool = False  # a path, made absolute on the command line start_flags writes
    passed_on: bool = True  # written by start_flags (not --log-file: each starter picks its own)
    bounds: tuple | None = None  # (low, high), checked by check_bounds with the daemon's message

    @property
    def dest(self) -> str:
        return _dest(self.flag)

    def add_to(self, parser: argparse.ArgumentParser, default: bool = True) -> None:
        """Add this flag to ``parser``. The default is shown by main.DefaultsHelpFormatter,
        unless :attr:`shown` says it in words. Without ``default``, a flag not given sets
        nothing (restart tells a flag given at its default value from one not given)."""
        if not default:  # restart's: the running daemon's value is kept
            text = self.help + " (default: the running daemon's, else start's)"
        else:
            text = self.help + (f" (default: {self.shown})" if self.shown else "")
        kwargs = dict(default=self.default if default else argparse.SUPPRESS,
                      help=argparse.SUPPRESS if self.hidden else text)
        for name in ("type", "choices", "metavar", "action"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.bounds is not None:  # refused while parsing, as any bad value is
            kwargs["type"] = _bounded(self.type or int, *self.bounds)
        parser.add_argument(self.flag, **kwargs)


def _bounded(kind, low, high):
    """An argparse type: ``kind``'s value, between ``low`` and ``high``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number from {low} to {high}, "
                                             f"not {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, not {value}")
        return value

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _dest(flag: str) -> str:
    """argparse's dest of a long flag: --cache-gb is cache_gb."""
    return flag.removeprefix("--").replace("-", "_")


def add_options(parser: argparse.ArgumentParser, options, defaults: bool = True) -> None:
    """Add every option of ``options`` to ``parser``, in their order (which --help keeps);
    without ``defaults``, as Option.add_to."""
    for option in options:
        option.add_to(parser, defaults)


def option_values(args, options) -> dict:
    """``{dest: value}`` of ``options`` in the namespace ``args``."""
    return {option.dest: getattr(args, option.dest) for option in options}


# ---- expertd start, restart, service install -----------------------------------------------------

_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerConfig)}


def _setting(flag: str, help: str, field: str | None = None, **kwargs) -> Option:
    """A start option that sets ``ServerConfig.<field>`` (default: the flag's own name), with
    that field's default."""
    field = field or _dest(flag)
    return Option(flag, help, default=_CONFIG_DEFAULTS[field], field=field, **kwargs)


START_OPTIONS = (
    Option("--cache-gb", "size of the shared expert cache: the whole arena, in GiB (8), or 8G, "
           "512M; or a share of the experts, the side rows and slot tables on top (100%% holds "
           "every one; e.g. 30%%). A size above what every expert needs is cut to it (start "
           "says so)", default="4", metavar="SIZE"),
    _setting("--workers", "parallel pread workers", type=int, bounds=(1, MAX_WORKERS)),
    _setting("--io", "direct: bypass the page cache (O_DIRECT / F_NOCACHE), so the arena is the "
             "only copy; buffered: trust the page cache", choices=IO_MODES),
    _setting("--verify", "check each expert's checksum every time it is read from the disk (a "
             "corrupt blob is refused by name, never served), only the first time, or never",
             choices=VERIFY_MODES),
    _setting("--pin-file", "JSON list of [layer, expert] to pin", type=argtypes.file_path,
             metavar="JSON", is_path=True),
    _setting("--auto-pin", "keep the N hottest resident experts pinned", type=int, metavar="N",
             shown="0, off"),
    _setting("--prefetch", "fill the experts clients predict into side rows that never evict "
             "cached ones: on, off (the daemon ignores clients' read-ahead requests) or auto "
             "(on here; each client turns prediction off for layers where it does not pay)",
             choices=PREFETCH_MODES),
    _setting("--side-rows", "prefetch rows per generation; the arena keeps two generations, so "
             "2 x N rows of the cache budget. One client reads ahead up to twice a token's "
             "top_k experts per layer: raise N when several clients decode at once (STATS "
             "prefetch_dropped counts what found no row)", type=int, metavar="N",
             shown="2 x top_k when that leaves 16 times as many cache rows, else top_k"),
    _setting("--client-timeout", "reclaim a client's leases after S seconds without a heartbeat",
             type=argtypes.seconds, metavar="S"),
    _setting("--lease-timeout", "revoke a lease held longer than S seconds, even from a live "
             "client (a client copies its rows in milliseconds)", type=argtypes.seconds,
             metavar="S"),
    _setting("--heartbeat", "heartbeat interval clients are told to use", type=argtypes.seconds,
             metavar="S", field="heartbeat_interval"),
    # Hidden, for tests: a long hold leaves a client's death as the only thing that frees its
    # side rows, a short one lets a test see the hold lapse without waiting a second.
    _setting("--side-hold", "", type=argtypes.seconds, hidden=True),
    # Hidden, for tests that attach more clients from their own process than a process may.
    _setting("--clients-per-process", "", type=argtypes.positive_int, hidden=True),
    Option("--state-file", "where the hot set is saved", is_path=True,
           shown="per-user state dir"),
    Option("--log-file", "rotating log file", type=argtypes.new_file_path, metavar="PATH",
           shown="<runtime dir>/<id>.log when detached, stderr with --foreground",
           passed_on=False),
)


def add_start_flags(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """The flags ``start``, ``restart`` and ``service install`` share (restart's without
    ``defaults``: see Option.add_to)."""
    parser.add_argument("--blobs", required=True, metavar="BLOB_DIR",
                        help="blob directory to serve")
    add_options(parser, START_OPTIONS, defaults)


def start_flags(args) -> list:
    """The start flags of ``args`` that differ from their defaults, paths made absolute: the
    command line a detached daemon or a service runs with, after ``--blobs``."""
    flags = []
    for option in START_OPTIONS:
        value = getattr(args, option.dest)
        if not option.passed_on or value is None or value == option.default:
            continue
        if option.is_path:
            value = Path(value).expanduser().absolute()
        flags += [option.flag, str(value)]
    return flags


def check_bounds(args) -> None:
    """Refuse a start option outside its static bounds (those that depend on the model are
    checked where the model is known: daemon_control.config_from_args).

    Raises:
        ValueError: naming the flag and its bounds.
    """
    for option in START_OPTIONS:
        value = getattr(args, option.dest)
        if option.bounds and not option.bounds[0] <= value <= option.bounds[1]:
            low, high = option.bounds
            raise FlagError(f"{option.flag} must be between {low} and {high}, not {value}")


def config_settings(args) -> dict:
    """The ``ServerConfig`` fields the start options of ``args`` set as given, paths
    expanded (the budget and the blob directory are the caller's: they need the model)."""
    settings = {}
    for option in START_OPTIONS:
        if option.field:
            value = getattr(args, option.dest)
            settings[option.field] = Path(value).expanduser() if option.is_path and value else value
    return settings


# ---- expertd serve: mlx_lm.server's settings -----------------------------------------------------

# The settings `expertd serve` has no flag for, kept at mlx_lm.server's defaults (mlx-lm 0.32);
# --adapter-path and --trust-remote-code are flags of the model's load (serve sets them).
MLX_SERVER_FIXED = dict(adapter_path=None, trust_remote_code=False, pipeline=False)

# mlx_lm.server's flags that `expertd serve` has, with mlx_lm.server's defaults (mlx-lm 0.32;
# pyproject.toml pins the range) and expertd's checks of each value.
MLX_SERVER_OPTIONS = (
    Option("--chat-template", "a chat template (Jinja) replacing the tokenizer's", default="",
           shown="none"),
    Option("--use-default-chat-template", "use the tokenizer's built-in chat template if none "
           "is set", default=False, action="store_true"),
    Option("--chat-template-args", "JSON arguments for apply_chat_template, e.g. "
           "'{\"enable_thinking\":false}'", default={}, type=argtypes.json_object),
    Option("--temp", "sampling temperature of requests that set none", default=0.0,
           type=argtypes.non_negative_float),
    Option("--top-p", "top-p of requests that set none (0 or 1: off)", default=1.0,
           type=argtypes.probability, shown="off (mlx-lm's 1.0)"),
    Option("--top-k", "top-k of requests that set none (0: off)", default=0,
           type=argtypes.non_negative_int),
    Option("--min-p", "min-p of requests that set none (0: off)", default=0.0,
           type=argtypes.probability),
    Option("--max-tokens", "most tokens generated for a request that sets no max_tokens",
           default=512, type=argtypes.positive_int),
    Option("--decode-concurrency", "requests decoded together in one batch", default=32,
           type=argtypes.positive_int),
    Option("--prompt-concurrency", "prompts processed together in one batch", default=8,
           type=argtypes.positive_int),
    Option("--prefill-step-size", "prompt tokens per prefill step",
           default=argtypes.DEFAULT_PREFILL_STEP_SIZE, type=argtypes.positive_int),
    Option("--prompt-cache-size", "most KV caches kept for reuse across requests", default=10,
           type=argtypes.non_negative_int),
    Option("--prompt-cache-bytes", "most bytes of the KV caches kept for reuse, e.g. 2GB or "
           "500MB", type=argtypes.byte_size, metavar="SIZE",
           shown="no bound but --prompt-cache-size"),
    Option("--kv-bits", "bits of the quantized KV cache; as in mlx_lm.server, requests are "
           "then served one at a time, not batched", type=int, choices=argtypes.KV_BITS,
           shown="not quantized"),
    Option("--kv-group-size", "group size of the quantized KV cache",
           default=argtypes.DEFAULT_KV_GROUP_SIZE, type=int, choices=argtypes.KV_GROUP_SIZES),
    Option("--quantized-kv-start", "with --kv-bits, quantize a request's KV cache from this many "
           "tokens on", default=argtypes.DEFAULT_QUANTIZED_KV_START,
           type=argtypes.non_negative_int),
    Option("--draft-model", "a small resident mlx-lm model (a directory or a Hugging Face id) "
           "drafting tokens for mlx-lm's speculative decoding, checked several at a call by the "
           "streamed model; as in mlx_lm.server, requests are then served one at a time",
           metavar="MODEL", shown="none"),
    Option("--num-draft-tokens", "tokens drafted at a time, for requests that set none",
           default=argtypes.DEFAULT_DRAFT_TOKENS, type=argtypes.positive_int,
           action=argtypes.Given),
    Option("--allowed-origins", "CORS origins, comma-separated", default=["*"],
           type=lambda text: text.split(","), shown="*"),
    Option("--log-level", "mlx_lm.server's logging level", default="INFO",
           choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
)
