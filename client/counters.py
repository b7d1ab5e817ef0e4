"""The client's counters by name: what a session counts, what a step reports into them, and
what a heartbeat carries to the daemon's status. Imports nothing, so the session (a floor
below the step) and the step both take their names from here."""

REPLAY_CAUSES = {"pool": "an expert missed its pool", "absent": "a pulled expert was absent "
                 "from the arena", "epoch": "the daemon revoked the step's epoch",
                 "device": "the device's pull differed from the host copy"}
# The counters of replays by cause beside "replays" (a pool miss counts in "replays" alone).
REPLAY_COUNTERS = tuple(f"replays_{cause}" for cause in REPLAY_CAUSES if cause != "pool")
# Decode steps' sequences (tokens), steps of several sequences, and of those (their good
# speculative runs, and their layers waiting per layer): the pairs routed and the distinct
# experts among them (see StepCheck.count_union).
BATCH_COUNTERS = ("decode_tokens", "batch_steps", "routed_pairs", "union_experts")
SESSION_COUNTERS = ("fast_hits", "demanded", "drained", "retries", "reconnects", "late_leases",
                    "prefetch_asked", "misses", "prefetch_saved", "hits_reported")
# The steps' own (step.Steps owns them; its layers count their waits and batches into them).
STEP_COUNTERS = ("steps", "host_waits", "speculative_steps", "unchecked_steps", "replays",
                 "pulled_steps", *BATCH_COUNTERS, *REPLAY_COUNTERS)
# Where the main thread's time goes per MoE layer call (see layer.py); the last three: a
# speculative step's building, its one wait, its bookkeeping.
TIMING = ("sync_s", "exposed_s", "copy_s", "fill_wait_s", "copier_wait_s", "prestage_s",
          "layers")
STEP_TIMING = ("step_build_s", "step_wait_s", "step_book_s")


def new_counters() -> dict:
    """A session's counters, every one at 0."""
    return dict.fromkeys(SESSION_COUNTERS, 0)


def new_timing() -> dict:
    """A session's timing: seconds at 0.0, and the count of layer calls (``layers``) at 0."""
    return {key: 0 if key == "layers" else 0.0 for key in TIMING}


def new_step_counters() -> dict:
    """A model's steps' counters, every one at 0."""
    return dict.fromkeys(STEP_COUNTERS, 0)


def new_step_timing() -> dict:
    return dict.fromkeys(STEP_TIMING, 0.0)


def heartbeat_report(counters: dict, pulled: dict) -> dict:
    """What a heartbeat carries for the daemon's status: the steps' ``counters`` (see
    STEP_COUNTERS), and ``pulled`` (the session's pull counters) in the wire's names."""
    return {"steps": counters["steps"], "host_waits": counters["host_waits"],
            "replays": counters["replays"], "pulled_rows": pulled["rows_pulled"],
            "pulled_bytes": pulled["bytes_pulled"],
            **{key: counters[key] for key in REPLAY_COUNTERS},
            "pull_us": round(1e6 * pulled["pull_s"]),
            "pull_timed_bytes": pulled["timed_bytes"],
            **{key: counters[key] for key in BATCH_COUNTERS}}
