"""tether.common.pages: arrays in anonymous memory, in transparent huge pages where the system allows."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from tether.common import pages


def _anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("shape,dtype", [(10, np.int64), ((3, 5), np.float32), ((1 << 20, 4), np.float32), (0, np.float32)])
def test_empty_has_the_shape_and_type_asked_and_is_writable(shape: object, dtype: type) -> None:
    a = pages.empty(shape, dtype)  # type: ignore[arg-type]
    want = (shape,) if isinstance(shape, int) else shape
    assert a.shape == want and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
    a[...] = 7
    assert (a == 7).all()


def test_a_large_array_starts_on_a_huge_page_and_reads_zero() -> None:
    a = pages.empty((1 << 20, 2), np.float32)  # 8 MiB
    assert not a.any()  # anonymous memory: zero pages until written
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert a.ctypes.data % pages.HUGE_PAGE == 0


def test_a_large_array_is_backed_by_huge_pages_where_the_system_allows() -> None:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text() or not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("transparent huge pages are off here")
    before = _anon_huge_kib()
    a = pages.empty((8 << 20) // 4, np.float32)  # 8 MiB
    a[:] = 1.0  # touched: faulted in
    assert _anon_huge_kib() - before >= 2048  # at least one 2 MiB page
