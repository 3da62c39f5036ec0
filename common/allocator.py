"""Process-wide malloc settings for the processes that move tensors (shards and workers).

Every step allocates and frees tensors of a few hundred KiB to a few MiB (gathered rows,
gradients, pulled results; torch's CPU allocator is plain malloc/free). With glibc's defaults,
blocks that size are mmap'd and unmapped, or the heap top is trimmed back to the kernel, so the
next step page-faults the same amount in again, zeroed: on the 2-core machine of
``bench/RESULTS.md`` that cost a sparse client up to 1 ms of system time per step. Raising the
mmap and trim thresholds keeps freed blocks in the heap for the next step to reuse; the price
is that a process keeps its peak heap instead of handing free memory back.

The settings apply once per process, only under glibc, and not where the user set any of
glibc's own ``MALLOC_*_`` variables or ``TETHER_MALLOC=default``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

__all__ = ["MMAP_THRESHOLD", "TOP_PAD", "TRIM_THRESHOLD", "tune_malloc"]

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# Blocks below this come from the heap (glibc's ceiling for it on 64-bit is 32 MiB).
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top is given back only beyond this.
TRIM_THRESHOLD = 256 << 20
# Extra bytes asked of the kernel each time the heap grows.
TOP_PAD = 16 << 20
_GLIBC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_lock = threading.Lock()
_applied: bool | None = None


def tune_malloc() -> bool:
    """Apply the thresholds above to this process's malloc (once; later calls only report).

    Returns:
        Whether they are in effect: False off glibc, or where the environment opted out.
    """
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if os.environ.get("TETHER_MALLOC", "").lower() == "default" or any(v in os.environ for v in _GLIBC_VARS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # mallopt's parameters are glibc's
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD),
    ))
    if not ok:
        log.debug("mallopt refused tether's thresholds; glibc's defaults stay")
    return ok


def one_thread_unless_asked() -> bool:
    """One compute thread for torch in this process (as ``tether launch`` gives its workers with
    ``OMP_NUM_THREADS=1``), unless ``OMP_NUM_THREADS`` is set. Torch-free: sets the variable for a
    torch imported later, and torch's own count where it is imported already. Returns whether it
    changed anything."""
    if "OMP_NUM_THREADS" in os.environ:
        return False
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    return True
