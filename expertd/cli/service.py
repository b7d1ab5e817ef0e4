"""``expertd service``: run one daemon per blob directory under launchd (macOS) or systemd (Linux).

What goes into the agent or unit file and which commands activate it are pure functions of a
:class:`ServicePlan`, so tests render both platforms' files on any machine. The manager is the
only supervisor: the daemon runs ``start --foreground`` and exits on SIGTERM.

One job, over 400 lines: the service's install, status and removal on both managers.
"""

import os
import secrets
import subprocess
import sys
from pathlib import Path

from expertd.cli.daemon_control import config_from_args, snapshot
from expertd.cli.options import add_start_flags, start_flags
from expertd.cli.service_plan import (  # noqa: F401 (service's names for them)
    DAEMON_CWD,
    PLATFORMS,
    RUNTIME_VARS,
    STOP_GRACE_S,
    ServicePlan,
    expertd_command,
    make_plan,
    restart_command,
    service_id,
    this_platform,
)
from expertd.errors import DaemonError, FlagError

# ---- file contents ---------------------------------------------------------------------------

def systemd_quote(arg: str) -> str:
    """One ExecStart word: double-quoted when needed, with systemd's escapes.

    systemd expands ``%`` specifiers and ``$VAR`` in ExecStart, and splits on spaces; quotes
    and backslashes are C-style escaped inside double quotes.
    """
    word = arg.replace("%", "%%").replace("$", "$$")
    if word and all(c.isalnum() or c in "/._-+=:,@" for c in word):
        return word
    for raw, escaped in (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\t", "\\t")):
        word = word.replace(raw, escaped)
    return f'"{word}"'


def render_unit(plan: ServicePlan) -> str:
    """The systemd user unit's text."""
    env = "".join(f"Environment={systemd_quote(f'{k}={v}')}\n" for k, v in plan.environment)
    if not dict(plan.environment).get("XDG_RUNTIME_DIR"):
        # The installing shell had none, so its clients look in /tmp: the daemon must too.
        env += "UnsetEnvironment=XDG_RUNTIME_DIR\n"
    return (
        "# Written by `expertd service install`; remove with `expertd service uninstall`.\n"
        "[Unit]\n"
        f"Description=expertd serving {plan.blob_dir}\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"ExecStart={' '.join(systemd_quote(a) for a in plan.argv)}\n"
        f"WorkingDirectory={DAEMON_CWD}\n"
        f"{env}"
        "Restart=on-failure\n"
        "RestartSec=2\n"
        f"TimeoutStopSec={STOP_GRACE_S}\n"
        "KillMode=mixed\n"
        "\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def plist_dict(plan: ServicePlan) -> dict:
    """The launchd agent's property list, as a dict."""
    return {
        "Label": plan.name,
        "ProgramArguments": list(plan.argv),
        "WorkingDirectory": DAEMON_CWD,
        "EnvironmentVariables": dict(plan.environment),
        "RunAtLoad": True,
        # Restart after a crash, not after a clean stop (SIGTERM exits 0).
        "KeepAlive": {"SuccessfulExit": False},
        "ExitTimeOut": STOP_GRACE_S,
        "ProcessType": "Interactive",  # the daemon is on every client's token path
        "StandardOutPath": str(plan.launchd_log),
        "StandardErrorPath": str(plan.launchd_log),
    }


def render(plan: ServicePlan) -> bytes:
    """The file ``install`` writes at ``plan.path``."""
    if plan.platform == "macos":
        import plistlib  # only here: every `expertd` command builds the parser that imports us

        return plistlib.dumps(plist_dict(plan), sort_keys=False)
    return render_unit(plan).encode()


# ---- the manager's commands ------------------------------------------------------------------

def install_commands(plan: ServicePlan) -> list:
    """The commands that start the service once its file is written, in order."""
    if plan.platform == "macos":
        return [["launchctl", "bootstrap", f"gui/{os.getuid()}", str(plan.path)]]
    return [["systemctl", "--user", "daemon-reload"],
            ["systemctl", "--user", "enable", "--now", plan.name]]


def stop_commands(plan: ServicePlan) -> list:
    """The commands that stop and disable the service before its file is removed."""
    if plan.platform == "macos":
        return [["launchctl", "bootout", f"gui/{os.getuid()}/{plan.name}"]]
    return [["systemctl", "--user", "disable", "--now", plan.name]]


def reload_commands(plan: ServicePlan) -> list:
    """The commands to run after the file is removed."""
    return [] if plan.platform == "macos" else [["systemctl", "--user", "daemon-reload"]]


def status_command(plan: ServicePlan) -> list:
    """The command that shows the manager's view of the service."""
    if plan.platform == "macos":
        return ["launchctl", "print", f"gui/{os.getuid()}/{plan.name}"]
    return ["systemctl", "--user", "is-active", plan.name]


def manager_unreachable(plan: ServicePlan) -> str | None:
    """Why systemd's user manager cannot be reached from this shell (its words), or None if
    it can, or on macOS. Without one (a container, a session without lingering) a unit can
    be written and enabled, but nothing can be started, stopped or asked."""
    if plan.platform == "macos":
        return None
    done = run(["systemctl", "--user", "show-environment"])  # fails only without the manager
    if done.returncode == 0:
        return None
    return (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"


def shell_line(cmd) -> str:
    """A command as one line to paste into a shell."""
    import shlex

    return shlex.join(cmd)


def write_file(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` atomically (mode 0644: launchd refuses writable agents).

    Returns:
        True if it replaced an existing file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    existed = path.exists()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # whatever the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return existed


def run(cmd, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run a manager command, capturing its output; a missing program is exit status 127."""
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except FileNotFoundError:
        return subprocess.CompletedProcess(cmd, 127, "", f"{cmd[0]}: command not found")


# ---- the subcommands ---------------------------------------------------------------------------

def _run_all(commands, action: str, then=()) -> bool:
    """Run ``commands`` in order, stopping at the first failure, which is reported on stderr
    with what to run by hand (the rest, and ``then``). Returns True if all succeeded."""
    commands = list(commands)
    for i, cmd in enumerate(commands):
        done = run(cmd)
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
            left = "\n".join(f"  {shell_line(c)}" for c in [*commands[i:], *then])
            print(f"expertd service {action}: `{shell_line(cmd)}` failed: {why}\n"
                  f"run by hand once it can work:\n{left}", file=sys.stderr)
            return False
    return True


def _plan(args) -> ServicePlan:
    flags = start_flags(args) if args.action == "install" else []
    if args.action == "install" and args.log_file:
        raise FlagError("--log-file is chosen by the service (macOS: ~/Library/Logs/expertd/, "
                        "Linux: the journal); leave it out")
    return make_plan(args.blobs, flags, platform=args.platform)


def _manages_here(args, plan: ServicePlan) -> bool:
    """True unless told not to touch the manager, or the file is for another platform."""
    return not args.no_start and plan.platform == this_platform()


def _cmd_install(args) -> int:
    config_from_args(args)  # refuse a bad blob directory or budget now, not in a restart loop
    plan = _plan(args)
    by_hand = _daemon_beside(plan)[0] if plan.platform == this_platform() else ""
    if by_hand and _manages_here(args, plan):
        earlier = (" (if it is this service's own, started by an earlier expertd, restart it "
                   "with its manager instead)" if plan.path.exists() else "")
        raise DaemonError(f"{by_hand}, so the service's daemon could not start beside it: stop "
                          f"it first (expertd stop --blobs {plan.blob_dir}), then install; "
                          f"--no-start only writes the file{earlier}")
    if plan.log is not None:  # launchd and the daemon's --log-file both need it to exist
        plan.log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    replaced = write_file(plan.path, render(plan))
    print(f"{'replaced' if replaced else 'wrote'} {plan.path}")
    print(f"  runs: {shell_line(plan.argv)}")
    print(f"  log: {plan.log_hint}")
    commands = install_commands(plan)
    if replaced:  # the running service keeps its old flags until it is restarted
        commands = (stop_commands(plan) if plan.platform == "macos" else []) + commands + (
            [restart_command(plan.platform, plan.name)] if plan.platform == "linux" else [])
    if not _manages_here(args, plan):
        print("to start it, run:\n" + "\n".join(f"  {shell_line(c)}" for c in commands))
        if by_hand:
            print(f"note: {by_hand}: the service's daemon will not start while it runs; stop "
                  f"it first (expertd stop --blobs {plan.blob_dir})")
        return 0
    unreachable = manager_unreachable(plan)
    if unreachable is not None:
        return _install_without_manager(plan, commands, unreachable)
    if replaced and plan.platform == "macos":
        run(commands.pop(0))  # bootout of an agent that is not loaded fails: that is fine
    if not _run_all(commands, "install"):
        return 1
    print(f"started {plan.name}")
    return 0


def _install_without_manager(plan: ServicePlan, commands, why: str) -> int:
    """The unit is written; systemd's user manager cannot be reached, so nothing can start
    it now. It is enabled without the manager (systemctl does that on the files alone), so
    that it starts with the manager; exit status 1: the daemon does not run."""
    enabled = run(["systemctl", "--user", "enable", plan.name])
    if enabled.returncode == 0:
        print(f"enabled {plan.name}: it starts when your user manager does (at your next "
              "login, or at boot after `loginctl enable-linger`)")
    print(f"expertd service install: systemd's user manager is unreachable from this shell "
          f"({why}), so the service is not started\n"
          f"once it is reachable, start it with:\n  {' && '.join(map(shell_line, commands))}\n"
          "without a user manager (a container), run the daemon by hand instead:\n"
          f"  {shell_line(['expertd', *plan.argv[len(expertd_command()):-1]])}",
          file=sys.stderr)
    return 1


def _daemon_beside(plan: ServicePlan) -> tuple:
    """Who serves the blob directory: ``(sentence, None)`` for a daemon started by hand (its
    service's daemon could not start beside it, and its manager would retry in a loop);
    ``("", pid)`` for the service's own (its run file names the service); ``("", None)``
    for none."""
    from expertd.cli.lifecycle import serving_pid
    from expertd.paths import daemon_paths
    from expertd.runfile import claimant, claimant_runtime, elsewhere_text, read_run_info

    paths = daemon_paths(plan.blob_dir)
    pid = serving_pid(paths)
    other = claimant(paths) if pid is None else None
    # The serving daemon's run file, in this runtime directory or in its own (the service
    # may run where the installing shell's XDG_RUNTIME_DIR differs).
    run = claimant_runtime(other)
    info = read_run_info(daemon_paths(plan.blob_dir, run)) if pid is not None or run else None
    if info is not None and info.service == plan.name:
        return "", info.pid
    if pid is not None:
        return f"an expertd (pid {pid}) started by hand serves {plan.blob_dir}", None
    return elsewhere_text(paths, other), None


def _cmd_uninstall(args) -> int:
    plan = _plan(args)
    if not plan.path.exists():
        print(f"no expertd service for {plan.blob_dir} is installed ({plan.path} does not "
              "exist); nothing to remove")
        return 0
    if not _manages_here(args, plan):
        plan.path.unlink()
        print(f"removed {plan.path}")
        commands = stop_commands(plan) + reload_commands(plan)
        print("to stop it, run:\n" + "\n".join(f"  {shell_line(c)}" for c in commands))
        return 0
    unreachable = manager_unreachable(plan)
    if unreachable is not None:
        return _uninstall_without_manager(plan, unreachable)
    # The file goes even if the manager cannot be reached: uninstall means "not any more".
    stopped = _run_all(stop_commands(plan), "uninstall", then=reload_commands(plan))
    plan.path.unlink()
    print(f"removed {plan.path}")
    return 0 if stopped and _run_all(reload_commands(plan), "uninstall") else 1


def _uninstall_without_manager(plan: ServicePlan, why: str) -> int:
    """Disabled and removed without the manager; exit status 0 unless the service's daemon
    still runs (under a manager this shell cannot reach), which nothing here can stop."""
    run(["systemctl", "--user", "disable", plan.name])  # on the files alone; may be disabled
    plan.path.unlink()
    print(f"removed {plan.path}")
    pid = _daemon_beside(plan)[1]
    if pid is None:
        print(f"  systemd's user manager is unreachable from this shell ({why}); nothing of "
              "the service's runs, so nothing is left to stop")
        return 0
    print(f"expertd service uninstall: its daemon (pid {pid}) still runs, under a user manager "
          f"this shell cannot reach ({why}): stop it with expertd stop --blobs {plan.blob_dir}",
          file=sys.stderr)
    return 1


def _cmd_status(args) -> int:
    import argparse

    plan = _plan(args)
    installed = plan.path.exists()
    print(f"{plan.name}: {plan.path} {'installed' if installed else 'not installed'}")
    if not installed:  # nothing of the manager's to show: a daemon started by hand logs here
        from expertd.paths import daemon_paths

        print(f"  no service for {plan.blob_dir}; a daemon started by hand (expertd start) "
              f"logs to {daemon_paths(plan.blob_dir).log}")
    else:
        print(f"  log: {plan.log_hint}")
    unreachable = None
    if installed and plan.platform == this_platform():
        unreachable = manager_unreachable(plan)
    if unreachable is not None:
        print(f"  systemd's user manager: unreachable from this shell ({unreachable})")
    elif installed and plan.platform == this_platform():
        cmd = status_command(plan)
        done = run(cmd)
        view = (done.stdout.strip() or done.stderr.strip() or f"exit status {done.returncode}")
        if plan.platform == "macos":  # `launchctl print` is long: its state lines say enough
            view = "\n".join(ln.strip() for ln in view.splitlines()
                             if ln.strip().startswith(("state =", "pid =", "last exit"))) or view
        print(f"  {shell_line(cmd)}: " + view.replace("\n", "\n    "))
    code, out = snapshot(argparse.Namespace(blobs=str(plan.blob_dir), json=False, timeout=5.0))
    print(out if code == 0 else "  the daemon: not running")
    by_hand = _daemon_beside(plan)[0] if installed and plan.platform == this_platform() else ""
    if by_hand:
        print(f"note: {by_hand}: the service's daemon will not start while it runs")
    # LSB's and systemctl's: 0 running, 3 not running (or no service).
    return 0 if installed and code == 0 else 3


def add_subcommands(sub) -> None:
    p = sub.add_parser("service", help="run the daemon as a launchd agent or systemd user unit",
                       description="Install, remove or inspect a per-user service that keeps "
                       "one expertd serving BLOB_DIR: a launchd agent in ~/Library/LaunchAgents "
                       "on macOS (logs in ~/Library/Logs/expertd), a systemd user unit in "
                       "~/.config/systemd/user on Linux (logs in the journal).")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    def common(q):
        q.add_argument("--platform", choices=PLATFORMS, default=this_platform(),
                       help="whose service file to handle; another platform's file is written "
                       "but never activated")

    q = actions.add_parser("install", help="write the service file and start the service",
                           description="Write the agent/unit file for BLOB_DIR (replacing one "
                           "already there) and start it with launchctl bootstrap / systemctl "
                           "--user enable --now. The flags are `expertd start`'s. Exits 0 once "
                           "the service is started (with --no-start, once the file is written); "
                           "1 if it is not started: where systemd's user manager is unreachable "
                           "(a container, a session without lingering) the unit is left written "
                           "and enabled, and the commands to run are printed.")
    add_start_flags(q)
    common(q)
    q.add_argument("--no-start", action="store_true",
                   help="only write the file and print the commands that would start it")
    q.set_defaults(func=_cmd_install)

    q = actions.add_parser("uninstall", help="stop the service and remove its file",
                           description="Stop and disable the service of BLOB_DIR, remove its "
                           "file. Exits 0 once the file is gone and no daemon of the service "
                           "runs (nothing installed is not an error; without systemd's user "
                           "manager the unit is disabled on its files alone), 1 otherwise.")
    q.add_argument("--blobs", required=True, metavar="BLOB_DIR")
    common(q)
    q.add_argument("--no-start", action="store_true",
                   help="only remove the file and print the commands that would stop it")
    q.set_defaults(func=_cmd_uninstall)

    q = actions.add_parser("status", help="the service file, the manager's view, the daemon's",
                           description="Whether the service file of BLOB_DIR exists, what "
                           "systemctl/launchctl say about it, and the daemon's own status. "
                           "Exits 0 if the service is installed and its daemon answers, 3 "
                           "otherwise (not running, or not installed), as systemctl does.")
    q.add_argument("--blobs", required=True, metavar="BLOB_DIR")
    common(q)
    q.set_defaults(func=_cmd_status)
