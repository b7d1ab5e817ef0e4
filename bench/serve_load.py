"""Serving under load (issue 42): ``expertd serve`` next to ``mlx_lm.server``, real HTTP.

    PYTHONSAFEPATH=1 python bench/serve_load.py [--small] [--clients 1,4,8,16] [--tokens 64]
                                                [--rounds 3] [--out FILE.json] [--results]

Two servers on one machine: ``expertd serve`` (the streamed model, pools of a quarter of the
experts) and ``mlx_lm.server`` on the same checkpoint resident. For each number of clients,
that many requests are sent at once (plain HTTP, one thread each, greedy, distinct prompts) to
one server, then the same requests to the other, alternating over the rounds; the aggregate
completion tokens per second are compared. Both servers batch (``--decode-concurrency``).

- **pools 25%, arena holding every expert**: aggregate ÷ mlx_lm.server's at 1, 4, 8 and 16
  clients (bar 0.8, target 0.9);
- **arena 25%** (a daemon holding a quarter of the experts: the model larger than its cache):
  expertd serve alone, 1 client and 8: aggregate at 8 ÷ at 1, the bytes the daemon read from
  the disk per generated token at 8 ÷ at 1 (bar ≤ 0.85: each read row serves several
  sequences), the union of experts a batch step routes to ÷ its pairs, and the aggregate ÷ the
  disk bound (the blob files' O_DIRECT rate ÷ those bytes per token; bar ≥ 0.8). Case
  ``capped-off`` runs it again with ``--speculate off``: each MoE layer waits for its rows,
  and the next layer's guessed experts are read ahead meanwhile (client/predict.py), which a
  speculative step cannot do.

Each reply's text is compared with the other server's for the same request and round: the
count of equal ones is reported (bit-exactness at equal batches is the suite's, on the CPU).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_env, daemon, run_and_report, stats
from gpu_pools import QWEN3_30B_SHAPES, TINY
from overlap import arena_gb

SECTION = "## GPU: serving under load (issue 42)"
CPU_SECTION = "## CPU: serving under load, a small model (issue 42; its bars are the GPU's)"
CAPPED = 0.25  # of the experts: the capped arena (the pools: gpu_pull.pull_model's, the same)
BARS = dict(pooled=0.8, target=0.9, bytes=0.85, disk=0.8)
STEP_KEYS = ("steps", "replays", "replays_absent", "host_waits", "batch_steps")
START_TIMEOUT = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpServer:
    """A server process on 127.0.0.1, ready once a completion came back."""

    def __init__(self, cmd: list, port: int, log: Path, env: dict):
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited with {self.proc.returncode}: see {log}")
            try:
                self.complete("warm up", 4)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd[:4]} did not answer: see {log}") from None
                time.sleep(0.5)

    def complete(self, prompt: str, tokens: int) -> dict:
        body = json.dumps(dict(prompt=prompt, max_tokens=tokens, temperature=0.0)).encode()
        req = urllib.request.Request(self.base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as reply:
            return json.loads(reply.read())

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                         if line and not line.startswith("#"))}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def read_every_expert(blob_dir) -> None:
    """Have the daemon read every expert into its arena (one that holds them all)."""
    import numpy as np

    from expertd.client.session import Session

    session = Session(blob_dir)
    try:
        for layer in session.manifest.layers:
            session.demand_absent(layer.index, np.arange(layer.num_experts, dtype=np.int32))
    finally:
        session.close()


def burst(server: HttpServer, prompts: list, tokens: int) -> dict:
    """All ``prompts`` sent at once: aggregate completion tokens/s, and each reply's text."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        started = time.perf_counter()
        replies = list(pool.map(lambda p: server.complete(p, tokens), prompts))
        seconds = time.perf_counter() - started
    generated = sum(r["usage"]["completion_tokens"] for r in replies)
    return dict(tps=generated / seconds, tokens=generated, seconds=seconds,
                texts=[r["choices"][0]["text"] for r in replies])


def prompts_for(clients: int, round_: int) -> list:
    return [f"Request {round_}.{i}: the shared cache serves every client from one copy of "
            f"the experts, {i} times over" for i in range(clients)]


def serve_cmd(blob_dir, port: int, pool_gb: float, concurrency: int,
              speculate: str = "auto") -> list:
    return [sys.executable, "-m", "expertd", "serve", "--blobs", str(blob_dir), "--port",
            str(port), "--pool-gb", f"{pool_gb:.6f}", "--decode-concurrency", str(concurrency),
            "--speculate", speculate, "--log-level", "WARNING"]


def pooled_case(model_dir, blob_dir, all_gb, pool_gb, args, env) -> dict:
    """pools 25%, arena all: both servers, every client count."""
    levels = [int(c) for c in args.clients.split(",")]
    concurrency = max(levels)
    out = dict(levels={})
    with daemon(blob_dir, all_gb):
        read_every_expert(blob_dir)  # the arena holds every expert: none read while timed
        port = free_port()
        ours = HttpServer(serve_cmd(blob_dir, port, pool_gb, concurrency), port,
                          args.logs / "expertd-serve.log", env)
        port2 = free_port()
        theirs = HttpServer([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
                             "--port", str(port2), "--decode-concurrency", str(concurrency),
                             "--log-level", "WARNING"], port2, args.logs / "mlx-server.log",
                            env)
        try:
            for clients in levels:  # each server warm at this batch size first
                for server in (ours, theirs):
                    burst(server, prompts_for(clients, -1), 8)
                rounds = []
                for rnd in range(args.rounds):
                    ps = prompts_for(clients, rnd)
                    a, b = burst(ours, ps, args.tokens), burst(theirs, ps, args.tokens)
                    rounds.append(dict(ratio=a["tps"] / b["tps"], expertd_tps=a["tps"],
                                       mlx_tps=b["tps"], equal=sum(
                                           x == y for x, y in zip(a["texts"], b["texts"])),
                                       requests=clients))
                out["levels"][clients] = dict(
                    ratio=statistics.median(r["ratio"] for r in rounds), rounds=rounds)
                print(f"pooled {clients} clients: {out['levels'][clients]['ratio']:.2f}",
                      flush=True)
                if args.out:  # what a run cut short by its time limit keeps
                    args.out.write_text(json.dumps(dict(partial=out), indent=1))
            out["metrics"] = ours.metrics()
        finally:
            ours.close()
            theirs.close()
    return out


def capped_case(blob_dir, capped_gb, pool_gb, args, env, speculate: str = "auto") -> dict:
    """arena 25%: expertd serve alone at 1 client and 8, bytes read per token. ``speculate``
    "off": every decode step waits in each MoE layer, where the next layer's guessed experts
    are read ahead (client/predict.py) while this one's are read and computed."""
    out = {}
    with daemon(blob_dir, capped_gb):
        port = free_port()
        ours = HttpServer(serve_cmd(blob_dir, port, pool_gb, 8, speculate), port,
                          args.logs / f"expertd-serve-capped-{speculate}.log", env)
        try:
            for clients in (1, 8):
                burst(ours, prompts_for(clients, -1), 8)
                rounds = []
                for rnd in range(args.rounds):
                    before, m0 = stats(blob_dir)["bytes_read"], ours.metrics()
                    r = burst(ours, prompts_for(clients, 100 + rnd), args.tokens)
                    m1 = ours.metrics()
                    read = stats(blob_dir)["bytes_read"] - before
                    pairs = m1["expertd_client_routed_pairs_total"] - \
                        m0["expertd_client_routed_pairs_total"]
                    union = m1["expertd_client_union_experts_total"] - \
                        m0["expertd_client_union_experts_total"]
                    # Where a step's time goes: its replays (rows absent from the arena)
                    # and host waits, per decode step.
                    moved = {key: m1[f"expertd_client_{key}_total"]
                             - m0[f"expertd_client_{key}_total"] for key in STEP_KEYS}
                    steps = max(1, moved["steps"])
                    rounds.append(dict(tps=r["tps"], bytes_per_token=read / r["tokens"],
                                       union_ratio=union / pairs if pairs else 1.0,
                                       read_gbps=read / r["seconds"] / 1e9,
                                       **{f"{key}_per_step": moved[key] / steps
                                          for key in STEP_KEYS if key != "steps"}))
                out[clients] = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
                print(f"capped (speculate {speculate}) {clients} clients: {out[clients]}",
                      flush=True)
        finally:
            ours.close()
    from gpu_pull import disk_bound_gbps

    out["disk_gbps"] = disk_bound_gbps(blob_dir)
    return out


def run(args) -> dict:
    import mlx.core as mx
    from gpu_pull import pull_model

    spec = TINY if args.small else QWEN3_30B_SHAPES
    model_dir, blob_dir, m, all_gb, pool_gb = pull_model(args.small)
    capped_gb = arena_gb(blob_dir, round(CAPPED * len(m.layers) * m.max_experts))
    env = dict(bench_env(), PYTHONSAFEPATH="1")
    args.logs.mkdir(parents=True, exist_ok=True)
    out = dict(model=spec, device=str(mx.default_device()), mlx=mx.__version__,
               tokens=args.tokens, rounds=args.rounds)
    cases = args.cases.split(",")
    if "pooled" in cases:
        out["pooled"] = pooled_case(model_dir, blob_dir, all_gb, pool_gb, args, env)
    if "capped" in cases:
        out["capped"] = capped_case(blob_dir, capped_gb, pool_gb, args, env)
    if "capped-off" in cases:
        out["capped_off"] = capped_case(blob_dir, capped_gb, pool_gb, args, env, "off")
    return out


def model_text(spec: dict) -> str:
    return (f"{spec['layers']} MoE layers × {spec['experts']} experts, top-{spec['top_k']}, "
            f"hidden {spec['hidden']}, {spec['bits']}-bit")


def section(r: dict) -> str:
    return CPU_SECTION if "cpu" in r["device"] else SECTION


def table(r: dict) -> str:
    lines = [f"{section(r)}\n", f"{r['device']}, MLX {r['mlx']}; `expertd serve` (pools 25%) and "
             f"`mlx_lm.server` (resident) on one machine, real HTTP, greedy requests of "
             f"{r['tokens']} tokens sent at once by N clients, the two servers alternating "
             f"over {r['rounds']} rounds; model {model_text(r['model'])}. "
             f"`python bench/serve_load.py{' --small' if r['model'] == TINY else ''}`.\n",
             "| case | clients | aggregate ÷ mlx_lm.server (median; rounds) | replies equal | "
             "target | verdict |", "| --- | --- | --- | --- | --- | --- |"]
    for clients, level in r.get("pooled", {}).get("levels", {}).items():
        ratio = level["ratio"]
        equal = sum(x["equal"] for x in level["rounds"])
        total = sum(x["requests"] for x in level["rounds"])
        lines.append(f"| pools 25%, arena all | {clients} | {ratio:.2f} ("
                     f"{', '.join(format(x['ratio'], '.2f') for x in level['rounds'])}; "
                     f"{statistics.median(x['expertd_tps'] for x in level['rounds']):.0f} vs "
                     f"{statistics.median(x['mlx_tps'] for x in level['rounds']):.0f} tok/s) | "
                     f"{equal}/{total} | ≥ {BARS['pooled']} (target {BARS['target']}) | "
                     f"{'pass' if ratio >= BARS['pooled'] else 'FAIL'} |")
    for key, name in (("capped", "arena 25%"),
                      ("capped_off", "arena 25%, speculate off (waits per layer, reads ahead)")):
        c = r.get(key)
        if c:
            lines += capped_table(r, c, name)
    return "\n".join(lines) + "\n"


def capped_table(r: dict, c: dict, name: str) -> list:
    """The rows of one arena-25% case (serve_load's capped_case)."""
    lines = []
    one, eight = c["1"] if "1" in c else c[1], c["8"] if "8" in c else c[8]
    per = eight["bytes_per_token"] / one["bytes_per_token"] if one["bytes_per_token"] else 0
    disk = c["disk_gbps"] * 1e9 / eight["bytes_per_token"] if eight["bytes_per_token"] \
        else float("inf")
    # The bound: the disk's, or resident mlx_lm.server's at 8 clients where that is lower
    # (the pooled case's, when it ran).
    levels = r.get("pooled", {}).get("levels", {})
    level = levels.get("8", levels.get(8))
    resident = (statistics.median(x["mlx_tps"] for x in level["rounds"]) if level
                else float("inf"))
    bound = min(disk, resident)
    lines += ["", f"| {name} | 1 client | 8 clients | 8 ÷ 1 | target | verdict |",
              "| --- | --- | --- | --- | --- | --- |",
              f"| aggregate tok/s | {one['tps']:.1f} | {eight['tps']:.1f} | "
              f"{eight['tps'] / one['tps']:.2f} | | |",
              f"| disk bytes / token | {one['bytes_per_token'] / 2**20:.2f} MiB | "
              f"{eight['bytes_per_token'] / 2**20:.2f} MiB | {per:.2f} | ≤ {BARS['bytes']} | "
              f"{'pass' if per <= BARS['bytes'] else 'FAIL'} |",
              f"| union ÷ pairs of a batch step | | {eight['union_ratio']:.2f} | | | |",
              f"| aggregate ÷ min(resident at 8 clients {resident:.0f} tok/s, disk bound "
              f"{c['disk_gbps']:.2f} GB/s ÷ bytes/token = {disk:.0f} tok/s) | | "
              f"{eight['tps'] / bound:.2f} | | ≥ {BARS['disk']} | "
              f"{'pass' if eight['tps'] / bound >= BARS['disk'] else 'FAIL'} |"]
    if "read_gbps" in eight:
        lines.append("| read GB/s; replays (absent) and host waits a step | "
                     + " | ".join(f"{x['read_gbps']:.2f}; {x['replays_per_step']:.2f} "
                                  f"({x['replays_absent_per_step']:.2f}), "
                                  f"{x['host_waits_per_step']:.2f}" for x in (one, eight))
                     + " | | | |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny model (a smoke run)")
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--cases", default="pooled,capped")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--logs", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "serve-logs")
    run_and_report(p, run, table, section)


if __name__ == "__main__":
    main()
