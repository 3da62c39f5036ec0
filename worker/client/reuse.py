"""How many of a step's rows a worker already wanted within the last S steps, per table: the
ceiling of what a row cache can save (``tether_worker_rows_recent_total{within}``, the re-pull
figures of ``bench/traffic.py``).

Each table's ids seen within the largest window live in the cells of an id index
(``tether.rules.index_kernels``: the id and the step it was last wanted where the shard's index
keeps a slot; its cells prefetched ahead), so a step costs one probe an id
whatever the window: a CTR step of ~1,200 ids took 1.4 ms of CPU in Python dicts, and a
``--preset gpu`` step of ~69k ids 64 ms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tether.rules.index_kernels import EMPTY_SLOT, cell_from, index_place, mix64, prefetch
from tether.rules.kernel_cache import compiled

__all__ = ["REUSE_WINDOWS", "ReuseTracker"]

# Steps back that the reuse measure looks (``tether_worker_rows_recent_total{within}``).
REUSE_WINDOWS: tuple[int, ...] = (1, 5, 20, 100)
_MIN_CELLS = 1024

_jit = compiled()
_AHEAD = 16  # how many ids ahead a pass asks for the cell it will read (``prefetch``)


@_jit
def _observe(cells: np.ndarray, ids: np.ndarray, now: np.int64, window: np.int64, ages: np.ndarray) -> int:
    """Note ``ids`` (unique) wanted at step ``now`` in ``cells`` (the id index's cells,
    ``tether.rules.index_kernels``: an id and the step it was last wanted): ``ages[a]`` counts
    those last wanted ``a`` steps before (``a <= window``); the ids not there are placed. Each
    id's home cell is asked for ``_AHEAD`` ids before it is read, so the probes of a step,
    scattered over the table, overlap. Returns how many ids were placed (the caller keeps the
    table at most half full)."""
    mask = np.uint64(len(cells) - 1)
    flat = cells.reshape(-1)
    home = np.empty(len(ids), np.int64)
    for i in range(len(ids)):
        home[i] = np.int64(mix64(ids[i]) & mask)
    new = np.zeros(len(ids), np.bool_)
    for i in range(len(ids)):
        if i + _AHEAD < len(ids):
            prefetch(flat, 2 * home[i + _AHEAD])
        c = cell_from(cells, ids[i], home[i], mask)
        if c < 0:
            new[i] = True
            continue
        age = now - cells[c, 1]
        if age <= window:
            ages[age] += 1
        cells[c, 1] = now
    fresh = ids[new]
    index_place(cells, fresh, np.full(len(fresh), now, np.int64))
    return len(fresh)


class ReuseTracker:
    """For each step's sorted unique ids per table, how many were already wanted in one of the
    last S steps, for each S of ``windows``. Remembers only ids seen within the largest window
    (those older are dropped whenever a table's hash table fills up to half)."""

    def __init__(self, windows: Sequence[int] = REUSE_WINDOWS) -> None:
        if not windows or any(w < 1 for w in windows):
            raise ValueError(f"windows must be ints >= 1, got {list(windows)!r}")
        self.windows = tuple(sorted(windows))
        self.step = 0
        # Per table: its index cells (id, the step it was last wanted), and the cells taken.
        self._tables: dict[str, tuple[np.ndarray, int]] = {}

    def observe(self, sparse: Mapping[str, torch.Tensor]) -> dict[str, dict[int, int]]:
        """Count one step's ids (table -> unique ids); returns table -> {S: rows seen within S}."""
        self.step += 1
        now, window = self.step, self.windows[-1]
        out: dict[str, dict[int, int]] = {}
        for t, ids in sparse.items():
            arr = np.ascontiguousarray(ids.detach().cpu().numpy(), np.int64)
            cells, filled = self._tables.get(t) or (np.full((_MIN_CELLS, 2), EMPTY_SLOT, np.int64), 0)
            if 2 * (filled + len(arr)) > len(cells):  # rebuilt without the ids past the window
                live = cells[cells[:, 1] >= max(now - window, 1)]  # steps count from 1; empty cells hold -1
                cells = np.full((max(_MIN_CELLS, 1 << int(4 * (len(live) + len(arr))).bit_length()), 2), EMPTY_SLOT, np.int64)
                index_place(cells, np.ascontiguousarray(live[:, 0]), np.ascontiguousarray(live[:, 1]))
                filled = len(live)
            ages = np.zeros(window + 1, np.int64)
            filled += int(_observe(cells, arr, np.int64(now), np.int64(window), ages))
            self._tables[t] = (cells, int(filled))
            within = np.cumsum(ages).tolist()
            out[t] = {w: within[w] for w in self.windows}
        return out
