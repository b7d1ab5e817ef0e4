"""Subcommands that talk to the daemon: start, stop, status (generate and demo: see client)."""

import argparse
import json
import math
import sys
from pathlib import Path

from .errors import DaemonError, DaemonNotRunning
from .hotset import read_pin_file

MAX_WORKERS = 256
MAX_CACHE_GB = 1 << 20  # a PiB: no machine has it, and int(gb * 2**30) never overflows below it


def _cache_bytes(args, manifest) -> int:
    """``--cache-gb`` in bytes, refused unless the daemon can serve the model with it.

    The floor is 2 x top_k cache rows (capped at the model's expert count) beside the
    2 x top_k prefetch side rows. One demand may hold at most half of the rows pins leave
    (``config.cache_limits``); below the floor demands shrink to a row or two and every layer
    of every token waits on several round trips.

    Raises:
        ValueError: one line naming the smallest budget that works, in GiB.
    """
    from .shm.layout import Geometry

    gb = args.cache_gb
    if not math.isfinite(gb) or gb <= 0:
        raise ValueError(f"--cache-gb must be a finite number of GiB above 0, not {gb}")
    if gb > MAX_CACHE_GB:
        raise ValueError(f"--cache-gb {gb:g} is more memory than any machine has "
                         f"(at most {MAX_CACHE_GB} GiB)")
    m = manifest
    rows = min(2 * m.top_k, len(m.layers) * m.max_experts)
    least = Geometry.smallest_budget(len(m.layers), m.max_experts, m.stride, side_rows=m.top_k,
                                     cache_rows=rows)
    cache_bytes = int(gb * 2**30)
    if cache_bytes < least:
        least_gb = math.ceil(least / 2**30 * 1e6) / 1e6  # rounded up: the number shown works
        raise ValueError(f"--cache-gb {gb:g} is too small for {args.blobs}: the smallest cache "
                         f"that serves it is {least_gb:g} GiB ({rows} rows of {m.stride} bytes, "
                         f"twice a token's top_k = {m.top_k} experts, beside 2 x {m.top_k} "
                         "prefetch rows)")
    return cache_bytes


def _cmd_start(args) -> int:
    from .blobstore import BlobStore
    from .daemon import run_foreground, start_detached
    from .paths import daemon_paths
    from .config import ServerConfig

    blob_dir = Path(args.blobs).expanduser().resolve()
    store = BlobStore(blob_dir)  # refuse a bad directory here, not in the detached child
    try:
        cache_bytes = _cache_bytes(args, store.manifest)
    finally:
        store.close()
    if not 1 <= args.workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be between 1 and {MAX_WORKERS}, not {args.workers}")
    if args.pin_file:  # here too, so a bad pin file is named before anything starts
        read_pin_file(Path(args.pin_file).expanduser())
    config = ServerConfig(
        blob_dir=blob_dir, cache_bytes=cache_bytes,
        workers=args.workers, io=args.io, verify=args.verify,
        client_timeout=args.client_timeout, heartbeat_interval=args.heartbeat,
        lease_timeout=args.lease_timeout,
        pin_file=Path(args.pin_file).expanduser() if args.pin_file else None,
        auto_pin=args.auto_pin, prefetch=args.prefetch)
    if args.foreground:
        return run_foreground(config, Path(args.state_file) if args.state_file else None,
                              log_to_file=args.log_to_file)
    argv = [a for a in args.argv_all if a not in ("-v", "--verbose")]
    stats = start_detached(config.blob_dir, argv)
    print(f"expertd serving {stats['blob_dir']} on {stats['endpoint']} (pid {stats['pid']}, "
          f"{stats['arena_rows']} rows, {stats['arena_bytes'] / 2**30:.2f} GiB arena)")
    print(f"  log: {daemon_paths(config.blob_dir).log}")
    return 0


def _cmd_stop(args) -> int:
    from .daemon import stop

    pid = stop(Path(args.blobs), timeout=args.timeout)
    print(f"stopped expertd pid {pid}")
    return 0


def _status_lines(s: dict) -> list:
    return [
        f"expertd pid {s['pid']} serving {s['blob_dir']}",
        f"  endpoint     {s['endpoint']}",
        f"  uptime       {s['uptime_s']:.1f} s",
        f"  arena        {s['arena_bytes'] / 2**30:.3f} GiB, {s['rows_used']}/{s['arena_rows']} "
        f"rows used, {s['pinned']} pinned",
        f"  hits/misses  {s['hits']}/{s['misses']} (hit rate {s['hit_rate']:.1%})",
        f"  prefetch     {s['prefetch']}: {s['prefetch_fills']} read ahead into "
        f"{s['side_rows']} side rows, {s['prefetch_hits']} used, {s['prefetch_wasted']} "
        f"wasted, {s['prefetch_dropped']} dropped",
        f"  read         {s['bytes_read'] / 2**20:.1f} MiB in {s['fills']} fills, "
        f"{s['fill_gbps']:.2f} GB/s while filling",
        f"  clients      {s['clients']} connected, {s['leases']} leases",
        f"  log          {s['log']}",
    ]


def _cmd_status(args) -> int:
    from .connection import Connection
    from .daemon import list_sockets
    from .paths import daemon_paths
    from .protocol import Op

    targets = [dict(blob_dir=args.blobs)] if args.blobs else [
        dict(socket=str(s)) for s in list_sockets()]
    results = []
    for target in targets:
        try:
            with Connection(**target) as conn:
                stats = conn.request(Op.STATS, timeout=args.timeout)
            stats["log"] = str(daemon_paths(stats["blob_dir"]).log)
            results.append(stats)
        except DaemonError as exc:
            if args.blobs:
                raise
            print(f"{target['socket']}: not answering ({exc})", file=sys.stderr)
    if args.json:
        print(json.dumps(results[0] if args.blobs else results, indent=2))
    elif not results:
        raise DaemonNotRunning("no expertd is running")
    else:
        for stats in results:
            print("\n".join(_status_lines(stats)))
    return 0


def add_subcommands(sub) -> None:
    p = sub.add_parser("start", help="start the daemon for a blob directory",
                       description="Start the expertd daemon that serves BLOB_DIR: it creates "
                       "the shared-memory expert cache and listens on a per-user socket derived "
                       "from the directory. Returns once the daemon answers, unless "
                       "--foreground (for launchd/systemd or debugging).")
    p.add_argument("--blobs", required=True, metavar="BLOB_DIR", help="blob directory to serve")
    p.add_argument("--cache-gb", type=float, default=4.0,
                   help="size of the shared expert cache in GiB (default: 4)")
    p.add_argument("--workers", type=int, default=8, help="parallel pread workers (default: 8)")
    p.add_argument("--io", choices=("direct", "buffered"), default="direct",
                   help="direct: bypass the page cache (O_DIRECT / F_NOCACHE), so the arena is "
                   "the only copy; buffered: trust the page cache (default: direct)")
    p.add_argument("--verify", choices=("always", "first", "never"), default="always",
                   help="check each expert's checksum every time it is read from the disk "
                   "(a corrupt blob is refused by name, never served), only the first time, "
                   "or never (default: always)")
    p.add_argument("--pin-file", metavar="JSON", help="JSON list of [layer, expert] to pin")
    p.add_argument("--auto-pin", type=int, default=0, metavar="N",
                   help="keep the N hottest resident experts pinned (default: 0, off)")
    p.add_argument("--prefetch", choices=("on", "off", "auto"), default="auto",
                   help="fill the experts clients predict into side rows that never evict "
                   "cached ones: on, off (PREFETCH is ignored) or auto (on here; each client "
                   "turns prediction off for layers where it does not pay; default: auto)")
    p.add_argument("--client-timeout", type=float, default=10.0, metavar="S",
                   help="reclaim a client's leases after S seconds without a heartbeat")
    p.add_argument("--lease-timeout", type=float, default=30.0, metavar="S",
                   help="revoke a lease held longer than S seconds, even from a live client "
                   "(a client copies its rows in milliseconds; default: 30)")
    p.add_argument("--heartbeat", type=float, default=1.0, metavar="S",
                   help="heartbeat interval clients are told to use (default: 1)")
    p.add_argument("--state-file", help="where the hot set is saved (default: per-user state dir)")
    p.add_argument("--foreground", action="store_true", help="serve in this process")
    p.add_argument("--log-to-file", action="store_true", help=argparse.SUPPRESS)  # detached child
    p.set_defaults(func=_cmd_start)

    p = sub.add_parser("stop", help="stop the daemon of a blob directory",
                       description="SIGTERM the daemon: it fails in-flight requests, saves its "
                       "hot set, unlinks the arena and exits; SIGKILL after --timeout.")
    p.add_argument("--blobs", required=True, metavar="BLOB_DIR")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds before SIGKILL")
    p.set_defaults(func=_cmd_stop)

    p = sub.add_parser("status", help="show what a daemon is doing",
                       description="Cache use, hits, misses, bytes read, fill throughput, "
                       "clients. Without --blobs: every daemon of this user.")
    p.add_argument("--blobs", metavar="BLOB_DIR")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=_cmd_status)

    add_client_subcommands(sub)


def _cmd_generate(args) -> int:
    from expertd.client.generate import generate, summary_line

    summary = generate(Path(args.blobs), args.prompt, max_tokens=args.max_tokens,
                       temp=args.temp, seed=args.seed, prefetch=args.prefetch)
    print()
    print(summary_line(summary))
    if args.json_summary:
        Path(args.json_summary).write_text(json.dumps(summary))
    return 0


def _cmd_demo(args) -> int:
    from .tools.demo import run_demo

    return run_demo(Path(args.workdir) if args.workdir else None, rebuild=args.rebuild)


def add_client_subcommands(sub) -> None:
    p = sub.add_parser("generate", help="generate text through the daemon (a client process)",
                       description="Load the model of BLOB_DIR with its experts served by the "
                       "running expertd, stream a completion of --prompt to stdout, and end "
                       "with a one-line summary: tok/s for prompt and generation, the daemon's "
                       "hit rate and bytes read during the run.")
    p.add_argument("--blobs", required=True, metavar="BLOB_DIR")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--prefetch", choices=("auto", "on", "off"), default="auto",
                   help="guess each next MoE layer's experts at the router sync, copy the "
                   "resident ones in the background and have the daemon read the others ahead; "
                   "auto (default) stops guessing in a layer whose guesses are mostly wrong")
    p.add_argument("--json-summary", metavar="FILE", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("demo", help="the whole job on a built-in synthetic model",
                       description="Build a synthetic MoE model (cached), convert it, start a "
                       "daemon whose cache is smaller than the experts, run two client "
                       "processes generating at the same time, show their text and speed and "
                       "the shared cache's statistics, and stop the daemon.")
    p.add_argument("--workdir", help="where the model and blobs are cached "
                   "(default: ~/.cache/expertd/demo)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the model and blobs")
    p.set_defaults(func=_cmd_demo)
