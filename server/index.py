"""An open-addressing hash index from int64 ids (>= 0) to row slots.

Lookups and inserts are compiled loops (``tether.server.kernels``) over the batch: linear
probing from each id's splitmix64 home cell, load factor at most 1/3, growth by rehashing into a
larger table. They cost O(batch) however many rows the table holds.

Concurrency: one writer at a time (the caller holds the table's lock), any number of readers
without a lock. A writer stores a slot before its key, and growth builds new arrays and swaps
them in as one tuple, so a reader either finds an id with its correct slot or misses it (and
the caller then retries under the lock).

Removal (for bounded tables that evict rows) leaves a tombstone in the id's cell: probes pass
over it as over any occupied cell, inserts never reuse it, and the next rebuild drops it. The
load factor counts tombstones, so a table that keeps evicting and inserting rebuilds instead of
filling up with them.
"""

from __future__ import annotations

import numpy as np

from tether.server import kernels

__all__ = ["IdIndex"]

_EMPTY = np.int64(-1)
# Keep the load factor at most 1/_SPREAD: short probe chains for 16 bytes per cell.
_SPREAD = 3
# A removed id's cell: not empty (probes go on past it), matches no id (ids are >= 0).
_TOMBSTONE = np.int64(-2)


class IdIndex:
    """Maps non-negative int64 ids to int64 slots."""

    def __init__(self, capacity: int = 1024) -> None:
        cap = 1 << max(4, int(capacity - 1).bit_length())
        self._arrays = (np.full(cap, _EMPTY, np.int64), np.zeros(cap, np.int64))
        self.size = 0
        self.tombstones = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and slot arrays."""
        keys, slots = self._arrays
        return keys.nbytes + slots.nbytes

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where the id is absent."""
        # Keys and slots from one snapshot: growth swaps both at once.
        keys, slots = self._arrays
        return kernels.index_lookup(keys, slots, np.ascontiguousarray(ids, np.int64))

    def insert(self, ids: np.ndarray, new_slots: np.ndarray) -> None:
        """Add unique ids that are absent, with their slots. Caller holds the writer lock."""
        ids, new_slots = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(new_slots, np.int64)
        keys, slots = self._arrays
        if _SPREAD * (self.size + self.tombstones + len(ids)) > len(keys):
            cap = len(keys)
            while _SPREAD * (self.size + len(ids)) > cap:
                cap *= 2
            present = keys >= 0
            keys, slots = np.full(cap, _EMPTY, np.int64), np.zeros(cap, np.int64)
            kernels.index_place(keys, slots, self._arrays[0][present], self._arrays[1][present])
            kernels.index_place(keys, slots, ids, new_slots)
            self._arrays = (keys, slots)
            self.tombstones = 0
        else:
            kernels.index_place(keys, slots, ids, new_slots)
        self.size += len(ids)

    def remove(self, ids: np.ndarray) -> int:
        """Remove the present ones of unique ``ids``; returns how many. Caller holds the writer lock.

        A lock-free reader may still return a removed id's old slot; tables that remove (and
        reuse slots) read under their lock.
        """
        keys, _ = self._arrays
        cell = kernels.index_cells(keys, np.ascontiguousarray(ids, np.int64))
        cell = cell[cell >= 0]
        keys[cell] = _TOMBSTONE
        self.size -= len(cell)
        self.tombstones += len(cell)
        return len(cell)

    def items(self, sort: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """All (ids, slots), sorted by id unless ``sort`` is False."""
        keys, slots = self._arrays
        present = keys >= 0
        ids, where = keys[present], slots[present]
        if not sort:
            return ids, where
        order = np.argsort(ids, kind="stable")
        return ids[order], where[order]
