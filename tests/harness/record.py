"""The daemon's behaviour on a fixed request sequence, recorded to compare a refactoring's
before and after (issue 25): every reply, STATS, the arena's row layout and the saved hot set,
at four cache sizes, from two clients' demands, prefetches (with claims), pins and unpins.

    python tests/harness/record.py OUT.json      # before; again after; then cmp the two

Deterministic: the daemon runs in this process on a clock that never moves (no tick, no hold
expires), with one fill worker, and each request's fills finish before the next request.
Values that differ run to run (pids, paths, times, names) are left out.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from expertd.errors import DaemonError
from expertd.protocol import Op
from expertd.tools.convert import convert
from expertd.tools.synth import SynthConfig, synthesize
from harness.core import wait_until
from harness.inprocess import FakeClock, InProcessDaemon
from harness.raw import RawClient

VOLATILE = {"endpoint", "arena", "pid", "blob_dir", "log", "uptime_s", "fill_seconds",
            "fill_gbps", "epoch", "token", "client", "busy", "epoch_wait_max_s", "peers",
            "peers_accepted", "peers_closed", "implementation", "client_pools", "clients"}

def norm(x):
    if isinstance(x, dict):
        return {k: norm(v) for k, v in sorted(x.items()) if k not in VOLATILE}
    if isinstance(x, (list, tuple)):
        return [norm(v) for v in x]
    if isinstance(x, bytes):
        return x.hex()
    if isinstance(x, float):
        return round(x, 6)
    return x

def layout(c):
    s = c.arena.slots
    return [[int(r["layer"]), int(r["expert"]), int(r["state"]), int(r["version"])] for r in s]

def settle(c):
    def idle():
        st = c.request(Op.STATS, {})
        return st["in_flight"] == 0 and st["queued"] == 0

    wait_until(idle, 10, "the fills to settle", interval=0.005)

def scenario(blob_dir, pct, root):
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="xr", dir="/tmp")
    os.environ["XDG_STATE_HOME"] = str(root / f"state{pct}")
    state = root / f"hot{pct}.json"
    rng = np.random.default_rng(pct)
    out = []
    with InProcessDaemon(blob_dir, "--cache-gb", f"{pct}%", "--workers", "1", "--state-file",
                         str(state), clock=FakeClock()):
        a, b = RawClient(blob_dir), RawClient(blob_dir)
        layers, n = len(a.manifest.layers), a.manifest.layers[0].num_experts
        for i in range(90):
            c = a if rng.random() < 0.6 else b
            layer = int(rng.integers(layers))
            experts = sorted(set(rng.integers(n, size=int(rng.integers(1, 4))).tolist()))
            kind = rng.random()
            if kind < 0.55:
                r = c.demand(layer, experts)
                c.release(r["lease"])
                out.append(["demand", layer, experts, norm(r)])
            elif kind < 0.85:
                guess = sorted(set(rng.integers(n, size=int(rng.integers(1, 6))).tolist()))
                claim = [e for e in experts if e not in guess]
                c.conn.send(Op.PREFETCH, {"layer": layer, "experts": guess,
                                          "core": max(1, len(guess) // 2), "claim": claim})
                out.append(["prefetch", layer, guess, claim])
            elif kind < 0.93:
                try:
                    r = norm(c.request(Op.PIN, {"layer": layer, "experts": experts}))
                except DaemonError as exc:
                    r = ["error", str(exc), exc.code]
                out.append(["pin", layer, experts, r])
            else:
                r = c.request(Op.UNPIN, {"layer": layer, "experts": experts})
                out.append(["unpin", layer, experts, norm(r)])
            settle(c)
            if i % 15 == 14:
                out.append(["layout", layout(a)])
        out.append(["stats", norm(a.request(Op.STATS, {}))])
        a.close()
        b.close()
    out.append(["hot", norm(json.loads(state.read_text())) if state.exists() else None])
    shutil.rmtree(os.environ["XDG_RUNTIME_DIR"], ignore_errors=True)
    return out


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="rec"))
    try:
        model = synthesize(SynthConfig(layers=3, experts=16, top_k=4), root / "m",
                           progress=False)
        convert(model, root / "b", progress=False)
        rec = {pct: scenario(root / "b", pct, root) for pct in (15, 30, 60, 100)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(sys.argv[1]).write_text(json.dumps(rec, indent=0))
    print("recorded", {k: len(v) for k, v in rec.items()})


if __name__ == "__main__":
    main()
