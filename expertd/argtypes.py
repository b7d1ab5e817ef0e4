"""Argument types for the client subcommands' flags (generate, chat, serve), and mlx-lm's
defaults for them. Each type refuses a bad value at the edge, with argparse's one error line and
exit code 2."""

import argparse
import math

MAX_SEED = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer
# mlx-lm's defaults, and the KV quantizations MLX supports (mx.quantize, affine).
DEFAULT_PREFILL_STEP_SIZE = 2048
DEFAULT_QUANTIZED_KV_START = 5000
DEFAULT_KV_GROUP_SIZE = 64
KV_BITS = (1, 2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}") from None


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1 (--max-tokens, --max-kv-size, --prefill-step-size)."""
    value = _integer(text, "an integer of at least 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1, not {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer of at least 0 (--top-k, where 0 is off; --quantized-kv-start)."""
    value = _integer(text, "an integer of at least 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 0, not {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0 (--temp, where 0 is greedy)."""
    value = _number(text, "a finite number of at least 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, not {text!r}")
    return value


def probability(text: str) -> float:
    """A number between 0 and 1 (--top-p, --min-p)."""
    value = _number(text, "a number between 0 and 1")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1, not {text!r}")
    return value


def seed(text: str) -> int:
    """A random seed, as mx.random.seed takes it: 0 to 2**64 - 1."""
    value = _integer(text, f"an integer between 0 and {MAX_SEED}")
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer between 0 and {MAX_SEED}, "
                                         f"not {text!r}")
    return value


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
