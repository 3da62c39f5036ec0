"""Anonymous memory in transparent huge pages, where the system allows them (Linux with THP on
``madvise`` or ``always``): a shard's receive buffers (``tether.server.serving.connection``) and
the worker row cache's per-slot arrays (``tether.worker.cache.slots``).

A buffer of megabytes is faulted in a few 2 MiB pages instead of 4 KiB at a time, and costs
fewer TLB misses when it is read at scattered rows: the row cache's passes over a step's rows,
run with the caches cold as they are in a training step, took 25-30% less time with their
arrays in huge pages (bench/RESULTS.md, issue 41). Untouched pages still cost nothing; touched
memory is counted in 2 MiB pages, so an array's resident size rounds up to one.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

__all__ = ["HUGE_PAGE", "anonymous", "empty"]

HUGE_PAGE = 2 << 20


def anonymous(n: int) -> tuple[mmap.mmap, int]:
    """``n`` bytes of anonymous memory, in transparent huge pages where the system allows them:
    the mapping and the offset in it where the ``n`` bytes start (on a huge-page boundary).

    (A shard's 4 MiB frame after an idle release: 1,025 page faults before, 3 with THP on
    ``madvise``.)
    """
    if n < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return mmap.mmap(-1, max(n, 1)), 0
    # Private (shared anonymous memory is shmem: no huge pages unless shmem THP is on), one huge
    # page longer so that the bytes used can start on a huge-page boundary (only touched pages
    # cost memory).
    buf = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return buf, 0  # no THP here: 4 KiB pages
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return buf, -address % HUGE_PAGE


def empty(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised C-contiguous array (zero-filled pages, touched only when written), in
    huge pages where it is at least one and the system allows them (``anonymous``), else
    ``np.empty``'s. The array keeps its mapping alive."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count * dt.itemsize < HUGE_PAGE:
        return np.empty(shape, dt)
    buf, start = anonymous(count * dt.itemsize)
    return np.frombuffer(buf, dtype=dt, count=count, offset=start).reshape(shape)
