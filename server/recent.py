"""The last pulls of one embedding table, remembered for the pushes that follow them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tether.server.index import IdIndex

__all__ = ["Pulled", "RecentPulls"]

# Pulls remembered for the pushes that follow (a few per worker) and the largest one kept.
_RECENT_PULLS = 16
_RECENT_MAX_IDS = 1 << 16


@dataclass(frozen=True)
class Pulled:
    """Slots a recent pull found for a push's ids (``EmbeddingTable.pulled``)."""

    index: IdIndex
    slots: np.ndarray
    unique: bool


class RecentPulls:
    """(index, ids, slots) of a table's last pulls: only for tables where a row's slot never
    changes once it exists (no capacity, no admission). The caller holds the table's lock
    where it says so."""

    def __init__(self) -> None:
        self._pulls: deque[tuple[IdIndex, np.ndarray, np.ndarray]] = deque(maxlen=_RECENT_PULLS)
        # Scratch for the uniqueness check of ``pulled`` (one int32 per row, under the lock).
        self._marks = np.zeros(0, np.int32)

    def remember(self, index: IdIndex, ids: np.ndarray, slots: np.ndarray) -> None:
        """Keep a pull's ids and slots (unless it is too large to be worth it)."""
        if len(ids) <= _RECENT_MAX_IDS:
            self._pulls.append((index, ids.copy(), slots))

    def slots(self, current: IdIndex, ids: np.ndarray) -> np.ndarray | None:
        """Slots of ``ids`` if a recent pull from the ``current`` index named exactly these ids
        (a push's ids are usually those of its step's pull). The array is shared with the
        cache: callers only read it."""
        for index, seen, slots in reversed(list(self._pulls)):
            if index is current and len(seen) == len(ids) and np.array_equal(seen, ids):
                return slots
        return None

    def pulled(self, current: IdIndex, ids: np.ndarray, rows: int) -> Pulled | None:
        """If a recent pull named exactly ``ids``: their slots, and whether they are unique
        (``rows``: the table's slot count). Caller holds the table's lock."""
        slots = self.slots(current, ids)
        if slots is None:
            return None
        if len(self._marks) < rows:
            self._marks = np.zeros(rows, np.int32)
        # Write each slot's position, read them back: a slot named twice keeps only its
        # last position, so an earlier one reads back different.
        order = np.arange(len(slots), dtype=np.int32)
        self._marks[slots] = order
        unique = bool(np.array_equal(self._marks[slots], order))
        return Pulled(current, slots, unique)

    def clear(self) -> None:
        """Forget every pull (the table's rows were replaced)."""
        self._pulls.clear()
