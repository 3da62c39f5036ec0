"""How many of a step's rows a worker already wanted within the last S steps, per table: the
ceiling of what a row cache can save (``tether_worker_rows_recent_total{within}``, the re-pull
figures of ``bench/traffic.py``).

Each table's ids seen within the largest window live in an open-addressing hash table (the id
and the step it was last wanted, compiled like the shard's index: ``tether.rules.index_kernels``'
hash), so a step costs one probe an id whatever the window: a CTR step of ~1,200 ids took 1.4 ms
of CPU in Python dicts, and a ``--preset gpu`` step of ~69k ids some 80 ms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tether.rules.index_kernels import mix64
from tether.rules.kernel_cache import compiled

__all__ = ["REUSE_WINDOWS", "ReuseTracker"]

# Steps back that the reuse measure looks (``tether_worker_rows_recent_total{within}``).
REUSE_WINDOWS: tuple[int, ...] = (1, 5, 20, 100)
_MIN_CELLS = 1024

_jit = compiled()


@_jit
def _observe(keys: np.ndarray, steps: np.ndarray, ids: np.ndarray, now: np.int64, window: np.int64, ages: np.ndarray) -> int:
    """Note ``ids`` (unique) wanted at step ``now``: ``ages[a]`` counts those last wanted ``a``
    steps before (``a <= window``). A cell holds an id where its step is not 0 (steps count from
    1); returns how many cells the ids newly took (the caller keeps the table at most half full)."""
    mask = np.uint64(len(keys) - 1)
    added = 0
    for i in range(len(ids)):
        key = ids[i]
        c = np.int64(mix64(key) & mask)
        while steps[c] != 0 and keys[c] != key:
            c = np.int64((np.uint64(c) + np.uint64(1)) & mask)
        if steps[c] == 0:
            keys[c] = key
            added += 1
        else:
            age = now - steps[c]
            if age <= window:
                ages[age] += 1
        steps[c] = now
    return added


@_jit
def _rebuilt(keys: np.ndarray, steps: np.ndarray, oldest: np.int64, cells: np.int64) -> tuple[np.ndarray, np.ndarray, int]:
    """A table of ``cells`` cells (a power of two) holding the ids of ``keys`` last wanted at step
    ``oldest`` or later, and their count."""
    out_keys = np.zeros(cells, np.int64)
    out_steps = np.zeros(cells, np.int64)
    mask = np.uint64(cells - 1)
    n = 0
    for i in range(len(keys)):
        if steps[i] == 0 or steps[i] < oldest:
            continue
        c = np.int64(mix64(keys[i]) & mask)
        while out_steps[c] != 0:
            c = np.int64((np.uint64(c) + np.uint64(1)) & mask)
        out_keys[c], out_steps[c] = keys[i], steps[i]
        n += 1
    return out_keys, out_steps, n


class ReuseTracker:
    """For each step's sorted unique ids per table, how many were already wanted in one of the
    last S steps, for each S of ``windows``. Remembers only ids seen within the largest window
    (those older are dropped whenever a table's hash table fills up to half)."""

    def __init__(self, windows: Sequence[int] = REUSE_WINDOWS) -> None:
        if not windows or any(w < 1 for w in windows):
            raise ValueError(f"windows must be ints >= 1, got {list(windows)!r}")
        self.windows = tuple(sorted(windows))
        self.step = 0
        # Per table: the cells' ids, the step each was last wanted (0: empty), cells taken.
        self._tables: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}

    def observe(self, sparse: Mapping[str, torch.Tensor]) -> dict[str, dict[int, int]]:
        """Count one step's ids (table -> unique ids); returns table -> {S: rows seen within S}."""
        self.step += 1
        now, window = self.step, self.windows[-1]
        out: dict[str, dict[int, int]] = {}
        for t, ids in sparse.items():
            arr = np.ascontiguousarray(ids.detach().cpu().numpy(), np.int64)
            keys, steps, filled = self._tables.get(t) or (np.zeros(_MIN_CELLS, np.int64), np.zeros(_MIN_CELLS, np.int64), 0)
            if 2 * (filled + len(arr)) > len(keys):
                oldest = max(now - window, 1)
                live = int(np.count_nonzero(steps >= oldest))
                cells = max(_MIN_CELLS, 1 << int(4 * (live + len(arr))).bit_length())
                keys, steps, filled = _rebuilt(keys, steps, np.int64(oldest), np.int64(cells))
            ages = np.zeros(window + 1, np.int64)
            filled += int(_observe(keys, steps, arr, np.int64(now), np.int64(window), ages))
            self._tables[t] = (keys, steps, int(filled))
            within = np.cumsum(ages).tolist()
            out[t] = {w: within[w] for w in self.windows}
        return out
