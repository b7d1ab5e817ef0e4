"""``expertd chat`` driven through a pipe: mlx_lm.chat's loop, replies equal resident mlx-lm's.

The resident reference runs the loop of mlx_lm.chat (one KV cache across turns, ``r`` makes a
new one) with the whole model loaded, in this process.
"""

import os
import selectors
import signal
import subprocess
import sys
import time

import mlx_lm
import pytest
from harness import SMALL_CACHE_GB, Daemon, sigint_as_usual
from mlx_lm.models.cache import make_prompt_cache

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


def test_chat_samples_with_xtc_as_mlx_lm_chat(models, isolated_env):
    """mlx_lm.chat's --xtc-probability / --xtc-threshold (it refused them)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    blobs, model_dir = models.blobs(), models.model()
    query = "def main():"

    def resident(**xtc) -> str:  # as mlx_lm.chat --seed 3: seeded, then the model loaded
        mx.random.seed(3)
        model, tokenizer = mlx_lm.load(str(model_dir))
        special = tokenizer.encode("\n") + list(tokenizer.eos_token_ids)
        sampler = make_sampler(1.0, 1.0, xtc_special_tokens=special, **xtc)
        return "".join(r.text for r in mlx_lm.stream_generate(
            model, tokenizer, query, max_tokens=MAX_TOKENS, sampler=sampler,
            prompt_cache=make_prompt_cache(model)))

    want = resident(xtc_probability=1.0, xtc_threshold=0.05)
    assert want != resident(xtc_probability=0.0)  # XTC changes what is sampled
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB):
        done = run_chat(blobs, query + "\n", "--temp", "1", "--seed", "3",
                        "--xtc-probability", "1", "--xtc-threshold", "0.05")
    assert done.returncode == 0, done.stderr
    assert done.stdout == want + "\n"


def test_chat_without_a_daemon(models, isolated_env):
    blobs = models.blobs()
    done = run_chat(blobs, "hello\n")
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("expertd chat: error: ")
    assert f"start one with: expertd start --blobs {blobs}" in lines[0]


# ---- Ctrl-C: a reply stops and its turn is dropped; at the prompt, the chat quits ---------------

READ_TIMEOUT = 120.0  # a model load and a reply on a busy machine, far above either
ENDLESS = 100_000  # --max-tokens: the first reply runs until it is interrupted


class ChatProcess:
    """A real ``expertd chat`` child, its stdout and stderr read as raw bytes as they come."""

    def __init__(self, blob_dir, *flags):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "expertd", "chat", "--blobs", str(blob_dir), *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=os.environ, preexec_fn=sigint_as_usual)
        self.out = self.err = b""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ, "out")
        self._sel.register(self.proc.stderr, selectors.EVENT_READ, "err")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def _pump(self, timeout: float) -> None:
        for key, _ in self._sel.select(timeout):
            data = os.read(key.fileobj.fileno(), 65536)
            if not data:
                self._sel.unregister(key.fileobj)
            setattr(self, key.data, getattr(self, key.data) + data)

    def read_until(self, done, what: str) -> None:
        deadline = time.monotonic() + READ_TIMEOUT
        while not done():
            if not self._sel.get_map():
                raise AssertionError(f"chat exited ({self.proc.wait()}) before {what}:\n"
                                     f"{self.err.decode(errors='replace')}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {READ_TIMEOUT:g} s")
            self._pump(max(0.0, deadline - time.monotonic()))

    def drain(self) -> None:
        """Read what the child has written already (it flushes stdout before stderr)."""
        before = None
        while before != (self.out, self.err) and self._sel.get_map():
            before = self.out, self.err
            self._pump(0)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._sel.close()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            pipe.close()


def _stats_lines(chat) -> int:
    """The turns' statistics lines the chat has written whole."""
    return sum(" tok/s · prompt ".encode() in line for line in chat.err.split(b"\n")[:-1])


def test_ctrl_c_stops_a_reply_and_the_next_turn_starts_before_it(models, isolated_env):
    """The interrupted turn is dropped: the next reply is the one a new conversation gets. With
    a rotating KV cache that has wrapped, the conversation starts again, and the chat says so."""
    blobs, model_dir = models.blobs(), models.model()
    long_query, short_query = "def main():", "hello"
    model, tokenizer = mlx_lm.load(str(model_dir))
    cases = [((), {}, 4, "interrupted: the turn is dropped from the conversation"),
             (("--max-kv-size", "16"), dict(max_kv_size=16), 200,
              "interrupted: context cleared (the KV cache could not be trimmed back)")]
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB) as daemon:
        for flags, options, cut_after, note in cases:
            first = "".join(r.text for r in mlx_lm.stream_generate(
                model, tokenizer, long_query, max_tokens=32, **options)).encode()
            # The second turn ends on its own, well before ENDLESS tokens.
            short = list(mlx_lm.stream_generate(model, tokenizer, short_query,
                                                max_tokens=ENDLESS, **options))
            assert short[-1].finish_reason == "stop"
            chat = ChatProcess(blobs, "--max-tokens", str(ENDLESS), *flags)
            try:
                chat.send(long_query)
                # Past the KV cache's 16 tokens in the second case (a token is a few bytes).
                chat.read_until(lambda: len(chat.out) >= cut_after, "first reply")
                chat.proc.send_signal(signal.SIGINT)
                chat.read_until(lambda: chat.err.endswith(note.encode() + b"\n"),
                                f"note {note!r}")
                chat.drain()
                cut = chat.out
                assert cut.endswith(b"\n") and len(cut) > cut_after
                shown = min(len(cut) - 1, len(first))
                assert cut[:shown] == first[:shown]  # it was the real reply
                assert _stats_lines(chat) == 0

                chat.send(short_query)
                chat.read_until(lambda: _stats_lines(chat) == 1, "the second reply's end")
                chat.drain()
                assert chat.out[len(cut):] == "".join(r.text for r in short).encode() + b"\n"
                if not flags:
                    chat.proc.send_signal(signal.SIGINT)  # at the prompt: quit
                else:
                    chat.proc.stdin.close()  # the end of the input quits as before
                chat.read_until(lambda: not chat._sel.get_map(), "the chat's exit")
                assert chat.proc.wait(READ_TIMEOUT) == 0
                assert chat.err.decode().splitlines()[-1] == "bye"
                assert b"Traceback" not in chat.err
            finally:
                chat.close()
            assert daemon.stats()["clients"] == 0, "the chat said goodbye"


# ---- issue 26: on a terminal, nothing is printed over the prompt's rule or glued to a reply --

def in_terminal(argv, keys: bytes, ready: bytes | None = None, timeout: float = 120) -> bytes:
    """What ``argv`` writes to a pseudo-terminal (stdin, stdout and stderr all on it), with
    ``keys`` typed once ``ready`` has been written (at once without it); until it exits."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=os.environ,
                            close_fds=True)
    os.close(slave)
    out, typed = b"", False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not typed and (ready is None or ready in out):
                os.write(master, keys)
                typed = True
            sel = selectors.DefaultSelector()
            sel.register(master, selectors.EVENT_READ)
            ready_now = sel.select(0.2)
            sel.close()
            if ready_now:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the other side closed (the process exited)
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        os.close(master)
    return out


def test_ctrl_d_at_the_prompt_says_bye_below_the_rule(models, isolated_env):
    """mlx-lm's prompt sits between two rules; Ctrl-D there leaves the cursor on the bottom
    rule, and bye must come on the line after it, not over it."""
    blobs = models.blobs()
    with Daemon(blobs, isolated_env, "--cache-gb", SMALL_CACHE_GB):
        out = in_terminal([sys.executable, "-m", "expertd", "chat", "--blobs", str(blobs)],
                          b"\x04", ready=b"\x1b[2A")
    assert b"bye" in out, out[-500:]
    after = out[out.rindex(b"\x1b[2A"):out.rindex(b"bye")]
    # The prompt's own newline reaches the bottom rule; one more steps past it.
    assert after.count(b"\n") >= 2, after


def test_a_daemon_notice_starts_its_own_line_on_a_terminal():
    """A reply streamed to a terminal leaves the cursor mid-line; the session's notice (the
    daemon died, re-attached) begins on the next line, not glued to the reply."""
    code = ("import sys\nsys.stdout.write('half a reply'); sys.stdout.flush()\n"
            "from expertd.client.session import notice\nnotice('expertd: the daemon died')\n")
    out = in_terminal([sys.executable, "-c", code], b"")
    assert b"half a reply\r\nexpertd: the daemon died\r\n" in out, out


def test_chat_over_pipeline_ranks_replies_as_resident_mlx_lm(models, tmp_path, monkeypatch):
    """chat --pipeline under mlx.launch (ring backend, two ranks, each with its own daemon and
    its stage's blob directory): every rank reads its copy of the input, rank 0 alone prints,
    and the replies are resident mlx-lm's, the KV cache kept across turns."""
    import shlex
    from contextlib import ExitStack

    from test_pipeline import CACHE_GB, LAUNCH, free_port_pair, rank_envs, stage_dirs

    model_dir = stage_dirs(models, tmp_path, family="qwen3_moe")
    turns = ["def main():", "return x"]
    expected = resident_replies(model_dir, turns)
    envs = rank_envs(tmp_path)
    command = (f"{shlex.quote(sys.executable)} -m expertd chat --pipeline --blobs "
               f"{tmp_path}/stage$MLX_RANK --max-tokens {MAX_TOKENS}")
    wrapped = (f"XDG_RUNTIME_DIR=$(cat {tmp_path}/rt$MLX_RANK) "
               f"XDG_STATE_HOME={tmp_path}/state$MLX_RANK exec {command}")
    try:
        with ExitStack() as stack:
            for rank, env in enumerate(envs):
                for key, value in env.items():  # where the harness looks for the daemon
                    monkeypatch.setenv(key, value)
                stack.enter_context(Daemon(tmp_path / f"stage{rank}", env, "--cache-gb",
                                           CACHE_GB))
            done = subprocess.run([str(LAUNCH), "-n", "2", "--backend", "ring", "-p",
                                   str(free_port_pair()), "--", "sh", "-c", wrapped],
                                  input="\n".join(turns + ["q"]) + "\n", capture_output=True,
                                  text=True, timeout=240)
    finally:
        for env in envs:
            subprocess.run(["rm", "-rf", env["XDG_RUNTIME_DIR"]])
    assert done.stdout == "".join(reply + "\n" for reply in expected), done.stderr
    err = done.stderr.splitlines()
    assert err.count("bye") == 1 and sum(" tok/s · prompt " in line for line in err) == 2, err
