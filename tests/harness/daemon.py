"""A real daemon process: ``python -m expertd start --foreground``, for what needs a process
(kills, SIGSTOP, permissions, restarts, the command line, the daemon's own memory)."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from expertd.shm.layout import unlink_arena

from .core import START_TIMEOUT, STOP_TIMEOUT, Served, arena_owner, try_stats, wait_until
from .processes import stop_process


class Daemon(Served):
    """A real ``expertd start --foreground`` process serving ``blob_dir``, ready when built.

    Use it as a context manager (``with Daemon(...) as d``) or call :meth:`close`. Attributes:
    ``proc``, ``pid``, ``blob_dir``, ``log`` (the file of its output), ``ready`` (its first
    stats) and ``arena`` (its arena's name).

    Args:
        env: the test's XDG_RUNTIME_DIR / XDG_STATE_HOME (the ``isolated_env`` fixture).
        flags: extra ``expertd start`` flags, e.g. ``"--cache-gb", "0.00028"``.
        log: file for the daemon's output (default: in the runtime directory).
    Raises:
        AssertionError: if it exits or does not answer STATS within ``START_TIMEOUT``.
    """

    def __init__(self, blob_dir, env: dict | None = None, *flags, log: Path | None = None):
        self.blob_dir = Path(blob_dir)
        env = {**os.environ, **(env or {})}
        runtime = env.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        self.log = Path(log or Path(runtime) / f"daemon-{time.monotonic_ns()}.log")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "expertd", "start", "--blobs", str(self.blob_dir),
               "--foreground", *map(str, flags)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        self.arena = None
        self._term_ignored = False
        try:
            self.ready = wait_until(self._answered, START_TIMEOUT,
                                    f"expertd pid {self.pid} to answer STATS for {blob_dir}")
        except BaseException:
            self.close(check=False)
            raise
        self.arena = self.ready["arena"]

    def _answered(self) -> dict | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"expertd exited with {self.proc.returncode} during start-up:\n"
                                 f"{self.log_text()}")
        stats = try_stats(self.blob_dir)
        # Another daemon's answer (one being replaced) does not count.
        return stats if stats and stats["pid"] == self.pid else None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL, as a crash would (the arena stays behind, as after a real crash)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(STOP_TIMEOUT)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL past ``STOP_TIMEOUT``; the exit status."""
        if stop_process(self.proc):
            self._term_ignored = True
        return self.proc.returncode

    def close(self, check: bool = True) -> None:
        """Stop the daemon; check that its process is gone and its arena removed.

        A daemon that was SIGKILLed cannot remove its arena: the harness does, as the next
        start would. Anything else left behind is removed too, then reported.

        Raises:
            AssertionError: (with ``check``) if SIGTERM did not stop it or it left its arena.
        """
        self.stop()
        problems = []
        if self._term_ignored:
            problems.append(f"did not stop within {STOP_TIMEOUT:g} s of SIGTERM")
        if self.proc.returncode is None:
            problems.append("is still running")
        # The owner check: never remove a live daemon's arena that happens to bear the name.
        if self.arena and arena_owner(self.arena) == self.pid:
            if self.proc.returncode != -signal.SIGKILL or self._term_ignored:
                problems.append(f"left its arena {self.arena} behind")
            unlink_arena(self.arena)
        if check and problems:
            raise AssertionError(f"expertd pid {self.pid} " + " and ".join(problems) +
                                 f"; its log:\n{self.log_text()}")


# The name the daemon tests use: ``with running_daemon(blob_dir, env, *flags) as d``.
running_daemon = Daemon


def kill_serving_daemon(blob_dir) -> None:
    """Teardown for daemons started detached by the CLI: stop whatever still serves the dir
    (SIGTERM, SIGKILL past ``STOP_TIMEOUT``) and remove its arena if it left it. A detached
    daemon is no child of ours: it is found by its lock and signalled by pid."""
    from expertd.cli.lifecycle import serving_pid
    from expertd.paths import daemon_paths

    paths = daemon_paths(blob_dir)
    pid = serving_pid(paths)
    if pid is None or pid <= 0:
        return
    stats = try_stats(blob_dir)
    os.kill(pid, signal.SIGTERM)
    try:
        wait_until(lambda: serving_pid(paths) is None, STOP_TIMEOUT, "the detached expertd to stop")
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: serving_pid(paths) is None, STOP_TIMEOUT, "the detached expertd to die")
    if stats:
        unlink_arena(stats["arena"])
