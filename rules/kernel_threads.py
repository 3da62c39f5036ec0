"""Large kernel calls split across a few threads of the shard (``TETHER_KERNEL_THREADS``).

A push or pull of a GPU-sized step (tens of thousands of rows of 128 floats per request) spends
most of its time waiting on memory: each row sits somewhere else in a table of a GiB. The shard's
compiled kernels release the GIL, so such a call is cut into contiguous runs of rows, one per
thread, and the runs go on at once. Each row's result is computed by the same code from the same
inputs as in one run (rows of one call are unique, so no two runs touch one row): the results
are bit for bit those of one thread. Calls under ``PARALLEL_ELEMENTS`` floats (the default
model's, a few thousand) run on the calling thread, as before.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["PARALLEL_ELEMENTS", "in_parts", "kernel_threads"]

# A call of at least this many floats (1 MiB) is split.
PARALLEL_ELEMENTS = 1 << 18
# At most this many threads by default (memory, not arithmetic, bounds these calls: a few
# threads keep enough rows in flight), one per this many CPUs: a shard shares its host with
# workers and their data threads. On a 2-CPU machine (shared with a worker and other jobs) a
# push split in two took 20-25% longer than one thread (bench/RESULTS.md), so it is not split.
_DEFAULT_MAX = 4
_CPUS_PER_THREAD = 4
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_threads: int | None = None


def kernel_threads() -> int:
    """Threads a large call is split across: ``TETHER_KERNEL_THREADS`` if set (1: never split),
    else one per 4 CPUs this process may use, at least 1 and at most 4 (a 16-CPU GPU host: 4).

    Raises:
        ValueError: ``TETHER_KERNEL_THREADS`` that is not an integer >= 1.
    """
    global _threads
    if _threads is None:
        text = os.environ.get("TETHER_KERNEL_THREADS", "").strip()
        if text:
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"TETHER_KERNEL_THREADS must be an integer >= 1, got {text!r}")
            _threads = int(text)
        else:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            _threads = max(1, min(_DEFAULT_MAX, cpus // _CPUS_PER_THREAD))
    return _threads


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="tether-kernel")
        return _pool


def in_parts(run: Callable[[int, int], None], rows: int, per_row: int) -> None:
    """``run(start, stop)`` over ``[0, rows)``: at once where the call is small (under
    ``PARALLEL_ELEMENTS`` floats, ``per_row`` a row) or one thread is set, else in one run per
    thread, the first on the calling thread; returns when every run is done (the first
    exception of a run is raised once all have ended)."""
    threads = kernel_threads()
    if threads < 2 or rows * per_row < PARALLEL_ELEMENTS or rows < 2 * threads:
        run(0, rows)
        return
    bounds = [rows * i // threads for i in range(threads + 1)]
    pool = _executor(threads)
    futures = [pool.submit(run, a, b) for a, b in itertools.pairwise(bounds[1:])]
    try:
        run(bounds[0], bounds[1])
    finally:
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error
