"""``expertd chat`` driven through a pipe: mlx_lm.chat's loop, replies equal resident mlx-lm's.

The resident reference runs the loop of mlx_lm.chat (one KV cache across turns, ``r`` makes a
new one) with the whole model loaded, in this process.
"""

import os
import subprocess
import sys

import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from harness import SMALL_CACHE_GB, Daemon

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 8


def run_chat(blob_dir, stdin: str, *flags) -> subprocess.CompletedProcess:
    """``expertd chat`` with ``stdin`` piped in; stdout and stderr as bytes decoded untouched
    (a reply may hold a carriage return that text mode would turn into a newline)."""
    done = subprocess.run([sys.executable, "-m", "expertd", "chat", "--blobs", str(blob_dir),
                           "--max-tokens", str(MAX_TOKENS), *flags], input=stdin.encode(),
                          capture_output=True, timeout=120, env=os.environ)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(),
                                       done.stderr.decode())


def resident_replies(model_dir, turns) -> list[str]:
    """mlx_lm.chat's loop over ``turns`` with the model resident (no chat template here)."""
    model, tokenizer = mlx_lm.load(str(model_dir))
    cache, replies = make_prompt_cache(model), []
    for query in turns:
        if query == "r":
            cache = make_prompt_cache(model)
            continue
        replies.append("".join(r.text for r in mlx_lm.stream_generate(
            model, tokenizer, query, max_tokens=MAX_TOKENS, prompt_cache=cache)))
    return replies


def test_chat_through_a_pipe(models, isolated_env):
    blobs, model_dir = models.blobs(), models.model()
    turns = ["def main():", "return x", "r", "def main():"]
    expected = resident_replies(model_dir, turns)
    # The KV cache really carries over: the second turn alone would be answered otherwise.
    assert expected[1] != resident_replies(model_dir, ["return x"])[0]
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB) as daemon:
        done = run_chat(blobs, "\n".join(turns[:2] + ["h"] + turns[2:] + ["q", "never sent"])
                        + "\n")
        assert done.returncode == 0, done.stderr
        assert done.stdout == "".join(reply + "\n" for reply in expected)
        err = done.stderr.splitlines()
        assert err[0].startswith("commands: q quit, r reset")
        assert err.count(err[0]) == 2  # at start and for h
        assert "reset: context cleared" in err and err[-1] == "bye"
        assert sum(" tok/s · prompt " in line for line in err) == 3
        assert daemon.stats()["clients"] == 0, "the chat said goodbye"

        # The end of the input quits as q does; /q is q.
        for stdin in ("def main():\n", "def main():\n/q\nnever sent\n"):
            done = run_chat(blobs, stdin)
            assert done.returncode == 0, done.stderr
            assert done.stdout == expected[0] + "\n"
            assert done.stderr.splitlines()[-1] == "bye"


def test_chat_without_a_daemon(models, isolated_env):
    blobs = models.blobs()
    done = run_chat(blobs, "hello\n")
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("expertd chat: error: ")
    assert f"start one with: expertd start --blobs {blobs}" in lines[0]
