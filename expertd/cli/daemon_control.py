"""Subcommands that control a daemon: start, stop, restart, status (generate and demo:
inference.py; the start flags: options.py).

They behave like pg_ctl or systemctl: ``stop`` of a stopped daemon is not an error, ``status``
exits 3 when nothing runs (and still answers in JSON with ``--json``), ``start`` and ``status``
say where the log is.

One job, over 400 lines: the daemon's control commands.
"""

import argparse
import contextlib
import io
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

from expertd.cli import argtypes
from expertd.cli.options import (
    START_OPTIONS,
    add_start_flags,
    check_bounds,
    config_settings,
    start_flags,
)
from expertd.errors import DaemonError, DaemonNotRunning, FlagError
from expertd.serving.hotset import read_pin_file, read_pins
from expertd.units import batch_sharing, pull_rate, replay_causes, size_text

MAX_SIDE_ROWS = 64  # x top_k: prefetch rows per generation, at most
MAX_CACHE_GB = argtypes.MAX_GIB
PIN_WAIT = 30.0  # seconds start waits for its pinned experts to be read, to name any it cannot
PIN_POLL = 0.1
NOT_RUNNING = 3  # status's exit code when no daemon runs, as pg_ctl and LSB init scripts use
_UNITS = {"": 2**30, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(%|[kmgt]?)(?:i?b)?", re.IGNORECASE)


# ---- --cache-gb --------------------------------------------------------------------------------

def parse_size(text: str, total_bytes: int) -> float:
    """A cache size in GiB: a bare number, or 8G / 512M / 2T / 64K (binary units), or a
    percentage of ``total_bytes`` (the experts' total size).

    Returns:
        The size in GiB (may be nan, inf, zero or negative: the caller checks).
    Raises:
        ValueError: if ``text`` is no size at all.
    """
    text = str(text).strip()
    try:
        return float(text)  # a bare number, "nan" and "inf" included
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    match = _SIZE.fullmatch(text.lstrip("+-").strip())
    if not match:
        raise ValueError(f"{text!r} is not a size")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        return sign * number / 100 * total_bytes / 2**30
    return sign * number * _UNITS[unit] / 2**30


def _share_bytes(m, expert_bytes: float, side_rows: int | None) -> int:
    """The arena whose cache rows hold ``expert_bytes`` of experts (100%: every one), its
    side rows (the daemon's default for that arena, if not given) and slot tables on top."""
    from expertd.protocol import GUESS_WIDTH
    from expertd.shm.layout import Geometry

    shape = len(m.layers), m.max_experts, m.stride
    rows = max(1, math.ceil(round(expert_bytes / m.stride, 6)))
    if side_rows is not None:
        return Geometry.smallest_budget(*shape, side_rows=side_rows, cache_rows=rows)
    wide = Geometry.smallest_budget(*shape, side_rows=GUESS_WIDTH * m.top_k, cache_rows=rows)
    if Geometry.default_side_rows(*shape, wide, m.top_k, GUESS_WIDTH) > m.top_k:
        return wide
    return Geometry.smallest_budget(*shape, side_rows=m.top_k, cache_rows=rows)


def cache_bytes(text: str, manifest, blobs, side_rows: int | None = None) -> int:
    """``--cache-gb`` in bytes, refused unless the daemon can serve the model with it.

    A size is the whole arena (slot tables and prefetch side rows included); a percentage is a
    share of the experts, held in cache rows with the side rows and tables on top, so that 100%
    holds every expert. The floor is
    2 x top_k cache rows (capped at the model's expert count) beside the 2 x ``side_rows``
    side rows (``side_rows`` defaults to top_k):
    one demand may hold at most half of the rows pins leave (``config.cache_limits``); below
    the floor demands shrink to a row or two and every layer of every token waits on several
    round trips.

    Raises:
        ValueError: one line naming the smallest budget that works.
    """
    from expertd.shm.layout import Geometry

    m = manifest
    side = m.top_k if side_rows is None else side_rows
    rows = min(2 * m.top_k, len(m.layers) * m.max_experts)
    least = Geometry.smallest_budget(len(m.layers), m.max_experts, m.stride, side_rows=side,
                                     cache_rows=rows)
    least_text = size_text(least, round_up=True)  # rounded up: the size shown works
    try:
        gib = parse_size(text, m.total_expert_bytes)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib <= 0:
        raise FlagError(f"--cache-gb {text} is not a cache size: give a finite number of GiB "
                        f"above 0 (e.g. 8), or 8G, 512M, 30% (of the experts' "
                        f"{size_text(m.total_expert_bytes)}); the smallest cache that serves "
                        f"{blobs} is {least_text}")
    if gib > MAX_CACHE_GB:
        raise FlagError(f"--cache-gb {text} is more memory than any machine has "
                        f"(at most {MAX_CACHE_GB} GiB)")
    size = int(gib * 2**30)
    if str(text).strip().endswith("%"):
        size = _share_bytes(m, gib * 2**30, side_rows)
    if size < least:
        raise FlagError(f"--cache-gb {text} is too small for {blobs}: the smallest cache "
                        f"that serves it is {least_text} ({rows} rows of {m.stride} bytes, "
                        f"twice a token's top_k = {m.top_k} experts, beside 2 x {side} "
                        "prefetch rows)")
    return size


# ---- start, stop, restart ----------------------------------------------------------------------

def config_from_args(args):
    """The daemon's configuration from ``start`` flags, every flag checked before anything runs
    (``start``, ``restart`` and ``service install`` refuse bad flags before they act).

    Raises:
        ValueError: one line naming the bad flag or pin file.
        BlobStoreError: a blob directory that cannot be served.
    """
    from expertd.blobstore import BlobStore
    from expertd.serving.config import ServerConfig

    blob_dir = Path(args.blobs).expanduser().resolve()
    store = BlobStore(blob_dir)  # refuse a bad directory here, not in the detached child
    try:
        top_k = store.manifest.top_k
        if args.side_rows is not None and not 0 <= args.side_rows <= MAX_SIDE_ROWS * top_k:
            raise FlagError(f"--side-rows must be between 0 and {MAX_SIDE_ROWS * top_k} "
                            f"({MAX_SIDE_ROWS} x top_k = {top_k}), not {args.side_rows}")
        budget = cache_bytes(args.cache_gb, store.manifest, args.blobs, args.side_rows)
        # Auto-pins are pins: at most a quarter of the cache rows (config.cache_limits), of
        # the arena the daemon lays out (config.arena_geometry).
        from expertd.serving.config import arena_geometry, cache_limits

        rows = arena_geometry(store.manifest, budget, args.side_rows).cache_rows
        max_pins = cache_limits(rows)[0]
        if not 0 <= args.auto_pin <= max_pins:
            raise FlagError(f"--auto-pin must be between 0 and {max_pins} (a "
                            f"quarter of this cache's {rows} rows), not {args.auto_pin}")
        n_experts = [layer.num_experts for layer in store.manifest.layers]
    finally:
        store.close()
    check_bounds(args)
    settings = config_settings(args)
    if settings["pin_file"]:  # here too, so a bad pin file is named before anything starts
        try:
            read_pins(settings["pin_file"], n_experts, max_pins, rows)
        except ValueError as exc:
            raise FlagError(f"--pin-file {exc}") from None
    return ServerConfig(blob_dir=blob_dir, cache_bytes=budget, **settings)


def _log_file(args, config) -> Path:
    from expertd.paths import daemon_paths

    if args.log_file:
        return Path(args.log_file).expanduser().absolute()
    return daemon_paths(config.blob_dir).log


def _cmd_start(args) -> int:
    from expertd.cli.lifecycle import run_foreground

    config = config_from_args(args)
    state_file = Path(args.state_file).expanduser() if args.state_file else None
    if args.foreground:
        log_file = Path(args.log_file).expanduser().absolute() if args.log_file else None
        # What restart keeps (see _kept_flags) and status reads (log_location): -v, the start
        # flags, a log file of the user's (not the one a detached start passes by default).
        from expertd.paths import daemon_paths

        own_log = log_file is not None and log_file != daemon_paths(config.blob_dir).log
        kept = ((["-v"] if args.verbose else []) + start_flags(args)
                + (["--log-file", str(log_file)] if own_log else []))
        return run_foreground(config, state_file, log_file=log_file, flags=kept)
    stats, log_file = start_detached_from(args, config)
    print(f"expertd serving {stats['blob_dir']} on {stats['endpoint']} (pid {stats['pid']}, "
          f"{stats['arena_rows']} rows, {size_text(stats['arena_bytes'])} arena)")
    if stats.get("cache_capped"):
        print(f"  --cache-gb {args.cache_gb} is more than every expert needs: the arena holds "
              f"all {stats['arena_rows']} in {size_text(stats['arena_bytes'])}")
    if config.pin_file:
        _report_pins(config)
    print(f"  log: {log_file}")
    return 0


def start_detached_from(args, config=None) -> tuple:
    """Start the daemon of the ``start`` flags ``args`` detached, as ``expertd start`` does
    (``config``: theirs, where already read).

    Returns:
        ``(stats, log_file)``: the daemon's stats once it answers, and its log's path.
    Raises:
        DaemonError: one already serves the directory, or the new one failed to come up.
    """
    from expertd.cli.lifecycle import start_detached

    config = config or config_from_args(args)
    log_file = _log_file(args, config)
    argv = [*(["-v"] if args.verbose else []), "start", "--blobs", str(config.blob_dir),
            *start_flags(args)]
    return start_detached(config.blob_dir, argv, log_file), log_file


def _report_pins(config) -> None:
    """Once the daemon has read its pinned experts, say which it could not (their blob
    failed its checksum, or a read failed): they are served by no one until fixed."""
    from expertd.connection import Connection
    from expertd.protocol import Op

    pins = {tuple(k) for k in read_pin_file(config.pin_file)}
    deadline = time.monotonic() + PIN_WAIT
    try:
        with Connection(config.blob_dir) as conn:
            while True:  # until its pins (read first) and warm-up are read, or PIN_WAIT
                stats = conn.request(Op.STATS, timeout=5.0)
                if not stats.get("background_pending") or time.monotonic() > deadline:
                    break
                time.sleep(PIN_POLL)
    except (DaemonError, OSError):
        return  # it went away: status says why
    shown = stats.get("failed_experts", [])
    bad = [(la, ex, why) for la, ex, why in shown if (la, ex) in pins]
    for layer, expert, why in bad:
        print(f"  pin layer {layer} expert {expert} cannot be served: {why}", file=sys.stderr)
    unnamed = stats.get("failed_count", len(shown)) - len(shown)
    if bad and len(bad) == len(shown) and unnamed > 0:  # (STATS names failed pins first)
        print(f"  and {unnamed} more experts, pinned ones among them, cannot be served",
              file=sys.stderr)
    if bad:
        print(f"  check the blobs: expertd verify --blobs {config.blob_dir}", file=sys.stderr)


def attached_clients(blob_dir) -> list:
    """``[(pid, kind)]`` of the client processes attached to the daemon of ``blob_dir`` (empty
    if it does not answer within a moment); kind is the expertd subcommand a client runs
    (serve, chat, generate, ...) or its program's name."""
    from expertd.connection import Connection
    from expertd.protocol import Op

    try:
        with Connection(blob_dir) as conn:
            stats = conn.request(Op.STATS, timeout=2.0)
    except (DaemonError, OSError):
        return []
    return [(c["pid"], process_kind(c["pid"])) for c in stats.get("client_pools", [])]


def process_kind(pid: int) -> str:
    """What process ``pid`` is, from its command line: an expertd subcommand's name, else its
    program's name ("a process" where its command line cannot be read)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # no /proc (macOS): ps says it
        try:
            done = subprocess.run(["ps", "-p", str(pid), "-o", "command="], capture_output=True,
                                  text=True, timeout=5)
            argv = done.stdout.split()
        except (OSError, subprocess.SubprocessError):
            return "a process"
    words = [Path(a).name for a in argv if a]
    for i, word in enumerate(words):
        if word == "expertd" or (word == "-m" and i + 1 < len(words)
                                 and words[i + 1] == "expertd"):
            rest = [w for w in words[i + 1:] if not w.startswith("-") and w != "expertd"]
            if rest:
                return rest[0]
    return words[0] if words else "a process"


def _cmd_stop(args) -> int:
    from expertd.cli.lifecycle import remove_dead, stop
    from expertd.errors import BlobStoreError
    from expertd.manifest import blob_dir_problem

    clients = attached_clients(Path(args.blobs))
    try:
        pid = stop(Path(args.blobs), timeout=args.timeout)
    except DaemonNotRunning as exc:
        removed = remove_dead(Path(args.blobs))
        if removed:
            print(f"{exc}; removed what a killed one left: {', '.join(removed)}")
            return 0
        problem = blob_dir_problem(Path(args.blobs).expanduser())
        if problem is not None:  # a typo in the path: not a daemon that is already stopped
            raise BlobStoreError(f"{problem}; nothing was stopped") from None
        print(f"{exc}; nothing to stop")
        return 0
    print(f"stopped expertd pid {pid}")
    if clients:
        print(f"{_named(clients)}; {'they wait' if len(clients) != 1 else 'it waits'} for a "
              f"daemon to come back (expertd start --blobs {args.blobs}) up to its "
              "--reconnect-timeout")
    return 0


def _named(clients: list) -> str:
    """``N clients attached (serve pid P, ...)`` of :func:`attached_clients`' list."""
    named = ", ".join(f"{kind} pid {client}" for client, kind in clients)
    return f"{len(clients)} client{'s' * (len(clients) != 1)} attached ({named})"


def _cmd_restart(args) -> int:
    from expertd.cli.lifecycle import stop

    if args.foreground:
        raise ValueError("restart starts the daemon detached; for --foreground, run stop "
                         "then start --foreground")
    from expertd.paths import daemon_paths
    from expertd.runfile import read_run_info, serving_epoch

    paths = daemon_paths(args.blobs)
    info = read_run_info(paths) if serving_epoch(paths) else None  # None: nothing runs
    _refuse_a_services_daemon(paths, info)
    args, kept, given, source = _kept_flags(args, paths, info)
    if kept:
        anew = f"; with {' '.join(given)} anew" if given else ""
        print(f"keeping the flags {source}: {' '.join(kept)}{anew}")
    try:
        config_from_args(args)  # refuse bad flags before stopping a daemon that works
    except ValueError as exc:
        if not kept or str(exc).split(" ", 1)[0] in (given or [])[::2]:
            raise  # a flag given anew: its own error
        kind = FlagError if isinstance(exc, FlagError) else ValueError
        raise kind(f"{exc} (a flag {source}; restart it with the flags it should have)"
                   ) from None
    clients = attached_clients(Path(args.blobs))
    try:
        print(f"stopped expertd pid {stop(Path(args.blobs), timeout=args.timeout)}")
    except DaemonNotRunning as exc:
        print(f"{exc}; starting one")
    status = _cmd_start(args)
    if clients:
        print(f"{_named(clients)}; each attaches to the new daemon at its next request")
    return status


def _refuse_a_services_daemon(paths, info) -> None:
    """A daemon a launchd agent or systemd unit runs (``info``: the run file of the daemon of
    ``paths`` that runs, or None) is restarted by its manager, with its unit's flags: one
    restarted by hand would leave the service failing beside it."""
    if info is None or not info.service:
        return
    import shlex

    from expertd.cli.service_plan import restart_command

    platform = "linux" if info.service.endswith(".service") else "macos"
    manager = shlex.join(restart_command(platform, info.service))
    raise DaemonError(f"expertd pid {info.pid} is the service {info.service}'s: restart it "
                      f"with {manager} (its flags are its unit's: expertd service install "
                      f"--blobs {paths.blob_dir} FLAGS rewrites them)")


def _kept_flags(args, paths, info) -> tuple:
    """``(args, kept, given, source)``: a restart keeps the flags the running daemon was
    started with (``info``, its run file), or where none runs those it last ran with
    (runfile's last flags of ``paths``), as ``pg_ctl restart`` keeps a server's options, but
    for those it is given anew; ``kept`` is the list it keeps (None where there is none to
    keep), ``given`` the flags given anew, each with its value, ``source`` whose flags they
    are, in words."""
    from expertd.runfile import read_last_flags

    given = {}  # the options given anew, by flag (at their default value too)
    for option in START_OPTIONS:
        if hasattr(args, option.dest):
            given[option.flag] = (option.dest, getattr(args, option.dest))
        else:  # restart's parser sets no defaults: not given here
            setattr(args, option.dest, option.default)
    if info is not None:
        recorded, source = info.flags, "it was started with"
    else:
        recorded, source = read_last_flags(paths), "it last ran with"
    if not recorded:
        return args, None, None, source
    rest = [f for f in recorded if f != "-v"]
    # Those given anew are not parsed from the record: a file gone since, or another version's
    # value, must not stand in the way of the flag that replaces it.
    rest = [word for flag, value in zip(rest[::2], rest[1::2]) if flag not in given
            for word in (flag, value)]
    parser = argparse.ArgumentParser(prog="expertd restart", add_help=False)
    add_start_flags(parser)  # restart's own flags (see add_subcommands), but --timeout
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            again = parser.parse_args(["--blobs", str(args.blobs), *rest])
    except SystemExit:  # written by another expertd version, or a file gone since
        why = said.getvalue().strip().splitlines()[-1].split(": error: ", 1)[-1]
        if info is None:  # nothing runs: the defaults and those given start it
            print(f"the flags {source} ({' '.join(rest)}) do not go now ({why}); starting "
                  "with the defaults and the flags given", file=sys.stderr)
            return args, None, None, source
        raise ValueError(f"the flags {source} ({' '.join(rest)}) do not go now ({why}); "
                         "restart it with the flags it should have") from None
    for name in ("command", "func", "foreground", "timeout"):
        setattr(again, name, getattr(args, name))
    again.verbose = args.verbose or "-v" in recorded
    for dest, value in given.values():  # given anew: they replace the recorded ones
        setattr(again, dest, value)
    kept = (["-v"] if "-v" in recorded else []) + rest  # the recorded ones not given anew
    return again, kept or None, [word for flag, (_, value) in given.items()
                                 for word in (flag, str(value))], source


# ---- status ------------------------------------------------------------------------------------

def status_lines(s: dict) -> list:
    return [
        f"expertd pid {s['pid']} serving {s['blob_dir']}",
        f"  endpoint     {s['endpoint']}",
        f"  uptime       {s['uptime_s']:.1f} s",
        f"  arena        {size_text(s['arena_bytes'])}, {s['rows_used']}/{s['arena_rows']} "
        f"rows used, {s['pinned']} pinned",
        f"  hits/misses  {s['hits']}/{s['misses']} (hit rate {s['hit_rate']:.1%})",
        f"  prefetch     {s['prefetch']}: {s['prefetch_fills']} read ahead into "
        f"{s['side_rows']} side rows, {s['prefetch_hits']} used, {s['prefetch_wasted']} "
        f"wasted, {s['prefetch_dropped']} dropped, {s['prefetch_shed']} shed (no "
        "spare worker)",
        f"  read         {s['bytes_read'] / 2**20:.1f} MiB in {s['fills']} fills, "
        f"{s['fill_gbps']:.2f} GB/s while filling",
        *failed_lines(s),
        *([f"  remote       {r['rows_present']}/{r['rows_total']} rows present, "
           f"{r['bytes_fetched'] / 2**20:.1f} MiB fetched in {r['fetch_requests']} requests, "
           f"{r['pending']} pending, {r['fetch_errors']} failed, from {r['source']}"]
          if (r := s.get("remote")) else []),
        f"  clients      {s['clients']} connected, {s['leases']} leases",
        *[f"    {process_kind(c['pid'])} pid {c['pid']}: pools {c['pool_bytes'] / 2**20:.1f} MiB, "
          f"{c.get('steps', 0)} steps, "
          f"{c.get('host_waits', 0) / max(1, c.get('steps', 0)):.2f} host waits a step"
          + (f", {c.get('replays', 0)} replayed{replay_causes(c)}" if c.get("replays") else "")
          + (f", pulled {c['pulled_rows'] / max(1, c.get('steps', 0)):.1f} rows "
             f"({c['pulled_bytes'] / max(1, c.get('steps', 0)) / 2**20:.2f} MiB) a step"
             if c.get("pulled_rows") else "")
          + pull_rate(c.get("pull_timed_bytes", 0), c.get("pull_us", 0) / 1e6)
          + batch_sharing(c)
          for c in s.get("client_pools", [])],
        f"  epochs       {s.get('epoch_clients', 0)} records given out, "
        f"{s.get('deferred_fills', 0)} refills waited for a step to end (longest "
        f"{s.get('epoch_wait_max_s', 0.0):.3f} s), {s.get('epochs_lost', 0)} epochs lost",
        f"  log          {s['log']}",
    ]


def failed_lines(s: dict) -> list:
    """Status lines naming the experts whose latest read failed, and the remedy (none if
    every fill succeeded)."""
    failed = s.get("failed_experts") or []
    count = s.get("failed_count", len(failed))
    if not s.get("fill_errors") and not failed:
        return []
    lines = [f"  failed       {s.get('fill_errors', 0)} fills failed; "
             + (f"{count} expert{'s' * (count != 1)} cannot be served now"
                + (f" (the first {len(failed)}, pinned ones first):" if count > len(failed)
                   else ":") if failed else "each was read again since")]
    lines += [f"    layer {layer} expert {expert}: {why}" for layer, expert, why in failed]
    if failed:
        lines.append(f"    check the blobs: expertd verify --blobs {s['blob_dir']} (a damaged "
                     "blob: convert the checkpoint again)")
    return lines


def log_location(blob_dir, run: Path | None = None) -> str:
    """Where the daemon of ``blob_dir`` logs: the --log-file it was started with (its run
    file), else its service's log if one is installed here, else the runtime directory's
    rotating log of detached daemons (``run``: another runtime directory's daemon)."""
    from expertd.cli.service_plan import make_plan
    from expertd.paths import daemon_paths
    from expertd.runfile import read_run_info

    paths = daemon_paths(blob_dir, run)
    info = read_run_info(paths)
    flags = info.flags if info is not None and info.flags else []
    if "--log-file" in flags[:-1]:
        return flags[flags.index("--log-file") + 1]
    plan = make_plan(blob_dir)
    if info is not None:  # it runs (or ran, and left its run file): its own log
        return plan.log_hint if info.service == plan.name else str(paths.log)
    return plan.log_hint if plan.path.exists() else str(paths.log)


def snapshot(args) -> tuple:
    """``(exit code, text or JSON-able value)`` of one status look.

    ``args`` has ``blobs`` (None: every daemon of this user), ``json`` and ``timeout``; the
    code is 0, or NOT_RUNNING when nothing answers.
    """
    from expertd.cli.lifecycle import list_sockets
    from expertd.connection import Connection
    from expertd.manifest import blob_dir_problem
    from expertd.paths import daemon_paths
    from expertd.protocol import Op
    from expertd.runfile import leftover, lock_held

    targets = [dict(blob_dir=args.blobs)] if args.blobs else [
        dict(socket=str(s)) for s in list_sockets()]
    results, notes, silent, down = [], [], [], []
    for target in targets:
        # A free lock means no daemon (a killed one leaves its socket behind): say so at once
        # rather than wait for an answer that cannot come.
        lock = (daemon_paths(args.blobs).lock if args.blobs else
                Path(target["socket"]).with_suffix(".lock"))
        if not lock_held(lock):
            if args.blobs:
                blob_dir = Path(args.blobs).expanduser().resolve()
                advice = blob_dir_problem(blob_dir) or (f"start one with: expertd start "
                                                        f"--blobs {blob_dir}")
                return _not_running(args, f"no expertd serves {blob_dir}: not running (its lock "
                                          f"is free); {advice}")
            socket = Path(target["socket"])
            left = leftover(socket.with_suffix(".run"), socket)
            if left is not None:  # a killed daemon's arena: memory held by nothing
                down.append({"running": False, "socket": str(socket),
                             "blob_dir": left["blob_dir"],
                             "log": left["blob_dir"] and log_location(left["blob_dir"]),
                             "leftover": left})
                notes.append(f"{socket}: not running; {_leftover_text(left)}")
            else:
                notes.append(f"{socket}: not running (its lock is free)")
            continue
        try:
            with Connection(**target) as conn:
                stats = conn.request(Op.STATS, timeout=args.timeout)
            for client in stats.get("client_pools", []):  # named as the text names it
                client["kind"] = process_kind(client["pid"])
            results.append({"running": True, **stats, "log": log_location(stats["blob_dir"])})
        except DaemonError as exc:
            if args.blobs and isinstance(exc, DaemonNotRunning):
                return _not_running(args, str(exc))
            # Its lock is held but it does not answer (stopped, stuck): said, never left out.
            silent.append({"running": True, "answering": False, "error": str(exc),
                           **({"blob_dir": str(Path(args.blobs).expanduser().resolve())}
                              if args.blobs else {"socket": target["socket"]})})
            if args.blobs and not args.json:
                raise
            notes.append(f"{target.get('socket', args.blobs)}: not answering ({exc})")
    if args.json:
        # One shape: a list of daemons, with --blobs or without (killed ones that left an
        # arena included); exit status 3 when none runs, as in text.
        code = 1 if args.blobs and silent else 0 if results or silent else NOT_RUNNING
        return code, results + silent + down
    if not results:
        from expertd.paths import runtime_dir, state_dir
        from expertd.runfile import claims_elsewhere

        there = [f"{c['blob_dir']}: served by expertd pid {c['pid']} from the runtime "
                 f"directory {c['runtime']}, out of this one's reach (XDG_RUNTIME_DIR differs)"
                 for c in claims_elsewhere(state_dir(), runtime_dir())]
        return NOT_RUNNING, "\n".join(notes + there + ["no expertd is running here" if there
                                                       else "no expertd is running"])
    # A blank line between two daemons.
    return 0, "\n\n".join(["\n".join(status_lines(s)) for s in results] + notes)


def _not_running(args, message: str) -> tuple:
    """Status's answer for ``--blobs`` when no daemon serves it, naming what a killed daemon
    left behind (``leftover`` in JSON: its arena's path and size, or null)."""
    from expertd.paths import daemon_paths
    from expertd.runfile import claimant, claimant_runtime, elsewhere_text, leftover, lock_held

    blob_dir = str(Path(args.blobs).expanduser().resolve())
    paths = daemon_paths(blob_dir)
    left = None if lock_held(paths.lock) else leftover(paths.runfile, paths.socket)
    # served_from: {"pid", "runtime"} of a daemon serving it from another runtime directory,
    # whose log is the one named
    other = claimant(paths)
    down = {"running": False, "blob_dir": blob_dir,
            "log": log_location(blob_dir, claimant_runtime(other)),
            "leftover": left, "served_from": other}
    if args.json:
        return NOT_RUNNING, [down]
    text = f"{elsewhere_text(paths, other) or message}\n  log: {down['log']}"
    if left:
        text += f"\n  {_leftover_text({**left, 'blob_dir': blob_dir})}"
    return NOT_RUNNING, text


def _leftover_text(left: dict) -> str:
    """What a killed daemon left (runfile.leftover), and the command that removes it."""
    blob_dir = left["blob_dir"] or "ITS_BLOB_DIR"
    return (f"left behind by a killed expertd (pid {left['pid']}): its arena {left['path']} "
            f"({size_text(left['bytes'])} of memory held by nothing)"
            f"{', its socket' if left['socket'] else ''} and run files; remove them with: "
            f"expertd stop --blobs {blob_dir}")


def _cmd_status(args) -> int:
    if args.watch is None:
        from expertd.cli.output import answer

        code, out = snapshot(args)
        if args.json:
            return answer(json.dumps(out, indent=2), code)
        return answer(out, code, file=sys.stdout if code == 0 else sys.stderr)
    clear = sys.stdout.isatty() and not args.json
    try:
        while True:
            code, out = snapshot(args)
            if clear:
                print("\033[H\033[2J", end="")
            # One JSON document per line, so that a reader can follow it line by line.
            print(json.dumps(out) if args.json else
                  f"{time.strftime('%H:%M:%S')} (every {args.watch:g} s, Ctrl-C to stop)\n{out}",
                  flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


# ---- the parser --------------------------------------------------------------------------------

def add_subcommands(sub) -> None:
    p = sub.add_parser("start", help="start the daemon for a blob directory",
                       description="Start the expertd daemon that serves BLOB_DIR: it creates "
                       "the shared-memory expert cache and listens on a per-user socket derived "
                       "from the directory. Returns once the daemon answers, unless "
                       "--foreground (for launchd/systemd or debugging).")
    add_start_flags(p)
    p.add_argument("--foreground", action="store_true",
                   help="serve in this process (default: detach once it answers)")
    p.set_defaults(func=_cmd_start)

    p = sub.add_parser("stop", help="stop the daemon of a blob directory",
                       description="SIGTERM the daemon: it fails in-flight requests, saves its "
                       "hot set, unlinks the arena and exits; SIGKILL after --timeout. "
                       "Stopping a daemon that does not run says so and succeeds.")
    p.add_argument("--blobs", required=True, metavar="BLOB_DIR")
    p.add_argument("--timeout", type=argtypes.seconds, default=10.0,
                   help="seconds before SIGKILL")
    p.set_defaults(func=_cmd_stop)

    p = sub.add_parser("restart", help="stop the daemon if it runs, then start it",
                       description="Stop the daemon of BLOB_DIR if one runs (as `stop`), then "
                       "start one detached (as `start`) with the flags the running daemon was "
                       "started with (as pg_ctl restart does), those given here replacing "
                       "theirs (a flag given at its default value drops the recorded one). Bad "
                       "flags are refused before the running daemon is stopped.")
    # No defaults: a flag given (even at its default value) replaces the recorded one, and
    # one not given keeps it (see _kept_flags).
    add_start_flags(p, defaults=False)
    p.add_argument("--timeout", type=argtypes.seconds, default=10.0,
                   help="seconds before SIGKILL of the old daemon")
    p.set_defaults(func=_cmd_restart, foreground=False)

    p = sub.add_parser("status", help="show what a daemon is doing",
                       description="Cache use, hits, misses, bytes read, fill throughput, "
                       "clients, the log's path. Without --blobs: every daemon of this user. "
                       f"Exits {NOT_RUNNING} when no daemon runs. --json prints a list of "
                       'daemons, one with --blobs ({"running": false, ...} when it does not '
                       "run).")
    p.add_argument("--blobs", metavar="BLOB_DIR",
                   help="the daemon of this blob directory (default: every daemon of yours)")
    p.add_argument("--json", action="store_true",
                   help="machine-readable output; with --watch, one JSON document per line "
                   "(default: off)")
    p.add_argument("--watch", type=argtypes.seconds, nargs="?", const=2.0, metavar="SECONDS",
                   help="refresh every SECONDS (2 if not given) until Ctrl-C (default: once)")
    p.add_argument("--timeout", type=argtypes.seconds, default=5.0,
                   help="seconds to wait for the daemon's answer")
    p.set_defaults(func=_cmd_status)
