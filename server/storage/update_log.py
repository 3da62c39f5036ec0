"""What a table keeps to count how many updates each row of a push missed since its read
(per-row staleness): its last updates (each one's table version and the slots it wrote, int32,
oldest first, at most ``max_updates`` updates and ``max_slots`` slots in all), and the version
of each row's last update (``RowVersions``)."""

from __future__ import annotations

import bisect

import numpy as np

from tether.rules.index_kernels import count_since
from tether.server.storage.zeroed import zeros

__all__ = ["RowVersions", "UpdateLog"]


class UpdateLog:
    """The table's last updates; the table's lock guards it.

    The slots of the updates held lie in one ring of int32 (grown by doubling up to
    ``max_slots``), each update's slots contiguous in it (or wrapping once at its end), so the
    slots written since a read are at most two slices of it: counting them copies nothing and
    loops over no update in Python (a row cache's push reads rows tens of updates old).
    Positions count slots from the first one ever written; the ring holds ``[begin, end)``."""

    def __init__(self, max_updates: int, max_slots: int) -> None:
        self._max_updates, self._max_slots = max_updates, max_slots
        self._versions: list[int] = []  # each update's table version, oldest first, from _head on
        self._starts: list[int] = []  # the position of its first slot
        self._head = 0
        self._ring = np.empty(min(max_slots, 4096), np.int32)
        self._begin = self._end = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the slots held."""
        return 4 * (self._end - self._begin)

    def record(self, version: int, slots: np.ndarray) -> None:
        """The update that made the table ``version`` wrote the rows at ``slots`` (below 2**31)."""
        n = len(slots)
        self._versions.append(version)
        self._starts.append(self._end)
        end = self._end + n
        while len(self._versions) - self._head > self._max_updates or end - self._begin > self._max_slots:
            self._head += 1
            self._begin = self._starts[self._head] if self._head < len(self._versions) else end
        if self._head > 64 and 2 * self._head > len(self._versions):
            del self._versions[:self._head], self._starts[:self._head]
            self._head = 0
        if self._head == len(self._versions):  # this update alone is more than the log holds
            self._begin = self._end = end
            return
        if end - self._begin > len(self._ring):
            held = self._slices(self._begin, self._end)
            self._ring = np.empty(min(self._max_slots, max(end - self._begin, 2 * len(self._ring))), np.int32)
            at = self._begin
            for part in held:
                self._place(at, part)
                at += len(part)
        self._place(self._end, slots)
        self._end = end

    def _place(self, at: int, values: np.ndarray) -> None:
        """``values`` into the ring from position ``at`` on (wrapping once)."""
        size = len(self._ring)
        i = at % size
        head = min(len(values), size - i)
        self._ring[i:i + head] = values[:head]
        self._ring[:len(values) - head] = values[head:]

    def _slices(self, a: int, b: int) -> list[np.ndarray]:
        """The ring's positions ``[a, b)`` as one or two views."""
        size = len(self._ring)
        if a == b:
            return []
        i, j = a % size, b % size
        return [self._ring[i:j]] if i < j else [self._ring[i:], self._ring[:j]]

    def clear(self) -> None:
        self._versions.clear()
        self._starts.clear()
        self._head = 0
        self._begin = self._end

    def count(self, slots: np.ndarray, versions: RowVersions, version: int, read_version: int, per_row: bool) -> np.ndarray | int | None:
        """How many updates since ``read_version`` wrote each of ``slots`` (int64; -1: not a row,
        never updated) that ``versions`` says were updated since the read, of a table now at
        ``version``: an int64 array per slot (None where no row was updated since), or
        (``per_row`` False) the largest (0: none). A read older than the log counts each newer row
        as stale by every update since the read. One compiled pass (``count_since``); memory: the
        size of the push, none per row of the table and no copy of the log."""
        after = versions.after(read_version)
        whole = -1
        since: list[np.ndarray] = []
        if self._head == len(self._versions) or self._versions[self._head] > read_version + 1:
            whole = version - read_version
        else:
            first = bisect.bisect_right(self._versions, read_version, self._head)
            if first < len(self._versions):
                since = self._slices(self._starts[first], self._end)
        a = since[0] if since else _NONE
        b = since[1] if len(since) > 1 else _NONE
        out = np.empty(len(slots), np.int64)
        largest = int(count_since(np.ascontiguousarray(slots, np.int64), versions.array, np.int64(after), a, b, np.int64(whole), out))
        if not per_row:
            return max(largest, 0)
        return out if largest >= 0 else None


# No log entries (an empty run of the ring for ``count_since``).
_NONE = np.empty(0, np.int32)


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

    def after(self, read_version: int) -> int:
        """The offset a row updated after a read at ``read_version`` holds more than (-1: every
        row, for a read older than the versions know)."""
        if read_version < self.floor:
            return -1
        return min(max(read_version - self.base, 0), self.span)
