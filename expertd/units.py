"""How sizes are printed (GiB, or MiB below a GiB, so that a small size never reads 0.00 GiB),
and a client's replays by cause."""

import math


def size_text(n_bytes: float, round_up: bool = False) -> str:
    """``1.50 GiB``, or ``768.00 MiB`` below a GiB. ``round_up``: the last digit rounded up,
    for a least size that must work when given back as shown."""
    unit, name = (2**30, "GiB") if n_bytes >= 2**30 else (2**20, "MiB")
    if round_up:  # in whole hundredths, counted exactly
        return f"{-(-math.ceil(n_bytes) * 100 // unit) / 100:.2f} {name}"
    return f"{n_bytes / unit:.2f} {name}"


def pull_rate(timed_bytes: int, seconds: float) -> str:
    """``, prompt pulls at 12.3 GB/s``: the rate of a client's timed pulls; "" before any."""
    return f", prompt pulls at {timed_bytes / seconds / 1e9:.1f} GB/s" if seconds else ""


def batch_sharing(counts: dict) -> str:
    """``, 40 batch steps (their experts 62% of the pairs routed)``: a client's decode steps
    of several sequences and how much their pulls were shared, from its batch counters (a
    heartbeat's or a session's); "" if it decoded no batch."""
    steps, pairs = counts.get("batch_steps", 0), counts.get("routed_pairs", 0)
    if not steps:
        return ""
    shared = (f" (their experts {counts.get('union_experts', 0) / pairs:.0%} of the pairs "
              "routed)" if pairs else "")
    return f", {steps} batch steps{shared}"


def replay_causes(counts: dict) -> str:
    """`` (2 absent, 1 epoch)``: a client's replays by cause, from its ``replays_<cause>``
    counts (a heartbeat's or a session's), those it had; "" if none."""
    causes = [f"{n} {key[len('replays_'):]}" for key, n in counts.items()
              if key.startswith("replays_") and n]
    return f" ({', '.join(causes)})" if causes else ""
