"""Helpers for the client tests: a real daemon process, and a script run by client processes.

Imported by the tests (``Daemon``, ``spawn_client``, ``run_together``, ...) and run as a script by client
subprocesses (``python tests/client_helpers.py parity|generate ...``), so that each client is
its own process and ``EXPERTD_PURE_PYTHON`` is set before ``expertd.native`` is imported.
"""

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
PYTHON = sys.executable
PROMPT_LENGTHS = (1, 17, 300)
DECODE_STEPS = 20
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
# Cache sizes in rows: fewer than one layer's 16 experts (layers run in groups), fewer than the
# 3 x 16 experts of TINY (evictions within a run), and all of them.
ROWS_TINY = 8
ROWS_MEDIUM = 24
ROWS_ALL = 64


def cache_gb(blob_dir, rows: int) -> str:
    """The ``--cache-gb`` whose arena holds ``rows`` cache rows (capped at every expert)."""
    from expertd.manifest import Manifest
    from expertd.shm.layout import SLOT_DTYPE, Geometry

    m = Manifest.load(blob_dir)
    probe = Geometry(len(m.layers), m.max_experts, 1, m.top_k, m.stride)
    # The fixed part as Geometry.for_budget counts it, plus half a row against rounding.
    fixed = probe.rows_offset + m.stride * 2 * m.top_k + SLOT_DTYPE.itemsize * 64
    budget = fixed + rows * (m.stride + SLOT_DTYPE.itemsize) + m.stride // 2
    return repr(budget / 2**30)


def routed_model(models, family: str, mode: str, bits: int) -> tuple:
    """``(model_dir, blob_dir)`` of the conftest model of one family and quantization."""
    return (models.model(family=family, mode=mode, bits=bits),
            models.blobs(family=family, mode=mode, bits=bits))


def greedy_tokens(model, prompt: list, n: int) -> list:
    """``n`` tokens of mlx-lm's own decoding loop, greedy, without stopping at end-of-text."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def prompt_ids(length: int, vocab: int, seed: int = 0) -> list:
    """A deterministic prompt of ``length`` token ids, spread over the vocabulary."""
    return [(seed * 7919 + 37 * i + 11) % (vocab - 16) + 8 for i in range(length)]


# ---- the daemon ----------------------------------------------------------------------------


class Daemon:
    """An ``expertd start --foreground`` process on ``blob_dir``, ready when constructed.

    Raises:
        RuntimeError: if it exits or does not answer ``stats`` within ``START_TIMEOUT``.
    """

    def __init__(self, blob_dir: Path, env: dict, state_file: Path, rows: int,
                 workers: int = 2, client_timeout: float = 3.0, heartbeat: float = 0.5):
        self.blob_dir = Path(blob_dir)
        self.env = {**os.environ, **env}
        self.log_path = Path(state_file).with_suffix(f".{time.monotonic_ns()}.log")
        cmd = [PYTHON, "-m", "expertd", "start", "--blobs", str(blob_dir), "--foreground",
               "--cache-gb", cache_gb(blob_dir, rows), "--workers", str(workers),
               "--client-timeout", str(client_timeout), "--heartbeat", str(heartbeat),
               "--state-file", str(state_file)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        try:
            self.ready = self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self) -> dict:
        from expertd.errors import DaemonError

        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"expertd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                stats = self.stats(timeout=1.0)
                if stats["pid"] == self.pid:
                    return stats
            except DaemonError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"expertd did not answer within {START_TIMEOUT} s:\n"
                                   f"{self.log()}")
            time.sleep(0.05)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stats(self, timeout: float = 5.0) -> dict:
        from expertd.connection import Connection
        from expertd.protocol import Op

        with _env(self.env):
            with Connection(self.blob_dir) as conn:
                return conn.request(Op.STATS, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=STOP_TIMEOUT)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL past ``STOP_TIMEOUT``; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT)
        return self.proc.returncode


class _env:
    """Temporarily apply the daemon's XDG variables, so paths resolve to its runtime dir."""

    KEYS = ("XDG_RUNTIME_DIR", "XDG_STATE_HOME")

    def __init__(self, env: dict):
        self.env = env

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.KEYS}
        for k in self.KEYS:
            if k in self.env:
                os.environ[k] = self.env[k]

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- client processes ----------------------------------------------------------------------


def client_cmd(command: str, *args) -> list:
    return [PYTHON, str(HERE), command, *map(str, args)]


def spawn_client(command: str, args: list, env: dict,
                 pure: bool | None = None) -> subprocess.Popen:
    """Start a client process running this script's ``command``.

    ``pure``: True forces the pure-Python twins, False the Cython extension, None inherits
    this process's choice (``EXPERTD_PURE_PYTHON``).
    """
    full = {**os.environ, **env}
    if pure is not None:
        full["EXPERTD_PURE_PYTHON"] = "1" if pure else "0"
    return subprocess.Popen(client_cmd(command, *args), env=full, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def reap(proc: subprocess.Popen | None) -> None:
    """Kill a client process that is still running (stopped ones too)."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.communicate()


def finish_client(proc: subprocess.Popen, out: Path, timeout: float) -> dict:
    """Wait for a client started by :func:`spawn_client`; its JSON result.

    Raises:
        AssertionError: if it fails or does not finish in time.
    """
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"client did not finish within {timeout} s:\n{_text(stderr)}")
    assert proc.returncode == 0, f"client exited with {proc.returncode}:\n{_text(stderr)}"
    result = json.loads(Path(out).read_text())
    result["stderr"] = _text(stderr)
    return result


def run_together(blob_dir, env: dict, workdir: Path, prompts: list, max_tokens: int,
                 timeout: float = 120.0) -> list:
    """Run one ``generate`` client process per ``(prompt_len, seed)`` of ``prompts``, all
    released at once when every one has loaded (a file barrier); their results, in order."""
    barrier = Path(workdir) / "barrier"
    barrier.mkdir(parents=True)
    procs = []
    try:
        for i, (length, seed) in enumerate(prompts):
            out = Path(workdir) / f"client{i}.json"
            args = ["--blobs", blob_dir, "--prompt-len", length, "--seed", seed, "--max-tokens",
                    max_tokens, "--barrier", barrier, "--out", out]
            procs.append((spawn_client("generate", args, env), out))

        def all_ready():
            for proc, _ in procs:
                if proc.poll() is not None:
                    raise AssertionError(f"a client exited before the barrier:\n"
                                         f"{_text(proc.communicate()[1])}")
            return len(list(barrier.glob("ready-*"))) == len(procs)

        wait_for(all_ready, timeout, "every client to load")
        (barrier / "go").touch()
        deadline = time.monotonic() + timeout
        return [finish_client(proc, out, max(1.0, deadline - time.monotonic()))
                for proc, out in procs]
    finally:
        for proc, _ in procs:
            reap(proc)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else str(data or "")


def wait_for(condition, timeout: float, what: str, interval: float = 0.02):
    """Poll ``condition()`` until it returns something true; that value.

    Raises:
        AssertionError: naming ``what`` when ``timeout`` passes first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def read_tokens(path: Path) -> list:
    """The tokens a ``generate`` client has written so far (one per line, complete lines)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [int(t) for t in text.split("\n")[:-1]]


# ---- what client processes run -------------------------------------------------------------


def logits_digest(logits) -> str:
    import mlx.core as mx
    import numpy as np

    # float32 holds every bfloat16 / float16 value exactly.
    return hashlib.sha256(np.array(logits.astype(mx.float32)).tobytes()).hexdigest()[:16]


def compare_runs(resident, streamed, vocab: int, lengths=PROMPT_LENGTHS,
                 steps: int = DECODE_STEPS) -> list:
    """Prompt then ``steps`` greedy decode steps on both models, comparing logits each step.

    Returns:
        one dict per prompt length: ``steps`` compared, ``mismatch`` (first unequal step or
        None), the greedy tokens and a digest of the last logits of each model.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    results = []
    for length in lengths:
        ids = mx.array([prompt_ids(length, vocab)])
        caches = make_prompt_cache(resident), make_prompt_cache(streamed)
        x_ref = x_str = ids
        tokens, mismatch = [], None
        for step in range(steps + 1):
            ref = resident(x_ref, cache=caches[0])[:, -1, :]
            got = streamed(x_str, cache=caches[1])[:, -1, :]
            mx.eval(ref, got)
            if mismatch is None and not (ref.dtype == got.dtype and ref.shape == got.shape
                                         and mx.array_equal(ref, got).item()):
                mismatch = step
            tok_ref = mx.argmax(ref, axis=-1)
            tokens.append(int(tok_ref.item()))
            # Each model continues from its own choice, so a divergence cannot hide.
            x_ref, x_str = tok_ref[:, None], mx.argmax(got, axis=-1)[:, None]
        results.append(dict(length=length, steps=steps + 1, mismatch=mismatch, tokens=tokens,
                            ref_digest=logits_digest(ref), got_digest=logits_digest(got)))
    return results


def _cmd_parity(args) -> dict:
    import mlx_lm

    from expertd import native
    from expertd.client import load

    resident, _ = mlx_lm.load(args.model)
    streamed, tokenizer = load(args.blobs)
    runs = compare_runs(resident, streamed, tokenizer.vocab_size)
    session = streamed.expertd_session
    result = dict(implementation=native.IMPLEMENTATION, runs=runs,
                  counters=dict(session.counters), max_group=session.max_group)
    session.close()
    return result


def _cmd_generate(args) -> dict:
    """Greedy decoding of a fixed prompt, one token per line appended to ``--tokens-file``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from expertd import native
    from expertd.client import load

    model, tokenizer = load(args.blobs, reconnect_timeout=args.reconnect_timeout)
    session = model.expertd_session
    prompt = prompt_ids(args.prompt_len, tokenizer.vocab_size, args.seed)
    if args.barrier:
        # Tell the test we are loaded, then wait for everyone to be: no sleep, a file.
        barrier = Path(args.barrier)
        (barrier / f"ready-{os.getpid()}").touch()
        deadline = time.monotonic() + 120
        while not (barrier / "go").exists():
            if time.monotonic() > deadline:
                raise SystemExit("the test never said go")
            time.sleep(0.005)
    tokens = []
    out = open(args.tokens_file, "w") if args.tokens_file else None
    error = None
    try:
        # mlx-lm's own decoding loop, without the stop at end-of-sequence: a fixed length.
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=args.max_tokens):
            tokens.append(int(token))
            if out:
                out.write(f"{int(token)}\n")
                out.flush()
    except Exception as exc:  # reported to the test, which decides
        error = dict(type=type(exc).__name__, message=str(exc))
    finally:
        if out:
            out.close()
    result = dict(tokens=tokens, implementation=native.IMPLEMENTATION, error=error,
                  counters=dict(session.counters))
    if error is None:
        session.close()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("parity", help="compare streamed and resident logits")
    p.add_argument("--blobs", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_parity)
    p = sub.add_parser("generate", help="greedy generation, tokens written as they come")
    p.add_argument("--blobs", required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--tokens-file")
    p.add_argument("--barrier")
    p.add_argument("--reconnect-timeout", type=float, default=60.0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_generate)
    args = parser.parse_args(argv)
    result = args.func(args)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
