"""The client subcommands' flags are checked at the edge: a bad value is refused in one line
with argparse's exit code 2 before anything loads; mlx-lm's spellings (--model, -p, -m) are
accepted. --auto-pin is refused beyond what the cache can pin, before the daemon starts."""

import subprocess
import sys

import pytest
from harness import SMALL_CACHE_GB, Daemon, expertd_cli

from expertd.cli.main import build_parser


def refusal(capsys, *argv) -> str:
    """The one error line argparse gives for ``argv``; fails unless it exits with 2."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(list(argv))
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


GENERATE = ("generate", "--blobs", "B", "--prompt", "hi")
CHAT = ("chat", "--blobs", "B")
BAD = [
    (("--max-tokens", "-5"),
     "argument --max-tokens/-m: must be an integer of at least 1, not '-5'"),
    (("--max-tokens", "0"), "argument --max-tokens/-m: must be an integer of at least 1, not '0'"),
    (("-m", "1.5"), "argument --max-tokens/-m: must be an integer of at least 1, not '1.5'"),
    (("--temp", "-1"), "argument --temp: must be a finite number of at least 0, not '-1'"),
    (("--temp", "nan"), "argument --temp: must be a finite number of at least 0, not 'nan'"),
    (("--top-p", "2"), "argument --top-p: must be a number between 0 and 1, not '2'"),
    (("--top-p", "-0.5"), "argument --top-p: must be a number between 0 and 1, not '-0.5'"),
    (("--seed", "-1"), "argument --seed: must be an integer between 0 and 18446744073709551615, "
     "not '-1'"),
    (("--max-kv-size", "0"), "argument --max-kv-size: must be an integer of at least 1, not '0'"),
    (("--prefill-step-size", "-2"), "argument --prefill-step-size: must be an integer of at "
     "least 1, not '-2'"),
]
GENERATE_ONLY = [
    (("--min-p", "1.5"), "argument --min-p: must be a number between 0 and 1, not '1.5'"),
    (("--min-p", "-0.1"), "argument --min-p: must be a number between 0 and 1, not '-0.1'"),
    (("--top-k", "-1"), "argument --top-k: must be an integer of at least 0, not '-1'"),
    (("--verbose", "maybe"), "argument --verbose: must be True or False, not 'maybe'"),
    (("--kv-bits", "7"), "argument --kv-bits: invalid choice: 7 (choose from 1, 2, 3, 4, 5, 6, "
     "8)"),
    (("--quantized-kv-start", "-1"), "argument --quantized-kv-start: must be an integer of at "
     "least 0, not '-1'"),
]


@pytest.mark.parametrize("flags, message", BAD + GENERATE_ONLY)
def test_generate_refuses_bad_values(capsys, flags, message):
    assert refusal(capsys, *GENERATE, *flags) == f"expertd generate: error: {message}"


@pytest.mark.parametrize("flags, message", BAD)
def test_chat_refuses_bad_values(capsys, flags, message):
    assert refusal(capsys, *CHAT, *flags) == f"expertd chat: error: {message}"


def test_an_empty_prompt_is_refused(capsys):
    assert refusal(capsys, "generate", "--blobs", "B", "-p", "") == (
        "expertd generate: error: argument --prompt/-p: must not be empty (give some text, or "
        "'-' to read it from stdin)")
    # An empty stdin is refused as well, before the model loads (B does not exist).
    done = subprocess.run([sys.executable, "-m", "expertd", "generate", "--blobs", "B", "-p", "-"],
                          input="", capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == "expertd generate: error: the prompt read from stdin is empty\n"


def test_mlx_lm_spellings_are_accepted(capsys):
    args = build_parser().parse_args(["generate", "--model", "B", "-p", "hi", "-m", "5"])
    assert (args.blobs, args.prompt, args.max_tokens) == ("B", "hi", 5)
    assert args.summary is True and args.verbose is False  # expertd -v is not generate's
    args = build_parser().parse_args(["-v", "generate", "--model", "B", "-p", "hi",
                                      "--verbose", "f"])
    assert args.summary is False and args.verbose is True
    args = build_parser().parse_args(["chat", "--model", "B", "-m", "7", "--top-p", "1"])
    assert (args.blobs, args.max_tokens, args.top_p) == ("B", 7, 1.0)
    assert refusal(capsys, "generate", "-p", "hi") == (
        "expertd generate: error: the following arguments are required: --blobs/--model")


def test_a_rotating_kv_cache_is_not_quantized():
    """mlx-lm would fail in mid-generation; the pair is refused before the model loads."""
    done = expertd_cli("generate", "--blobs", "B", "-p", "hi", "--kv-bits", "4",
                       "--max-kv-size", "64")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("expertd generate: error: --kv-bits and --max-kv-size do not go "
                           "together: mlx-lm cannot quantize a rotating KV cache\n")


def test_auto_pin_is_refused_beyond_a_quarter_of_the_cache(models, isolated_env):
    blobs = models.blobs()
    for n in ("100000", "13", "-1"):
        done = expertd_cli("start", "--blobs", blobs, "--cache-gb", SMALL_CACHE_GB,
                           "--auto-pin", n, timeout=60)
        assert done.returncode == 2 and done.stdout == "", done
        assert done.stderr == (f"expertd start: error: --auto-pin must be between 0 and 12 (a "
                               f"quarter of this cache's 48 rows), not {n}\n")
    # The bound is the daemon's own: it starts with it.
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB, "--auto-pin", "12") as daemon:
        assert daemon.ready["arena_rows"] == 48


# ---- issue 16, what outside tries still found ---------------------------------------------------

GIB = ("must be a number of GiB above 0, at most 1048576 (more memory than any machine has), "
       "not {!r}")


@pytest.mark.parametrize("command", [GENERATE, CHAT, ("serve", "--blobs", "B")])
@pytest.mark.parametrize("value", ["1e30", "", "nan", "0", "-1"])
def test_pool_gb_is_bounded_like_cache_gb(capsys, command, value):
    said = refusal(capsys, *command, "--pool-gb", value)
    assert said == f"expertd {command[0]}: error: argument --pool-gb: {GIB.format(value)}"
    assert build_parser().parse_args([*command, "--pool-gb", "0.5"]).pool_gb == 0.5


def test_an_extra_eos_token_id_is_not_negative(capsys):
    assert refusal(capsys, *GENERATE, "--extra-eos-token", "-1") == (
        "expertd generate: error: argument --extra-eos-token: must be a token's text or id (an "
        "integer of at least 0), not '-1'")
    args = build_parser().parse_args([*GENERATE, "--extra-eos-token", "7", "</s>"])
    assert args.extra_eos_token == ["7", "</s>"]


SERVE = ("serve", "--blobs", "B")


@pytest.mark.parametrize("value", ["1.5", "1e30", "0", "0.0005KB", "lots"])
def test_prompt_cache_bytes_is_a_whole_number_of_bytes(capsys, value):
    assert refusal(capsys, *SERVE, "--prompt-cache-bytes", value) == (
        "expertd serve: error: argument --prompt-cache-bytes: must be a whole number of bytes, "
        f"at least 1 and at most a PiB (e.g. 500MB or 2GB), not {value!r}")
    for given, want in (("1.5G", 1_500_000_000), ("500MB", 500_000_000), ("7", 7)):
        assert build_parser().parse_args([*SERVE, "--prompt-cache-bytes", given]) \
            .prompt_cache_bytes == want


def test_serve_messages_name_what_is_wrong(capsys):
    """No internal function names in argparse's errors, no advice about the port for a bad
    host."""
    assert refusal(capsys, *SERVE, "--host", "") == (
        "expertd serve: error: argument --host: must be an address such as 127.0.0.1 (this "
        "machine only) or 0.0.0.0 (every interface), not ''")
    assert refusal(capsys, *SERVE, "--chat-template-args", "[1]") == (
        "expertd serve: error: argument --chat-template-args: must be a JSON object, not '[1]'")
    said = refusal(capsys, *SERVE, "--chat-template-args", "{x")
    assert said.startswith("expertd serve: error: argument --chat-template-args: must be a JSON "
                           "object, not '{x' (")
    assert build_parser().parse_args([*SERVE, "--chat-template-args", '{"a": 1}']) \
        .chat_template_args == {"a": 1}


@pytest.mark.parametrize("kwargs, message", [
    (dict(reconnect_timeout="abc"), "reconnect_timeout must be a number of seconds from 0"),
    (dict(reconnect_timeout=float("nan")), "reconnect_timeout must be a number of seconds"),
    (dict(reconnect_timeout=-1), "reconnect_timeout must be a number of seconds from 0"),
    (dict(reconnect_timeout=True), "reconnect_timeout must be a number of seconds from 0"),
    (dict(pool_gb=float("inf")), "pool_gb must be a number of GiB above 0, at most 1048576"),
    (dict(pool_gb="1"), "pool_gb must be a number of GiB above 0"),
    (dict(pool_gb=0), "pool_gb must be a number of GiB above 0"),
])
def test_load_refuses_bad_arguments_before_it_connects(kwargs, message):
    """ValueError, as load()'s docstring says, before anything looks for a daemon."""
    from expertd.client import load

    with pytest.raises(ValueError, match=message):
        load("no-such-blob-dir", **kwargs)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_blobs_and_model_naming_two_directories_are_refused(capsys, command):
    """--model is --blobs spelled as mlx-lm spells it: two different directories are refused,
    not the last one taken; the same one twice is fine."""
    said = refusal(capsys, command, "--blobs", "A", "--model", "B")
    assert said.endswith("error: --model B and an earlier --blobs/--model A name two "
                         "directories; give one")
    args = build_parser().parse_args([command, "--model", "A", "--blobs", "./A/"])
    assert args.blobs == "./A/"  # one directory, however spelled
