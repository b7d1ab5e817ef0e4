"""Shared pieces of the benchmarks: cached synthetic models, a real daemon, side-by-side timing."""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "out"

# Expert shapes of Qwen3-30B-A3B (hidden 2048, expert intermediate 768, top-8, 4-bit), fewer
# layers and experts so that it builds in seconds; the per-layer work is the real model's.
QWEN3_30B_LIKE = dict(family="qwen3_moe", layers=12, experts=16, top_k=8, hidden=2048,
                      moe_inter=768, bits=4, mode="affine", seed=1)
MEDIUM = dict(family="qwen3_moe", layers=8, experts=32, top_k=8, hidden=512, moe_inter=384,
              bits=4, mode="affine", seed=3)
SMALL = dict(family="qwen3_moe", layers=8, experts=32, top_k=4, hidden=256, moe_inter=256,
             bits=4, mode="affine", seed=2)


def build_seconds(make, calls: int, evaluate_every: int = 1) -> float:
    """Median host seconds to build what ``make()`` returns (the Python and MLX's bindings,
    no evaluation), over ``calls`` calls; every ``evaluate_every``-th result is evaluated, so
    the graphs do not grow."""
    import statistics

    import mlx.core as mx

    mx.eval(make())  # compiled, warm
    times = []
    for i in range(calls):
        t = time.perf_counter()
        out = make()
        times.append(time.perf_counter() - t)
        if i % evaluate_every == 0:
            mx.eval(out)
    return statistics.median(times)


def write_section(results_md: Path, header: str, text: str) -> None:
    """Put ``text`` (a section starting with ``header``) into ``results_md`` in place of an
    older section with the same header, every other section kept."""
    current = results_md.read_text() if results_md.exists() else ""
    start = current.find(header)
    if start < 0:
        current = current.rstrip("\n") + "\n\n" + text
    else:
        end = current.find("\n## ", start + len(header))
        current = current[:start] + text + ("" if end < 0 else current[end + 1:])
    results_md.write_text(current)


def report(args, r: dict, text: str, header: str) -> None:
    """A benchmark's last words: its results ``r`` as JSON to ``args.out`` (if given), its
    section ``text`` printed, and written into RESULTS.md under ``header`` with
    ``args.results``."""
    import json

    if args.out:
        args.out.write_text(json.dumps(r, indent=1))
    print(text)
    if args.results:
        write_section(ROOT / "RESULTS.md", header, text)


def run_and_report(parser, run, table, section) -> None:
    """A benchmark's main: ``parser`` gets --out and --results, ``run(args)`` measures, and
    :func:`report` writes ``table(r)`` under ``section(r)``."""
    from pathlib import Path

    parser.add_argument("--out", type=Path, help="the results as JSON")
    parser.add_argument("--results", action="store_true", help="write bench/RESULTS.md's section")
    args = parser.parse_args()
    r = run(args)
    report(args, r, table(r), section(r))


def ensure_model(name: str, spec: dict) -> tuple:
    """(model_dir, blob_dir) of a synthetic model, built and converted once."""
    from expertd.tools.convert import convert
    from expertd.tools.synth import SynthConfig, synthesize

    model_dir, blob_dir = OUT / "models" / name, OUT / "blobs" / name
    if not (model_dir / "config.json").exists():
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        synthesize(SynthConfig(**spec), model_dir)
    if blob_dir.exists():
        from expertd.errors import BlobStoreError
        from expertd.manifest import Manifest

        try:
            Manifest.load(blob_dir)
        except BlobStoreError:  # an older format (or a broken run): convert again
            shutil.rmtree(blob_dir)
    if not blob_dir.exists():
        blob_dir.parent.mkdir(parents=True, exist_ok=True)
        convert(model_dir, blob_dir, progress=False)
    return model_dir, blob_dir


def bench_env() -> dict:
    run = Path("/tmp") / f"xdbench{os.getpid()}"
    env = dict(os.environ, XDG_RUNTIME_DIR=str(run), XDG_STATE_HOME=str(OUT / "state"))
    os.environ.update(XDG_RUNTIME_DIR=env["XDG_RUNTIME_DIR"], XDG_STATE_HOME=env["XDG_STATE_HOME"])
    return env


@contextmanager
def daemon(blob_dir: Path, cache_gb: float, *flags: str):
    """A real expertd on ``blob_dir`` with a fresh (cold) state; yields its pid."""
    from expertd.connection import Connection
    from expertd.errors import DaemonError
    from expertd.protocol import Op

    env = bench_env()
    state = OUT / "state" / f"bench-{os.getpid()}.json"
    state.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "expertd", "start", "--blobs", str(blob_dir),
                             "--foreground", "--cache-gb", f"{cache_gb:.6f}", "--state-file",
                             str(state), *flags], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            with Connection(blob_dir) as conn:
                conn.request(Op.STATS, timeout=1.0)
            break
        except DaemonError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark daemon did not start") from None
            time.sleep(0.05)
    try:
        yield proc.pid
    finally:
        stop_daemon(proc)
        state.unlink(missing_ok=True)


def stop_daemon(proc: subprocess.Popen) -> None:
    """SIGTERM a foreground daemon; SIGKILL it if it has not exited within 15 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stats(blob_dir: Path) -> dict:
    from expertd.connection import Connection
    from expertd.protocol import Op

    with Connection(blob_dir) as conn:
        return conn.request(Op.STATS)


def rss_breakdown(pid: int) -> dict:
    """Anonymous, file and shared-memory resident bytes of a process (Linux)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def no_arguments(doc: str) -> None:
    """A bench script that takes no arguments: ``--help`` prints its docstring and exits,
    and anything else is refused in one line (it never starts a long run by mistake)."""
    argparse.ArgumentParser(description=doc,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
