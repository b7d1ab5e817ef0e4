"""``expertd service``: run one daemon per blob directory under launchd (macOS) or systemd (Linux).

What goes into the agent or unit file and which commands activate it are pure functions of a
:class:`ServicePlan`, so tests render both platforms' files on any machine. The manager is the
only supervisor: the daemon runs ``start --foreground`` and exits on SIGTERM.
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
from expertd.errors import FlagError

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
    if _manages_here(args, plan):
        _refuse_beside_a_daemon(plan)
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
        return 0
    if replaced and plan.platform == "macos":
        run(commands.pop(0))  # bootout of an agent that is not loaded fails: that is fine
    if not _run_all(commands, "install"):
        return 1
    print(f"started {plan.name}")
    return 0


def _refuse_beside_a_daemon(plan: ServicePlan) -> None:
    """A daemon started by hand serves the directory: the service's would fail to start
    beside it, and its manager retry in a loop (systemd then gives up). Refused before
    anything is written. The service's own daemon (its run file names the service) is the one
    a reinstall restarts."""
    from expertd.cli.lifecycle import serving_pid
    from expertd.errors import DaemonError
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
        return  # the service's own: the install restarts it
    if pid is not None:
        there = f"an expertd (pid {pid}) started by hand serves {plan.blob_dir}"
    else:
        there = elsewhere_text(paths, other)
    if there:
        earlier = (" (if it is this service's own, started by an earlier expertd, restart it "
                   "with its manager instead)" if plan.path.exists() else "")
        raise DaemonError(f"{there}, so the service's daemon could not start beside it: stop "
                          f"it first (expertd stop --blobs {plan.blob_dir}), then install; "
                          f"--no-start only writes the file{earlier}")


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
    # The file goes even if the manager cannot be reached: uninstall means "not any more".
    stopped = _run_all(stop_commands(plan), "uninstall", then=reload_commands(plan))
    plan.path.unlink()
    print(f"removed {plan.path}")
    return 0 if stopped and _run_all(reload_commands(plan), "uninstall") else 1


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
    if installed and plan.platform == this_platform():
        cmd = status_command(plan)
        done = run(cmd)
        view = (done.stdout.strip() or done.stderr.strip() or f"exit status {done.returncode}")
        if plan.platform == "macos":  # `launchctl print` is long: its state lines say enough
            view = "\n".join(ln.strip() for ln in view.splitlines()
                             if ln.strip().startswith(("state =", "pid =", "last exit"))) or view
        print(f"  {shell_line(cmd)}: " + view.replace("\n", "\n    "))
    code, out = snapshot(argparse.Namespace(blobs=str(plan.blob_dir), json=False, timeout=5.0))
    print(out if code == 0 else "  the daemon: not running")
    return 0 if installed else 3


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
                           "--user enable --now. The flags are `expertd start`'s.")
    add_start_flags(q)
    common(q)
    q.add_argument("--no-start", action="store_true",
                   help="only write the file and print the commands that would start it")
    q.set_defaults(func=_cmd_install)

    q = actions.add_parser("uninstall", help="stop the service and remove its file",
                           description="Stop and disable the service of BLOB_DIR, remove its "
                           "file. Nothing installed is not an error.")
    q.add_argument("--blobs", required=True, metavar="BLOB_DIR")
    common(q)
    q.add_argument("--no-start", action="store_true",
                   help="only remove the file and print the commands that would stop it")
    q.set_defaults(func=_cmd_uninstall)

    q = actions.add_parser("status", help="the service file, the manager's view, the daemon's",
                           description="Whether the service file of BLOB_DIR exists, what "
                           "systemctl/launchctl say about it, and the daemon's own status. "
                           "Exits 3 if no service is installed.")
    q.add_argument("--blobs", required=True, metavar="BLOB_DIR")
    common(q)
    q.set_defaults(func=_cmd_status)
