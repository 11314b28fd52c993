"""The udev probe (colibri-device-probe, udev/61-colibri-pack.rules): run as udev runs it, on
real loop devices, and the rule file's syntax."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

from colibrid.blockdev.superblock import Superblock
from tests.blockdev.conftest import MIB, mkfs_ext4

REPO = Path(__file__).resolve().parents[2]


def _probe(node) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibrid.tools.device_probe", str(node)], capture_output=True,
                          text=True, timeout=30, cwd=REPO)


def test_a_device_with_a_superblock_prints_its_pack_id_for_udev(loops):
    node = loops.attach(4 * MIB)
    pack_id = uuid.uuid4()
    with open(node, "r+b") as f:
        f.write(Superblock(pack_id, 512, 8, 16, 8192).encode())
    result = _probe(node)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [f"COLIBRI_PACK_ID={pack_id}", "COLIBRI_PACK_REGION_BYTES=8192"]


def test_anything_else_prints_nothing_and_exits_1(loops, tmp_path):
    blank = loops.attach(4 * MIB, name="blank.img")
    ext4 = loops.attach(8 * MIB, name="ext4.img")
    mkfs_ext4(ext4)
    too_small = loops.attach(1 * MIB, name="small.img")  # its region would end past the device
    with open(too_small, "r+b") as f:
        f.write(Superblock(uuid.uuid4(), 512, 8, 4096, 4096 * 512).encode())
    damaged = loops.attach(4 * MIB, name="damaged.img")
    data = bytearray(Superblock(uuid.uuid4(), 512, 8, 16, 8192).encode())
    data[30] ^= 1
    with open(damaged, "r+b") as f:
        f.write(data)
    regular = tmp_path / "file"
    regular.write_bytes(Superblock(uuid.uuid4(), 512, 8, 16, 8192).encode())  # valid, but not a block device
    for target in (blank, ext4, too_small, damaged, regular, tmp_path / "missing"):
        result = _probe(target)
        assert (result.returncode, result.stdout) == (1, ""), target


def test_usage():
    result = subprocess.run([sys.executable, "-m", "colibrid.tools.device_probe"], capture_output=True, text=True,
                            timeout=30, cwd=REPO)
    assert result.returncode == 2 and "usage" in result.stderr


RULE_KEYS = {"ACTION", "SUBSYSTEM", "ATTR", "ENV", "IMPORT", "GROUP", "MODE", "SYMLINK", "GOTO", "LABEL"}
RULE_PAIR = re.compile(r'(?P<key>[A-Z]+)(\{(?P<attr>[^}]+)\})?(?P<op>==|!=|\+=|:=|=)"(?P<value>[^"]*)"')


def _rules(path: Path) -> list[list[dict]]:
    """Each rule line as its key/operator/value pairs; AssertionError on anything udev would not parse."""
    rules = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        pairs, rest = [], line.strip()
        while rest:
            match = RULE_PAIR.match(rest)
            assert match, f"line {number}: cannot parse {rest!r}"
            assert match["key"] in RULE_KEYS, f"line {number}: unknown key {match['key']}"
            pairs.append(match.groupdict())
            rest = rest[match.end():].lstrip()
            assert not rest or rest.startswith(","), f"line {number}: pairs must be separated by commas"
            rest = rest[1:].lstrip()
        rules.append(pairs)
    return rules


def test_the_rule_probes_then_grants_the_colibri_group_read_access_by_the_probes_answer():
    rules = _rules(REPO / "udev" / "61-colibri-pack.rules")
    gotos = {p["value"] for rule in rules for p in rule if p["key"] == "GOTO"}
    labels = {p["value"] for rule in rules for p in rule if p["key"] == "LABEL"}
    assert gotos == labels == {"colibri_pack_end"}
    imports = [p for rule in rules for p in rule if p["key"] == "IMPORT"]
    assert [(p["attr"], p["value"]) for p in imports] == [("program", "@BINDIR@/colibri-device-probe $devnode")]
    (grant,) = [rule for rule in rules if any(p["key"] == "GROUP" for p in rule)]
    as_dict = {(p["key"], p["attr"], p["op"]): p["value"] for p in grant}
    assert as_dict == {("ENV", "COLIBRI_PACK_ID", "=="): "?*", ("GROUP", None, "="): "colibri",
                       ("MODE", None, "="): "0640"}
    # Identified by the probe, not by a name: no rule matches KERNEL or a device name.
    assert not any(p["key"] in ("KERNEL", "NAME") for rule in rules for p in rule)
