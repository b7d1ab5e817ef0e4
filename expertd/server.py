"""The serving loop: one thread owns the ROUTER socket and dispatches each request.

What it decides lives in rooms of its own: the slot table (which row holds which expert), the
policy (which rows to evict), the lease book (which client holds which rows, which demands
wait) and the client registry (hello, heartbeat, time-to-dead). Fills run on the pread pool and
come back through a wake-up pipe polled next to the socket.
"""

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import zmq

from . import native
from .blobstore import BlobStore
from .clients import ClientRegistry
from .errors import ProtocolError
from .hotset import load_hot_set, read_pin_file, save_hot_set
from .io import FillPool
from .leases import Demand, LeaseBook
from .policy import LfuPolicy
from .protocol import (MAX_BODY, PROTOCOL_VERSION, ErrorCode, Op, parse_request, reply_error,
                       reply_ok)
from .shm.layout import Arena, Geometry, SlotState
from .slots import SlotTable

log = logging.getLogger("expertd")

TICK = 0.1
SHUTDOWN_GRACE = 5.0
MAX_QUEUED_PER_CLIENT = 32
RECV_BATCH = 256


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``expertd start`` decides, validated once."""

    blob_dir: Path
    cache_bytes: int
    workers: int = 8
    io: str = "direct"
    verify: str = "always"
    client_timeout: float = 10.0
    heartbeat_interval: float = 1.0
    lease_timeout: float = 30.0
    pin_file: Path | None = None
    auto_pin: int = 0
    save_interval: float = 60.0

    def __post_init__(self):
        if self.cache_bytes <= 0:
            raise ValueError("cache size must be positive")
        if self.workers < 1:
            raise ValueError("workers must be at least 1")
        if self.io not in ("direct", "buffered"):
            raise ValueError("io must be 'direct' or 'buffered'")
        if self.verify not in ("first", "always", "never"):
            raise ValueError("verify must be 'always', 'first' or 'never'")
        for name in ("client_timeout", "heartbeat_interval", "lease_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name.replace('_', ' ')} must be a positive number of seconds")
        if self.client_timeout <= self.heartbeat_interval:
            raise ValueError("client timeout must exceed the heartbeat interval")
        if self.auto_pin < 0:
            raise ValueError("auto-pin must not be negative")


def cache_limits(cache_rows: int) -> tuple:
    """``(max_pins, max_demand, client_cap)`` for a cache of ``cache_rows`` rows.

    Pins take at most a quarter of the rows. A demand (one client's group) takes at most half of
    the rest, and one client holds at most what leaves room for another client's largest group
    beside every pin: no client, however greedy, can starve the others.
    """
    max_pins = cache_rows // 4
    max_demand = max(1, (cache_rows - max_pins) // 2)
    client_cap = max(max_demand, cache_rows - max_pins - max_demand)
    return max_pins, max_demand, client_cap


class ExpertServer:
    """The daemon's state and serving loop.

    Args:
        config: the validated start-up configuration.
        paths: the daemon's :class:`~expertd.paths.DaemonPaths`.
        state_file: where the hot set is saved and read back.
        arena_name: the shared-memory name to create (random per start).
        epoch: this start's identity, published in the arena header and the hello.
    """

    def __init__(self, config: ServerConfig, paths, state_file: Path, arena_name: str,
                 epoch: int):
        self.config = config
        self.paths = paths
        self.state_file = state_file
        self.epoch = epoch
        self.store = BlobStore(config.blob_dir, direct=config.io == "direct")
        m = self.store.manifest
        self.n_experts = [layer.num_experts for layer in m.layers]
        g = self.geometry = Geometry.for_budget(len(m.layers), m.max_experts, m.stride,
                                                config.cache_bytes, side_rows=m.top_k)
        self.max_pins, self.max_demand, client_cap = cache_limits(g.cache_rows)
        # Checked before anything is created: more pins than PIN allows would leave demands
        # too few rows, and they would wait forever.
        self.pins = read_pin_file(config.pin_file) if config.pin_file is not None else []
        if len(set(self.pins)) > self.max_pins:
            raise ValueError(f"{config.pin_file}: {len(set(self.pins))} experts to pin, but a "
                             f"cache of {g.cache_rows} rows can pin at most {self.max_pins}")
        self.arena = Arena.create(arena_name, g, os.getpid(), epoch)
        try:
            self.arena.populate()
            self.table = SlotTable(self.arena)
            self.policy = LfuPolicy(g.cache_rows, g.n_layers, g.n_experts)
            self.book = LeaseBook(g.cache_rows, client_cap, MAX_QUEUED_PER_CLIENT,
                                  config.lease_timeout)
            self.clients = ClientRegistry(config.client_timeout)
            self.pool = FillPool(self.store, self.arena, config.workers, config.verify)
            self.background: deque = deque()
            self.background_rows: set = set()  # rows being filled for warm-up, prefetch or pins
            self.warm_total = self.warm_done = 0
            self._ticks = 0
            self._room_changed = False
            self.started = time.monotonic()
            self.running = True
            self.stopping = False
            self.counters = dict(demand_hits=0, client_hits=0, misses=0, bytes_read=0, fills=0,
                                 fill_errors=0, bad_requests=0, demands=0, internal_errors=0,
                                 busy=0, clients_timed_out=0)
            self.in_flight = 0
            self._busy_since = 0.0
            self.fill_seconds = 0.0
            self.ctx = zmq.Context()
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            # ZeroMQ drops (and disconnects) a peer whose frame is larger than any valid one,
            # before Python ever allocates it.
            self.router.setsockopt(zmq.MAXMSGSIZE, MAX_BODY)
            old = os.umask(0o177)  # the socket file is created 0600
            try:
                self.router.bind(paths.endpoint)
            finally:
                os.umask(old)
            self._load_state()
        except BaseException:
            self.arena.unlink()
            raise

    # ---- lifecycle -------------------------------------------------------------------------

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pool.wake_fd, zmq.POLLIN)
        log.info("serving %s on %s (%d rows of %d bytes, %.2f GiB, arena %s)", self.store.dir,
                 self.paths.endpoint, self.geometry.cache_rows, self.geometry.stride,
                 self.geometry.total_size / 2**30, self.arena.name)
        try:
            self._serve_loop(poller)
        finally:
            self._shutdown()

    def _serve_loop(self, poller) -> None:
        next_tick = next_save = time.monotonic()
        while self.running:
            events = dict(poller.poll(int(TICK * 1000)))
            if self.pool.wake_fd in events:
                self._completions()
            if self.router in events:
                for _ in range(RECV_BATCH):
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(frames)
            if self._room_changed and not self.stopping:
                self._retry_queued()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK
                self._tick(now)
            if now >= next_save:
                next_save = now + self.config.save_interval
                self._save_state()

    def request_stop(self, *_):
        self.running = False

    def _shutdown(self) -> None:
        """Fail what waits, let running reads finish (bounded), save, unlink, whatever fails."""
        log.info("shutting down")
        self.stopping = True
        self.background.clear()
        try:
            for d in self.book.pending():
                self._send(d.owner, reply_error(d.rid, bytes([Op.DEMAND]),
                                                ErrorCode.SHUTTING_DOWN, "expertd is stopping"))
            deadline = time.monotonic() + SHUTDOWN_GRACE
            while self.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
                self._completions()
            self._save_state()
            self.arena.header["serving"] = 0
        finally:
            readers_done = self.pool.close(timeout=1.0)
            self.router.close(linger=0)
            self.ctx.term()
            if readers_done:  # a read still stuck in the kernel keeps its descriptor
                self.store.close()
            self.arena.unlink()
            self.arena.close()
            try:
                os.unlink(self.paths.socket)
            except FileNotFoundError:
                pass

    # ---- requests --------------------------------------------------------------------------

    def _send(self, identity: bytes, frames: list) -> None:
        try:
            self.router.send_multipart([identity] + frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone or its queue is full; it will time out and retry

    def _dispatch(self, frames: list) -> None:
        identity, body = frames[0], frames[1:]
        rid = body[0] if body and len(body[0]) <= 16 else b""
        op_byte = body[1][:1] if len(body) > 1 else b""
        try:
            rid, op, req = parse_request(body)
            self._handle(identity, rid, op, req)
        except ProtocolError as exc:
            self.counters["bad_requests"] += 1
            log.warning("bad request from %s: %s", identity.hex()[:12], exc)
            self._send(identity, reply_error(rid, op_byte, ErrorCode(exc.code), str(exc)))
        except Exception:
            # A bug in a handler: say so in the log and to the client, and keep serving.
            self.counters["internal_errors"] += 1
            log.exception("internal error handling a request from %s", identity.hex()[:12])
            self._send(identity, reply_error(rid, op_byte, ErrorCode.INTERNAL,
                                             "internal error in expertd (see its log)"))

    def _handle(self, identity: bytes, rid: bytes, op: Op, req) -> None:
        now = time.monotonic()
        if op is Op.HEARTBEAT:
            known = self.clients.heartbeat(req.client, req.token, now)
            self._send(identity, reply_ok(rid, op, epoch=self.epoch, known=known))
            return
        if op is Op.HELLO:
            if req.version != PROTOCOL_VERSION:
                raise ProtocolError(f"protocol version {req.version} is not supported "
                                    f"(this expertd speaks {PROTOCOL_VERSION})", ErrorCode.VERSION)
            if req.client != identity:
                raise ProtocolError("the client id must be the socket's routing id")
            client = self.clients.hello(identity, req.pid, now)
            self._send(identity, reply_ok(rid, op, token=client.token, **self._hello()))
            return
        if op is Op.STATS:
            self._send(identity, reply_ok(rid, op, **self.stats()))
            return
        client = self.clients.seen(identity, now)
        if client is None:
            raise ProtocolError("say hello first", ErrorCode.NOT_HELLO)
        if op is Op.SHUTDOWN:
            self._send(identity, reply_ok(rid, op))
            self.running = False
        elif op is Op.GOODBYE:
            self._forget(self.clients.remove(identity))
        elif op is Op.RELEASE:
            if self.book.release(req.lease, owner=identity):  # only its owner may release it
                self._room_changed = True
        else:
            self._check_range(req)
            if op is Op.DEMAND:
                self._demand(identity, rid, req)
            elif op is Op.PREFETCH:
                room = self.geometry.cache_rows - len(self.background)  # hints past it drop
                self.background.extend((req.layer, e) for e in req.experts[:max(0, room)])
                self._top_up_background()
            elif op is Op.PIN:
                self._pin(client, rid, req)
            elif op is Op.UNPIN:
                for key in ((req.layer, e) for e in req.experts):
                    if key in client.pins:
                        client.pins.discard(key)
                        self.policy.drop(key)
                self._send(identity, reply_ok(rid, op, pinned=len(self.policy.pinned_keys)))

    def _check_range(self, req) -> None:
        if req.layer >= len(self.n_experts):
            raise ProtocolError(f"layer {req.layer} out of range (0..{len(self.n_experts) - 1})",
                                ErrorCode.OUT_OF_RANGE)
        n = self.n_experts[req.layer]
        bad = [e for e in req.experts if e >= n]
        if bad:
            raise ProtocolError(f"expert {bad[0]} out of range for layer {req.layer} "
                                f"(0..{n - 1})", ErrorCode.OUT_OF_RANGE)

    def _demand(self, identity: bytes, rid: bytes, req) -> None:
        self.counters["demands"] += 1
        if len(req.experts) > self.max_demand:
            raise ProtocolError(f"{len(req.experts)} experts in one demand; at most "
                                f"{self.max_demand} fit", ErrorCode.OUT_OF_RANGE)
        demand = Demand(identity, rid, req.layer, req.experts)
        if not self._start(demand) and not self.book.enqueue(demand):
            self.counters["busy"] += 1
            raise ProtocolError(f"{MAX_QUEUED_PER_CLIENT} demands of this client wait already; "
                                "release leases first", ErrorCode.BUSY)

    def _pin(self, client, rid: bytes, req) -> None:
        """A client's pins hold while it lives; only the pin file pins for good."""
        keys = [(req.layer, e) for e in req.experts if (req.layer, e) not in client.pins]
        new = sum(not self.policy.is_pinned(key) for key in keys)
        if self.policy.n_pinned_keys + new > self.max_pins:
            raise ProtocolError(f"at most {self.max_pins} experts can be pinned in this cache",
                                ErrorCode.OUT_OF_RANGE)
        for key in keys:
            self.policy.hold(key)
            client.pins.add(key)
        self.background.extendleft(keys)
        self._top_up_background()
        self._send(client.identity, reply_ok(rid, Op.PIN, pinned=len(self.policy.pinned_keys)))

    def _hello(self) -> dict:
        g = self.geometry
        m = self.store.manifest
        return dict(version=PROTOCOL_VERSION, arena=self.arena.name, epoch=self.epoch,
                    pid=os.getpid(), blob_dir=str(self.store.dir), model_type=m.model_type,
                    manifest=m.digest, n_layers=g.n_layers, n_experts=g.n_experts,
                    cache_rows=g.cache_rows, side_rows=g.side_rows, stride=g.stride,
                    max_demand=self.max_demand, client_cap=self.book.client_cap,
                    heartbeat_interval=self.config.heartbeat_interval,
                    client_timeout=self.config.client_timeout,
                    lease_timeout=self.config.lease_timeout)

    # ---- demand, fill, lease ---------------------------------------------------------------

    def _start(self, d: Demand) -> bool:
        """Lease what is resident, fill the rest; False (nothing held) if rows are short."""
        if not self.book.fits(d.owner, len(d.experts)):
            return False
        rows, need, waiting = [], [], set()
        for i, e in enumerate(d.experts):
            row, state = self.table.lookup(d.layer, e)
            if state == SlotState.READY or state == SlotState.FILLING:
                rows.append(row)
                if state == SlotState.FILLING:
                    waiting.add(row)
            else:
                rows.append(-1)
                need.append(i)
        if need:
            eligible = (self.book.leased == 0) & ~self.table.filling()
            eligible[[r for r in rows if r >= 0]] = False  # never evict what this demand uses
            victims = self.policy.victims(len(need), eligible, self.table.row_keys())
            if len(victims) < len(need):
                return False
            for i, row in zip(need, victims):
                self._fill(int(row), d.layer, d.experts[i])
                rows[i] = int(row)
                waiting.add(int(row))
        filled = set(need)
        for i, e in enumerate(d.experts):
            if i not in filled:  # a fill counts its own use
                self.policy.on_touched((d.layer, e))
        self.counters["demand_hits"] += len(d.experts) - len(need)
        self.counters["misses"] += len(need)
        self.book.grant(d, rows, waiting, time.monotonic())
        if not waiting:
            self._answer(d)
        return True

    def _fill(self, row: int, layer: int, expert: int) -> None:
        evicted = self.table.begin_fill(row, layer, expert)
        if evicted is not None and evicted[1]:
            self.policy.on_touched(*evicted)  # uses not harvested yet belong to the old key
        self.policy.on_touched((layer, expert))
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        self.in_flight += 1
        self.pool.submit(row, layer, expert)

    def _completions(self) -> None:
        done = self.pool.completions()
        for row, layer, expert, error in done:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.fill_seconds += time.monotonic() - self._busy_since
            self.table.end_fill(row, error is None)
            if error is None:
                self.counters["bytes_read"] += self.geometry.stride
                self.counters["fills"] += 1
            else:
                log.error("fill failed: %s", error[1])
                self.counters["fill_errors"] += 1
            if row in self.background_rows:
                self.background_rows.discard(row)
                self._warm_progress()
            for d in self.book.filled(row, error):
                self._answer(d)
        if done and not self.stopping:
            # Rows that were filling are eligible again: demands queued behind them may fit.
            self._room_changed = True
            self._top_up_background()

    def _answer(self, d: Demand) -> None:
        if d.error is not None:
            self.book.release(d.lease)
            self._room_changed = True
            self._send(d.owner, reply_error(d.rid, bytes([Op.DEMAND]), *d.error))
            return
        self.book.answered(d, time.monotonic())
        self._send(d.owner, reply_ok(d.rid, Op.DEMAND, rows=d.rows,
                                     versions=self.table.versions(d.rows), lease=d.lease))

    def _retry_queued(self) -> None:
        self._room_changed = False
        still = [d for d in self.book.take_queue()
                 if d.owner in self.clients and not self._start(d)]
        self.book.requeue_front(still)

    def _forget(self, client) -> None:
        """A client left or died: its leases, queued demands and pins go with it."""
        if client is None:
            return
        self.book.drop_owner(client.identity)
        for key in client.pins:
            self.policy.drop(key)
        client.pins.clear()
        self._room_changed = True

    def _top_up_background(self) -> None:
        """Start queued background fills (warm-up, prefetch, pins) while workers are free."""
        while self.background and len(self.background_rows) < self.config.workers:
            layer, expert = self.background.popleft()
            if self.table.lookup(layer, expert)[1] != SlotState.EMPTY:
                continue
            eligible = (self.book.leased == 0) & ~self.table.filling()
            victims = self.policy.victims(1, eligible, self.table.row_keys())
            if not victims:
                self.background.clear()
                return
            row = int(victims[0])
            self._fill(row, layer, expert)
            self.background_rows.add(row)

    def _warm_progress(self) -> None:
        if self.warm_done >= self.warm_total:
            return
        self.warm_done += 1
        step = max(1, self.warm_total // 10)
        if self.warm_done % step == 0 or self.warm_done == self.warm_total:
            log.info("warm-up: %d/%d experts read", self.warm_done, self.warm_total)

    # ---- housekeeping ----------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        rows, counts = self.table.harvest()
        for row, count in zip(rows.tolist(), counts.tolist()):
            self.policy.on_touched(self.table.key(row), count)
        self.counters["client_hits"] += int(counts.sum())
        for client in self.clients.dead(now):
            log.info("client pid %d timed out; reclaiming its %d leased rows", client.pid,
                     self.book.held(client.identity))
            self.counters["clients_timed_out"] += 1
            self._forget(client)
        if self.book.expire(now):
            self._room_changed = True
        self._ticks += 1
        if self.config.auto_pin and self._ticks % 10 == 0:
            room = self.max_pins - self.policy.n_pinned_keys
            self.policy.auto_pin(max(0, min(self.config.auto_pin, room)), self.table.row_keys())

    def stats(self) -> dict:
        c = self.counters
        hits = c["demand_hits"] + c["client_hits"]
        g = self.geometry
        busy = self.fill_seconds + (time.monotonic() - self._busy_since if self.in_flight else 0)
        return dict(
            endpoint=self.paths.endpoint, arena=self.arena.name, pid=os.getpid(),
            blob_dir=str(self.store.dir), epoch=self.epoch, log=str(self.paths.log),
            uptime_s=round(time.monotonic() - self.started, 3),
            arena_bytes=g.total_size, arena_rows=g.cache_rows, stride=g.stride,
            rows_used=self.table.rows_used(),
            hits=hits, demand_hits=c["demand_hits"], client_hits=c["client_hits"],
            misses=c["misses"], hit_rate=round(hits / max(1, hits + c["misses"]), 4),
            bytes_read=c["bytes_read"], fills=c["fills"], fill_errors=c["fill_errors"],
            fill_seconds=round(busy, 6),
            fill_gbps=round(c["bytes_read"] / busy / 1e9, 3) if busy else 0.0,
            pinned=self.policy.n_pinned_rows(self.table.row_keys()), clients=len(self.clients),
            leases=len(self.book), leased_rows=int(self.book.leased.sum()),
            queued=self.book.queued(), lease_expiries=self.book.expired,
            max_demand=self.max_demand, client_cap=self.book.client_cap,
            bad_requests=c["bad_requests"], internal_errors=c["internal_errors"],
            busy=c["busy"], clients_timed_out=c["clients_timed_out"], demands=c["demands"],
            in_flight=self.in_flight, io=self.store.io_mode, io_reason=self.store.io_reason,
            workers=self.config.workers, verify=self.config.verify,
            implementation=native.IMPLEMENTATION)

    def _valid_key(self, layer, expert) -> bool:
        return (type(layer) is int and type(expert) is int and 0 <= layer < len(self.n_experts)
                and 0 <= expert < self.n_experts[layer])

    # ---- warm restart ----------------------------------------------------------------------

    def _save_state(self) -> None:
        try:
            save_hot_set(self.state_file, self.store.dir, self.policy, self.geometry.cache_rows)
        except OSError as exc:
            log.warning("could not save the hot set to %s: %s", self.state_file, exc)

    def _load_state(self) -> None:
        keys = load_hot_set(self.state_file, self.policy)
        for key in self.pins:
            if not self._valid_key(*key):
                raise ValueError(f"{self.config.pin_file}: no expert {key[1]} in layer {key[0]}")
            self.policy.pin(key)
        for key in sorted(self.policy.pinned_keys)[self.max_pins:]:
            log.warning("not pinning %s: the cache can pin at most %d", key, self.max_pins)
            self.policy.unpin(key)
        keys = list(dict.fromkeys(sorted(self.policy.pinned_keys) + keys))
        keys = [key for key in keys if self._valid_key(*key)][:self.geometry.cache_rows]
        if keys:
            log.info("warming %d experts from %s", len(keys), self.state_file)
        self.warm_total = len(keys)
        self.background.extend(keys)
        self._top_up_background()
