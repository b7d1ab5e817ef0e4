"""The client's heartbeat: a thread that tells the daemon the client lives, and notices when
the daemon does not, the jupyter_client way (a time-to-dead computed from replies)."""

import threading
import time

from expertd.connection import Connection
from expertd.errors import DaemonNotRunning, ProtocolError
from expertd.protocol import Op

IDLE_SLICE = 0.01  # how often the idle hook runs while it asks to come back soon
STOP_TIMEOUT = 2.0  # the thread wakes at once when stopped; this only bounds a stuck one


class Heartbeat:
    """A thread with its own connection that tells the daemon this client is alive, and
    notices when the daemon is gone, the jupyter_client way: ``lost`` when ``alive()`` says the
    daemon no longer holds its directory, ``stuck`` when it still does but has answered no
    heartbeat for ``time_to_dead`` seconds. Each heartbeat carries ``report()``'s counters
    (for the daemon's status).

    Between heartbeats the thread runs ``idle()`` (the session's: releasing late leases while
    the client is idle), again every IDLE_SLICE while it returns True, and at once when ``wake``
    (an event of the idle hook's owner) is set. Its connection is its own, a DEALER opened and
    closed in the thread (a ZeroMQ socket belongs to one thread; ZeroMQ connects it again
    should the daemon drop it): :meth:`stop` asks, the thread closes it."""

    def __init__(self, socket_path: str, client_id: bytes, token: bytes, interval: float,
                 time_to_dead: float, alive, report, idle, wake: threading.Event):
        self.lost = self.stuck = False
        self.time_to_dead = time_to_dead
        self._alive, self._report, self._idle = alive, report, idle
        self._stop = threading.Event()
        self._wake = wake
        self._thread = threading.Thread(target=self._run,
                                        args=(socket_path, client_id, token, interval),
                                        name="expertd-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, socket_path: str, client_id: bytes, token: bytes, interval: float) -> None:
        conn = None
        now = last_reply = time.monotonic()
        next_beat = now + interval
        again = False
        try:
            while True:
                self._wake.wait(min(IDLE_SLICE, interval) if again else interval)
                self._wake.clear()
                if self._stop.is_set():
                    return
                again = self._idle()
                now = time.monotonic()
                while conn is not None and conn.poll(0):
                    try:
                        conn.recv()
                    except ProtocolError:
                        pass  # an answer all the same
                    last_reply = now
                if now < next_beat:
                    continue
                next_beat = now + interval
                if not self._alive():
                    self.lost = True
                    return
                self.stuck = now - last_reply > self.time_to_dead
                try:
                    if conn is None:
                        conn = Connection(socket=socket_path, at_exit=False)
                    # Dropped when the daemon reads none.
                    conn.send_quietly(Op.HEARTBEAT, {"client": client_id, "token": token,
                                                     **self._report()})
                except DaemonNotRunning:
                    pass  # no daemon's socket now: alive() tells the rest
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        """Stop the thread and wait for it to close its socket (unless called from it: a
        dropped session's finalizer may run on any thread the garbage collector runs on)."""
        self._stop.set()
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=STOP_TIMEOUT)
