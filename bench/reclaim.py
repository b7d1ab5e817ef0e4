"""How long the daemon's loop stalls while a dead client's leases are reclaimed.

    python bench/reclaim.py

One client takes 500 one-expert leases and falls silent, as a hung one would; another sends
STATS back to back until the daemon has timed the first out and reclaimed its leases. The
worst round trip is the figure (bar: 100 ms). The tests check what a busy machine cannot
change: the reclaim's work is the dead client's own leases (tests/test_leases.py) and live
clients stay served (tests/test_daemon_fairness.py).
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import daemon, ensure_model, no_arguments

# The test's model: 6 layers of 256 experts, so 500 one-expert leases fit one client's cap.
MANY_EXPERTS = dict(family="qwen3_moe", layers=6, experts=256, top_k=4, hidden=128,
                    moe_inter=64, bits=4, mode="affine", seed=3)
LEASES = 500
BAR_S = 0.1


def run(leases: int = LEASES) -> dict:
    from expertd.connection import Connection
    from expertd.manifest import Manifest
    from expertd.protocol import PROTOCOL_VERSION, Op

    _, blob_dir = ensure_model("many-experts", MANY_EXPERTS)
    layers = Manifest.load(blob_dir).layers
    keys = [(layer.index, e) for layer in layers for e in range(layer.num_experts)][:leases]
    with daemon(blob_dir, 0.03, "--client-timeout", "1", "--heartbeat", "0.25"):
        with Connection(blob_dir) as holder, Connection(blob_dir) as asker:
            holder.request(Op.HELLO, {"version": PROTOCOL_VERSION, "client": holder.client_id,
                                      "pid": os.getpid()})
            for layer, e in keys:  # never released, and no heartbeat: it times out
                holder.request(Op.DEMAND, {"layer": layer, "experts": [e]})
            if asker.request(Op.STATS)["leases"] != leases:
                raise RuntimeError(f"the holder did not get its {leases} leases")
            worst, trips, deadline = 0.0, 0, time.monotonic() + 30
            while True:
                start = time.perf_counter()
                stats = asker.request(Op.STATS, timeout=5.0)
                worst = max(worst, time.perf_counter() - start)
                trips += 1
                if stats["leases"] == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the silent client's leases were never reclaimed")
    return dict(leases=leases, worst_ms=worst * 1e3, round_trips=trips, bar_ms=BAR_S * 1e3,
                ok=worst < BAR_S)


def row(r: dict) -> str:
    """The RESULTS.md table row."""
    verdict = "pass" if r["ok"] else "fail"
    return (f"| STATS while a dead client's {r['leases']} leases are reclaimed | worst round "
            f"trip {r['worst_ms']:.1f} ms of {r['round_trips']} | ≤ {r['bar_ms']:.0f} ms: "
            f"{verdict} |")


if __name__ == "__main__":
    no_arguments(__doc__)
    result = run()
    print(json.dumps(result, indent=1))
    print(row(result))
