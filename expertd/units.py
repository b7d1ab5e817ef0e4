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


def replay_causes(counts: dict) -> str:
    """`` (2 absent, 1 epoch)``: a client's replays by cause, from its ``replays_<cause>``
    counts (a heartbeat's or a session's), those it had; "" if none."""
    causes = [f"{n} {key[len('replays_'):]}" for key, n in counts.items()
              if key.startswith("replays_") and n]
    return f" ({', '.join(causes)})" if causes else ""
