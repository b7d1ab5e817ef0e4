"""``expertd service``: the systemd unit and the launchd agent it writes into a temporary HOME,
the exact commands it runs or prints, the template in launchd/, and a real daemon run from the
command line the files hold."""

import json
import os
import plistlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import expertd_cli, kill_serving_daemon, stop_process, try_stats, wait_until

from expertd.cli.service import (
    STOP_GRACE_S,
    expertd_command,
    make_plan,
    plist_dict,
    service_id,
    systemd_quote,
)
from expertd.paths import daemon_paths

TEMPLATE = Path(__file__).resolve().parents[1] / "launchd" / "com.expertd.agent.plist"
CACHE = "80%"  # of the tiny model's 768 KiB of experts: 37 of its 48 rows


@pytest.fixture
def home(tmp_path, monkeypatch, isolated_env):
    """A temporary HOME (Path.home() follows it) beside the test's runtime directories.

    The runtime directory is the test's own and the session bus's address is dropped, so
    `systemctl --user` reaches no user manager, as in a container: never the developer's."""
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("HOME", str(path))
    monkeypatch.delenv("DBUS_SESSION_BUS_ADDRESS", raising=False)
    return path


@pytest.fixture
def systemctl(home):
    """This machine's real systemctl, which reaches no user manager from the test (see home)."""
    if sys.platform == "darwin" or not shutil.which("systemctl"):
        pytest.skip("systemctl is Linux's, and not installed here")
    probe = subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode != 0, "a user manager answered in the test's runtime directory"
    return probe.stderr.strip()


@pytest.fixture
def awkward_blobs(models, tmp_path) -> Path:
    """The tiny model's blobs under a name with a space, '%' and '$' (systemd expands both)."""
    out = tmp_path / "my blobs 50% $HOME"
    shutil.copytree(models.blobs(), out)
    return out.resolve()


def _files(root: Path) -> list:
    return sorted(p for p in root.rglob("*") if not p.is_dir())


# ---- systemd (Linux) -----------------------------------------------------------------------------

def test_systemd_quoting_escapes_what_systemd_would_expand():
    assert systemd_quote("/usr/bin/python3") == "/usr/bin/python3"
    assert systemd_quote("a b") == '"a b"'
    assert systemd_quote("30%") == '"30%%"'
    assert systemd_quote("$HOME") == '"$$HOME"'
    assert systemd_quote('say "hi"\\') == '"say \\"hi\\"\\\\"'
    assert systemd_quote("") == '""'


def test_install_writes_the_unit_and_prints_the_exact_commands(awkward_blobs, home):
    got = expertd_cli("service", "install", "--blobs", awkward_blobs, "--cache-gb", CACHE,
                      "--workers", "2", "--platform", "linux", "--no-start")
    assert got.returncode == 0, got.stderr
    unit = f"expertd-{service_id(awkward_blobs)}.service"
    path = home / ".config" / "systemd" / "user" / unit
    assert _files(home) == [path]
    text = path.read_text()
    python = os.path.abspath(sys.executable)
    blobs = str(awkward_blobs).replace("%", "%%").replace("$", "$$")
    assert (f'ExecStart={python} -m expertd start --blobs "{blobs}" --cache-gb "80%%" '
            "--workers 2 --foreground\n") in text
    for line in ("Type=simple", "WorkingDirectory=/", "Restart=on-failure",
                 f"TimeoutStopSec={STOP_GRACE_S}",
                 "WantedBy=default.target",
                 f"Environment=XDG_RUNTIME_DIR={os.environ['XDG_RUNTIME_DIR']}"):
        assert f"\n{line}\n" in text, line
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert got.stdout.splitlines()[-3:] == [
        "to start it, run:", "  systemctl --user daemon-reload",
        f"  systemctl --user enable --now {unit}"]

    again = expertd_cli("service", "install", "--blobs", awkward_blobs, "--cache-gb", "90%",
                        "--platform", "linux", "--no-start")
    assert again.returncode == 0 and f"replaced {path}" in again.stdout, again
    assert '--cache-gb "90%%"' in path.read_text() and "--workers" not in path.read_text()
    assert f"  systemctl --user restart {unit}" in again.stdout  # the new flags take effect

    gone = expertd_cli("service", "uninstall", "--blobs", awkward_blobs, "--platform", "linux",
                       "--no-start")
    assert gone.returncode == 0 and f"removed {path}" in gone.stdout, gone
    assert f"  systemctl --user disable --now {unit}" in gone.stdout
    assert _files(home) == []
    nothing = expertd_cli("service", "uninstall", "--blobs", awkward_blobs)
    assert nothing.returncode == 0 and "nothing to remove" in nothing.stdout, nothing


def test_unit_passes_systemd_analyze_verify(awkward_blobs, home):
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        pytest.skip("systemd-analyze is not installed here")
    assert expertd_cli("service", "install", "--blobs", awkward_blobs, "--cache-gb", CACHE,
                       "--platform", "linux", "--no-start").returncode == 0
    unit = make_plan(awkward_blobs, platform="linux").path
    ok = subprocess.run([analyze, "verify", "--user", str(unit)], capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0, ok.stderr
    # The check can fail: a relative ExecStart is refused.
    bad = unit.with_name("expertd-bad.service")
    bad.write_text(unit.read_text().replace(f"ExecStart={os.path.abspath(sys.executable)}",
                                            "ExecStart=python"))
    refused = subprocess.run([analyze, "verify", "--user", str(bad)], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode != 0


def test_unit_without_a_runtime_dir_unsets_the_managers(models):
    from expertd.cli.service import render_unit

    plan = make_plan(models.blobs(), platform="linux", home=Path("/home/u"), environ={})
    assert plan.path == Path("/home/u/.config/systemd/user") / plan.name
    unit = render_unit(plan)
    assert "\nUnsetEnvironment=XDG_RUNTIME_DIR\n" in unit and "\nEnvironment=XDG" not in unit
    # Its daemon says whose it is (status and a reinstall tell it from one started by hand).
    assert f"\nEnvironment=EXPERTD_SERVICE={plan.name}\n" in unit


def test_without_a_user_manager_install_enables_the_unit_and_says_what_to_run(
        awkward_blobs, home, systemctl):
    """No mock: this machine's systemctl runs, and reaches no user manager (a container, an
    SSH session without lingering). install writes the unit and enables it on its files alone,
    says why it is not started and what to run, and exits 1 (the daemon does not run); status
    exits 3 (not running), as systemctl does; uninstall disables and removes it and exits 0."""
    unit = make_plan(awkward_blobs, platform="linux")
    wants = unit.path.parent / "default.target.wants" / unit.name
    got = expertd_cli("service", "install", "--blobs", awkward_blobs, "--cache-gb", CACHE,
                      "--platform", "linux")
    assert got.returncode == 1, got
    assert _files(home) == sorted([unit.path, wants]) and wants.resolve() == unit.path
    assert (f"enabled {unit.name}: it starts when your user manager does (at your next login, "
            "or at boot after `loginctl enable-linger`)") in got.stdout.splitlines(), got.stdout
    assert got.stderr.splitlines() == [
        "expertd service install: systemd's user manager is unreachable from this shell "
        f"({systemctl}), so the service is not started",
        "once it is reachable, start it with:",
        f"  systemctl --user daemon-reload && systemctl --user enable --now {unit.name}",
        "without a user manager (a container), run the daemon by hand instead:",
        f"  expertd start --blobs '{awkward_blobs}' --cache-gb 80%"], got.stderr
    status = expertd_cli("service", "status", "--blobs", awkward_blobs)
    assert status.returncode == 3 and f"{unit.path} installed" in status.stdout, status
    assert (f"  systemd's user manager: unreachable from this shell ({systemctl})"
            in status.stdout.splitlines()), status.stdout
    assert "the daemon: not running" in status.stdout
    # The daemon's status names the service's log (the journal), running or not.
    daemon = expertd_cli("status", "--blobs", awkward_blobs, "--json")
    assert json.loads(daemon.stdout)[0]["log"] == f"journalctl --user -u {unit.name}"
    gone = expertd_cli("service", "uninstall", "--blobs", awkward_blobs)
    assert gone.returncode == 0 and gone.stderr == "", gone
    assert gone.stdout.splitlines() == [
        f"removed {unit.path}",
        f"  systemd's user manager is unreachable from this shell ({systemctl}); nothing of "
        "the service's runs, so nothing is left to stop"]
    assert _files(home) == []  # the unit and its link
    status = expertd_cli("service", "status", "--blobs", awkward_blobs)
    assert status.returncode == 3 and "not installed" in status.stdout
    # No service: no journal and no manager's command; where a daemon started by hand logs.
    assert "journalctl" not in status.stdout and "systemctl" not in status.stdout
    assert f"logs to {daemon_paths(awkward_blobs).log}" in status.stdout


def test_install_refuses_beside_a_daemon_started_by_hand(awkward_blobs, home, monkeypatch,
                                                          other_runtime, systemctl):
    """The service's daemon could not start beside one started by hand (its manager would
    retry in a loop): install says so before writing anything, --no-start writes the file and
    says the unit will not start while that daemon runs. With the service's own daemon
    running, a reinstall goes on (to this machine's systemctl, which reaches no manager), and
    uninstall, unable to stop it, says so and exits 1."""
    unit = make_plan(awkward_blobs, platform="linux")
    home_runtime = os.environ["XDG_RUNTIME_DIR"]
    other = other_runtime
    try:
        assert expertd_cli("start", "--blobs", awkward_blobs, "--cache-gb", CACHE).returncode == 0
        by_hand = f"an expertd (pid {try_stats(awkward_blobs)['pid']}) started by hand serves " \
                  f"{awkward_blobs}"
        got = expertd_cli("service", "install", "--blobs", awkward_blobs, "--cache-gb", CACHE)
        assert got.returncode == 1 and "Traceback" not in got.stderr, got
        assert f"{by_hand}, so the service's daemon could not start beside it: stop it first" \
            in got.stderr, got.stderr
        assert got.stderr.startswith("expertd service install: error: "), got.stderr
        assert not unit.path.exists() and not make_plan(awkward_blobs, platform="macos").path.exists()
        # --no-start only writes the file, and says it will not start while that one runs.
        wrote = expertd_cli("service", "install", "--blobs", awkward_blobs, "--cache-gb", CACHE,
                            "--platform", "linux", "--no-start")
        assert wrote.returncode == 0 and unit.path.exists(), wrote
        note = (f"note: {by_hand}: the service's daemon will not start while it runs")
        assert wrote.stdout.splitlines()[-1] == (f"{note}; stop it first (expertd stop --blobs "
                                                 f"{awkward_blobs})"), wrote.stdout
        status = expertd_cli("service", "status", "--blobs", awkward_blobs)
        assert status.returncode == 0 and status.stdout.splitlines()[-1] == note, status
        # The file there, the daemon is still the hand-started one: its log, and refused again.
        log = json.loads(expertd_cli("status", "--blobs", awkward_blobs, "--json").stdout)[0]
        assert log["log"] == str(daemon_paths(awkward_blobs).log), log
        again = expertd_cli("service", "install", "--blobs", awkward_blobs, "--cache-gb", CACHE)
        assert again.returncode == 1 and "could not start beside it" in again.stderr, again
        assert expertd_cli("stop", "--blobs", awkward_blobs).returncode == 0
        # The unit's own daemon (its command line and environment, as systemd runs it): its
        # log is the journal, and a reinstall goes on to restart it.
        env = {**os.environ, **dict(unit.environment)}
        with open(os.devnull, "wb") as quiet:
            own = subprocess.Popen(unit.argv, env=env, stdin=subprocess.DEVNULL, stdout=quiet,
                                   stderr=quiet)
        try:
            wait_until(lambda: try_stats(awkward_blobs), 60, "the unit's daemon to answer")
            log = json.loads(expertd_cli("status", "--blobs", awkward_blobs, "--json").stdout)[0]
            assert log["log"] == f"journalctl --user -u {unit.name}", log
            status = expertd_cli("service", "status", "--blobs", awkward_blobs)
            assert status.returncode == 0 and "note:" not in status.stdout, status
            # Restarted by its manager, not by hand (the service would fail beside it).
            by_hand = expertd_cli("restart", "--blobs", awkward_blobs)
            assert by_hand.returncode == 1, by_hand
            assert f"restart it with systemctl --user restart {unit.name}" in by_hand.stderr
            # From a shell whose XDG_RUNTIME_DIR differs too: the service's own is found (its
            # claim names its runtime directory, whose run file names the service).
            for runtime in (None, other):
                if runtime is not None:
                    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
                reinstall = expertd_cli("service", "install", "--blobs", awkward_blobs,
                                        "--cache-gb", CACHE)
                assert reinstall.returncode == 1, reinstall  # no manager to restart it
                assert "systemd's user manager is unreachable" in reinstall.stderr, reinstall
                assert f"systemctl --user restart {unit.name}" in reinstall.stderr  # it went on
                assert "could not start beside it" not in reinstall.stderr, reinstall.stderr
            # Its daemon runs under a manager this shell cannot reach: nothing here stops it.
            gone = expertd_cli("service", "uninstall", "--blobs", awkward_blobs)
            assert gone.returncode == 1 and not unit.path.exists(), gone
            assert gone.stderr == (
                f"expertd service uninstall: its daemon (pid {own.pid}) still runs, under a "
                f"user manager this shell cannot reach ({systemctl}): stop it with expertd "
                f"stop --blobs {awkward_blobs}\n"), gone.stderr
        finally:
            monkeypatch.setenv("XDG_RUNTIME_DIR", home_runtime)
            stop_process(own)
        nothing = expertd_cli("service", "uninstall", "--blobs", awkward_blobs)
        assert nothing.returncode == 0 and "nothing to remove" in nothing.stdout, nothing
        assert _files(home) == []
    finally:
        kill_serving_daemon(awkward_blobs)


def test_install_refuses_bad_flags_before_writing_anything(awkward_blobs, home):
    for flags, message, code in ((["--cache-gb", "nan"], "smallest cache that serves", 2),
                                 (["--workers", "0"], "--workers: must be from 1 to", 2),
                                 (["--log-file", "x.log"], "--log-file is chosen by the service",
                                  2)):
        got = expertd_cli("service", "install", "--blobs", awkward_blobs, *flags, "--no-start")
        assert got.returncode == code and message in got.stderr, got
        assert len(got.stderr.strip().splitlines()) == 1 and "Traceback" not in got.stderr
    assert _files(home) == []


# ---- launchd (macOS) ----------------------------------------------------------------------------

def test_macos_agent_content_and_commands(awkward_blobs, home, tmp_path, monkeypatch):
    pins = tmp_path / "pins.json"
    pins.write_text("[[0, 1]]")
    monkeypatch.chdir(tmp_path)  # a relative pin file is written as an absolute path
    got = expertd_cli("service", "install", "--blobs", awkward_blobs, "--cache-gb", "512K",
                      "--pin-file", "pins.json", "--platform", "macos", "--no-start")
    assert got.returncode == 0, got.stderr
    label = f"com.expertd.{service_id(awkward_blobs)}"
    path = home / "Library" / "LaunchAgents" / f"{label}.plist"
    assert _files(home) == [path]
    agent = plistlib.loads(path.read_bytes())
    logs = home / "Library" / "Logs" / "expertd"
    assert logs.is_dir()  # launchd's StandardErrorPath and --log-file need it
    assert agent["ProgramArguments"] == [
        *expertd_command(), "start", "--blobs", str(awkward_blobs), "--cache-gb", "512K",
        "--pin-file", str(pins), "--log-file", str(logs / f"{label}.log"), "--foreground"]
    assert all(Path(a).is_absolute() for a in agent["ProgramArguments"] if "/" in a)
    assert agent["Label"] == label and agent["RunAtLoad"] is True
    assert agent["WorkingDirectory"] == "/"  # -m puts it first on sys.path
    assert agent["KeepAlive"] == {"SuccessfulExit": False}
    assert agent["ExitTimeOut"] == STOP_GRACE_S
    assert agent["StandardErrorPath"] == str(logs / f"{label}.launchd.log")
    assert agent["EnvironmentVariables"]["XDG_RUNTIME_DIR"] == os.environ["XDG_RUNTIME_DIR"]
    assert f"  launchctl bootstrap gui/{os.getuid()} {path}" in got.stdout
    gone = expertd_cli("service", "uninstall", "--blobs", awkward_blobs, "--platform", "macos",
                       "--no-start")
    assert gone.returncode == 0 and f"launchctl bootout gui/{os.getuid()}/{label}" in gone.stdout
    assert _files(home) == []


def test_the_launchd_template_matches_what_install_writes(models):
    home, tmp = Path("/Users/someone"), "/var/folders/xy/T/"
    plan = make_plan(models.blobs(), ["--cache-gb", "8G"], platform="macos", home=home,
                     environ={"TMPDIR": tmp})
    filled = TEMPLATE.read_text()
    for placeholder, value in (("@ID@", service_id(plan.blob_dir)),
                               ("@PYTHON@", expertd_command()[0]),
                               ("@BLOB_DIR@", str(plan.blob_dir)), ("@HOME@", str(home)),
                               ("@TMPDIR@", tmp)):
        assert placeholder in filled, placeholder
        filled = filled.replace(placeholder, value)
    assert plistlib.loads(filled.encode()) == plist_dict(plan)


@pytest.mark.timeout(120)
def test_the_agents_command_line_runs_a_daemon_that_logs_where_it_says(awkward_blobs, home):
    """ProgramArguments and EnvironmentVariables, run as launchd would: the daemon serves,
    logs under ~/Library/Logs/expertd, and exits 0 on SIGTERM (so KeepAlive leaves it down)."""
    plan = make_plan(awkward_blobs, ["--cache-gb", CACHE], platform="macos")
    agent = plist_dict(plan)
    env = {**os.environ, **agent["EnvironmentVariables"]}
    plan.log.parent.mkdir(parents=True)  # as `expertd service install` does
    with open(os.devnull, "wb") as quiet:
        proc = subprocess.Popen(agent["ProgramArguments"], env=env, stdin=subprocess.DEVNULL,
                                stdout=quiet, stderr=quiet, cwd=agent["WorkingDirectory"])
    try:
        stats = wait_until(lambda: proc.poll() is None and try_stats(awkward_blobs), 60,
                           "the agent's daemon to answer")
        assert stats["pid"] == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "serving" in plan.log.read_text()
        assert oct(plan.log.stat().st_mode & 0o777) == oct(0o600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        kill_serving_daemon(awkward_blobs)
