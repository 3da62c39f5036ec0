"""An open-addressing hash index from int64 ids (any value) to row slots.

Lookups and inserts are compiled loops (``tether.server.kernels``) over the batch: linear
probing from each id's splitmix64 home cell, load factor at most 1/3, growth by rehashing into a
larger table. They cost O(batch) however many rows the table holds.

Cells are (key, slot) pairs side by side in one ``[n, 2]`` int64 array, so a probe touches one
cache line. A cell's state is told by its slot, never by its key, so every int64 is an id
(negative 64-bit hashes, ``INT64_MIN`` and ``INT64_MAX`` included): slot >= 0 is a row,
``EMPTY_SLOT`` (-1) ends a probe chain, ``REMOVED_SLOT`` (-2) is a tombstone.

Concurrency: one writer at a time (the caller holds the table's lock), any number of readers
without a lock. A writer stores a cell's key before its slot and a reader reads the slot before
the key, so a reader that sees a row's slot sees that row's key (a cell's key never changes once
its slot is stored: tombstones are not reused). Growth builds a new array and swaps it in with
one assignment. So a reader either finds an id with its correct slot or misses it (and the
caller then retries under the lock). This relies on the compiled loops keeping those two stores,
and those two loads, in program order, which x86-64's memory model keeps for plain accesses.

Removal (for bounded tables that evict rows) marks the id's cell removed: probes pass over it as
over any row, inserts never reuse it, and the next rebuild drops it. The load factor counts
tombstones, so a table that keeps evicting and inserting rebuilds instead of filling up with
them.
"""

from __future__ import annotations

import numpy as np

from tether.server import kernels

__all__ = ["IdIndex"]

# Keep the load factor at most 1/_SPREAD: short probe chains for 16 bytes per cell.
_SPREAD = 3


def _empty_cells(cap: int) -> np.ndarray:
    # Keys of empty cells are never read (their slot says empty), so any key will do.
    return np.full((cap, 2), kernels.EMPTY_SLOT, np.int64)


class IdIndex:
    """Maps int64 ids (any value) to int64 slots (>= 0)."""

    def __init__(self, capacity: int = 1024) -> None:
        cap = 1 << max(4, int(capacity - 1).bit_length())
        self._cells = _empty_cells(cap)
        self.size = 0
        self.tombstones = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the cells."""
        return self._cells.nbytes

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where the id is absent."""
        # One read of the attribute: one snapshot, however the writer grows the index meanwhile.
        return kernels.index_lookup(self._cells, np.ascontiguousarray(ids, np.int64))

    def insert(self, ids: np.ndarray, new_slots: np.ndarray) -> None:
        """Add unique ids that are absent, with their slots. Caller holds the writer lock.

        Raises:
            ValueError: a slot below 0 (those mark empty and removed cells).
        """
        ids, new_slots = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(new_slots, np.int64)
        if len(new_slots) != len(ids):
            raise ValueError(f"{len(ids)} ids but {len(new_slots)} slots")
        if len(new_slots) and int(new_slots.min()) < 0:
            raise ValueError(f"slots must be >= 0, got {int(new_slots.min())}")
        cells = self._cells
        if _SPREAD * (self.size + self.tombstones + len(ids)) > len(cells):
            cap = len(cells)
            while _SPREAD * (self.size + len(ids)) > cap:
                cap *= 2
            live = cells[cells[:, 1] >= 0]
            grown = _empty_cells(cap)
            kernels.index_place(grown, np.ascontiguousarray(live[:, 0]), np.ascontiguousarray(live[:, 1]))
            kernels.index_place(grown, ids, new_slots)
            self._cells = grown
            self.tombstones = 0
        else:
            kernels.index_place(cells, ids, new_slots)
        self.size += len(ids)

    def remove(self, ids: np.ndarray) -> int:
        """Remove the present ones of unique ``ids``; returns how many. Caller holds the writer lock.

        A lock-free reader may still return a removed id's old slot; tables that remove (and
        reuse slots) read under their lock.
        """
        cells = self._cells
        where = kernels.index_cells(cells, np.ascontiguousarray(ids, np.int64))
        where = where[where >= 0]
        cells[where, 1] = kernels.REMOVED_SLOT
        self.size -= len(where)
        self.tombstones += len(where)
        return len(where)

    def items(self, sort: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """All (ids, slots), sorted by id unless ``sort`` is False."""
        cells = self._cells
        live = cells[cells[:, 1] >= 0]
        ids, where = live[:, 0].copy(), live[:, 1].copy()
        if not sort:
            return ids, where
        order = np.argsort(ids, kind="stable")
        return ids[order], where[order]
