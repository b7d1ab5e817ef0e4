"""Child processes: the ``expertd`` command line, client processes (``daemon_helpers.py`` or a
test file that is its own client), the one SIGTERM-then-SIGKILL stopper, and a pseudo-terminal.
"""

import fcntl
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

from .core import STOP_TIMEOUT

CLIENT_SCRIPT = Path(__file__).resolve().parent.parent / "daemon_helpers.py"
EXPERTD = str(Path(sys.executable).with_name("expertd"))  # the installed command, for its own argv[0]


def expertd_cli(*args, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run the ``expertd`` command line in a child process (environment inherited).

    Returns:
        the CompletedProcess, with the child's ``pid`` added.
    """
    with subprocess.Popen([sys.executable, "-m", "expertd", *map(str, args)],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid
    return done


def stop_process(proc: subprocess.Popen | None, timeout: float = STOP_TIMEOUT) -> bool:
    """Stop a child that may still run (stopped ones too): SIGTERM, then SIGKILL past
    ``timeout``; its pipes are drained and closed. The one place that stops a child.

    Returns:
        True if SIGTERM did not stop it within ``timeout`` (it took a SIGKILL).
    """
    if proc is None:
        return False
    killed = False
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)  # a SIGSTOPped child only acts on SIGTERM once resumed
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            killed = True
            proc.kill()
    proc.communicate(timeout=timeout)
    return killed


def sigint_as_usual() -> None:
    """``preexec_fn`` for children that are sent SIGINT: a shell runs background jobs with
    SIGINT ignored, and an ignored signal stays ignored across exec, so a test suite started
    in the background would otherwise see its children shrug Ctrl-C off."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_client(mode: str, *args, env: dict | None = None, pure: bool | None = None,
                 script: Path | None = None, stdin: bool = False) -> subprocess.Popen:
    """A client process running ``daemon_helpers.py MODE ARGS...`` (text pipes).

    Args:
        env: variables added to this process's environment.
        pure: True forces the pure-Python twins in the child, False the Cython extension,
            None inherits this process's choice.
        script: another script to run instead (a test file that is its own client).
        stdin: give the child a pipe to read commands from (else /dev/null).
    """
    full = {**os.environ, **(env or {})}
    if pure is not None:
        full["EXPERTD_PURE_PYTHON"] = "1" if pure else "0"
    return subprocess.Popen([sys.executable, str(script or CLIENT_SCRIPT), mode,
                             *map(str, args)], env=full,
                            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_usual)


def read_json_line(proc: subprocess.Popen, timeout: float) -> dict:
    """The next line a client process prints, parsed; fails after ``timeout`` s."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"client pid {proc.pid} printed nothing within {timeout:g} s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"client pid {proc.pid} exited ({proc.wait()}): {proc.stderr.read()}")
    return json.loads(line)


def finish_client(proc: subprocess.Popen, out: Path, timeout: float) -> dict:
    """Wait for a client that writes its JSON result to ``out``; that result, plus its stderr.

    Raises:
        AssertionError: if it fails or does not finish in time.
    """
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        raise AssertionError(f"client pid {proc.pid} did not finish within {timeout:g} s:\n"
                             f"{stderr}") from None
    assert proc.returncode == 0, f"client pid {proc.pid} exited with {proc.returncode}:\n{stderr}"
    result = json.loads(Path(out).read_text())
    result["stderr"] = stderr
    return result


def terminal() -> tuple:
    """A pseudo-terminal of 24 x 100 characters: (master, slave)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    return master, slave


def drawn(master: int) -> str:
    """Everything written to the terminal, once every writer has closed it (EIO on Linux)."""
    data = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")
