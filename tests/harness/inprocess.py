"""The daemon's serving loop in this process: the real ``ExpertServer`` on a thread, built from
the same ``expertd start`` flags as a daemon process, with a clock a test may move by hand.

For every test of the protocol that needs no process of its own (what needs one: kills, SIGSTOP,
permissions, restarts, the command line, the daemon's memory; see ``daemon.py``). What a process
adds around the loop is done here as ``run_foreground`` does it: the lock, the pid file and the
run file (through which client sessions tell a live daemon), leftovers removed at the end.
"""

import logging
import os
import socket
import threading
import time
from pathlib import Path

from expertd.cli.lifecycle import LOCK_PATIENCE
from expertd.paths import daemon_paths
from expertd.runfile import (
    RunInfo,
    new_arena_name,
    new_epoch,
    remove_leftovers,
    take_lock,
    write_atomically,
    write_run_info,
)
from expertd.shm.layout import unlink_arena

from .core import SEEN_ARENAS, STOP_TIMEOUT, Served, shm_exists


class FakeClock:
    """A monotonic clock in seconds that moves only when :meth:`advance` moves it."""

    def __init__(self, start: float | None = None):
        self.now = time.monotonic() if start is None else float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock ``seconds`` on; the new time."""
        self.now += seconds
        return self.now


def server_config(blob_dir, *flags):
    """``(ServerConfig, state_file or None)`` from ``expertd start`` flags, checked as the
    command line checks them (its parser and its flag-to-config step)."""
    from expertd.cli.daemon_control import config_from_args
    from expertd.cli.main import build_parser

    args = build_parser().parse_args(["start", "--blobs", str(blob_dir), *map(str, flags)])
    state_file = Path(args.state_file).expanduser() if args.state_file else None
    return config_from_args(args), state_file


class _Captured(logging.Handler):
    """The daemon's log lines (the ``expertd`` logger, INFO and up, as ``expertd start``
    logs), kept for :meth:`InProcessDaemon.log_text`."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        self.lines: list = []

    def emit(self, record) -> None:
        self.lines.append(self.format(record))


class InProcessDaemon(Served):
    """An ``ExpertServer`` serving ``blob_dir`` from a thread of this process, ready when built.

    The surface of :class:`~harness.daemon.Daemon` where a thread can offer it: ``blob_dir``,
    ``pid`` (this process's), ``arena``, ``ready`` (its first stats), :meth:`stats`,
    :meth:`log_text`, :meth:`poll` / :meth:`wait` (None while it serves, else 0 when its loop
    returned, 1 when it raised, as a daemon process's exit status) and the context manager,
    whose exit (or :meth:`close`) stops the loop and checks that nothing is left: no serving
    thread, no fill worker, no arena, no socket. The environment is this process's (the
    ``isolated_env`` fixture sets it).

    Args:
        flags: ``expertd start`` flags, e.g. ``"--cache-gb", TINY_CACHE_GB``.
        clock: what heartbeats, lease and client timeouts, side-row holds and ticks are timed
            by; a :class:`FakeClock` lets the test move it with :meth:`advance` (fills and the
            shutdown grace take real time whatever the clock). Default: ``time.monotonic``.
    """

    def __init__(self, blob_dir, *flags, clock=None):
        from expertd.serving.server import ExpertServer

        self.blob_dir = Path(blob_dir)
        self.clock = clock
        self.pid = os.getpid()
        config, state_file = server_config(blob_dir, *flags)
        self.paths = daemon_paths(config.blob_dir)
        self._ticked = threading.Condition()
        self._ticked_at = float("-inf")
        self.error = None
        self.server = self.thread = None
        self._closed = False
        self._lock = take_lock(self.paths.lock, LOCK_PATIENCE)
        if self._lock is None:
            raise AssertionError(f"an expertd already serves {self.paths.blob_dir}")
        self.arena, epoch = new_arena_name(), new_epoch()
        SEEN_ARENAS.add(self.arena)  # conftest checks at the end of the session it is gone
        self._log = _Captured()
        self._logger = logging.getLogger("expertd")
        self._level = self._logger.level
        self._logger.addHandler(self._log)
        if self._logger.getEffectiveLevel() > logging.INFO:
            self._logger.setLevel(logging.INFO)
        try:
            remove_leftovers(self.paths)
            write_atomically(self.paths.pidfile, str(self.pid).encode())
            write_run_info(self.paths, RunInfo(self.pid, self.arena, epoch, ready=False))
            self.server = ExpertServer(config, self.paths, state_file or self.paths.state_file,
                                       self.arena, epoch, clock=clock or time.monotonic)
            write_run_info(self.paths, RunInfo(self.pid, self.arena, epoch, ready=True))
            tick = self.server._tick
            self.server._tick = lambda now: self._tick(tick, now)  # observed, not replaced
            self.thread = threading.Thread(target=self._serve, name="expertd-serve", daemon=True)
            self.thread.start()
            self.ready = self.stats()
        except BaseException:
            self.close(check=False)
            raise

    def _serve(self) -> None:
        try:
            self.server.serve()
        except BaseException as exc:  # the test sees it in close() or wait()
            self.error = exc

    def _tick(self, tick, now: float) -> None:
        tick(now)
        with self._ticked:
            self._ticked_at = now
            self._ticked.notify_all()

    # ---- what tests ask ----------------------------------------------------------------------

    def log_text(self) -> str:
        return "\n".join(self._log.lines)

    def poll(self) -> int | None:
        """None while the loop serves; then 0 if it returned, 1 if it raised."""
        if self.thread is not None and self.thread.is_alive():
            return None
        return 0 if self.error is None else 1

    def wait(self, timeout: float) -> int:
        """The loop's status (see :meth:`poll`) once it has stopped, within ``timeout`` s."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"the serving loop did not stop within {timeout:g} s")
        return self.poll()

    def advance(self, seconds: float) -> None:
        """Move the fake clock ``seconds`` on and return once the loop has ticked at the new
        time (client and lease timeouts, side-row holds), if a tick is due by then.

        The wait is on the tick itself: its time is recorded by the real tick's caller, and
        a STATS round trip wakes the loop, which ticks right after answering it.
        """
        from expertd.serving.server import TICK

        assert isinstance(self.clock, FakeClock), "advance() needs clock=FakeClock()"
        now = self.clock.advance(seconds)
        self.stats()
        with self._ticked:
            if now < self._ticked_at + TICK:
                return  # the loop ticks only once TICK has passed since its last tick
            if not self._ticked.wait_for(lambda: self._ticked_at >= now
                                         or not self.thread.is_alive(), STOP_TIMEOUT):
                raise AssertionError(f"the loop did not tick within {STOP_TIMEOUT:g} s")

    # ---- the end -------------------------------------------------------------------------------

    def stop(self) -> int:
        """Ask the loop to stop (as SIGTERM does) and wait for it; its status."""
        if self.thread is None:
            if self.server is not None:  # built, never served: its own clean-up, all the same
                self.server._shutdown()
                self.server = None
            return self.poll()
        if self.thread.is_alive():
            self.server.request_stop()
            try:  # a connection wakes the loop's poll at once, rather than at its next tick
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                    wake.connect(str(self.paths.socket))
            except OSError:
                pass  # stopping already: the socket is gone
            self.thread.join(STOP_TIMEOUT)
        return self.poll()

    def close(self, check: bool = True) -> None:
        """Stop the loop; check that it, its fill workers, its arena and socket are gone.

        Raises:
            AssertionError: (with ``check``) naming what was left or what went wrong.
        """
        if self._closed:
            return
        self._closed = True
        self.stop()
        problems = []
        if self.server is not None:
            if self.thread.is_alive():
                problems.append(f"its loop did not stop within {STOP_TIMEOUT:g} s")
            elif self.error is not None:
                problems.append(f"its loop raised {self.error!r}")
            for worker in self.server.pool._threads:
                worker.join(STOP_TIMEOUT)
            if any(worker.is_alive() for worker in self.server.pool._threads):
                problems.append("a fill worker still runs")
            if self.paths.socket.exists() and not self.thread.is_alive():
                problems.append(f"left its socket {self.paths.socket}")
        if shm_exists(self.arena):
            if self.server is not None:
                problems.append(f"left its arena {self.arena}")
            unlink_arena(self.arena)
        remove_leftovers(self.paths)
        os.close(self._lock)
        self._logger.removeHandler(self._log)
        self._logger.setLevel(self._level)
        if check and problems:
            raise AssertionError("the in-process expertd " + " and ".join(problems) +
                                 f"; its log:\n{self.log_text()}")
