"""The serving loop: one thread owns the daemon's ROUTER (peers.py) and dispatches each request.

What it decides lives in rooms of its own: the expert cache (cache.py: the slot table, the
policy and the lease book, and the fills around them, reached only through its verbs) and the
client registry (hello, heartbeat, time-to-dead). Fills run on the pread pool and come back
through a wake-up pipe polled next to the peers.
"""

import logging
import os
import time
from pathlib import Path

from expertd import native
from expertd.blobstore import BlobStore
from expertd.errors import ProtocolError
from expertd.protocol import (
    HEARTBEAT_COUNTS,
    PROTOCOL_VERSION,
    ErrorCode,
    Op,
    pack_ok,
    parse_request,
    reply_error,
    reply_ok,
    reply_packed,
)
from expertd.serving.cache import ExpertCache
from expertd.serving.clients import MAX_CLIENTS, ClientRegistry
from expertd.serving.config import ServerConfig, arena_geometry, cache_limits
from expertd.serving.hotset import HotSet
from expertd.serving.leases import Demand, LeaseBook
from expertd.serving.peers import Peers
from expertd.serving.preads import FillPool
from expertd.serving.stats import DaemonInfo, ServerCounters, assemble
from expertd.shm.layout import Arena, Geometry
from expertd.units import size_text

log = logging.getLogger("expertd")

TICK = 0.1
EPOCH_POLL = 0.001  # the loop's poll while a refill waits for a client's step to end
SHUTDOWN_GRACE = 5.0
MAX_QUEUED_PER_CLIENT = 32
RECV_BATCH = 256  # requests handled between two looks at completed fills
WAKE = "fills"  # the pool's wake-up pipe, as the peers' poll names it


class ExpertServer:
    """The daemon's state and serving loop.

    Args:
        config: the validated start-up configuration.
        paths: the daemon's :class:`~expertd.paths.DaemonPaths`.
        state_file: where the hot set is saved and read back.
        arena_name: the shared-memory name to create (random per start).
        epoch: this start's identity, published in the arena header and the hello.
        clock: seconds, monotonic: what heartbeats, leases, side-row holds and ticks are timed
            by. A test drives a server in its own process with a clock it moves by hand.
    """

    def __init__(self, config: ServerConfig, paths, state_file: Path, arena_name: str,
                 epoch: int, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self.paths = paths
        self.state_file = state_file
        self.epoch = epoch
        self.store = BlobStore(config.blob_dir, direct=config.io == "direct")
        m = self.store.manifest
        self.n_experts = [layer.num_experts for layer in m.layers]
        g = self.geometry = arena_geometry(m, config.cache_bytes, config.side_rows)
        # A budget with room for a row more than every expert: the arena is cut to what is useful.
        self.capped = config.cache_bytes >= Geometry.smallest_budget(
            g.n_layers, g.n_experts, g.stride, side_rows=g.side_rows, cache_rows=g.cache_rows + 1)
        self.max_pins, self.max_demand, self.client_cap = cache_limits(g.cache_rows)
        # The pin file is checked before anything is created: more pins than PIN allows would
        # leave demands too few rows, and they would wait forever.
        self.hot_set = HotSet(state_file, config.pin_file, self.n_experts, self.max_pins,
                              g.cache_rows)
        self.arena = Arena.create(arena_name, g, os.getpid(), epoch)
        try:
            self.arena.populate()
            self.pool = FillPool(self.store, self.arena, config.workers, config.verify)
            book = LeaseBook(g.total_rows, self.client_cap, MAX_QUEUED_PER_CLIENT,
                             config.lease_timeout)
            self.cache = ExpertCache(self.arena, self.pool, book, config.workers, self._send,
                                     prefetch=config.prefetch, top_k=m.top_k,
                                     side_hold=config.side_hold, clock=clock,
                                     max_pins=self.max_pins, epoch_hold=config.lease_timeout)
            self.clients = ClientRegistry(config.client_timeout, MAX_CLIENTS)
            self._quiet_until, self._unlogged = 0.0, 0  # bad requests: a log line a second
            # (peers.changes, the STATS reply packed, as a frame the replies share) for a run
            # of STATS with nothing else between them: a flood of them costs one.
            self._stats_body = None
            self._ticks = 0
            self.started = time.monotonic()
            self.running = True
            self.counters = ServerCounters()
            # libzmq closes a connection silent as long as the registry waits for a client.
            self.peers = Peers(str(paths.socket), config.heartbeat_interval,
                               config.client_timeout)
            try:
                self.peers.watch(self.pool.wake_fd, WAKE)
                self._load_state()
            except BaseException:
                self.peers.close()
                raise
        except BaseException:
            self.arena.unlink()
            raise

    # ---- lifecycle -------------------------------------------------------------------------

    def serve(self) -> None:
        g = self.geometry
        log.info("serving %s on %s (%d rows of %d bytes, %s, arena %s)", self.store.dir,
                 self.paths.endpoint, g.cache_rows, g.stride, size_text(g.total_size),
                 self.arena.name)
        if self.capped:
            log.info("the cache budget of %s is more than every expert needs: the arena holds "
                     "all %d in %s", size_text(self.config.cache_bytes), g.cache_rows,
                     size_text(g.total_size))
        try:
            self._serve_loop()
        finally:
            self._shutdown()

    def _serve_loop(self) -> None:
        next_tick = next_save = self.clock()
        while self.running:
            # Nothing wakes the loop when a step ends: while a refill waits for one, poll fast.
            woken, messages = self.peers.poll(EPOCH_POLL if self.cache.holds_fills() else TICK,
                                              RECV_BATCH)
            self._stats_body = None
            if woken:
                self.cache.completions()
            for message in messages:
                self._dispatch(message.identity, message.frames, message.count)
            if self.peers.gone:
                gone, self.peers.gone = self.peers.gone, []
                for identity in gone:
                    self._peer_gone(identity)
            if self.cache.room_changed:
                self.cache.retry_queued(self.clients.__contains__)
            now = self.clock()
            self.cache.check_epochs(now)
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
        try:
            # Held fills end too: no read started for them, nothing to wait for.
            self.cache.fail_pending(ErrorCode.SHUTTING_DOWN, "expertd is stopping")
            deadline = time.monotonic() + SHUTDOWN_GRACE  # real seconds: reads take real time
            while self.cache.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
                self.cache.completions(stopping=True)
            self._save_state()
            self.arena.header["serving"] = 0
        finally:
            readers_done = self.pool.close(timeout=1.0)
            self.peers.close()
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
        self.peers.send(identity, frames)  # a peer gone or not reading: it times out and retries

    def _dispatch(self, identity: bytes, body: list, count: int) -> None:
        """One request: ``body`` its first frames, of ``count``."""
        rid = body[0] if body and len(body[0]) <= 16 else b""
        op_byte = body[1][:1] if len(body) > 1 else b""
        try:
            if count > len(body):
                raise ProtocolError(f"expected 3 frames, got more than {len(body)}")
            rid, op, req = parse_request(body)
            if op is not Op.STATS:
                self._stats_body = None
            self._handle(identity, rid, op, req)
        except ProtocolError as exc:
            self._stats_body = None
            self.counters.bad_requests += 1
            self._log_bad(identity, exc)
            self._send(identity, reply_error(rid, op_byte, ErrorCode(exc.code), str(exc)))
        except Exception:
            # A bug in a handler: say so in the log and to the client, and keep serving.
            self._stats_body = None
            self.counters.internal_errors += 1
            log.exception("internal error handling a request from %s", identity.hex()[:12])
            self._send(identity, reply_error(rid, op_byte, ErrorCode.INTERNAL,
                                             "internal error in expertd (see its log)"))

    def _log_bad(self, identity: bytes, exc: ProtocolError) -> None:
        """One line a second at most: a flood of bad requests must not rotate the log away."""
        now = self.clock()
        if now < self._quiet_until:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last line)" if self._unlogged else ""
        log.warning("bad request from %s: %s%s", identity.hex()[:12], exc, more)
        self._quiet_until, self._unlogged = now + 1.0, 0

    def _handle(self, identity: bytes, rid: bytes, op: Op, req) -> None:
        now = self.clock()
        if op is Op.HEARTBEAT:
            known = self.clients.heartbeat(req.client, req.token, now,
                                           **{key: getattr(req, key) for key in HEARTBEAT_COUNTS})
            self._send(identity, reply_ok(rid, op, epoch=self.epoch, known=known))
            return
        if op is Op.HELLO:
            if req.version != PROTOCOL_VERSION:
                raise ProtocolError(f"protocol version {req.version} is not supported "
                                    f"(this expertd speaks {PROTOCOL_VERSION})", ErrorCode.VERSION)
            if req.client != identity:
                raise ProtocolError("the client id must be the socket's routing id")
            # The kernel's word for the process, where it has one: a client's claim is only
            # what it says (status shows it, and the per-process cap counts it).
            pid = self.peers.peer_pid(identity) or req.pid
            cap = self.config.clients_per_process
            if identity not in self.clients and self.clients.of_process(pid) >= cap:
                raise ProtocolError(f"process {pid} has {cap} clients attached already, the "
                                    "most one process may; close one first", ErrorCode.BUSY)
            client = self.clients.hello(identity, pid, now, req.pool_bytes)
            if client is None:
                raise ProtocolError(f"{self.clients.max_clients} clients are connected "
                                    "already; try again later", ErrorCode.BUSY)
            slot = self.cache.attach_client(identity, pid)  # a second hello keeps its own
            self._send(identity, reply_ok(rid, op, token=client.token, epoch_slot=slot, **self._hello()))
            return
        if op is Op.STATS:
            asker = self.clients.get(identity)
            if asker is not None:
                self._send(identity, reply_ok(rid, op, **self.stats(),
                                              client_prefetch_reads=asker.prefetch_reads))
                return
            if self._stats_body is None or self._stats_body[0] != self.peers.changes:
                self._stats_body = (self.peers.changes,
                                    self.peers.share(pack_ok(**self.stats())))
            self._send(identity, reply_packed(rid, op, self._stats_body[1]))
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
            self.cache.release(req.lease, identity)
        else:
            self._check_range(req)
            if op is Op.DEMAND:
                self._demand(identity, rid, req)
            elif op is Op.PREFETCH:
                client.prefetch_reads += self.cache.prefetch(identity, req.layer, req.experts,
                                                             req.core, req.claim)
            elif op is Op.PIN:
                self._pin(client, rid, req)
            elif op is Op.UNPIN:
                pinned = self.cache.unpin(identity, [(req.layer, e) for e in req.experts])
                self._send(identity, reply_ok(rid, op, pinned=pinned))

    def _check_range(self, req) -> None:
        if req.layer >= len(self.n_experts):
            # A stage's directory holds some of the model's layers: say which, and where.
            raise ProtocolError(f"layer {req.layer} out of range (0..{len(self.n_experts) - 1}) "
                                f"of {self.store.manifest.describe(self.store.dir)}",
                                ErrorCode.OUT_OF_RANGE)
        n = self.n_experts[req.layer]
        bad = [e for e in req.experts + req.claim if e >= n]
        if bad:
            raise ProtocolError(f"expert {bad[0]} out of range for layer {req.layer} "
                                f"(0..{n - 1})", ErrorCode.OUT_OF_RANGE)

    def _demand(self, identity: bytes, rid: bytes, req) -> None:
        self.counters.demands += 1
        if len(req.experts) > self.max_demand:
            raise ProtocolError(f"{len(req.experts)} experts in one demand; at most "
                                f"{self.max_demand} fit", ErrorCode.OUT_OF_RANGE)
        # A lazy directory's rows marked absent since (their shard failed its sha256, maybe
        # in expertd fetch a moment ago) are not leased from the arena: a stat, then nothing.
        self.cache.withdraw(self.pool.withdrawn(req.layer))
        demand = Demand(identity, rid, req.layer, req.experts)
        if not self.cache.start(demand) and not self.cache.enqueue(demand):
            self.counters.busy += 1
            book = self.cache.book
            if book.queued() >= book.max_queued_total:
                raise ProtocolError(f"{book.max_queued_total} demands of all clients wait for "
                                    "rows already; try again shortly", ErrorCode.BUSY)
            raise ProtocolError(f"{MAX_QUEUED_PER_CLIENT} demands of this client wait already; "
                                "release leases first", ErrorCode.BUSY)

    def _pin(self, client, rid: bytes, req) -> None:
        """A client's pins hold while it lives; only the pin file pins for good."""
        pinned = self.cache.pin(client.identity, [(req.layer, e) for e in req.experts])
        if pinned is None:
            raise ProtocolError(f"at most {self.max_pins} experts can be pinned in this cache",
                                ErrorCode.OUT_OF_RANGE)
        self._send(client.identity, reply_ok(rid, Op.PIN, pinned=pinned))

    def _hello(self) -> dict:
        g = self.geometry
        m = self.store.manifest
        return dict(version=PROTOCOL_VERSION, arena=self.arena.name, epoch=self.epoch,
                    pid=os.getpid(), blob_dir=str(self.store.dir), model_type=m.model_type,
                    manifest=m.digest, n_layers=g.n_layers, n_experts=g.n_experts,
                    cache_rows=g.cache_rows, side_rows=g.side_rows, stride=g.stride,
                    max_demand=self.max_demand, client_cap=self.client_cap,
                    heartbeat_interval=self.config.heartbeat_interval,
                    client_timeout=self.config.client_timeout,
                    lease_timeout=self.config.lease_timeout, prefetch=self.config.prefetch)

    # ---- clients' connections --------------------------------------------------------------

    def _peer_gone(self, identity: bytes) -> None:
        """A connection closed: a client whose own it was is gone with it (a SIGKILLed one
        too: the kernel closes its socket; a silent one: libzmq's heartbeat closes it)."""
        client = self.clients.remove(identity)
        if client is not None:
            self.counters.clients_disconnected += 1
            self._forget(client)

    def _forget(self, client) -> None:
        """Drop a client's leases, demands and pins (one that asks again must say hello
        again)."""
        if client is not None:
            self.cache.forget(client)

    # ---- housekeeping ----------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        self.cache.harvest_hits()
        self.cache.withdraw(self.pool.withdrawn())  # rows of a shard that failed its sha256
        self.pool.arrivals()  # rows expertd fetch brought beside us: status counts them
        for client in self.clients.dead(now):
            log.info("client pid %d timed out; reclaiming its %d leased rows", client.pid,
                     self.cache.held_by(client.identity))
            self.counters.clients_timed_out += 1
            self._forget(client)
        self.cache.expire(now)
        self._ticks += 1
        if self.config.auto_pin and self._ticks % 10 == 0:
            self.cache.auto_pin(self.config.auto_pin)

    def stats(self) -> dict:
        """The STATS reply: who this daemon is, then each part's record (see stats.py)."""
        g, store = self.geometry, self.store
        info = DaemonInfo(
            endpoint=self.paths.endpoint, arena=self.arena.name, pid=os.getpid(),
            blob_dir=str(store.dir), epoch=self.epoch, log=str(self.paths.log),
            uptime_s=round(time.monotonic() - self.started, 3), arena_bytes=g.total_size,
            arena_rows=g.cache_rows, stride=g.stride, cache_capped=self.capped,
            max_demand=self.max_demand, io=store.io_mode, io_reason=store.io_reason,
            workers=self.config.workers, verify=self.config.verify,
            implementation=native.IMPLEMENTATION, peers=self.peers.count)
        return {**assemble(info, self.counters, *self.cache.stats_records(),
                           self.clients.stats(), self.peers.counters),
                **self.pool.remote_stats()}

    # ---- warm restart ----------------------------------------------------------------------

    def _save_state(self) -> None:
        try:
            self.hot_set.save(self.store.dir, self.cache.policy_state(self.hot_set.limit))
        except OSError as exc:
            log.warning("could not save the hot set to %s: %s", self.state_file, exc)

    def _load_state(self) -> None:
        keys = self.cache.restore_policy(self.hot_set)
        if keys:
            log.info("warming %d experts from %s", len(keys), self.state_file)
        self.cache.warm(keys)
