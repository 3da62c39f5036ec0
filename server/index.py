"""A vectorised open-addressing hash index from int64 ids (>= 0) to row slots.

Lookups and inserts run as a few NumPy passes over the whole batch (one per probe round), never
a Python loop over ids, and cost O(batch) however many rows the table holds. Linear probing,
load factor at most 1/3, growth by rehashing into a larger table.

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

from tether.protos.partition import mix64

__all__ = ["IdIndex"]

_EMPTY = np.int64(-1)
# Keep the load factor at most 1/_SPREAD: each probe round is a NumPy pass, and at 1/2 the
# longest chains of a 4096-id batch take ~20 rounds; at 1/3 about half as many, for 16 bytes
# per cell.
_SPREAD = 3
# A removed id's cell: not empty (probes go on past it), matches no id (ids are >= 0).
_TOMBSTONE = np.int64(-2)
# Inserts of at most this many ids probe id by id instead of in vectorised rounds.
_SCALAR_MAX = 32


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

    @staticmethod
    def _home(ids: np.ndarray, mask: int) -> np.ndarray:
        h = mix64(ids.view(np.uint64))
        h &= np.uint64(mask)
        return h.view(np.int64)

    def _cells(self, ids: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Cell of each id in ``keys`` (one snapshot of the key array), -1 where absent."""
        mask = len(keys) - 1
        pos = self._home(ids, mask)
        # The first probe settles most ids (load factor <= 1/3): it runs on the whole batch
        # without index bookkeeping, and only the ids that met another key go round again.
        k = keys[pos]
        hit = k == ids
        cell = np.where(hit, pos, -1)
        more = ~hit
        more &= k != _EMPTY
        active = np.flatnonzero(more)
        pos = pos[active]
        while active.size:
            if active.size <= _SCALAR_MAX // 4:
                # The last few long chains: walk them one id at a time (see ``_place``).
                for i, p in zip(active.tolist(), pos.tolist()):
                    key = ids[i]
                    while True:
                        p = (p + 1) & mask
                        k = keys[p]
                        if k == key:
                            cell[i] = p
                            break
                        if k == _EMPTY:
                            break
                return cell
            pos += 1
            pos &= mask
            k = keys[pos]
            hit = k == ids[active]
            cell[active[hit]] = pos[hit]
            more = ~hit & (k != _EMPTY)
            active = active[more]
            pos = pos[more]
        return cell

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where the id is absent."""
        # Keys and slots from one snapshot: growth swaps both at once.
        keys, slots = self._arrays
        cell = self._cells(ids, keys)
        return np.where(cell >= 0, slots[cell], -1)

    def insert(self, ids: np.ndarray, new_slots: np.ndarray) -> None:
        """Add unique ids that are absent, with their slots. Caller holds the writer lock."""
        keys, slots = self._arrays
        if _SPREAD * (self.size + self.tombstones + len(ids)) > len(keys):
            cap = len(keys)
            while _SPREAD * (self.size + len(ids)) > cap:
                cap *= 2
            present = keys >= 0
            keys, slots = np.full(cap, _EMPTY, np.int64), np.zeros(cap, np.int64)
            self._place(keys, slots, self._arrays[0][present], self._arrays[1][present])
            self._place(keys, slots, ids, new_slots)
            self._arrays = (keys, slots)
            self.tombstones = 0
        else:
            self._place(keys, slots, ids, new_slots)
        self.size += len(ids)

    def remove(self, ids: np.ndarray) -> int:
        """Remove the present ones of unique ``ids``; returns how many. Caller holds the writer lock.

        A lock-free reader may still return a removed id's old slot; tables that remove (and
        reuse slots) read under their lock.
        """
        keys, _ = self._arrays
        cell = self._cells(ids, keys)
        cell = cell[cell >= 0]
        keys[cell] = _TOMBSTONE
        self.size -= len(cell)
        self.tombstones += len(cell)
        return len(cell)

    def _place(self, keys: np.ndarray, slots: np.ndarray, ids: np.ndarray, new_slots: np.ndarray) -> None:
        mask = len(keys) - 1
        pos = self._home(ids, mask)
        pending = np.arange(len(ids))
        while pending.size:
            if pending.size <= _SCALAR_MAX:
                # A handful of new ids (the usual steady state, and the stragglers of a large
                # insert): probing them one by one costs a few microseconds, a vectorised
                # round with its duplicate-cell check tens.
                for key, slot, cell in zip(ids[pending].tolist(), new_slots[pending].tolist(), pos.tolist()):
                    while keys[cell] != _EMPTY:
                        cell = (cell + 1) & mask
                    slots[cell] = slot
                    keys[cell] = key
                return
            free = keys[pos] == _EMPTY
            # Several pending ids may want the same free cell: the first of each wins it.
            cells, first = np.unique(pos[free], return_index=True)
            winners = pending[free][first]
            slots[cells] = new_slots[winners]
            keys[cells] = ids[winners]
            placed = np.zeros(len(ids), bool)
            placed[winners] = True
            keep = ~placed[pending]
            # Everyone left now faces an occupied cell: step to the next one.
            pending = pending[keep]
            pos = (pos[keep] + 1) & mask

    def items(self, sort: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """All (ids, slots), sorted by id unless ``sort`` is False."""
        keys, slots = self._arrays
        present = keys >= 0
        ids, where = keys[present], slots[present]
        if not sort:
            return ids, where
        order = np.argsort(ids, kind="stable")
        return ids[order], where[order]
