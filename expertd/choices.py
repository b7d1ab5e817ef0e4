"""What the command line, the daemon and the client library share: the modes' names, mlx-lm's
defaults, and the checks of values given to the Python API (each raising ValueError that
names the value). Imports nothing of expertd's, so every side may import it."""

import math

PREFETCH_MODES = ("auto", "on", "off")
SPECULATE_MODES = ("auto", "on", "off")  # the client's one-wait-a-step mode (client/step.py)
PULL_MODES = ("auto", "device", "host", "off")  # who reads a pool's misses (client/pull.py)

# mlx-lm's defaults, and the KV quantizations MLX supports (mx.quantize, affine).
DEFAULT_PREFILL_STEP_SIZE = 2048
DEFAULT_QUANTIZED_KV_START = 5000
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_PROMPT = "hello"  # mlx_lm.generate's --prompt
DEFAULT_XTC_THRESHOLD = 0.0  # mlx_lm.generate's
CHAT_XTC_THRESHOLD = 0.1  # mlx_lm.chat's
DEFAULT_DRAFT_TOKENS = 3  # mlx_lm.generate's --num-draft-tokens
DEFAULT_MIN_TOKENS_TO_KEEP = 1  # mlx_lm.generate's --min-tokens-to-keep
KV_BITS = (1, 2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)

MAX_SECONDS = 86400.0  # a day: any timeout beyond it is a typo
MAX_GIB = 1 << 20  # a PiB: no machine has it, and int(gb * 2**30) never overflows below it
SECONDS = f"a number of seconds above 0, at most {MAX_SECONDS:g} (a day)"
GIB = f"a number of GiB above 0, at most {MAX_GIB} (more memory than any machine has)"


def bounded(value, what: str, low: float, high: float) -> float:
    """``value`` as a float when a real number in (low, high], else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be {what}, not {value!r}")
    if not (math.isfinite(value) and low < value <= high):
        raise ValueError(f"must be {what}, not {value!r}")
    return float(value)


def checked(name: str, value, what: str, hi: float) -> float:
    """:func:`bounded` in (0, hi], its error naming ``name``."""
    try:
        return bounded(value, what, 0, hi)
    except ValueError as exc:
        raise ValueError(f"{name} {exc}") from None


def check_choice(name: str, value: str, choices) -> str:
    """``value`` if it is one of ``choices``, else a ValueError naming ``name`` and them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")
    return value


def check_seconds(name: str, value) -> float:
    """A timeout given to the Python API: a number of seconds in (0, a day].

    Raises:
        ValueError: naming ``name``.
    """
    return checked(name, value, SECONDS, MAX_SECONDS)


def check_gib(name: str, value) -> float:
    """A memory budget given to the Python API: a number of GiB in (0, MAX_GIB].

    Raises:
        ValueError: naming ``name``.
    """
    return checked(name, value, GIB, MAX_GIB)


def check_wait(name: str, value) -> float:
    """A wait given to the Python API: seconds in [0, a day] (0: do not wait).

    Raises:
        ValueError: naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 <= value <= MAX_SECONDS):
        raise ValueError(f"{name} must be a number of seconds from 0 to {MAX_SECONDS:g}, not "
                         f"{value!r}")
    return float(value)


# mlx_lm.server's settings as `expertd serve` passes them (mlx-lm 0.32), by their argparse
# names; serve's flags (expertd.cli.options) have these defaults, which a test holds equal.
MLX_SERVER_DEFAULTS = {
    "adapter_path": None, "trust_remote_code": False, "pipeline": False, "chat_template": "",
    "use_default_chat_template": False, "chat_template_args": {}, "temp": 0.0, "top_p": 1.0,
    "top_k": 0, "min_p": 0.0, "max_tokens": 512, "decode_concurrency": 32,
    "prompt_concurrency": 8, "prefill_step_size": DEFAULT_PREFILL_STEP_SIZE,
    "prompt_cache_size": 10, "prompt_cache_bytes": None, "kv_bits": None,
    "kv_group_size": DEFAULT_KV_GROUP_SIZE, "quantized_kv_start": DEFAULT_QUANTIZED_KV_START,
    "draft_model": None, "num_draft_tokens": DEFAULT_DRAFT_TOKENS, "allowed_origins": ["*"],
    "log_level": "INFO",
}
