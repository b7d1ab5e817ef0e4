"""Two pipeline ranks (mlx.launch, one expertd each) vs one process, same model and the same
total cache: decode tok/s and the bytes each daemon read from the SSD.

    python bench/pipeline.py [--rounds 2] [--tokens 48] [--arena 0.5]
    python bench/pipeline.py --model qwen3-30b [--layers 24] [--backend nccl]   # on GPUs

``--model qwen3-30b`` takes Qwen3-30B-A3B's expert shapes (128 experts, top-8, hidden 2048).
``--backend ring`` runs both ranks over loopback (on one GPU, both share it); ``nccl`` gives each
rank its own GPU, as mlx.launch does. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0).

Each rank has its own runtime directory and a blob directory of its layer range only (``expertd
convert --layers``), as two hosts would; the one process has the whole model's directory and
the whole cache. Every run starts from cold daemons. Prints a Markdown table (RESULTS.md).
"""

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MEDIUM, OUT, QWEN3_30B_LIKE, ensure_model, stop_daemon

PY = sys.executable
# mlx.launch: the script beside this interpreter, or its module where MLX was installed without
# scripts (the GPU machine's --target install).
LAUNCH = ([str(Path(PY).with_name("mlx.launch"))] if Path(PY).with_name("mlx.launch").exists()
          else [PY, "-c", "import sys; from mlx._distributed_utils.launch import main; "
                "sys.exit(main())"])
MODELS = {"medium": MEDIUM, "qwen3-30b": dict(QWEN3_30B_LIKE, experts=128)}
os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by the daemons, mlx.launch and the ranks
PROMPT = "Once upon a time"


def start_daemon(blob_dir: Path, cache_gb: float, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([PY, "-m", "expertd", "start", "--blobs", str(blob_dir),
                             "--foreground", "--cache-gb", f"{cache_gb:.6f}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while subprocess.run([PY, "-m", "expertd", "status", "--blobs", str(blob_dir), "--json"],
                         env=env, capture_output=True).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"expertd did not start for {blob_dir}: "
                               f"{proc.stderr.read() if proc.poll() is not None else ''}")
        time.sleep(0.1)
    return proc


def generate_flags(tokens: int, summary: Path) -> str:
    return (f"--prompt {shlex.quote(PROMPT)} --ignore-chat-template --max-tokens {tokens} "
            f"--json-summary {summary}")


def one_process(blob_dir: Path, cache_gb: float, tokens: int, work: Path) -> dict:
    env = dict(os.environ, XDG_RUNTIME_DIR=tempfile.mkdtemp(prefix="xdb", dir="/tmp"))
    daemon = start_daemon(blob_dir, cache_gb, env)
    try:
        out = work / "one.json"
        subprocess.run(f"{shlex.quote(PY)} -m expertd generate --blobs {blob_dir} "
                       f"{generate_flags(tokens, out)}", shell=True, env=env, check=True,
                       capture_output=True)
        return json.loads(out.read_text())
    finally:
        stop_daemon(daemon)
        shutil.rmtree(env["XDG_RUNTIME_DIR"], ignore_errors=True)


def two_ranks(stages: list, cache_gb: float, tokens: int, work: Path, port: int,
              backend: str) -> dict:
    runtimes = [tempfile.mkdtemp(prefix="xdb", dir="/tmp") for _ in stages]
    daemons = [start_daemon(stage, cache_gb / 2, dict(os.environ, XDG_RUNTIME_DIR=runtime))
               for stage, runtime in zip(stages, runtimes)]
    try:
        out = work / "two.json"
        out.unlink(missing_ok=True)
        prefix = str(stages[0])[:-1]  # stage0, stage1: the rank picks its own
        command = (f"exec {shlex.quote(PY)} -m expertd generate --pipeline --blobs "
                   f"{prefix}$MLX_RANK {generate_flags(tokens, out)}")
        # Each rank its own runtime directory, so the two daemons are as apart as on two hosts.
        script = work / "rank.sh"
        script.write_text("".join(f'[ "$MLX_RANK" = {r} ] && export XDG_RUNTIME_DIR={rt}\n'
                                  for r, rt in enumerate(runtimes)) + command + "\n")
        run = subprocess.run([*LAUNCH, "-n", "2", "--backend", backend, "-p", str(port), "--",
                              "sh", str(script)], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True)
        if not out.exists():
            raise RuntimeError(f"the two ranks failed:\n{run.stderr}")
        return json.loads(out.read_text())
    finally:
        for daemon in daemons:
            stop_daemon(daemon)
        for runtime in runtimes:
            shutil.rmtree(runtime, ignore_errors=True)


def stage_dirs(name: str, model_dir: Path, ranges: list) -> list:
    from expertd.tools.convert import convert

    stages = []
    for rank, spec in enumerate(ranges):
        out = OUT / "blobs" / f"{name}-stage{rank}"
        if out.exists():
            shutil.rmtree(out)
        convert(model_dir, out, progress=False, layers=spec)
        stages.append(out)
    return stages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    # Half of it per rank must still hold 2 x top-8 rows beside the prefetch rows.
    parser.add_argument("--arena", type=float, default=0.5,
                        help="total cache as a fraction of the model's experts")
    parser.add_argument("--port", type=int, default=38411)
    parser.add_argument("--model", choices=sorted(MODELS), default="medium")
    parser.add_argument("--layers", type=int, help="transformer layers (default: the model's)")
    parser.add_argument("--backend", choices=("ring", "nccl"), default="ring")
    args = parser.parse_args()

    from expertd.manifest import Manifest

    spec = dict(MODELS[args.model])
    spec["layers"] = args.layers or spec["layers"]
    name = args.model if args.layers is None else f"{args.model}-{spec['layers']}"
    model_dir, blob_dir = ensure_model(name, spec)
    layers = spec["layers"]
    # mlx-lm's split over 2 ranks: rank 0 runs the last half, rank 1 the first.
    ranges = [f"{layers // 2}:{layers}", f"0:{layers // 2}"]
    stages = stage_dirs(name, model_dir, ranges)
    manifest = Manifest.load(blob_dir)
    cache_gb = args.arena * manifest.total_expert_bytes / 2**30
    work = Path(tempfile.mkdtemp(prefix="xdpipe"))
    one, two = [], []
    for _ in range(args.rounds):  # alternating, so drift on a shared machine hits both
        one.append(one_process(blob_dir, cache_gb, args.tokens, work))
        two.append(two_ranks(stages, cache_gb, args.tokens, work, args.port, args.backend))
    shutil.rmtree(work, ignore_errors=True)
    same = all(t["tokens"] == one[0]["tokens"] for t in one + two)
    tps1 = statistics.median(r["generation_tps"] for r in one)
    tps2 = statistics.median(r["generation_tps"] for r in two)
    mib = 2**20
    bytes1 = statistics.median(r["bytes_read"] for r in one) / mib
    per_rank = [statistics.median(r["ranks"][k]["bytes_read"] for r in two) / mib
                for k in range(2)]
    stage_mib = [Manifest.load(s).total_expert_bytes / mib for s in stages]
    import mlx.core as mx

    print(f"| {args.model} qwen3_moe ({layers} layers x {spec['experts']} experts, top-"
          f"{spec['top_k']}) on {mx.default_device()}, {args.backend}, cache {args.arena:.0%} of "
          f"the experts in all, {args.tokens} "
          f"tokens, median of {args.rounds} | one process: {tps1:.2f} tok/s, "
          f"{bytes1:.1f} MiB read | two ranks: {tps2:.2f} tok/s ({tps2 / tps1:.2f}x), read "
          f"{per_rank[0]:.1f} MiB (rank 0, layers {ranges[0]}, of {stage_mib[0]:.0f} MiB) + "
          f"{per_rank[1]:.1f} MiB (rank 1, layers {ranges[1]}, of {stage_mib[1]:.0f} MiB) | "
          f"tokens equal: {same} | a row, no bar |")
    print(f"per round tok/s: one {[round(r['generation_tps'], 2) for r in one]}, "
          f"two {[round(r['generation_tps'], 2) for r in two]}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
