"""The serving loop: one thread owns the ROUTER socket, the slot table and the policy.

Demands are answered once every row they need is filled; the rows are leased to the client
until it releases them (or its heartbeat stops), so they cannot be evicted while it copies.
Fills run on the pread pool and come back through a wake-up pipe polled next to the socket.
"""

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from . import native
from .blobstore import BlobStore
from .errors import ProtocolError
from .hotset import load_hot_set, read_pin_file, save_hot_set
from .io import FillPool
from .policy import LfuPolicy
from .protocol import PROTOCOL_VERSION, ErrorCode, Op, parse_request, reply_error, reply_ok
from .shm.layout import Arena, Geometry, SlotState

log = logging.getLogger("expertd")

TICK = 0.1
SHUTDOWN_GRACE = 5.0


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
            raise ValueError("verify must be 'first', 'always' or 'never'")
        if self.client_timeout <= self.heartbeat_interval:
            raise ValueError("client timeout must exceed the heartbeat interval")
        if self.auto_pin < 0:
            raise ValueError("auto-pin must not be negative")


@dataclass
class Pending:
    """A demand waiting for fills (or for rows to become free)."""

    identity: bytes  # the client's routing id: leases and expiry are keyed by it
    rid: bytes
    layer: int
    experts: tuple
    rows: list = field(default_factory=list)
    waiting: set = field(default_factory=set)
    lease: int = 0
    error: tuple | None = None


@dataclass
class Client:
    identity: bytes
    pid: int
    last_seen: float
    leases: set = field(default_factory=set)


class ExpertServer:
    def __init__(self, config: ServerConfig, paths, state_file: Path):
        self.config = config
        self.paths = paths
        self.state_file = state_file
        self.store = BlobStore(config.blob_dir, direct=config.io == "direct")
        m = self.store.manifest
        self.n_experts = [layer.num_experts for layer in m.layers]
        self.geometry = Geometry.for_budget(len(m.layers), m.max_experts, m.stride,
                                            config.cache_bytes, side_rows=m.top_k)
        g = self.geometry
        self.max_demand = max(1, g.cache_rows // 2)
        self.max_pins = g.cache_rows // 4
        # Checked before anything is created: more pins than PIN allows would leave demands
        # too few rows, and they would wait forever.
        self.pins = read_pin_file(config.pin_file) if config.pin_file is not None else []
        if len(set(self.pins)) > self.max_pins:
            raise ValueError(f"{config.pin_file}: {len(set(self.pins))} experts to pin, but a "
                             f"cache of {g.cache_rows} rows can pin at most {self.max_pins}")
        self.epoch = int.from_bytes(os.urandom(8), "little") >> 1
        self.arena = Arena.create(paths.shm_name, g, os.getpid(), self.epoch)
        self.arena.populate()
        self.raw = self.arena.raw
        self.slots = self.arena.slots
        self.slot_of = self.arena.slot_of.reshape(g.n_layers, g.n_experts)
        self.policy = LfuPolicy(g.cache_rows, g.n_layers, g.n_experts)
        self.pool = FillPool(self.store, self.arena, config.workers, config.verify)
        self.leased = np.zeros(g.total_rows, dtype=np.int32)
        self.leases: dict = {}
        self.clients: dict = {}
        self.waiters: dict = {}
        self.queued: deque = deque()
        self.background: deque = deque()
        self.background_rows: set = set()  # rows being filled for warm-up, prefetch or pins
        self.warm_total = self.warm_done = 0
        self._ticks = 0
        self._next_lease = 1
        self._last_hits = np.zeros(g.cache_rows, dtype=np.uint64)
        self.started = time.monotonic()
        self.running = True
        self.stopping = False
        self.counters = dict(demand_hits=0, client_hits=0, misses=0, bytes_read=0, fills=0,
                             fill_errors=0, bad_requests=0, demands=0)
        self.in_flight = 0
        self._busy_since = 0.0
        self.fill_seconds = 0.0
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        old = os.umask(0o177)  # the socket file is created 0600
        try:
            self.router.bind(paths.endpoint)
        finally:
            os.umask(old)
        self._load_state()

    # ---- lifecycle -------------------------------------------------------------------------

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pool.wake_fd, zmq.POLLIN)
        next_tick = next_save = time.monotonic()
        log.info("serving %s on %s (%d rows of %d bytes, %.2f GiB)", self.store.dir,
                 self.paths.endpoint, self.geometry.cache_rows, self.geometry.stride,
                 self.geometry.total_size / 2**30)
        try:
            self._serve_loop(poller, next_tick, next_save)
        finally:
            self._shutdown()

    def _serve_loop(self, poller, next_tick: float, next_save: float) -> None:
        while self.running:
            events = dict(poller.poll(int(TICK * 1000)))
            if self.pool.wake_fd in events:
                self._completions()
            if self.router in events:
                for _ in range(256):
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._dispatch(frames)
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
        pending = {id(p): p for p in self.queued}
        pending.update((id(p), p) for ps in self.waiters.values() for p in ps)
        self.queued.clear()
        self.waiters.clear()
        self.background.clear()
        try:
            for p in pending.values():
                self._send(p.identity, reply_error(p.rid, bytes([Op.DEMAND]),
                                                   ErrorCode.SHUTTING_DOWN, "expertd is stopping"))
            deadline = time.monotonic() + SHUTDOWN_GRACE
            while self.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
                self._completions()
            self._save_state()
            self.arena.header["serving"] = 0
        finally:
            self.pool.close(wait=self.in_flight == 0)
            self.router.close(linger=0)
            self.ctx.term()
            if self.in_flight == 0:  # a read still stuck in the kernel keeps its descriptor
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
        try:
            rid, op, req = parse_request(body)
            self._handle(identity, rid, op, req)
        except ProtocolError as exc:
            self.counters["bad_requests"] += 1
            log.warning("bad request from %s: %s", identity.hex()[:12], exc)
            rid = body[0] if body and len(body[0]) <= 16 else b""
            op_byte = body[1][:1] if len(body) > 1 else b""
            self._send(identity, reply_error(rid, op_byte, ErrorCode(exc.code), str(exc)))

    def _handle(self, identity: bytes, rid: bytes, op: Op, req) -> None:
        now = time.monotonic()
        if op is Op.HEARTBEAT:
            client = self.clients.get(req.client)
            if client is not None:
                client.last_seen = now
            self._send(identity, reply_ok(rid, op, epoch=self.epoch, known=client is not None))
            return
        if op is Op.HELLO:
            if req.version != PROTOCOL_VERSION:
                raise ProtocolError(f"protocol version {req.version} is not supported "
                                    f"(this expertd speaks {PROTOCOL_VERSION})", ErrorCode.VERSION)
            if req.client != identity:
                raise ProtocolError("the client id must be the socket's routing id")
            # A second hello must not orphan the leases the client already holds.
            old = self.clients.get(identity)
            self.clients[identity] = Client(identity, req.pid, now,
                                            old.leases if old is not None else set())
            self._send(identity, reply_ok(rid, op, **self._hello()))
            return
        if op is Op.STATS:
            self._send(identity, reply_ok(rid, op, **self.stats()))
            return
        if op is Op.SHUTDOWN:
            self._send(identity, reply_ok(rid, op))
            self.running = False
            return
        client = self.clients.get(identity)
        if client is None:
            raise ProtocolError("say hello first", ErrorCode.NOT_HELLO)
        client.last_seen = now
        if op is Op.RELEASE:
            entry = self.leases.get(req.lease)
            if entry is not None and entry[0] == identity:  # only its owner may release a lease
                self._release(req.lease, client)
            return
        self._check_range(req)
        if op is Op.DEMAND:
            self.counters["demands"] += 1
            if len(req.experts) > self.max_demand:
                raise ProtocolError(f"{len(req.experts)} experts in one demand; at most "
                                    f"{self.max_demand} fit", ErrorCode.OUT_OF_RANGE)
            p = Pending(identity, rid, req.layer, req.experts)
            if not self._start(p):
                self.queued.append(p)
        elif op is Op.PREFETCH:
            room = self.geometry.cache_rows - len(self.background)  # hints past this are dropped
            self.background.extend((req.layer, e) for e in req.experts[:max(0, room)])
            self._top_up_background()
        elif op is Op.PIN:
            new = sum(not self.policy.is_pinned((req.layer, e)) for e in req.experts)
            if self.policy.n_explicit_pins + new > self.max_pins:
                raise ProtocolError(f"at most {self.max_pins} experts can be pinned in this "
                                    "cache", ErrorCode.OUT_OF_RANGE)
            for e in req.experts:
                self.policy.pin((req.layer, e))
            self.background.extendleft((req.layer, e) for e in req.experts)
            self._top_up_background()
            self._send(identity, reply_ok(rid, op, pinned=len(self.policy.pinned_keys)))
        elif op is Op.UNPIN:
            for e in req.experts:
                self.policy.unpin((req.layer, e))
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

    def _hello(self) -> dict:
        g = self.geometry
        m = self.store.manifest
        return dict(version=PROTOCOL_VERSION, arena=self.arena.name, epoch=self.epoch,
                    pid=os.getpid(), blob_dir=str(self.store.dir), model_type=m.model_type,
                    manifest=m.digest, n_layers=g.n_layers, n_experts=g.n_experts,
                    cache_rows=g.cache_rows,
                    side_rows=g.side_rows, stride=g.stride, max_demand=self.max_demand,
                    heartbeat_interval=self.config.heartbeat_interval,
                    client_timeout=self.config.client_timeout)

    # ---- demand, fill, lease ---------------------------------------------------------------

    def _resident(self, layer: int, expert: int) -> tuple:
        """(row, state) of a key that a row holds, or (-1, EMPTY)."""
        row = int(self.slot_of[layer, expert])
        if row >= 0:
            rec = self.slots[row]
            if rec["layer"] == layer and rec["expert"] == expert:
                return row, int(rec["state"])
        return -1, SlotState.EMPTY

    def _eligible(self) -> np.ndarray:
        n = self.geometry.cache_rows
        return (self.leased[:n] == 0) & (self.slots["state"][:n] != SlotState.FILLING)

    def _start(self, p: Pending) -> bool:
        """Lease what is resident, fill the rest; False (nothing held) if rows are short."""
        rows, need, waiting = [], [], set()
        for i, e in enumerate(p.experts):
            row, state = self._resident(p.layer, e)
            if state == SlotState.READY or state == SlotState.FILLING:
                rows.append(row)
                if state == SlotState.FILLING:
                    waiting.add(row)
            else:
                rows.append(-1)
                need.append(i)
        held = [r for r in rows if r >= 0]
        self.leased[held] += 1
        victims = self.policy.victims(len(need), self._eligible()) if need else []
        if len(victims) < len(need):
            self.leased[held] -= 1
            return False
        for i, row in zip(need, victims):
            self._fill(int(row), p.layer, p.experts[i])
            rows[i] = int(row)
            waiting.add(int(row))
            self.leased[row] += 1
        for r in held:
            self.policy.on_touched((p.layer, int(self.slots[r]["expert"])))
        self.counters["demand_hits"] += len(p.experts) - len(need)
        self.counters["misses"] += len(need)
        p.rows, p.waiting = rows, waiting
        p.lease = self._next_lease
        self._next_lease += 1
        self.leases[p.lease] = (p.identity, rows)
        client = self.clients.get(p.identity)
        if client is not None:
            client.leases.add(p.lease)
        for row in waiting:
            self.waiters.setdefault(row, []).append(p)
        if not waiting:
            self._finish(p)
        return True

    def _fill(self, row: int, layer: int, expert: int) -> None:
        rec = self.slots[row:row + 1]
        if rec["state"][0] != SlotState.EMPTY:
            old_layer, old_expert = int(rec["layer"][0]), int(rec["expert"][0])
            if self.slot_of[old_layer, old_expert] == row:
                self.slot_of[old_layer, old_expert] = -1
            self.policy.on_removed(row)
        native.begin_write(self.raw, self.geometry.slots_offset, row)
        rec["layer"], rec["expert"], rec["state"] = layer, expert, SlotState.FILLING
        self.slot_of[layer, expert] = row
        self.policy.on_filled(row, (layer, expert))
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
            rec = self.slots[row:row + 1]
            if error is None:
                rec["state"] = SlotState.READY
                self.counters["bytes_read"] += self.geometry.stride
                self.counters["fills"] += 1
            else:
                log.error("fill failed: %s", error[1])
                self.counters["fill_errors"] += 1
                if self.slot_of[layer, expert] == row:
                    self.slot_of[layer, expert] = -1
                rec["layer"], rec["expert"], rec["state"] = -1, -1, SlotState.EMPTY
                self.policy.on_removed(row)
            native.end_write(self.raw, self.geometry.slots_offset, row)
            if row in self.background_rows:
                self.background_rows.discard(row)
                self._warm_progress()
            for p in self.waiters.pop(row, ()):
                p.waiting.discard(row)
                if error is not None and p.error is None:
                    p.error = error
                if not p.waiting:
                    self._finish(p)
        if done and not self.stopping:
            # Rows that were filling are eligible again: demands queued behind them may fit.
            self._retry_queued()
            self._top_up_background()

    def _finish(self, p: Pending) -> None:
        if p.error is not None:
            self._release(p.lease, self.clients.get(p.identity))
            self._send(p.identity, reply_error(p.rid, bytes([Op.DEMAND]), *p.error))
            return
        versions = [int(v) for v in self.slots["version"][p.rows]]
        self._send(p.identity, reply_ok(p.rid, Op.DEMAND, rows=p.rows, versions=versions,
                                        lease=p.lease))

    def _release(self, lease: int, client) -> None:
        entry = self.leases.pop(lease, None)
        if entry is None:
            return
        self.leased[[r for r in entry[1] if r >= 0]] -= 1
        if client is not None:
            client.leases.discard(lease)
        self._retry_queued()

    def _retry_queued(self) -> None:
        for _ in range(len(self.queued)):
            p = self.queued.popleft()
            if p.identity in self.clients and not self._start(p):
                self.queued.append(p)

    def _top_up_background(self) -> None:
        """Start queued background fills (warm-up, prefetch, pins) while workers are free."""
        while self.background and len(self.background_rows) < self.config.workers:
            layer, expert = self.background.popleft()
            if self._resident(layer, expert)[1] != SlotState.EMPTY:
                continue
            victims = self.policy.victims(1, self._eligible())
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
        hits = self.slots["hits"][:self.geometry.cache_rows].copy()
        delta = hits - self._last_hits
        self._last_hits = hits
        for row in np.flatnonzero(delta):
            rec = self.slots[row]
            if rec["state"] == SlotState.READY:
                self.policy.on_touched((int(rec["layer"]), int(rec["expert"])), int(delta[row]))
        self.counters["client_hits"] += int(delta.sum())
        for identity, client in list(self.clients.items()):
            if now - client.last_seen > self.config.client_timeout:
                log.info("client pid %d timed out; reclaiming %d leases", client.pid,
                         len(client.leases))
                # Forget the client first, so releasing its leases cannot start its own queued
                # demands (which would take new leases nobody releases).
                del self.clients[identity]
                self.queued = deque(p for p in self.queued if p.identity != identity)
                while client.leases:
                    self._release(client.leases.pop(), client)
        self._retry_queued()
        self._ticks += 1
        if self.config.auto_pin and self._ticks % 10 == 0:
            room = self.max_pins - self.policy.n_explicit_pins
            self.policy.auto_pin(max(0, min(self.config.auto_pin, room)))

    def stats(self) -> dict:
        c = self.counters
        hits = c["demand_hits"] + c["client_hits"]
        g = self.geometry
        busy = self.fill_seconds + (time.monotonic() - self._busy_since if self.in_flight else 0)
        return dict(
            endpoint=self.paths.endpoint, arena=self.arena.name, pid=os.getpid(), blob_dir=str(self.store.dir),
            epoch=self.epoch, uptime_s=round(time.monotonic() - self.started, 3),
            arena_bytes=g.total_size, arena_rows=g.cache_rows, stride=g.stride,
            rows_used=int(np.count_nonzero(self.slots["state"][:g.cache_rows] != SlotState.EMPTY)),
            hits=hits, demand_hits=c["demand_hits"], client_hits=c["client_hits"],
            misses=c["misses"], hit_rate=round(hits / max(1, hits + c["misses"]), 4),
            bytes_read=c["bytes_read"], fills=c["fills"], fill_errors=c["fill_errors"],
            fill_seconds=round(busy, 6),
            fill_gbps=round(c["bytes_read"] / busy / 1e9, 3) if busy else 0.0,
            pinned=self.policy.n_pinned_rows, clients=len(self.clients),
            leases=len(self.leases), bad_requests=c["bad_requests"], demands=c["demands"],
            in_flight=self.in_flight, io=self.config.io, workers=self.config.workers,
            verify=self.config.verify, implementation=native.IMPLEMENTATION)

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
