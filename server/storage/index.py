"""An open-addressing hash index from int64 ids (any value) to row slots.

The ids live in one array by slot (``keys[slot]`` is the id of that row: 8 bytes a row, the
only copy of the ids a table keeps) and the hash is an array of int32 cells, each naming a slot
or marking the cell empty or removed: 4 bytes a cell, at a load factor between 0.6 and 0.7, so
5.7-6.7 bytes a row. Lookups and inserts are compiled loops (``tether.rules.index_kernels``:
``slot_lookup``, ``slot_place``) over the batch: linear probing from each id's splitmix64 home
cell. They cost O(batch) however many rows the table holds.

A live cell holds its slot in the low bits and, in the bits the slots leave free (31 minus
those of the largest slot the keys have room for: 11 bits at a million rows), a fingerprint of
its id's hash, so a probe reads an id from ``keys`` only where the fingerprint matches: about
one key read a lookup, not one per cell passed. Slots must be below 2**31 (a table of at most
2**31 rows per shard). A cell's state is told by its value, never by an id, so every int64 is an
id (``INT64_MIN``, ``INT64_MAX`` and negative hashes included): a cell >= 0 is a row,
``EMPTY_SLOT`` (-1) ends a probe chain, ``REMOVED_SLOT`` (-2) is a tombstone.

Concurrency: one writer at a time (the caller holds the table's lock), any number of readers
without a lock. A writer stores an id at ``keys[slot]`` before the cell naming that slot, and a
reader reads the cell before the key, so a reader that sees a slot sees its id. The cells, the
keys and the slot width are one snapshot, swapped in with one assignment; a writer adds cells
to the current snapshot only for slots its keys array already holds, and anything else (more
cells, more keys, a wider slot) builds a new snapshot. So a reader either finds an id with its
correct slot or misses it (and the caller then retries under the lock). This relies on the
compiled loops keeping those two stores, and those two loads, in program order, which x86-64's
memory model keeps for plain accesses.

Removal (for bounded tables that evict rows) marks the id's cell removed: probes pass over it as
over any row, inserts never reuse it, and the next rebuild drops it. The load factor counts
tombstones, so a table that keeps evicting and inserting rebuilds instead of filling up with
them. A removed id's slot may then be given to another id (``keys[slot]`` is overwritten), so a
lock-free reader could read the new id's row for the old one: tables that remove rows read
under their lock.
"""

from __future__ import annotations

import math

import numpy as np

from tether.rules import index_kernels
from tether.server.storage.zeroed import zeros

__all__ = ["IdIndex", "lookup_ids"]

# Rebuild when live cells and tombstones pass _MAX_LOAD of the cells, to _TARGET_LOAD.
_MAX_LOAD = 0.7
_TARGET_LOAD = 0.6
# The keys grow by this factor (at least to the largest slot inserted).
_KEYS_GROWTH = 1.5
_MIN_CELLS = 16
_SLOT_LIMIT = 1 << 31


def _bits(nkeys: int) -> int:
    """Bits a slot below ``nkeys`` needs (at least 1)."""
    return max(1, int(nkeys - 1).bit_length())


def _cells(n: int) -> np.ndarray:
    # Every cell is written, but from a mapping of its own where large (``zeroed``), so that a
    # rebuild's old cells go back to the kernel instead of leaving holes in the heap.
    cells = zeros(n, np.int32)
    cells.fill(index_kernels.EMPTY_SLOT)
    return cells


def lookup_ids(ids: np.ndarray) -> np.ndarray:
    """``ids`` as a compiled lookup takes them: contiguous int64, read-only (a view where they are
    writable: no copy). A request's ids are read-only (decoded from its bytes), others not;
    numba compiles a kernel once per kind, so a lookup is always given one: one compile on a
    machine's first run, not two."""
    ids = np.ascontiguousarray(ids, np.int64)
    if ids.flags.writeable:
        ids = ids.view()
        ids.flags.writeable = False
    return ids


class IdIndex:
    """Maps int64 ids (any value) to slots in [0, 2**31), at most one id per slot."""

    def __init__(self, capacity: int = 1024) -> None:
        capacity = max(1, capacity)
        keys = zeros(capacity, np.int64)  # pages of room for keys are resident once written
        # (cells, keys, slot bits): one snapshot, read once by a lookup.
        self._snap = (_cells(max(_MIN_CELLS, math.ceil(capacity / _TARGET_LOAD))), keys, _bits(capacity))
        self._end = 0  # one past the largest slot ever inserted: the part of ``keys`` written
        self.size = 0
        self.tombstones = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the cells and the keys (room for keys beyond the rows included: it is
        not resident until written)."""
        cells, keys, _ = self._snap
        return cells.nbytes + keys.nbytes

    @property
    def cells(self) -> int:
        """Number of hash cells."""
        return len(self._snap[0])

    @property
    def snapshot(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The cells, keys and slot bits a compiled lookup reads (``index_kernels.slot_lookup``,
        with ``lookup_ids``): one snapshot, however the writer grows the index meanwhile."""
        return self._snap

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id (int64), -1 where the id is absent."""
        cells, keys, bits = self._snap
        return index_kernels.slot_lookup(cells, keys, bits, lookup_ids(ids))

    def insert(self, ids: np.ndarray, new_slots: np.ndarray, span: tuple[int, int] | None = None) -> None:
        """Add unique ids that are absent, with their slots (unique, and not any present id's
        slot). Caller holds the writer lock. ``span``: the slots' least and greatest, where the
        caller knows them (a run of new slots: its ends; two reductions cost a third of a
        table's insert of a few rows).

        Raises:
            ValueError: as many slots as ids, each in [0, 2**31) (-1 and -2 mark empty and removed cells).
        """
        ids, new_slots = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(new_slots, np.int64)
        if len(new_slots) != len(ids):
            raise ValueError(f"{len(ids)} ids but {len(new_slots)} slots")
        if not len(ids):
            return
        low, high = span if span is not None else (int(new_slots.min()), int(new_slots.max()))
        if low < 0:
            raise ValueError(f"slots must be >= 0, got {low}")
        if high >= _SLOT_LIMIT:
            raise ValueError(f"slots must be below 2**31 (rows per table on one shard), got {high}")
        cells, keys, bits = self._snap
        end = max(self._end, high + 1)
        if end > len(keys) or self.size + self.tombstones + len(ids) > _MAX_LOAD * len(cells):
            self._rebuild(ids, new_slots, end)
        else:
            keys[new_slots] = ids  # before the cells that name them
            index_kernels.slot_place(cells, bits, ids, new_slots)
        self._end = end
        self.size += len(ids)

    def _rebuild(self, ids: np.ndarray, new_slots: np.ndarray, end: int) -> None:
        """A new snapshot with room for ``end`` keys and the live rows plus ``ids`` at the target
        load, tombstones dropped; readers go on with the old one until it is swapped in."""
        old_cells, old_keys, old_bits = self._snap
        nkeys = len(old_keys)
        if end > nkeys:
            nkeys = min(max(end, int(nkeys * _KEYS_GROWTH) + 1), _SLOT_LIMIT)
            keys = zeros(nkeys, np.int64)
            keys[: self._end] = old_keys[: self._end]  # only the written part: the rest stays unbacked
        else:
            # No old cell names the new slots (a removed id's reused slot is read under the lock)
            keys = old_keys
        keys[new_slots] = ids
        bits = _bits(nkeys)
        cells = _cells(max(_MIN_CELLS, math.ceil((self.size + len(ids)) / _TARGET_LOAD)))
        index_kernels.slot_rebuild(old_cells, old_bits, cells, bits, keys)
        index_kernels.slot_place(cells, bits, ids, new_slots)
        self._snap = (cells, keys, bits)
        self.tombstones = 0

    def remove(self, ids: np.ndarray) -> int:
        """Remove the present ones of unique ``ids``; returns how many. Caller holds the writer lock.

        Their slots are free to be given to other ids. A lock-free reader may still return a
        removed id's old slot; tables that remove (and reuse slots) read under their lock.
        """
        cells, keys, bits = self._snap
        where = index_kernels.slot_cells(cells, keys, bits, np.ascontiguousarray(ids, np.int64))
        where = where[where >= 0]
        cells[where] = index_kernels.REMOVED_SLOT
        self.size -= len(where)
        self.tombstones += len(where)
        return len(where)

    def items(self, sort: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """All (ids, slots), sorted by id unless ``sort`` is False."""
        cells, keys, bits = self._snap
        live = cells[cells >= 0]
        where = (live & np.int32((1 << bits) - 1) if bits < 31 else live).astype(np.int64)
        ids = keys[where]
        if not sort:
            return ids, where
        order = np.argsort(ids, kind="stable")
        return ids[order], where[order]
