"""A client under a hard memory cap on this CPU (issue 27): TTFT and decode next to resident.

    sudo python bench/capped_cpu.py [--large] [--tokens 32] [--prompt 205] [--rounds 2]
                                    [--speculate auto off]

--large: issue 44's model (16 layers of 256 experts, top-8, hidden 768: 3.8 GiB of experts, about
1 MB an expert; a 16-token prompt by default, as MLX's CPU takes about 2 s a token on it here).

The client runs in a cgroup (v1 memory controller, as root) whose limit is a quarter of the
experts' bytes plus what the same client needs when loaded and run once uncapped (its RSS
peak), so the experts are several times the room it has; resident mlx-lm runs outside the cap,
in this process, in lockstep with the capped client: the capped prompt between two resident
ones, then one decode token of each in turn. This machine's speed drifts by tens of percent
within a minute (a token takes 150 ms in one spell, 230 in the next), so runs measured minutes
apart compared the drift, not the two clients. The daemon's arena holds every expert (the bar:
each expert read from the disk at most once per prompt). Tokens and the prompt's first token must
be equal to resident's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, daemon, ensure_model, write_section

SPEC = dict(family="qwen3_moe", layers=16, experts=128, top_k=8, hidden=256, moe_inter=128,
            bits=4, mode="affine", seed=11)
LARGE = dict(SPEC, experts=256, hidden=768, moe_inter=768)
CGROUP = Path("/sys/fs/cgroup/memory/expertd-capped-bench")
SECTION = "## CPU: a client under a hard memory cap (issue 27)"
LARGE_SECTION = "## CPU: a client under a hard memory cap, 1 MB experts (issue 44)"
BARS = dict(ttft=1.2, decode=0.9)


def prompt_ids(n: int, vocab: int) -> list:
    return [(37 * i + 11) % (vocab - 16) + 8 for i in range(n)]


class Decoder:
    """One greedy sequence of ``model`` on ``ids``, a step at a time: :meth:`prompt` (a fresh
    cache, one forward of the prompt, its first token) and then :meth:`token`, each returning
    its seconds; ``tokens`` holds the ids so far."""

    def __init__(self, model, ids):
        self.model, self.ids = model, ids
        self.tokens, self.y, self.cache = [], None, None

    def prompt(self) -> float:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.cache = make_prompt_cache(self.model)
        start = time.perf_counter()
        self.y = mx.argmax(self.model(mx.array([self.ids]), cache=self.cache)[:, -1, :], axis=-1)
        mx.eval(self.y)
        seconds = time.perf_counter() - start
        self.tokens = [int(self.y.item())]
        return seconds

    def token(self) -> float:
        import mlx.core as mx

        start = time.perf_counter()
        self.y = mx.argmax(self.model(self.y[:, None], cache=self.cache)[:, -1, :], axis=-1)
        mx.eval(self.y)
        seconds = time.perf_counter() - start
        self.tokens.append(int(self.y.item()))
        return seconds


def measure(model, ids, tokens: int) -> dict:
    """The first token's seconds (one forward of the prompt), greedy decode tok/s and each
    decode token's seconds."""
    d = Decoder(model, ids)
    ttft = d.prompt()
    times = [d.token() for _ in range(tokens)]
    return dict(ttft_s=ttft, tps=tokens / sum(times), tokens=d.tokens, token_s=times)


def child(args) -> None:
    """The streamed client: load and a warm-up run (the prompt's experts read from the disk),
    then steps as the bench asks on stdin, one JSON line each on stdout: "prompt" and
    "token" (their seconds), "end" (the tokens, the counters and the peak RSS)."""
    from expertd.client import load

    model, _ = load(args.blobs, speculate=args.speculate)
    session = model.expertd_session
    try:
        ids = prompt_ids(args.prompt, model.args.vocab_size)
        before = session.stats()["bytes_read"]
        measure(model, ids, 2)
        read = session.stats()["bytes_read"] - before
        decoder = Decoder(model, ids)
        print(json.dumps(dict(ready=True)), flush=True)
        for line in sys.stdin:
            if line.strip() == "end":
                break
            seconds = decoder.prompt() if line.strip() == "prompt" else decoder.token()
            print(json.dumps(dict(s=seconds)), flush=True)
        c = session.counters
        peak = int(next(line.split()[1] for line in open("/proc/self/status")
                        if line.startswith("VmHWM"))) * 1024
        print(json.dumps(dict(tokens=decoder.tokens, bytes_read=read, peak_rss=peak,
                              host_waits=c["host_waits"], steps=c["steps"],
                              replays=c["replays"], speculative_steps=c["speculative_steps"],
                              pool_bytes=session.pool_bytes)), flush=True)
    finally:
        session.close()


class Streamed:
    """A streamed client process (:func:`child`), in the bench's cgroup with ``limit`` bytes
    (None: uncapped), driven a step at a time."""

    def __init__(self, args, speculate: str, limit: int | None):
        cmd = [sys.executable, __file__, "--child", "--blobs", str(args.blobs), "--speculate",
               speculate, "--prompt", str(args.prompt)]
        self.limit = limit
        if limit is not None:
            if CGROUP.exists():  # a fresh group: limits are refused out of order otherwise
                CGROUP.rmdir()
            CGROUP.mkdir()
            (CGROUP / "memory.limit_in_bytes").write_text(str(limit))
            try:
                (CGROUP / "memory.memsw.limit_in_bytes").write_text(str(limit))
            except OSError:
                pass  # no swap accounting: the limit alone holds

        def enter():
            if limit is not None:
                (CGROUP / "cgroup.procs").write_text(str(os.getpid()))

        # Its stderr to a file: a pipe nobody reads until the end would stall a chatty child.
        self.errors = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONSAFEPATH="1"),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.errors, text=True, preexec_fn=enter)
        self._read()  # ready

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.errors.seek(0)
            raise RuntimeError(f"the streamed client failed ({self.proc.returncode}): "
                               f"{self.errors.read()[-2000:]}")
        return json.loads(line)

    def ask(self, what: str) -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.errors.close()
        if self.limit is not None and CGROUP.exists():
            try:
                CGROUP.rmdir()  # nothing of the bench stays behind
            except OSError:
                pass


def alone(args, speculate: str) -> dict:
    """An uncapped streamed client's prompt and tokens (its peak RSS sizes the cap)."""
    streamed = Streamed(args, speculate, None)
    try:
        streamed.ask("prompt")
        for _ in range(args.tokens):
            streamed.ask("token")
        return streamed.ask("end")
    finally:
        streamed.close()


def lockstep(args, resident, ids, speculate: str, limit: int | None) -> dict:
    """One streamed client next to resident mlx-lm a step at a time: the streamed prompt
    between two resident ones, then each decode token of the two in turn (which goes first
    alternating), so that both see the same moment of this machine, whose speed drifts by
    tens of percent within a minute. Ratios: TTFT (streamed ÷ resident), decode (resident ÷
    streamed: summed seconds, and per-token medians)."""
    streamed = Streamed(args, speculate, limit)
    try:
        ours, theirs = [], []
        before = Decoder(resident, ids).prompt()
        ttft = streamed.ask("prompt")["s"]
        reference = Decoder(resident, ids)
        after = reference.prompt()
        for i in range(args.tokens):
            if i % 2:
                ours.append(streamed.ask("token")["s"])
                theirs.append(reference.token())
            else:
                theirs.append(reference.token())
                ours.append(streamed.ask("token")["s"])
        end = streamed.ask("end")
    finally:
        streamed.close()
    if end["tokens"] != reference.tokens:
        raise AssertionError("streamed tokens differ from resident ones")
    return dict(end, ttft_s=ttft, token_s=ours, resident_token_s=theirs,
                resident_ttft_s=[before, after], tps=len(ours) / sum(ours),
                resident_tps=len(theirs) / sum(theirs),
                ttft_ratio=ttft / statistics.fmean([before, after]),
                decode_ratio=sum(theirs) / sum(ours),
                median_ratio=statistics.median(theirs) / statistics.median(ours))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blobs", type=Path)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, help="prompt tokens (default: 205, --large 16)")
    parser.add_argument("--large", action="store_true", help="issue 44's 3.8 GiB model")
    parser.add_argument("--speculate", nargs="+", default=["auto", "off"])
    parser.add_argument("--rounds", type=int, default=2,
                        help="capped clients a mode, each in lockstep with resident mlx-lm; "
                             "the medians of their ratios decide (default 2)")
    parser.add_argument("--results", action="store_true")
    args = parser.parse_args()
    if args.child:
        args.speculate = args.speculate[0]
        child(args)
        return
    import mlx_lm

    from expertd.manifest import Manifest

    spec = LARGE if args.large else SPEC
    if args.prompt is None:
        args.prompt = 16 if args.large else 205
    model_dir, args.blobs = ensure_model("capped-cpu-large" if args.large else "capped-cpu-h256",
                                         spec)
    m = Manifest.load(args.blobs)
    experts = sum(la.num_experts * la.expert_bytes for la in m.layers)
    resident = mlx_lm.load(str(model_dir))[0]
    ids = prompt_ids(args.prompt, resident.args.vocab_size)
    measure(resident, ids, 2)  # warm
    rows = []
    for speculate in args.speculate:
        with daemon(args.blobs, m.total_expert_bytes * 1.3 / 2**30 + 0.01):  # cold each time
            free = alone(args, speculate)
            # The cap: its needs (the uncapped peak, less its own expert pools) and a quarter
            # of the experts.
            limit = free["peak_rss"] - free["pool_bytes"] + experts // 4
            rounds = [lockstep(args, resident, ids, speculate, limit)
                      for _ in range(args.rounds)]
            rows.append(dict(speculate=speculate, limit=limit, free=free, rounds=rounds,
                             **{key: statistics.median(r[key] for r in rounds)
                                for key in ("ttft_ratio", "decode_ratio", "median_ratio")}))
    runs = [x for r in rows for x in r["rounds"]]
    ref = dict(ttft_s=statistics.median(t for x in runs for t in x["resident_ttft_s"]),
               tps=statistics.median(x["resident_tps"] for x in runs))
    section = LARGE_SECTION if args.large else SECTION
    text = [f"{section}\n",
            f"`sudo python bench/capped_cpu.py{' --large' if args.large else ''}`: "
            f"{spec['layers']} layers, {spec['experts']} experts, top-{spec['top_k']}, hidden "
            f"{spec['hidden']}, {experts / 2**20:.0f} MiB of experts, a "
            f"{args.prompt}-token prompt and {args.tokens} greedy tokens; resident mlx-lm "
            "outside the cap, in lockstep with the capped client: the capped prompt between "
            "two resident ones, then each decode token of the two in turn (median resident: "
            f"TTFT {ref['ttft_s']:.2f} s, {ref['tps']:.1f} tok/s); {args.rounds} capped "
            f"client{'s' if args.rounds > 1 else ''} a mode, the medians of their ratios "
            "deciding; the arena holds every "
            "expert and starts cold for each mode; tokens equal.\n",
            "| speculate | cap (MiB) | peak RSS capped (MiB) | TTFT ÷ resident (rounds) | "
            "decode ÷ resident, summed seconds (rounds); per-token median | replays "
            "(speculative steps), all rounds | MiB read, first prompt of a cold arena | "
            "target | verdict |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ok = r["ttft_ratio"] <= BARS["ttft"] and r["decode_ratio"] >= BARS["decode"]

        def listed(key):
            return ", ".join(f"{x[key]:.2f}" for x in r["rounds"])

        text.append(f"| {r['speculate']} | {r['limit'] / 2**20:.0f} | "
                    f"{max(x['peak_rss'] for x in r['rounds']) / 2**20:.0f} | "
                    f"{r['ttft_ratio']:.2f} ({listed('ttft_ratio')}) | "
                    f"{r['decode_ratio']:.2f} ({listed('decode_ratio')}); "
                    f"{r['median_ratio']:.2f} ({listed('median_ratio')}) | "
                    f"{sum(x['replays'] for x in r['rounds'])} "
                    f"({sum(x['speculative_steps'] for x in r['rounds'])}) | "
                    f"{r['free']['bytes_read'] / 2**20:.1f} "
                    f"(experts {experts / 2**20:.0f}) | "
                    f"TTFT ≤ {BARS['ttft']}, decode ≥ {BARS['decode']} | "
                    f"{'pass' if ok else 'FAIL'} |")
    out = "\n".join(text) + "\n"
    print(out)
    (ROOT / f"capped_cpu{'_large' if args.large else ''}.json").write_text(
        json.dumps(dict(ref=ref, rows=rows, spec=spec, prompt=args.prompt), indent=1))
    if args.results:
        write_section(ROOT / "RESULTS.md", section, out)


if __name__ == "__main__":
    main()
