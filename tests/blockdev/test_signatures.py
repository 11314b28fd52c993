"""The signatures colibri-convert reads itself (so it works without blkid): each one in the
documented list is found where it lives, and a blank device shows none. Real file systems made
by mkfs/mkswap, where installed, are found too."""

from __future__ import annotations

import shutil
import subprocess
import uuid

import pytest

from colibrid.blockdev.signatures import HEAD_BYTES, TAIL_BYTES, find_signatures
from colibrid.blockdev.superblock import Superblock

SIZE = 8 << 20


def _found(head: bytearray, tail: bytearray | None = None, block: int = 512) -> list[tuple[str, str]]:
    tail = tail if tail is not None else bytearray(TAIL_BYTES)
    return [(s.kind, s.name) for s in find_signatures(bytes(head), bytes(tail), SIZE - TAIL_BYTES, SIZE, block)]


def _head(*writes: tuple[int, bytes]) -> bytearray:
    head = bytearray(HEAD_BYTES)
    for offset, data in writes:
        head[offset:offset + len(data)] = data
    return head


def test_a_blank_device_holds_nothing():
    assert _found(bytearray(HEAD_BYTES)) == []


@pytest.mark.parametrize("writes, expected", [
    ([(1080, b"\x53\xef")], ("filesystem", "ext2/3/4")),
    ([(0, b"XFSB")], ("filesystem", "xfs")),
    ([(65600, b"_BHRfS_M")], ("filesystem", "btrfs")),
    ([(82, b"FAT32   "), (510, b"\x55\xaa")], ("filesystem", "vfat")),
    ([(54, b"FAT16   "), (510, b"\x55\xaa")], ("filesystem", "vfat")),
    ([(4086, b"SWAPSPACE2")], ("swap", "Linux swap")),
    ([(512, b"LABELONE"), (536, b"LVM2 001")], ("lvm", "LVM2 physical volume")),
    ([(4096, (0xA92B4EFC).to_bytes(4, "little"))], ("raid", "Linux md RAID member")),
    ([(0, b"LUKS\xba\xbe")], ("crypto", "LUKS")),
    ([(512, b"EFI PART")], ("partition table", "GPT")),
    ([(446 + 4, b"\x83"), (510, b"\x55\xaa")], ("partition table", "MBR (dos)")),
])
def test_each_signature_in_the_list_is_found(writes, expected):
    assert _found(_head(*writes)) == [expected]


def test_a_gpt_on_a_4k_block_device_is_at_byte_4096():
    assert _found(_head((4096, b"EFI PART")), block=4096) == [("partition table", "GPT")]


def test_md_superblocks_at_the_end_of_the_device_are_found():
    magic = (0xA92B4EFC).to_bytes(4, "little")
    for offset in ((SIZE - 8192) & ~4095, (SIZE & ~65535) - 65536):  # v1.0, v0.90
        tail = bytearray(TAIL_BYTES)
        start = offset - (SIZE - TAIL_BYTES)
        tail[start:start + 4] = magic
        assert _found(bytearray(HEAD_BYTES), tail) == [("raid", "Linux md RAID member")]


def test_a_boot_signature_without_partitions_is_no_table():
    assert _found(_head((510, b"\x55\xaa"))) == []


def test_another_packs_superblock_is_found_with_its_pack_id():
    pack_id = uuid.uuid4()
    head = _head((0, Superblock(pack_id, 512, 8, 8, 4096).encode()))
    (signature,) = find_signatures(bytes(head), bytes(TAIL_BYTES), SIZE - TAIL_BYTES, SIZE, 512)
    assert signature.kind == "colibri" and str(pack_id) in signature.detail


@pytest.mark.parametrize("tool, args, expected", [
    ("mkfs.ext4", ["-q", "-F"], ("filesystem", "ext2/3/4")),
    ("mkswap", [], ("swap", "Linux swap")),
])
def test_real_file_systems_are_found(tmp_path, tool, args, expected):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    image = tmp_path / "image"
    with open(image, "wb") as f:
        f.truncate(SIZE)
    subprocess.run([tool, *args, str(image)], check=True, capture_output=True, timeout=60)
    data = image.read_bytes()
    found = find_signatures(data[:HEAD_BYTES], data[-TAIL_BYTES:], SIZE - TAIL_BYTES, SIZE, 512)
    assert expected in [(s.kind, s.name) for s in found]
