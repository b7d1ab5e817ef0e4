"""Where ``expertd service`` puts a daemon: the :class:`ServicePlan` of one blob directory on one
platform (a pure function of the directory, the flags and the environment). Apart from
service.py so that status and start can name a service's log without importing the commands
that install one."""

import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PLATFORMS = ("linux", "macos")
# launchd's and systemd's grace between SIGTERM and SIGKILL: above `expertd stop`'s 10 s, so
# the daemon always gets to save its hot set and unlink its arena.
STOP_GRACE_S = 15
# The runtime variables clients use to find the daemon (see paths.runtime_dir): the service
# gets the installing shell's values, so it serves where that shell's clients look.
RUNTIME_VARS = ("XDG_RUNTIME_DIR", "XDG_STATE_HOME")
# Set by a service's unit or agent to its name: the daemon records it in its run file, so that
# status and `service install` tell the service's daemon from one started by hand.
SERVICE_VARIABLE = "EXPERTD_SERVICE"


def this_platform() -> str:
    return "macos" if sys.platform == "darwin" else "linux"


def service_id(blob_dir: Path) -> str:
    """16 hex digits from the blob directory's real path and the user id.

    Unlike the daemon's runtime ident, it leaves out the runtime directory: the service's name
    must not change when XDG_RUNTIME_DIR does.
    """
    real = Path(blob_dir).expanduser().resolve()
    return hashlib.sha256(f"{real}\0{os.getuid()}".encode()).hexdigest()[:16]


# A daemon runs from the root directory: ``-m`` puts the working directory first on sys.path,
# so a daemon started from a directory another user can write to would import an ``expertd``
# planted there; and a daemon holds no user's directory (or its volume) busy.
DAEMON_CWD = "/"


def daemon_environment(environ) -> dict:
    """``environ`` for a daemon that runs from :data:`DAEMON_CWD`: PYTHONPATH's relative
    entries (an empty one means the working directory) made absolute, as they were meant."""
    env = dict(environ)
    env.pop(SERVICE_VARIABLE, None)  # started by hand, whatever the shell holds
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir)
                                            for p in env["PYTHONPATH"].split(os.pathsep))
    return env


def expertd_command() -> list:
    """The absolute command that runs this expertd: this interpreter with ``-m expertd``.

    Not resolved through symlinks: a virtual environment's python is a symlink, and resolving
    it would lose the environment (and expertd with it).
    """
    return [os.path.abspath(sys.executable), "-m", "expertd"]


@dataclass(frozen=True)
class ServicePlan:
    """Everything an install writes, for one blob directory on one platform."""

    platform: str  # "linux" or "macos"
    blob_dir: Path  # resolved
    name: str  # launchd label (com.expertd.<id>) or systemd unit (expertd-<id>.service)
    path: Path  # the plist or unit file
    argv: tuple  # the daemon's whole command line, absolute paths
    environment: tuple  # ((name, value), ...) pinned from the installing shell, and its name
    log: Path | None  # macOS: the daemon's rotating log; Linux: the journal
    launchd_log: Path | None  # macOS: the output launchd captures (before logging starts)

    @property
    def log_hint(self) -> str:
        """Where this service's daemon logs, as a path or the command that shows it."""
        return str(self.log) if self.log else f"journalctl --user -u {self.name}"


def make_plan(blob_dir, start_flags=(), platform: str | None = None, home: Path | None = None,
              environ=None) -> ServicePlan:
    """The service for ``blob_dir`` with ``expertd start`` flags ``start_flags``.

    Args:
        start_flags: flags for ``expertd start`` (e.g. ``["--cache-gb", "8G"]``), passed as given
            after ``--blobs`` (paths in them should already be absolute).
        platform: "linux" or "macos" (default: this machine's).
        home: the user's home (default: ``Path.home()``, i.e. ``$HOME``).
        environ: the environment whose runtime variables are pinned (default: ``os.environ``).
    Raises:
        ValueError: for an unknown platform.
    """
    platform = platform or this_platform()
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}, not {platform!r}")
    home = Path(home) if home else Path.home()
    environ = os.environ if environ is None else environ
    real = Path(blob_dir).expanduser().resolve()
    ident = service_id(real)
    argv = [*expertd_command(), "start", "--blobs", str(real), *map(str, start_flags),
            "--foreground"]
    env = [(k, environ[k]) for k in RUNTIME_VARS if environ.get(k)]
    if platform == "macos":
        name = f"com.expertd.{ident}"
        logs = home / "Library" / "Logs" / "expertd"
        log = logs / f"{name}.log"
        argv[-1:-1] = ["--log-file", str(log)]
        if not environ.get("XDG_RUNTIME_DIR"):  # launchd agents need not inherit TMPDIR
            env.append(("TMPDIR", environ.get("TMPDIR") or tempfile.gettempdir()))
        env.append((SERVICE_VARIABLE, name))
        return ServicePlan(platform, real, name, home / "Library" / "LaunchAgents" /
                           f"{name}.plist", tuple(argv), tuple(env), log,
                           logs / f"{name}.launchd.log")
    name = f"expertd-{ident}.service"
    env.append((SERVICE_VARIABLE, name))
    return ServicePlan(platform, real, name, home / ".config" / "systemd" / "user" / name,
                       tuple(argv), tuple(env), None, None)


def restart_command(platform: str, name: str) -> list:
    """The command that restarts the service ``name`` (its daemon, with its unit's flags)."""
    if platform == "macos":
        return ["launchctl", "kickstart", "-k", f"gui/{os.getuid()}/{name}"]
    return ["systemctl", "--user", "restart", name]
