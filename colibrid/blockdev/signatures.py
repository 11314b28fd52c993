"""What a block device already holds, found by its on-disk signatures: file systems, swap,
RAID and LVM members, encrypted volumes, partition tables, and Colibri's own superblock.

colibri-convert refuses to overwrite a device holding any of them (unless told to): the
signatures are read here directly, so the check works where blkid is not installed, and
``blkid -p`` (low-level probing, which knows many more) is asked as well when it is.

Read here (docs/format.md lists them too):
    ext2/3/4   0xEF53 at byte 1080 (superblock at 1024, s_magic at +56)
    xfs        "XFSB" at 0
    btrfs      "_BHRfS_M" at 65600 (superblock at 64 KiB, magic at +64)
    vfat       "FAT12   " / "FAT16   " at 54 or "FAT32   " at 82, with 0x55AA at 510
    swap       "SWAPSPACE2" / "SWAP-SPACE" in the last 10 bytes of the first 4, 8, 16 or 64 KiB
    LVM2 PV    "LABELONE" at the start of one of the first four 512-byte sectors, "LVM2 001" at +24
    md RAID    0xA92B4EFC (little-endian) at 0 (v1.1), 4096 (v1.2), 8 KiB before the end,
               rounded down to 4 KiB (v1.0), or 64 KiB before the end rounded down to 64 KiB (v0.90)
    LUKS       "LUKS\\xba\\xbe" at 0 (LUKS1 and LUKS2), "SKUL\\xba\\xbe" at 0 (a LUKS2 secondary header)
    GPT        "EFI PART" at LBA 1 (byte 512, or 4096 on 4 KiB-block devices)
    MBR        0x55AA at 510 with at least one partition entry whose type is not 0
    Colibri    the superblock of another pack's experts region (colibrid/blockdev/superblock.py)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from colibrid.blockdev.superblock import MAGIC as COLIBRI_MAGIC
from colibrid.blockdev.superblock import Superblock, SuperblockError

HEAD_BYTES = 128 << 10  # the start of the device every signature above is in
TAIL_BYTES = 128 << 10  # the end: md v0.90 and v1.0, the backup GPT
MD_MAGIC = (0xA92B4EFC).to_bytes(4, "little")
BLKID_TIMEOUT_S = 20


@dataclass(frozen=True)
class Signature:
    kind: str  # "filesystem", "swap", "raid", "lvm", "crypto", "partition table", "colibri"
    name: str  # "ext4", "GPT", ... as people say it
    offset: int  # byte offset where it was found (-1: reported by blkid)
    detail: str = ""

    def describe(self) -> str:
        where = f" at byte {self.offset}" if self.offset >= 0 else ""
        return f"{self.name} ({self.kind}{where}{', ' + self.detail if self.detail else ''})"


def _at(data: bytes, offset: int, magic: bytes) -> bool:
    return data[offset:offset + len(magic)] == magic


def find_signatures(head: bytes, tail: bytes, tail_offset: int, size_bytes: int,
                    logical_block_bytes: int) -> list[Signature]:
    """Every signature of the list above found in the device's first and last bytes."""
    found: list[Signature] = []
    if _at(head, 1080, b"\x53\xef"):
        found.append(Signature("filesystem", "ext2/3/4", 1024))
    if _at(head, 0, b"XFSB"):
        found.append(Signature("filesystem", "xfs", 0))
    if _at(head, 65600, b"_BHRfS_M"):
        found.append(Signature("filesystem", "btrfs", 65536))
    boot_signature = _at(head, 510, b"\x55\xaa")
    if boot_signature and (_at(head, 54, b"FAT12   ") or _at(head, 54, b"FAT16   ") or _at(head, 82, b"FAT32   ")):
        found.append(Signature("filesystem", "vfat", 0))
    for page in (4096, 8192, 16384, 65536):
        if _at(head, page - 10, b"SWAPSPACE2") or _at(head, page - 10, b"SWAP-SPACE"):
            found.append(Signature("swap", "Linux swap", page - 10))
    for sector in range(4):
        if _at(head, sector * 512, b"LABELONE") and _at(head, sector * 512 + 24, b"LVM2 001"):
            found.append(Signature("lvm", "LVM2 physical volume", sector * 512))
    for name, offset in (("v1.1", 0), ("v1.2", 4096), ("v1.0", ((size_bytes - 8192) & ~4095)),
                         ("v0.90", (size_bytes & ~65535) - 65536)):
        data, relative = (head, offset) if offset < HEAD_BYTES else (tail, offset - tail_offset)
        if offset >= 0 and relative >= 0 and _at(data, relative, MD_MAGIC):
            found.append(Signature("raid", "Linux md RAID member", offset, f"superblock {name}"))
    if _at(head, 0, b"LUKS\xba\xbe") or _at(head, 0, b"SKUL\xba\xbe"):
        found.append(Signature("crypto", "LUKS", 0))
    for lba_bytes in sorted({512, logical_block_bytes}):
        if _at(head, lba_bytes, b"EFI PART"):
            found.append(Signature("partition table", "GPT", lba_bytes))
    if boot_signature and not any(s.name == "vfat" for s in found) and _mbr_has_entries(head):
        found.append(Signature("partition table", "MBR (dos)", 510))
    if _at(head, 0, COLIBRI_MAGIC):
        found.append(_colibri(head))
    return found


def _mbr_has_entries(head: bytes) -> bool:
    """Four 16-byte entries at 446; byte 4 of each is the partition type, 0 = unused."""
    return any(head[446 + 16 * i + 4] != 0 for i in range(4))


def _colibri(head: bytes) -> Signature:
    try:
        sb = Superblock.decode(head)
    except SuperblockError as exc:
        return Signature("colibri", "Colibri experts region", 0, f"damaged: {exc}")
    return Signature("colibri", "Colibri experts region", 0, f"pack id {sb.pack_id}")


def blkid_signatures(node: str) -> tuple[list[Signature], str | None]:
    """(what ``blkid -p`` finds on ``node``, None) or ([], why blkid could not say)."""
    blkid = shutil.which("blkid") or next((p for p in ("/usr/sbin/blkid", "/sbin/blkid") if os.path.exists(p)), None)
    if blkid is None:
        return [], "blkid is not installed"
    try:
        result = subprocess.run([blkid, "-p", "-o", "export", node], capture_output=True, text=True,
                                timeout=BLKID_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"blkid failed: {exc}"
    if result.returncode == 2:  # nothing found
        return [], None
    if result.returncode != 0:
        return [], f"blkid -p exited with {result.returncode}: {result.stderr.strip()[:200]}"
    values = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    found = []
    if "TYPE" in values:
        found.append(Signature(values.get("USAGE", "filesystem"), values["TYPE"], -1, "blkid"))
    if "PTTYPE" in values:
        found.append(Signature("partition table", values["PTTYPE"], -1, "blkid"))
    return found, None
