"""What a table keeps to count how many updates each row of a push missed since its read
(per-row staleness): its last updates (each one's table version and the slots it wrote, int32,
oldest first, at most ``max_updates`` updates and ``max_slots`` slots in all), each entry linked
to the same row's entry before it, and per row the version and the log position of its last
update (``RowVersions``)."""

from __future__ import annotations

import bisect

import numpy as np

from tether.rules.index_kernels import count_linked, log_record
from tether.server.storage.zeroed import zeros

__all__ = ["RowVersions", "UpdateLog"]


class UpdateLog:
    """The table's last updates; the table's lock guards it.

    The slots of the updates held lie in one ring of entries (grown by doubling up to
    ``max_slots``), each update's slots contiguous in it (or wrapping once at its end), an
    entry two int32 side by side: the slot and how far back the same row's entry before it lies
    (0: none in the log). A row's count since a read is then a walk back along its own entries
    from its last (``RowVersions.last``), as many steps as it has updates since: a push costs
    its own rows' staleness, not the length of the log since its read (a row cache's combined
    push reads rows tens of updates old, of every table). Positions count slots from the first
    one ever written; the rings hold ``[begin, end)``."""

    def __init__(self, max_updates: int, max_slots: int) -> None:
        self._max_updates, self._max_slots = max_updates, max_slots
        self._versions: list[int] = []  # each update's table version, oldest first, from _head on
        self._starts: list[int] = []  # the position of its first slot
        self._head = 0
        # Entries (slot, link) by position modulo the ring's size, a power of two (masked, not divided).
        self._ring = np.empty((_pow2(min(max_slots, 4096)), 2), np.int32)
        self._begin = self._end = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the entries held (a slot and a link each)."""
        return 8 * (self._end - self._begin)

    def record(self, version: int, slots: np.ndarray, rows: RowVersions, used: int, read_version: int | None = None) -> int:
        """The update that made the table ``version`` wrote the rows at ``slots`` (unique, below
        2**31; of ``used`` slots in use): their versions and log entries noted (``rows``). With
        ``read_version``, returns what ``count(slots, rows, version - 1, read_version,
        per_row=False)`` would have just before (0 without): counted in the same compiled pass
        as the record, from the entries each row is linked to anyway."""
        offset = rows.offset(version, used)  # before ``after``: it may move the versions' base
        count = read_version is not None and len(slots) > 0
        whole, since, after = -1, self._end, 0
        if count:
            whole, since = self._reach(version - 1, read_version)  # type: ignore[arg-type]
            after = rows.after(read_version)  # type: ignore[arg-type]
        slots = np.ascontiguousarray(slots, np.int64)
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
        stale = -1
        if count and since < self._begin:
            # The read's entries are about to leave the log (this update pushes them out, or is
            # more than it holds): counted first, as they are, and the record counts nothing.
            stale = self._count(slots, rows, after, since, whole)
            count = False
        if self._head == len(self._versions):  # this update alone is more than the log holds
            rows.array[slots] = offset
            self._begin = self._end = end
            return max(stale, 0)
        if end - self._begin > len(self._ring):
            size = _pow2(min(self._max_slots, max(end - self._begin, 2 * len(self._ring))))
            self._ring = self._moved(self._ring, size)
        # Python ints, not np.int64s: numba types them the same (int64), and making six costs a
        # microsecond, a tenth of a push part's fixed cost.
        counted = log_record(self._ring, rows.pairs, slots, self._end, self._begin, offset, count, after, since, whole)
        self._end = end
        return max(stale, int(counted), 0)

    def _reach(self, version: int, read_version: int) -> tuple[int, int]:
        """For a read at ``read_version`` of a table now at ``version``: every update since it
        (``whole``, -1 where the log holds them all) and the position of the first entry since it
        (Python ints, whatever integers it is given: the compiled count takes them as they are)."""
        version, read_version = int(version), int(read_version)
        if self._head == len(self._versions) or self._versions[self._head] > read_version + 1:
            return version - read_version, self._end
        first = bisect.bisect_right(self._versions, read_version, self._head)
        return -1, self._starts[first] if first < len(self._versions) else self._end

    def _count(self, slots: np.ndarray, rows: RowVersions, after: int, since: int, whole: int, out: np.ndarray | None = None) -> int:
        """``count_linked`` over the log as it is: the largest (-1: no row updated since), each row's into ``out``."""
        out = np.empty(len(slots), np.int64) if out is None else out
        return int(count_linked(slots, rows.pairs, after, self._ring, since, self._end, whole, out))

    def _moved(self, ring: np.ndarray, size: int) -> np.ndarray:
        """``ring``'s entries held, in a ring of ``size`` at the same positions."""
        out = np.empty((size, *ring.shape[1:]), ring.dtype)
        old, at = len(ring), self._begin
        while at < self._end:
            i, j = at % old, at % size
            n = min(self._end - at, old - i, size - j)
            out[j: j + n] = ring[i: i + n]
            at += n
        return out

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
        as stale by every update since the read. One compiled pass (``count_linked``), each row's
        own entries since the read walked; memory: the size of the push."""
        after = versions.after(read_version)
        whole, since = self._reach(version, read_version)
        out = np.empty(len(slots), np.int64)
        largest = self._count(np.ascontiguousarray(slots, np.int64), versions, after, since, whole, out)
        if not per_row:
            return max(largest, 0)
        return out if largest >= 0 else None


def _pow2(n: int) -> int:
    """The least power of two >= ``n`` (>= 1)."""
    return 1 << max(n - 1, 0).bit_length()


class RowVersions:
    """The table version of each row's last update, by slot, for per-row staleness: int32
    offsets from a base version (4 bytes a row), 0 for a row not updated since the base; and
    where that update's entry is in the ``UpdateLog`` (``last``: its position modulo 2**32 as
    an int32, 4 bytes a row; the log checks an entry is the row's before it follows one). Both
    side by side (``pairs``, one int32 pair a slot: a count reads both of a row at once).

    When the table's version runs ``span`` past the base, the base moves up by half the span
    (one pass over the rows, once per 2**30 pushes with the int32 span). Rows last updated
    before the new base then read 0, "any time up to the base", so a read older than the base
    (``floor``: 2**30 pushes ago) counts every row as updated since it: a staleness count never
    falls short of the truth, it can only count rows that were not updated. The table's lock
    guards it."""

    def __init__(self, rows: int, span: int = 2**31 - 1) -> None:
        self._set(zeros((rows, 2), np.int32))
        self.span = span
        self.base = 0  # the version offsets count from
        self.floor = 0  # reads older than this count every row as updated since

    @property
    def nbytes(self) -> int:
        return int(self.pairs.nbytes)

    def _set(self, pairs: np.ndarray) -> None:
        self.pairs = pairs
        self.array, self.last = pairs[:, 0], pairs[:, 1]  # views

    def grow(self, rows: int, used: int) -> None:
        """Room for ``rows`` slots, keeping the first ``used``."""
        pairs = zeros((rows, 2), np.int32)
        pairs[:used] = self.pairs[:used]
        self._set(pairs)

    def reset(self, rows: int, version: int) -> None:
        """``rows`` slots, none updated since the table's ``version`` (restored rows)."""
        self._set(zeros((max(rows, 1), 2), np.int32))
        self.base, self.floor = version, 0

    def offset(self, version: int, used: int) -> int:
        """What a row updated at table ``version`` holds (of ``used`` slots in use), the base
        moved first where ``version`` is ``span`` past it."""
        if version - self.base > self.span:
            base = version - (self.span + 1) // 2
            rows = self.array[:used]
            np.subtract(rows, min(base - self.base, 2**31 - 1), out=rows, casting="unsafe")
            np.maximum(rows, 0, out=rows)
            self.base = self.floor = base
        return version - self.base

    def after(self, read_version: int) -> int:
        """The offset a row updated after a read at ``read_version`` holds more than (-1: every
        row, for a read older than the versions know); a Python int."""
        if read_version < self.floor:
            return -1
        return int(min(max(read_version - self.base, 0), self.span))
