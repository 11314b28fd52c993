"""``colibri-device-probe DEVNODE``: does this block device carry a Colibri superblock?

udev runs it (udev/61-colibri-pack.rules, IMPORT{program}) on every block device that
appears or changes and that blkid did not recognise; on a valid superblock it prints

    COLIBRI_PACK_ID=<uuid>
    COLIBRI_PACK_REGION_BYTES=<bytes of the experts region>

(udev's KEY=value import format) and exits 0, and the rule then gives the colibri group read
access. Anything else - not a block device, no superblock, a damaged one, a region that does
not fit the device - prints nothing and exits 1. Exit 2: usage. Standard library only, and
nothing but the first 4 KiB is read: it runs at every device hot-plug.
"""

from __future__ import annotations

import os
import stat
import sys

from colibrid.blockdev.superblock import SUPERBLOCK_BLOCK_BYTES, Superblock, SuperblockError

EXIT_FOUND = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2


def probe(node: str) -> Superblock | None:
    """The superblock of block device ``node``, if it has a valid one that fits the device."""
    try:
        fd = os.open(node, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISBLK(os.fstat(fd).st_mode):
            return None
        device_bytes = os.lseek(fd, 0, os.SEEK_END)
        superblock = Superblock.decode(os.pread(fd, SUPERBLOCK_BLOCK_BYTES, 0))
    except (OSError, SuperblockError):
        return None
    finally:
        os.close(fd)
    return superblock if superblock.end_bytes <= device_bytes else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: colibri-device-probe DEVNODE  (prints COLIBRI_PACK_ID=... for a device carrying a Colibri "
              "superblock; exit 0 found, 1 not)", file=sys.stderr)
        return EXIT_USAGE
    superblock = probe(args[0])
    if superblock is None:
        return EXIT_NOT_FOUND
    print(f"COLIBRI_PACK_ID={superblock.pack_id}")
    print(f"COLIBRI_PACK_REGION_BYTES={superblock.region_bytes}")
    return EXIT_FOUND


if __name__ == "__main__":
    sys.exit(main())
