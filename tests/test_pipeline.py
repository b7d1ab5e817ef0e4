"""Pipeline stages over mx.distributed: two ranks under `mlx.launch --backend ring`, each with its
own daemon, runtime directory and blob directory of its layer range, as on two hosts.

Run as a script (``python test_pipeline.py worker ...``), this file is the rank's process.
"""

import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from client_helpers import require_repeatable
from harness import Daemon, RawClient
from test_client_parity import resident_model

from expertd.errors import BlobStoreError, DaemonError
from expertd.manifest import Manifest

PROMPT = "Once upon a time"
TOKENS = 6
LAYERS = 4
# mlx-lm's split of 4 layers over 2 ranks: rank 0 runs the last layers, rank 1 the first.
RANGES = {0: "2:4", 1: "0:2"}
CACHE_GB = "0.0003"  # 10 rows of 16 KiB: fewer than the 16 or 32 experts of a stage
LAUNCH = Path(sys.executable).with_name("mlx.launch")


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the ring backend listens on one per rank)."""
    for _ in range(50):
        port = random.randrange(20000, 60000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise AssertionError("no two free consecutive ports")


def launch(tmp_path: Path, command: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``command`` on two ranks with mlx.launch (ring backend). ``$MLX_RANK`` picks each rank's
    runtime directory (``tmp_path/rt{rank}`` file) and blob directory, as two hosts would."""
    wrapped = (f'XDG_RUNTIME_DIR=$(cat {tmp_path}/rt$MLX_RANK) '
               f'XDG_STATE_HOME={tmp_path}/state$MLX_RANK exec {command}')
    return subprocess.run([str(LAUNCH), "-n", "2", "--backend", "ring", "-p",
                           str(free_port_pair()), "--", "sh", "-c", wrapped],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def resident(model_dir: Path):
    """Tokens and logits of resident mlx-lm, one process (the reference)."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))
    tokens = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    ids = tokenizer.encode(PROMPT) + tokens
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return tokens, np.array(logits)


def worker(blobs_prefix: str, out: str) -> None:
    """One rank: load its stage through its own daemon, generate, and record what it computed."""
    import mlx.core as mx
    from mlx_lm import stream_generate

    from expertd.client import load
    from expertd.client.switch import StreamedSwitch

    rank = int(os.environ["MLX_RANK"])
    group = mx.distributed.init()
    model, tokenizer = load(f"{blobs_prefix}{rank}", pipeline_group=group, prefetch="on")
    tokens = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS)]
    ids = tokenizer.encode(PROMPT) + tokens
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    session = model.expertd_session
    streamed = sorted(path for path, m in model.named_modules() if isinstance(m, StreamedSwitch))
    np.save(f"{out}{rank}.npy", np.array(logits))
    Path(f"{out}{rank}.json").write_text(json.dumps(dict(
        tokens=tokens, usage=session.usage(), streamed=streamed,
        layers=[model.model.start_idx, model.model.end_idx])))
    session.close()


def _launcher_ignores_sigint() -> None:
    """``preexec_fn`` of mlx.launch in the Ctrl-C test. mlx.launch does not handle SIGINT: the
    KeyboardInterrupt lands in its main thread wherever it is, and once it came inside a
    Queue.put, leaving the queue's lock held, so its rank threads hung on it with both ranks
    gone (a clean-clone run, 2026-12-02). What is tested is that the ranks stop; each serve
    rank takes SIGINT at its default action itself, ignored or not before."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def serve_pipeline(tmp_path: Path) -> str:
    """``expertd serve --pipeline`` on two ranks: one greedy completion through rank 0's HTTP
    server, then Ctrl-C (SIGINT to the launch's process group) stops every rank."""
    import signal
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        http_port = probe.getsockname()[1]
    command = (f"{shlex.quote(sys.executable)} -m expertd serve --pipeline --blobs "
               f"{tmp_path}/stage$MLX_RANK --port {http_port}")
    wrapped = (f'XDG_RUNTIME_DIR=$(cat {tmp_path}/rt$MLX_RANK) '
               f'XDG_STATE_HOME={tmp_path}/state$MLX_RANK exec {command}')
    proc = subprocess.Popen([str(LAUNCH), "-n", "2", "--backend", "ring", "-p",
                             str(free_port_pair()), "--", "sh", "-c", wrapped],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_launcher_ignores_sigint)
    try:
        line = proc.stdout.readline()  # rank 0's "expertd serve (loading ...)" line, then
        if line.startswith("expertd serve (loading"):
            line = proc.stdout.readline()  # its "expertd serve: ... on http://..." line
        assert f":{http_port}/v1" in line, (line, proc.stderr.read() if proc.poll() else "")
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/completions", method="POST",
            data=json.dumps({"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            text = json.loads(reply.read())["choices"][0]["text"]
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            left = subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:24,args", "-g",
                                   str(proc.pid)], capture_output=True, text=True).stdout
            os.killpg(proc.pid, signal.SIGKILL)
            err = proc.communicate()[1]
            raise AssertionError(f"the ranks did not stop on Ctrl-C; still running:\n{left}\n"
                                 f"they wrote:\n{err[-4000:]}") from None
        return text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def stage_dirs(models, tmp_path: Path, **kwargs) -> tuple:
    """The model, and one blob directory per rank holding only that rank's layers."""
    from expertd.tools.convert import convert

    model = models.model(layers=LAYERS, **kwargs)
    for rank, spec in RANGES.items():
        convert(model, tmp_path / f"stage{rank}", progress=False, layers=spec)
    return model


def rank_envs(tmp_path: Path) -> list:
    """One short runtime directory per rank (unix socket paths are limited), named in a file
    the launched shell reads."""
    envs = []
    for rank in RANGES:
        runtime = tempfile.mkdtemp(prefix="xdp", dir="/tmp")
        (tmp_path / f"rt{rank}").write_text(runtime)
        envs.append({"XDG_RUNTIME_DIR": runtime, "XDG_STATE_HOME": str(tmp_path / f"state{rank}")})
    return envs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,mode,bits", [("qwen3_moe", "affine", 4),
                                              ("deepseek_v3", "affine", 4)])
def test_two_ranks_equal_resident_mlx_lm(models, tmp_path, monkeypatch, family, mode, bits):
    model = stage_dirs(models, tmp_path, family=family, mode=mode, bits=bits)
    require_repeatable(resident_model(model), 64)
    tokens, logits = resident(model)
    envs = rank_envs(tmp_path)
    try:
        with ExitStack() as stack:
            daemons = []
            for rank, env in enumerate(envs):
                for key, value in env.items():  # where the harness looks for the daemon
                    monkeypatch.setenv(key, value)
                daemons.append(stack.enter_context(
                    Daemon(tmp_path / f"stage{rank}", env, "--cache-gb", CACHE_GB)))
            for rank, daemon in enumerate(daemons):
                experts = sum(layer.num_experts
                              for layer in Manifest.load(tmp_path / f"stage{rank}").layers)
                assert daemon.ready["arena_rows"] < experts  # the cache cannot hold the stage
            run = launch(tmp_path, f"{shlex.quote(sys.executable)} {shlex.quote(__file__)} "
                         f"worker {tmp_path}/stage {tmp_path}/out")
            # mlx.launch exits 0 even when a rank fails: each rank's output is the verdict.
            assert all((tmp_path / f"out{r}.json").exists() for r in RANGES), run.stderr
            cli = launch(tmp_path, f"{shlex.quote(sys.executable)} -m expertd generate "
                         f"--pipeline --blobs {tmp_path}/stage$MLX_RANK --prompt "
                         f"{shlex.quote(PROMPT)} --ignore-chat-template "
                         f"--max-tokens {TOKENS} --json-summary {tmp_path}/cli.json")
            assert (tmp_path / "cli.json").exists(), cli.stderr
            if family == "qwen3_moe":
                served = serve_pipeline(tmp_path)
    finally:
        for env in envs:
            subprocess.run(["rm", "-rf", env["XDG_RUNTIME_DIR"]])
    for rank, spec in RANGES.items():
        got = json.loads((tmp_path / f"out{rank}.json").read_text())
        assert got["tokens"] == tokens
        assert np.array_equal(np.load(tmp_path / f"out{rank}.npy"), logits)  # bit for bit
        start, stop = map(int, spec.split(":"))
        assert got["layers"] == [start, stop]
        # Only this rank's layers are streamed, each from its own daemon, with misses (the
        # cache is smaller than the stage).
        assert got["streamed"] == [layer.module for layer in
                                   Manifest.load(tmp_path / f"stage{rank}").layers]
        assert got["usage"]["misses"] > 0
    if family == "qwen3_moe":
        from mlx_lm import load as mlx_load

        _, tokenizer = mlx_load(str(model))
        assert served == tokenizer.decode(tokens)  # greedy, through rank 0's HTTP server
    summary = json.loads((tmp_path / "cli.json").read_text())
    assert summary["tokens"] == tokens
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    # Each rank used its own daemon (whose cache the worker run above may have warmed).
    assert all(r["hits"] + r["misses"] > 0 for r in summary["ranks"]), (summary, cli.stderr)
    assert "rank 1:" in cli.stderr and "rank 0:" in cli.stderr  # the summary: stderr


def test_a_stage_directory_refuses_what_it_cannot_serve(models, isolated_env, tmp_path):
    """Out-of-range layers at the daemon; no pipeline group, or a rank whose layers the directory
    lacks, at the client: each one clear line naming the directory and its range."""
    import mlx.core as mx

    from expertd.client import load
    from expertd.client.pipeline import PipelineError

    stage_dirs(models, tmp_path, family="qwen3_moe")
    blobs = tmp_path / "stage0"
    with Daemon(blobs, isolated_env, "--cache-gb", CACHE_GB):
        with RawClient(blobs) as client:
            with pytest.raises(DaemonError, match=rf"layer 2 out of range \(0..1\) of "
                               rf"{blobs} \(transformer layers 2:4 of 4 only\)"):
                client.demand(2, [0])
            assert len(client.fetch(1, [0, 1])) == 2  # its own layers are served
        with pytest.raises(BlobStoreError, match="is one pipeline stage of a model: run it "
                           "under mlx.launch"):
            load(blobs)
        # A group of one runs all 4 layers: this directory lacks 0:2.
        with pytest.raises(PipelineError, match=rf"rank 0 of 1 runs transformer layers 0:4, "
                           rf"but {blobs} \(transformer layers 2:4 of 4 only\) does not hold "
                           rf"them; convert this host's stage with: expertd convert MODEL "
                           rf"{blobs} --layers 0:4"):
            load(blobs, pipeline_group=mx.distributed.init())


def test_generate_pipeline_outside_mlx_launch_is_one_line(models, isolated_env, tmp_path):
    stage_dirs(models, tmp_path, family="qwen3_moe")
    proc = subprocess.run([sys.executable, "-m", "expertd", "generate", "--pipeline", "--blobs",
                           str(tmp_path / "stage0"), "--prompt", PROMPT],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "expertd generate: error: --pipeline runs one pipeline stage per process: start one "
        "process per stage with mlx.launch (README: Several machines)"]


def test_a_family_without_pipeline_support_names_those_with_it(models, tmp_path):
    from expertd.client.pipeline import pipeline_families

    model = models.model(family="mixtral", layers=LAYERS, bits=8)
    proc = subprocess.run([sys.executable, "-m", "expertd", "convert", str(model),
                           str(tmp_path / "out"), "--layers", "0:2", "-q"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    families = pipeline_families()
    assert {"qwen3_moe", "deepseek_v3", "glm4_moe"} <= set(families)
    assert proc.stderr.strip().splitlines() == [
        "expertd convert: error: mlx-lm cannot split a mixtral model into pipeline stages; the "
        f"families it can split are: {', '.join(families)}"]
    assert not (tmp_path / "out").exists()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3])
