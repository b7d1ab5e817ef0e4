"""The client's heartbeat: a thread that tells the daemon the client lives, and notices when
the daemon does not, the jupyter_client way (a time-to-dead computed from replies)."""

import os
import threading
import time

from expertd.protocol import CLIENT_ID_BYTES, Op, request
from expertd.wire import Channel

REAP_SLICE = 0.01  # how often the idle client looks for late replies to interrupted demands
STOP_TIMEOUT = 2.0  # the thread wakes at once when stopped; this only bounds a stuck one


class Heartbeat:
    """A thread with its own connection that tells the daemon this client is alive, and
    notices when the daemon is gone, the jupyter_client way: ``lost`` when ``alive()`` says the
    daemon no longer holds its directory, ``stuck`` when it still does but has answered no
    heartbeat for ``time_to_dead`` seconds. Between heartbeats it calls ``reap()``, which
    releases late leases while the client is idle (polled every REAP_SLICE while it returns
    True). Each heartbeat carries ``report()``'s counters (for the daemon's status).

    The thread's socket is its own, a DEALER opened and closed in the thread (a ZeroMQ socket
    belongs to one thread; ZeroMQ connects it again should the daemon drop it): :meth:`stop`
    asks, the thread closes it."""

    def __init__(self, socket_path: str, client_id: bytes, token: bytes, interval: float,
                 time_to_dead: float, alive, reap, report):
        self.lost = self.stuck = False
        self.time_to_dead = time_to_dead
        self._alive, self._reap, self._report = alive, reap, report
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run,
                                        args=(socket_path, client_id, token, interval),
                                        name="expertd-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, socket_path: str, client_id: bytes, token: bytes, interval: float) -> None:
        channel = None
        n = 0
        now = last_reply = time.monotonic()
        next_beat = now + interval
        reaping = False
        try:
            while True:
                self._wake.wait(min(REAP_SLICE, interval) if reaping else interval)
                self._wake.clear()
                if self._stop.is_set():
                    return
                reaping = self._reap()
                now = time.monotonic()
                while channel is not None and channel.poll(0):
                    channel.recv()
                    last_reply = now
                if now < next_beat:
                    continue
                next_beat = now + interval
                if not self._alive():
                    self.lost = True
                    return
                self.stuck = now - last_reply > self.time_to_dead
                n += 1
                beat = request(n.to_bytes(8, "little"), Op.HEARTBEAT,
                               {"client": client_id, "token": token, **self._report()})
                try:
                    if channel is None:
                        channel = Channel(socket_path, os.urandom(CLIENT_ID_BYTES))
                    channel.send(beat, quiet=True)  # dropped when the daemon reads none
                except FileNotFoundError:
                    pass  # no daemon's socket now: alive() tells the rest
        finally:
            if channel is not None:
                channel.close()

    def wake(self) -> None:
        """Look for late replies now rather than at the next heartbeat."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread and wait for it to close its socket (unless called from it: a
        dropped session's finalizer may run on any thread the garbage collector runs on)."""
        self._stop.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=STOP_TIMEOUT)
