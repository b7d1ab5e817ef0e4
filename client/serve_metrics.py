"""``expertd serve``'s /metrics: what the HTTP side did, and its Prometheus text exposition.

Written by hand rather than with prometheus_client: the figures are a few counters, gauges and
one histogram, most read at scrape time from the daemon's STATS and the session's counters.
"""

import threading
import time

# Seconds from a request's arrival to its first token.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Observations counted in cumulative buckets, as Prometheus histograms are exposed."""

    def __init__(self, bounds=TTFT_BUCKETS):
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)  # observations at most each bound
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1


class Flight:
    """One request's times and tokens, from its arrival at the generator to its end."""

    def __init__(self):
        self.arrived = time.perf_counter()
        self.admitted = self.first = self.last = None  # perf_counter times
        self.tokens = 0
        self.prompt_tokens = self.prompt_computed = 0  # computed: not from the prompt cache
        self.settled = False


class ServerCounters:
    """What the HTTP side did, for /metrics; updated from the handler threads."""

    def __init__(self):
        self.lock = threading.Lock()  # held by whoever reads or writes several counters at once
        self.changed = threading.Condition(self.lock)  # notified when a request ends
        self.requests = self.errors = self.prompt_tokens = self.generated_tokens = 0
        self.queued = self.running = 0
        self.daemon_refusals = self.disconnects = 0
        self.abandoned = 0  # requests answered 503 whose generation was then stopped
        # Summed over requests: prompt time is admission to first token, decode time first
        # to last token, so each speed is a request's own, however many share a batch.
        self.prompt_computed = self.decode_tokens = 0
        self.prompt_seconds = self.decode_seconds = 0.0
        self.ttft = Histogram()

    def add(self, **amounts) -> None:
        with self.lock:
            for key, amount in amounts.items():
                setattr(self, key, getattr(self, key) + amount)
            self.changed.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is queued or running (at most ``timeout`` s); whether so."""
        with self.changed:
            return self.changed.wait_for(lambda: self.queued + self.running <= 0, timeout)

    def arrived(self) -> Flight:
        self.add(requests=1, queued=1)
        return Flight()

    def refused(self, flight: Flight) -> None:
        """The generator did not take the request (unknown model, dead generation thread)."""
        flight.settled = True
        self.add(queued=-1, errors=1)

    def admitted(self, flight: Flight, prompt_tokens: int) -> None:
        flight.admitted, flight.prompt_tokens = time.perf_counter(), prompt_tokens
        self.add(queued=-1, running=1)

    def settle(self, flight: Flight) -> None:
        """The request ended (finished, failed or its client hung up): count it once."""
        if flight.settled:
            return
        flight.settled = True
        with self.lock:
            self.running -= 1
            self.prompt_tokens += flight.prompt_tokens
            self.generated_tokens += flight.tokens
            if flight.first is not None:
                self.ttft.observe(flight.first - flight.arrived)
                self.prompt_computed += flight.prompt_computed
                self.prompt_seconds += flight.first - flight.admitted
                self.decode_tokens += flight.tokens - 1
                self.decode_seconds += flight.last - flight.first
            self.changed.notify_all()


# (metric, type, help, where the value comes from)
DAEMON_METRICS = [
    ("hits", "counter", "expert lookups served from the arena", "hits"),
    ("misses", "counter", "expert lookups that had to be read from the blob files", "misses"),
    ("prefetch_hits", "counter", "misses saved by a prefetched side row", "prefetch_hits"),
    ("hit_rate", "gauge", "hits / (hits + misses + prefetch hits) since the daemon started",
     "hit_rate"),
    ("bytes_read", "counter", "bytes the daemon read from the blob files", "bytes_read"),
    ("fill_gbps", "gauge", "GB/s read while the daemon was filling rows", "fill_gbps"),
    ("clients", "gauge", "client processes attached to the daemon", "clients"),
    ("arena_bytes", "gauge", "size of the shared-memory arena", "arena_bytes"),
    ("rows_used", "gauge", "arena rows holding an expert", "rows_used"),
]

# This server's model: its session's counters and its pools' (see Session.all_counters).
CLIENT_METRICS = [
    ("pool_hits", "routed experts this server's model found in its own expert pools"),
    ("pool_moved", "routed experts copied into its pools from the daemon's arena when routed"),
    ("ahead_used", "experts copied into its pools ahead of their layer, then routed to"),
    ("fast_hits", "experts it copied from the arena without asking the daemon (found resident)"),
    ("demanded", "experts it asked the daemon for (not in the arena, or being filled)"),
    ("reconnects", "times it attached again to a restarted daemon"),
    ("steps", "forward steps its model ran (one decode step per token of each batch)"),
    ("host_waits", "times those steps waited for the device's routing (1 per warm decode step)"),
    ("replays", "speculative steps run again, exactly, because an expert missed its pools"),
    ("replays_absent", "of those, because a pulled expert was absent from the arena"),
    ("replays_epoch", "of those, because the daemon revoked the step's epoch (held too long)"),
    ("replays_device", "of those, because the device's pull differed from the host copy (it "
     "pulls no more)"),
    ("pulled_rows", "expert rows its device pulled from the arena (no host copy)"),
    ("pulled_bytes", "bytes its device pulled from the arena"),
    ("decode_tokens", "tokens its decode steps computed (a step computes one a sequence)"),
    ("batch_steps", "decode steps of several sequences (a batch)"),
    ("routed_pairs", "(token, expert) pairs its batch steps routed, a layer each"),
    ("union_experts", "distinct experts among those pairs, a layer each: the rows pulled or "
     "read serve several sequences"),
    ("misses", "experts the daemon had to read from the disk for this server's model"),
]


def render_metrics(stats: dict | None, server: ServerCounters, client: dict,
                   pool_bytes: int = 0, stride: int = 0) -> str:
    """Prometheus text format: ``expertd_daemon_*`` from STATS (``expertd_daemon_up 0`` and
    nothing else of the daemon's when it does not answer), ``expertd_server_*`` of this server,
    ``expertd_client_*`` of this process's session (``stride``: the bytes of one arena row, what
    a miss reads)."""
    lines = []

    def metric(name, kind, text, value):
        lines.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"])

    metric("expertd_daemon_up", "gauge", "1 if the daemon answered this scrape",
           int(stats is not None))
    for name, kind, text, key in DAEMON_METRICS if stats is not None else []:
        suffix = "_total" if kind == "counter" else ""
        metric(f"expertd_daemon_{name}{suffix}", kind, text, stats[key])
    with server.lock:  # one consistent reading of the handler threads' counters
        _server_metrics(metric, server)
        _histogram(lines, "expertd_server_time_to_first_token_seconds",
                   "seconds from a request's arrival to its first generated token", server.ttft)
    for key, text in CLIENT_METRICS:
        metric(f"expertd_client_{key}_total", "counter", text, client.get(key, 0))
    # The pull rate: a prompt's pulls, each pass timed under its own evaluation (a decode's
    # run inside its step's graph, beside the computation, and cannot be timed apart).
    seconds, timed = client.get("pull_s", 0.0), client.get("pull_timed_bytes", 0)
    metric("expertd_client_pull_seconds_total", "counter", "seconds of its prompts' device "
           "pulls, each timed under its own evaluation", round(seconds, 6))
    metric("expertd_client_pull_timed_bytes_total", "counter", "bytes of those timed pulls",
           timed)
    metric("expertd_client_pull_gbps", "gauge", "GB/s of those timed pulls (0 before any)",
           timed / seconds / 1e9 if seconds else 0.0)
    metric("expertd_client_pool_bytes", "gauge",
           "this server's own expert memory: its pools' bytes", pool_bytes)
    pairs, tokens = client.get("routed_pairs", 0), client.get("decode_tokens", 0)
    metric("expertd_client_batch_union_ratio", "gauge", "distinct experts / routed pairs of "
           "its batch steps (1 before any; lower: more shared)",
           client.get("union_experts", 0) / pairs if pairs else 1.0)
    metric("expertd_client_disk_bytes_per_token", "gauge", "bytes the daemon read from the "
           "disk for its misses, per decode token (0 before any)",
           client.get("misses", 0) * stride / tokens if tokens else 0.0)
    return "\n".join(lines) + "\n"


def _server_metrics(metric, server: ServerCounters) -> None:
    prompt_tps = server.prompt_computed / server.prompt_seconds if server.prompt_seconds else 0.0
    decode_tps = server.decode_tokens / server.decode_seconds if server.decode_seconds else 0.0
    for name, kind, text, value in [
        ("requests", "counter", "completion requests received", server.requests),
        ("request_errors", "counter", "requests refused before generating", server.errors),
        ("daemon_refusals", "counter", "requests answered 503 because the daemon was gone",
         server.daemon_refusals),
        ("requests_abandoned", "counter", "requests answered 503 while they waited, whose "
         "generation was stopped once the daemon was back", server.abandoned),
        ("client_disconnects", "counter", "requests whose client hung up before the reply "
         "was written", server.disconnects),
        ("requests_queued", "gauge", "requests waiting for the generation thread to take them",
         server.queued),
        ("requests_running", "gauge", "requests taken into generation and not finished",
         server.running),
        ("prompt_tokens", "counter", "prompt tokens of the finished requests",
         server.prompt_tokens),
        ("generated_tokens", "counter", "tokens generated for the finished requests",
         server.generated_tokens),
        ("prompt_seconds", "counter", "seconds between each request's admission and its "
         "first token", round(server.prompt_seconds, 6)),
        ("decode_seconds", "counter", "seconds between each request's first and last token",
         round(server.decode_seconds, 6)),
        ("prompt_tokens_per_second", "gauge", "prompt tok/s of a request, over all requests: "
         "prompt tokens computed (not found in the prompt cache) / prompt seconds",
         round(prompt_tps, 3)),
        ("decode_tokens_per_second", "gauge", "decode tok/s of a request, over all requests: "
         "tokens after each first one / decode seconds", round(decode_tps, 3)),
    ]:
        suffix = "_total" if kind == "counter" else ""
        metric(f"expertd_server_{name}{suffix}", kind, text, value)


def _histogram(lines: list, name: str, text: str, histogram: Histogram) -> None:
    lines.extend([f"# HELP {name} {text}", f"# TYPE {name} histogram"])
    for bound, count in zip(histogram.bounds, histogram.counts):
        lines.append(f'{name}_bucket{{le="{bound:g}"}} {count}')
    lines.extend([f'{name}_bucket{{le="+Inf"}} {histogram.count}',
                  f"{name}_sum {round(histogram.sum, 6)}", f"{name}_count {histogram.count}"])
