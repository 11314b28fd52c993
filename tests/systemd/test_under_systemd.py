"""colibrid under a real systemd: the shipped units installed with `make install`, socket-activated,
reloaded and stopped by systemctl, its levels read back from the journal.

systemd is not PID 1 on the machines we build on, so the test boots one as PID 1 of a new PID +
mount namespace (boot_systemd.sh: private /tmp, /run, /var and an overlay on /etc first, and a
boot target with nothing but journald), drives it with `nsenter ... systemctl`, and powers it
off at the end - also when the test fails. Only a drop-in differs from what users install: the
pack path, the socket path, and how to run this checkout's Python.

The service runs the very interpreter that runs the tests, sys.executable, not the file it links
to: in a virtualenv, bin/python is a link to the base interpreter, and only when started through
the link does Python find the virtualenv (its pyvenv.cfg) and the colibrid installed there. The
virtualenv, the base interpreter and the checkout are carried into the namespace when they live
where it hides (/tmp, /root, /var/...).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import colibrid

REPO = Path(__file__).resolve().parents[2]
BOOT_SCRIPT = Path(__file__).with_name("boot_systemd.sh")
SYSTEMD = Path("/lib/systemd/systemd")
SOCKET = "/run/colibri/test.sock"
PYTHON = sys.executable  # never resolved: see above
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _source_root() -> Path:
    """The checkout colibrid is imported from (an editable install points into it)."""
    return Path(colibrid.__file__).resolve().parent.parent


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "booting systemd in a namespace needs root"
    if not SYSTEMD.exists() or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "systemd, unshare or nsenter is not installed"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare of a PID + mount namespace is not permitted here: {probe.stderr.strip()}"
    if _source_root().is_relative_to("/run"):
        return "colibrid is imported from /run, which the namespace replaces before it can be carried over"
    return None


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


HIDDEN_BY_THE_NAMESPACE = ("/tmp", "/var/lib", "/var/tmp", "/var/log", "/root")
HIDDEN_BY_PRIVATE_TMP = ("/tmp", "/var/tmp")  # the service's PrivateTmp=yes


def _needed_paths() -> list[Path]:
    """What the service's Python needs: the base interpreter's installation (pyenv's lives
    under /root), the virtualenv if the tests run in one, and the checkout colibrid is
    imported from."""
    needed = [Path(sys.base_prefix), _source_root()]
    if sys.prefix != sys.base_prefix:
        needed.append(Path(sys.prefix))
    return needed


def _carried_paths() -> list[str]:
    """The needed paths the namespace hides, outermost only (a virtualenv inside the checkout
    comes with it)."""
    hidden = {path for path in _needed_paths() if any(path.is_relative_to(h) for h in HIDDEN_BY_THE_NAMESPACE)}
    return sorted(str(path) for path in hidden if not any(path != other and path.is_relative_to(other)
                                                        for other in hidden))


def _cgroup_dirs() -> set[Path]:
    dirs = set()
    for hierarchy in CGROUP_ROOT.iterdir():
        for root, subdirs, _ in os.walk(hierarchy):
            if Path(root).relative_to(hierarchy).parts.__len__() >= 4:
                subdirs[:] = []
            dirs.add(Path(root))
    return dirs


class BootedSystemd:
    def __init__(self, work_dir: Path) -> None:
        self.log = open(work_dir.parent / f"{work_dir.name}.boot.log", "w+")
        self.unshare = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation", "private",
             "sh", str(BOOT_SCRIPT), str(work_dir), *_carried_paths()],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = self._wait_for_pid_1()
        self._wait_until_running()

    def _wait_for_pid_1(self) -> int:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                children = Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children").read_text().split()
            except OSError:
                children = []
            if children:
                return int(children[0])
            if self.unshare.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"systemd did not start: {self.boot_log()}")

    def _wait_until_running(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                return
            time.sleep(0.1)
        raise RuntimeError(f"systemd did not finish booting (state {state!r}): {self.boot_log()}")

    def boot_log(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def run(self, *argv: str, check: bool = True, timeout_s: float = 60) -> subprocess.CompletedProcess:
        result = subprocess.run(["nsenter", "-t", str(self.pid), "-p", "-m", *argv], capture_output=True,
                                text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def write(self, path: str, text: str) -> None:
        self.run("sh", "-c", f"mkdir -p \"$(dirname '{path}')\" && cat > '{path}' <<'END'\n{text}END\n")

    def show(self, unit: str, prop: str) -> str:
        return self.run("systemctl", "show", unit, "-p", prop, "--value").stdout.strip()

    def poweroff(self) -> None:
        if self.unshare.poll() is None:
            self.run("systemctl", "poweroff", check=False, timeout_s=20)
            try:
                self.unshare.wait(30)
            except subprocess.TimeoutExpired:
                self.unshare.kill()  # killing the namespace's init... unshare's child dies with it
                self.unshare.wait(10)
        self.log.close()


@pytest.fixture
def booted_systemd(demo_pack):
    with boot_systemd_with(demo_pack) as systemd:
        yield systemd


@contextlib.contextmanager
def boot_systemd_with(pack: Path):
    """A booted systemd whose /run/colibri-test holds `pack` as demo.pack and what `make install` needs."""
    work_dir = Path(tempfile.mkdtemp(prefix="colibri-it-"))
    work_dir.chmod(0o755)
    shutil.copytree(pack, work_dir / "demo.pack")
    repo = work_dir / "repo"  # what `make install` needs, carried into the namespace
    repo.mkdir()
    for part in ("Makefile", "systemd", "udev", "etc", "docs"):
        (shutil.copytree if (REPO / part).is_dir() else shutil.copy)(REPO / part, repo / part)
    subprocess.run(["chmod", "-R", "a+rX", str(work_dir)], check=True)
    cgroups_before = _cgroup_dirs()
    systemd = None
    try:
        systemd = BootedSystemd(work_dir)
        yield systemd
    finally:
        if systemd is not None:
            systemd.poweroff()
        # The namespace's systemd made cgroups on the host's hierarchies; empty now, they go too.
        for path in sorted(_cgroup_dirs() - cgroups_before, key=lambda p: len(p.parts), reverse=True):
            try:
                path.rmdir()
            except OSError:
                pass
        shutil.rmtree(work_dir, ignore_errors=True)
        Path(f"{work_dir}.boot.log").unlink(missing_ok=True)


def _private_tmp_bindings() -> str:
    """A checkout or a virtualenv under /tmp (a CI clone) is hidden from the service by its
    PrivateTmp=yes: bind it back, read-only, at the same path."""
    paths = [path for path in _carried_paths() if any(Path(path).is_relative_to(h) for h in HIDDEN_BY_PRIVATE_TMP)]
    if not paths:
        return ""
    return ("# The code under test lives under /tmp, which PrivateTmp=yes hides.\n"
            + "".join(f"BindReadOnlyPaths={path}\n" for path in paths))


def _service_environment() -> dict[str, str]:
    """A checkout tested through PYTHONPATH (no install) is what the service must import too."""
    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}


def _imported_by_the_service_user(systemd: BootedSystemd) -> str:
    """Where the service's Python, run as the service's user with the service's environment,
    imports colibrid from."""
    environment = [f"{name}={value}" for name, value in _service_environment().items()]
    result = systemd.run("runuser", "-u", "colibri", "--", "env", "-i", *environment, PYTHON, "-c",
                         "import colibrid; print(colibrid.__file__)", check=False)
    return result.stdout.strip() if result.returncode == 0 else f"nothing: {result.stderr.strip()[-300:]}"


def colibrictl(systemd: BootedSystemd, *argv: str) -> subprocess.CompletedProcess:
    return systemd.run(PYTHON, "-m", "colibrictl", "--socket", SOCKET, *argv, check=False)


def test_socket_activated_reloaded_and_stopped_by_systemd(booted_systemd):
    systemd = booted_systemd
    systemd.run("make", "-s", "-C", "/run/colibri-test/repo", "install", "UNITDIR=/etc/systemd/system",
                "SYSUSERSDIR=/etc/sysusers.d", "TMPFILESDIR=/etc/tmpfiles.d", "UDEVRULESDIR=/etc/udev/rules.d",
                "SYSCTLDIR=/etc/sysctl.d", "DOCDIR=/run/colibri-test/doc", "BINDIR=/usr/bin")
    systemd.run("systemd-sysusers", "/etc/sysusers.d/colibri.conf")
    # The service must run the code under test, not whatever colibrid the base interpreter has.
    assert _imported_by_the_service_user(systemd) == str(_source_root() / "colibrid" / "__init__.py"), (
        f"{PYTHON} run as the colibri user must import colibrid from {_source_root()} "
        "(is the virtualenv readable by other users?)")
    systemd.write("/etc/systemd/system/colibrid.service.d/test.conf",
                  "[Service]\nExecStart=\n"
                  f"ExecStart={PYTHON} -m colibrid --config /etc/colibri/colibrid.toml "
                  "--model /run/colibri-test/demo.pack\n"
                  "# This Python lives under /root: readable, not hidden (the namespace's /root holds only it).\n"
                  "ProtectHome=read-only\n" + _private_tmp_bindings()
                  + "".join(f"Environment={name}={value}\n" for name, value in _service_environment().items()))
    systemd.write("/etc/systemd/system/colibrid.socket.d/test.conf",
                  f"[Socket]\nListenStream=\nListenStream={SOCKET}\n")
    systemd.run("systemctl", "daemon-reload")
    systemd.run("systemctl", "start", "colibrid.socket")
    assert systemd.run("stat", "-c", "%a %U %G", SOCKET).stdout.split() == ["660", "root", "colibri"]
    assert systemd.show("colibrid.service", "ActiveState") == "inactive"

    # The first connection starts the service; colibrictl just waits in the socket's backlog.
    answer = colibrictl(systemd, "ask", "--max-tokens", "8", "--temperature", "0", "def fibonacci(n):")
    assert answer.returncode == 0, answer.stderr
    assert systemd.show("colibrid.service", "ActiveState") == "active"
    assert systemd.show("colibrid.service", "StatusText").startswith("serving demo: ")
    main_pid = systemd.show("colibrid.service", "MainPID")
    assert systemd.run("ps", "-o", "user=", "-p", main_pid).stdout.strip() == "colibri"

    systemd.run("sh", "-c", "printf 'max_queue = 3\\nmax_context = 64\\nlog_level = \"debug\"\\n' "
                            ">> /etc/colibri/colibrid.toml")
    systemd.run("systemctl", "reload", "colibrid.service")
    deadline = time.monotonic() + 10
    while json.loads(colibrictl(systemd, "status", "--json").stdout or "{}").get("queue_limit") != 3:
        assert time.monotonic() < deadline, "the reload did not take effect"
        time.sleep(0.1)
    assert systemd.show("colibrid.service", "MainPID") == main_pid, "reload must not restart the process"

    systemd.run("systemctl", "stop", "colibrid.service")
    assert systemd.show("colibrid.service", "Result") == "success"
    assert systemd.show("colibrid.service", "ExecMainStatus") == "0"

    journal = [json.loads(line) for line in systemd.run(
        "journalctl", "-u", "colibrid.service", "-o", "json", "--no-pager").stdout.splitlines()]
    ours = [(entry["PRIORITY"], entry["MESSAGE"]) for entry in journal
            if entry.get("SYSLOG_IDENTIFIER") == "colibrid"]
    assert ("6", "stopped") in ours
    assert any(p == "6" and m.startswith("serving demo (") and "(from systemd)" in m for p, m in ours), ours
    assert ("4", "max_context changed to 64; it takes effect at the next restart") in ours
    assert any(p == "7" and m.startswith("colibrid.daemon.connection: connection ") for p, m in ours), ours
    assert not any(m.startswith("<") for _, m in ours), "a priority prefix reached the journal as text"
