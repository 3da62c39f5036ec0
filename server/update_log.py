"""The last updates of one table, to count how many updates each row of a push missed since
its read (per-row staleness): each update's table version and the slots it wrote (int32),
oldest first, at most ``max_updates`` updates and ``max_slots`` slots in all."""

from __future__ import annotations

from collections import deque

import numpy as np

from tether.server import kernels

__all__ = ["UpdateLog"]


class UpdateLog:
    """The table's last updates; the table's lock guards it."""

    def __init__(self, max_updates: int, max_slots: int) -> None:
        self._max_updates, self._max_slots = max_updates, max_slots
        self._log: deque[tuple[int, np.ndarray]] = deque()
        self._slots = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the slots held."""
        return 4 * self._slots

    def record(self, version: int, slots: np.ndarray) -> None:
        """The update that made the table ``version`` wrote the rows at ``slots`` (below 2**31)."""
        self._log.append((version, slots.astype(np.int32)))
        self._slots += len(slots)
        while len(self._log) > self._max_updates or self._slots > self._max_slots:
            self._slots -= len(self._log.popleft()[1])

    def clear(self) -> None:
        self._log.clear()
        self._slots = 0

    def count(self, slots: np.ndarray, newer: np.ndarray, version: int, read_version: int, per_row: bool) -> np.ndarray | int:
        """How many updates since ``read_version`` wrote each of ``slots`` where ``newer`` (the
        rows updated since the read), of a table now at ``version``: an int64 array per slot, or
        (``per_row`` False) the largest. A read older than the log counts each newer row as stale
        by every update since the read. Memory: the size of the push and of the log's part
        since the read, none per row of the table."""
        log = self._log
        if not log or log[0][0] > read_version + 1:
            if not per_row:
                return version - read_version
            return np.where(newer, version - read_version, 0).astype(np.int64)
        since = []
        for v, updated in reversed(log):
            if v <= read_version:
                break
            since.append(updated)
        seen = np.concatenate(since) if since else np.empty(0, np.int32)
        counted = kernels.count_in(np.ascontiguousarray(slots[newer], np.int64), seen)
        if not per_row:
            return int(counted.max())
        out = np.zeros(len(slots), np.int64)
        out[newer] = counted
        return out
