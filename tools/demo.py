"""``expertd demo``: the whole job on a synthetic model, with numbers a newcomer can read."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from .synth import SynthConfig

DEMO_MODEL = SynthConfig(family="qwen3_moe", layers=8, experts=32, top_k=4, hidden=256,
                         moe_inter=256, bits=4, mode="affine", vocab=512, seed=7)
PROMPT = "Once upon a time there was a small model that ran on a laptop"
MAX_TOKENS = 48
CACHE_FRACTION = 0.35


def _say(step: str, text: str) -> None:
    print(f"\n[{step}] {text}", flush=True)


def default_workdir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "expertd" / "demo"


def run_demo(workdir: Path | None = None, rebuild: bool = False) -> int:
    from expertd.cli.lifecycle import serving_pid, start_detached, stop
    from expertd.errors import BlobStoreError
    from expertd.manifest import Manifest
    from expertd.paths import daemon_paths

    from .convert import convert
    from .synth import synthesize

    workdir = Path(workdir or default_workdir()).expanduser().absolute()  # the daemon runs from /
    model_dir, blob_dir, state = workdir / "model", workdir / "blobs", workdir / "state.json"
    if rebuild:
        shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)

    if (model_dir / "config.json").exists():
        _say("1/5", f"synthetic {DEMO_MODEL.family} model: cached in {model_dir}")
    else:
        _say("1/5", f"building a synthetic {DEMO_MODEL.family} model (random weights, "
             f"{DEMO_MODEL.layers} layers x {DEMO_MODEL.experts} experts, top-{DEMO_MODEL.top_k})")
        synthesize(DEMO_MODEL, model_dir)
    if blob_dir.exists():
        try:
            Manifest.load(blob_dir)
        except BlobStoreError:  # converted by an older expertd, or a broken directory
            shutil.rmtree(blob_dir)
    if (blob_dir / "manifest.json").exists():
        _say("2/5", f"blobs: cached in {blob_dir}")
    else:
        _say("2/5", f"converting it into expert blobs + trunk: {blob_dir}")
        convert(model_dir, blob_dir)
    manifest = Manifest.load(blob_dir)
    expert_bytes = manifest.total_expert_bytes
    cache_gb = expert_bytes * CACHE_FRACTION / 2**30

    if serving_pid(daemon_paths(blob_dir)) is not None:
        stop(blob_dir)

    def cold_start():
        state.unlink(missing_ok=True)
        return start_detached(blob_dir, ["start", "--blobs", str(blob_dir), "--cache-gb",
                                         f"{cache_gb:.6f}", "--workers", "4",
                                         "--state-file", str(state)])

    stats = cold_start()
    _say("3/5", f"expertd started (pid {stats['pid']}): a {stats['arena_bytes'] / 2**20:.1f} MiB "
         f"shared cache ({stats['arena_rows']} rows) for {expert_bytes / 2**20:.1f} MiB of "
         f"experts: the model does not fit")
    try:
        _say("4/5", f"two client processes generate {MAX_TOKENS} tokens at the same time from "
             f"the prompt {PROMPT!r} (random weights, sampled at temperature 1 with the same seed: "
             "the text is noise, the numbers are not)")
        pair = _run_clients(blob_dir, 2)
        for i, (text, summary) in enumerate(pair, 1):
            ids = " ".join(str(t) for t in summary["tokens"][:16])
            print(f"\n  client {i}: tokens {ids} ...")
            print(f"  client {i}: text {textwrap.shorten(repr(text.strip()), 100)}")
            print(f"  client {i}: {summary['generation_tokens']} tokens at "
                  f"{summary['generation_tps']:.1f} tok/s (prompt {summary['prompt_tps']:.1f} "
                  f"tok/s), {summary['pool_hits']} experts found in its own pools, "
                  f"{summary['pool_moved']} moved in ({summary['fast_hits']} found in shared "
                  f"memory without asking, {summary['demanded']} demanded), "
                  f"{summary['host_waits'] / max(1, summary['steps']):.2f} host waits a step")
        shared = _daemon_stats(blob_dir)
        stop(blob_dir)

        stats = cold_start()
        solo = _run_clients(blob_dir, 1)
        alone = _daemon_stats(blob_dir)
        same = pair[0][1]["tokens"] == pair[1][1]["tokens"] == solo[0][1]["tokens"]
        _say("5/5", "what the shared cache did")
        print(f"  SSD reads, two clients together: {_reads(shared)}")
        print(f"  SSD reads, one client alone:     {_reads(alone)}")
        # Demand reads only: what is read ahead depends on each run's guesses, not on sharing.
        ratio = shared["misses"] / max(1, alone["misses"])
        print(f"  demand reads, two clients / one: {ratio:.2f} (private caches would read 2.00)"
              + ("; the second client was served from the first one's reads" if ratio < 1.5
                 else ""))
        print(f"  shared-cache hit rate with two clients: {shared['hit_rate']:.1%} "
              f"({shared['hits']} hits, {shared['misses']} misses)")
        print(f"  all three runs produced the same tokens: {'yes' if same else 'NO'}")
    finally:
        if serving_pid(daemon_paths(blob_dir)) is not None:
            stop(blob_dir)
    print(f"\nexpertd stopped. Next: {_activate()}expertd convert YOUR_MLX_MODEL BLOBS && "
          "expertd start --blobs BLOBS && expertd generate --blobs BLOBS --prompt ... "
          "(README.md: a first run without a model, and how to make an MLX MoE checkpoint)")
    return 0 if same else 1


def _activate() -> str:
    """What puts this expertd on the shell's PATH (`make demo` runs .venv/bin/expertd)."""
    here = Path(sys.executable).parent
    activate = Path(sys.prefix) / "bin" / "activate"
    on_path = shutil.which("expertd")
    if (on_path and Path(on_path).parent == here) or not activate.is_file():
        return ""
    shown = os.path.relpath(activate)
    return f". {activate if shown.startswith('..') else shown} (puts expertd on your PATH), then "


def _reads(stats: dict) -> str:
    """A daemon's SSD reads, demand and read-ahead apart."""
    mib = stats["stride"] / 2**20
    return (f"{stats['misses']} experts on demand ({stats['misses'] * mib:.1f} MiB), "
            f"{stats['prefetch_fills']} read ahead ({stats['prefetch_fills'] * mib:.1f} MiB, "
            f"{stats['prefetch_hits']} used)")


def _daemon_stats(blob_dir: Path) -> dict:
    from expertd.connection import Connection
    from expertd.protocol import Op

    with Connection(blob_dir) as conn:
        return conn.request(Op.STATS)


def _run_clients(blob_dir: Path, n: int) -> list:
    """Run ``n`` ``expertd generate`` processes at once; [(text, summary)] in order."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(n):
            summary = Path(tmp) / f"client{i}.json"
            cmd = [sys.executable, "-m", "expertd", "generate", "--blobs", str(blob_dir),
                   "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS),
                   "--temp", "1.0", "--seed", "1", "--verbose", "False",
                   "--json-summary", str(summary)]
            procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True), summary))
        results = []
        deadline = time.monotonic() + 300
        for proc, summary in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"a demo client failed:\n{err.strip()}")
            # stdout is the text alone (--verbose False: no summary block)
            results.append((out, json.loads(summary.read_text())))
        return results
