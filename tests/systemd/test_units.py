"""The files a distribution ships: `make install` puts them where systemd and udev look, and
systemd's own tools accept them without a single complaint."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Where the colibrid command really is, so that verify can check ExecStart= for real.
BINDIR = str(Path(shutil.which("colibrid") or "/usr/bin/colibrid").parent)


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    stage = tmp_path_factory.mktemp("stage")
    subprocess.run(["make", "-s", "-C", str(REPO), "install", f"DESTDIR={stage}", "PREFIX=/usr",
                    f"BINDIR={BINDIR}"], check=True, capture_output=True)
    return stage


def test_make_install_puts_every_file_where_systemd_and_udev_look(staged):
    files = sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file())
    assert files == [
        "etc/colibri/colibri-openai.toml",
        "etc/colibri/colibrid.toml",
        "usr/lib/sysctl.d/60-colibri.conf",
        "usr/lib/systemd/system/colibri-openai.service",
        "usr/lib/systemd/system/colibri-openai.socket",
        "usr/lib/systemd/system/colibrid.service",
        "usr/lib/systemd/system/colibrid.socket",
        "usr/lib/sysusers.d/colibri.conf",
        "usr/lib/tmpfiles.d/colibri.conf",
        "usr/lib/udev/rules.d/60-colibri-nvme.rules",
        "usr/lib/udev/rules.d/61-colibri-pack.rules",
        "usr/share/doc/colibri/gateway.md",
        "usr/share/doc/colibri/protocol.md",
        "usr/share/doc/colibri/rawdev.md",
        "usr/share/doc/colibri/security.md",
        "usr/share/doc/colibri/systemd.md",
        "usr/share/doc/colibri/thermal.md",
    ]
    service = (staged / "usr/lib/systemd/system/colibrid.service").read_text()
    assert f"ExecStart={BINDIR}/colibrid --config /etc/colibri/colibrid.toml" in service
    gateway = (staged / "usr/lib/systemd/system/colibri-openai.service").read_text()
    assert f"ExecStart={BINDIR}/colibri-openai --config /etc/colibri/colibri-openai.toml" in gateway
    pack_rule = (staged / "usr/lib/udev/rules.d/61-colibri-pack.rules").read_text()
    assert f'IMPORT{{program}}="{BINDIR}/colibri-device-probe $devnode"' in pack_rule and "@" not in pack_rule
    assert "@" not in re.sub(r"@[a-z-]+", "", service), "an @PLACEHOLDER@ was left unsubstituted"


def test_an_edited_config_is_not_overwritten(tmp_path):
    config = tmp_path / "etc" / "colibri" / "colibrid.toml"
    config.parent.mkdir(parents=True)
    config.write_text('model = "/srv/mine.pack"\n')
    subprocess.run(["make", "-s", "-C", str(REPO), "install", f"DESTDIR={tmp_path}"], check=True, capture_output=True)
    assert config.read_text() == 'model = "/srv/mine.pack"\n'


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_says_nothing(staged):
    # It exits 0 even for unknown settings: silence on stderr is the test.
    unit_dir = staged / "usr/lib/systemd/system"
    result = subprocess.run(["systemd-analyze", "verify", "./colibrid.service", "./colibrid.socket"],
                            cwd=unit_dir, capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_says_nothing_of_the_gateway_units(tmp_path):
    # ExecStart= is checked for an executable file: where colibri-openai is installed, or a stand-in
    # (a checkout tested without `pip install` has no colibri-openai command).
    bindir = Path(shutil.which("colibri-openai") or tmp_path / "bin" / "colibri-openai").parent
    if not (bindir / "colibri-openai").exists():
        bindir.mkdir()
        (bindir / "colibri-openai").write_text("#!/bin/sh\n")
        (bindir / "colibri-openai").chmod(0o755)
    subprocess.run(["make", "-s", "-C", str(REPO), "install", f"DESTDIR={tmp_path / 'stage'}", "PREFIX=/usr",
                    f"BINDIR={bindir}"], check=True, capture_output=True)
    result = subprocess.run(["systemd-analyze", "verify", "./colibri-openai.service", "./colibri-openai.socket"],
                            cwd=tmp_path / "stage/usr/lib/systemd/system", capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", ["colibrid.service", "colibri-openai.service"])
def test_the_sandbox_rates_ok(staged, unit):
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"./{unit}"],
                            cwd=staged / "usr/lib/systemd/system", capture_output=True, text=True)
    exposure = re.search(rf"Overall exposure level for {re.escape(unit)}: ([0-9.]+)", result.stdout)
    assert exposure and float(exposure.group(1)) <= 2.0, result.stdout[-500:]


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_sysusers_and_tmpfiles_create_the_user_and_the_state_directory(staged, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(staged, root)
    subprocess.run(["systemd-sysusers", f"--root={root}", "colibri.conf"], check=True, capture_output=True)
    assert any(line.startswith("colibri:") for line in (root / "etc/passwd").read_text().splitlines())
    assert any(line.startswith("colibri:") for line in (root / "etc/group").read_text().splitlines())
    result = subprocess.run(["systemd-tmpfiles", f"--root={root}", "--create", "colibri.conf"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert (root / "var/lib/colibri").is_dir()
    assert (root / "var/lib/colibri").stat().st_mode & 0o777 == 0o750


@pytest.mark.parametrize("rules", ["60-colibri-nvme.rules", "61-colibri-pack.rules"])
def test_every_udev_rule_says_why(rules):
    lines = (REPO / "udev" / rules).read_text().splitlines()
    for number, line in enumerate(lines):
        if line and not line.startswith("#") and not line.startswith("LABEL="):
            assert lines[number - 1].startswith("#"), f"rule on line {number + 1} has no comment above it"


def test_make_uninstall_removes_every_file_but_the_config(tmp_path):
    """The admin's config stays (it may be edited); everything else make install put there goes."""
    make = ["make", "-s", "-C", str(REPO), f"DESTDIR={tmp_path}", "PREFIX=/usr"]
    subprocess.run([*make, "install"], check=True, capture_output=True)

    subprocess.run([*make, "uninstall"], check=True, capture_output=True)

    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["etc/colibri/colibri-openai.toml", "etc/colibri/colibrid.toml"]
    assert not (tmp_path / "usr/share/doc/colibri").exists()


def test_the_sysctl_file_says_why_the_service_needs_its_reservation():
    """The shipped unit forbids colibrid to raise vm.nr_hugepages itself, so the reservation at
    boot is how a service gets hugetlb pages; the file must say so while the unit does this."""
    sysctl = (REPO / "etc/sysctl.d/60-colibri.conf").read_text()
    unit = (REPO / "systemd/colibrid.service").read_text()

    assert "ProtectKernelTunables=yes" in unit.splitlines()
    assert "ProtectKernelTunables=yes" in sysctl and 'hugepages = "auto"' in sysctl
    assert "not in this version" not in sysctl
