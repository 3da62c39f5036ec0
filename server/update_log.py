"""What a table keeps to count how many updates each row of a push missed since its read
(per-row staleness): its last updates (each one's table version and the slots it wrote, int32,
oldest first, at most ``max_updates`` updates and ``max_slots`` slots in all), and the version
of each row's last update (``RowVersions``)."""

from __future__ import annotations

from collections import deque

import numpy as np

from tether.server import kernels
from tether.server.zeroed import zeros

__all__ = ["RowVersions", "UpdateLog"]


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


class RowVersions:
    """The table version of each row's last update, by slot, for per-row staleness: int32
    offsets from a base version (4 bytes a row), 0 for a row not updated since the base.

    When the table's version runs ``span`` past the base, the base moves up by half the span
    (one pass over the rows, once per 2**30 pushes with the int32 span). Rows last updated
    before the new base then read 0, "any time up to the base", so a read older than the base
    (``floor``: 2**30 pushes ago) counts every row as updated since it: a staleness count never
    falls short of the truth, it can only count rows that were not updated. The table's lock
    guards it."""

    def __init__(self, rows: int, span: int = 2**31 - 1) -> None:
        self.array = zeros(rows, np.int32)
        self.span = span
        self.base = 0  # the version offsets count from
        self.floor = 0  # reads older than this count every row as updated since

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def grow(self, rows: int, used: int) -> None:
        """Room for ``rows`` slots, keeping the first ``used``."""
        array = zeros(rows, np.int32)
        array[:used] = self.array[:used]
        self.array = array

    def reset(self, rows: int, version: int) -> None:
        """``rows`` slots, none updated since the table's ``version`` (restored rows)."""
        self.array = zeros(max(rows, 1), np.int32)
        self.base, self.floor = version, 0

    def updated(self, slots: np.ndarray, version: int, used: int) -> None:
        """The update that made the table ``version`` wrote ``slots`` (of ``used`` slots in use)."""
        if version - self.base > self.span:
            base = version - (self.span + 1) // 2
            rows = self.array[:used]
            np.subtract(rows, min(base - self.base, 2**31 - 1), out=rows, casting="unsafe")
            np.maximum(rows, 0, out=rows)
            self.base = self.floor = base
        self.array[slots] = version - self.base

    def newer(self, slots: np.ndarray, read_version: int) -> np.ndarray:
        """Whether each of ``slots`` was updated after a read at ``read_version``."""
        if read_version < self.floor:  # older than the versions know: every row
            return np.ones(len(slots), bool)
        return self.array[slots] > min(max(read_version - self.base, 0), self.span)
