"""Argument types for the command line's flags, and mlx-lm's defaults for the client ones. Each
type refuses a bad value at the edge, with argparse's one error line and exit code 2; the
``check_*`` twins raise ValueError for the same values given to the Python API."""

import argparse
import math
from pathlib import Path

from expertd.choices import (  # noqa: F401 (the CLI's names for them)
    CHAT_XTC_THRESHOLD,
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_PREFILL_STEP_SIZE,
    DEFAULT_PROMPT,
    DEFAULT_QUANTIZED_KV_START,
    DEFAULT_XTC_THRESHOLD,
    GIB,
    KV_BITS,
    KV_GROUP_SIZES,
    MAX_GIB,
    MAX_SECONDS,
    SECONDS,
    bounded,
    check_gib,
    check_seconds,
    check_wait,
)
from expertd.paths import missing_parent
from expertd.serving.hotset import parse_json

MAX_SEED = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer
MAX_BYTES = MAX_GIB * 2**30


def _ranged(parse, what: str, ok, doc: str, show=str):
    """An argument type: ``parse(text)`` where ``ok`` of it, else argparse's one-line error.
    ``show`` writes a default of the type in --help (main.DefaultsHelpFormatter)."""
    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not ok(value):  # the comparisons refuse nan (and inf where bounded)
            raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}")
        return value

    check.__doc__ = doc
    check.show = show
    return check


positive_int = _ranged(int, "an integer of at least 1", lambda v: v >= 1,
                       "An integer of at least 1 (--max-tokens, --max-kv-size, "
                       "--prefill-step-size).")
non_negative_int = _ranged(int, "an integer of at least 0", lambda v: v >= 0,
                           "An integer of at least 0 (--top-k, where 0 is off; "
                           "--quantized-kv-start).")
non_negative_float = _ranged(float, "a finite number of at least 0", lambda v: 0 <= v < math.inf,
                             "A finite number of at least 0 (--temp, where 0 is greedy).")
probability = _ranged(float, "a number between 0 and 1", lambda v: 0 <= v <= 1,
                      "A number between 0 and 1 (--top-p, --min-p).")
seed = _ranged(int, f"an integer between 0 and {MAX_SEED}", lambda v: 0 <= v <= MAX_SEED,
               "A random seed, as mx.random.seed takes it: 0 to 2**64 - 1.")


class Given(argparse.Action):
    """Store the value as argparse does, and note the flag as given (``given_flags``, a set
    of dests): a flag with a default whose meaning needs another flag (main.NEEDS) is told
    given from defaulted by argparse itself, under any abbreviation or spelling."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given_flags = {*getattr(namespace, "given_flags", ()), self.dest}


def same_dir(a: str, b: str) -> bool:
    """``a`` and ``b`` name one directory (however spelled: ./b, b/, ~/b)."""
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def prompt_text(text: str) -> str:
    """A prompt that is not empty (mlx-lm cannot generate from no tokens)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (give some text, or '-' to read it "
                                         "from stdin)")
    return text


def true_or_false(text: str) -> bool:
    """mlx_lm.generate's --verbose values: True/T or False/F, in any case."""
    word = text.strip().lower()
    if word in ("true", "t"):
        return True
    if word in ("false", "f"):
        return False
    raise argparse.ArgumentTypeError(f"must be True or False, not {text!r}")


# A default of seconds reads as the user writes it: "(default: 10)", not 10.0.
seconds = _ranged(float, SECONDS, lambda v: 0 < v <= MAX_SECONDS,
                  "A timeout or interval: seconds above 0, at most a day (status/stop --timeout, "
                  "--client-timeout, --lease-timeout, --heartbeat, --watch).", show="{:g}".format)
wait_seconds = _ranged(float, f"a number of seconds from 0 to {MAX_SECONDS:g} (a day)",
                      lambda v: 0 <= v <= MAX_SECONDS,
                      "A wait: seconds from 0 (do not wait) to a day (--reconnect-timeout).",
                      show="{:g}".format)


gib = _ranged(float, GIB, lambda v: 0 < v <= MAX_GIB,
              "A memory budget in GiB above 0, bounded as --cache-gb is (--pool-gb).")


# Units of --prompt-cache-bytes, decimal as in mlx_lm.server's.
BYTE_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
              "GB": 10**9}


def byte_size(text: str) -> int:
    """A whole number of bytes, at least 1, with an optional decimal unit: 500MB, 2GB, 1.5G."""
    number = text.strip().upper().rstrip("KMGB")
    unit = text.strip().upper()[len(number):]
    try:
        value = float(number) * BYTE_UNITS[unit]
    except (ValueError, KeyError):
        value = 0.0
    if not (1 <= value <= MAX_BYTES and value == int(value)):
        raise argparse.ArgumentTypeError(f"must be a whole number of bytes, at least 1 and "
                                         f"at most a PiB (e.g. 500MB or 2GB), not {text!r}")
    return int(value)


port = _ranged(int, "a port from 0 to 65535", lambda v: 0 <= v <= 65535,
               "A TCP port, 0 to 65535 (0: any free one).")


def host(text: str) -> str:
    """An address to listen on, not empty (0.0.0.0 is every interface)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be an address such as 127.0.0.1 (this machine "
                                         "only) or 0.0.0.0 (every interface), not ''")
    return text


def json_object(text: str) -> dict:
    """A JSON object, such as '{"enable_thinking": false}'."""
    try:
        value = parse_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {text!r}")
    return value


def eos_token(text: str) -> str:
    """An end-of-sequence token: its text, or its id (a whole number of at least 0)."""
    if not text:
        raise argparse.ArgumentTypeError("must be a token's text or id, not ''")
    try:
        number = int(text)
    except ValueError:
        return text
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be a token's text or id (an integer of at "
                                         f"least 0), not {text!r}")
    return text


def file_path(text: str) -> str:
    """A path to an existing file's name, not empty (--pin-file)."""
    if not text:
        raise argparse.ArgumentTypeError("must be a file's path, not ''")
    return text


def new_file_path(text: str) -> str:
    """A file to write, whose directory exists (--log-file): a typo must not create
    directories, and a directory is no log file."""
    if not text:
        raise argparse.ArgumentTypeError("must be a file's path, not ''")
    path = Path(text).expanduser().absolute()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory: give a file's path in it")
    if missing_parent(path):
        raise argparse.ArgumentTypeError(missing_parent(path))
    return text



xtc_threshold = _ranged(float, "a number from 0 to 0.5", lambda v: 0 <= v <= 0.5,
                        "XTC's threshold: mlx-lm's sampler takes 0 to 0.5 (--xtc-threshold).")
