"""resident_bytes measures pages in memory, not sizes."""

from __future__ import annotations

import mmap

import numpy as np

from colibrid.native.residency import resident_bytes
from colibrid.system.residency import process_rss_bytes

MIB = 1 << 20
# Where transparent hugepages are on for every mapping, the first write to a 2 MiB-aligned span
# brings in the whole span: a partial span at each end of what was written may be resident too.
HUGE_PAGE = 2 * MIB


def test_an_untouched_buffer_is_not_resident_and_a_written_one_is():
    # A mapping of its own: np.empty may hand back memory malloc reused, already resident.
    mapping = mmap.mmap(-1, 64 * MIB)
    buffer = np.frombuffer(mapping, dtype=np.uint8)
    assert resident_bytes(buffer) == 0
    buffer[: 16 * MIB] = 1
    assert 16 * MIB <= resident_bytes(buffer) <= 16 * MIB + 2 * HUGE_PAGE
    buffer[:] = 1
    assert resident_bytes(buffer) == buffer.nbytes


def test_a_view_counts_only_its_own_bytes():
    buffer = np.ones(8 * MIB, dtype=np.uint8)
    assert resident_bytes(buffer[100 : 100 + 5000]) == 5000
    assert resident_bytes(buffer[:0]) == 0 and resident_bytes(None) == 0


def test_rss_is_the_kernels_figure():
    assert process_rss_bytes() > 10 * MIB
