"""Admission of new embedding rows: a count-min sketch of how often each id was touched."""

from __future__ import annotations

import numpy as np

from tether.protos.partition import mix64

__all__ = ["CountMinSketch", "sketch_width"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class CountMinSketch:
    """Approximate touch counts of int64 ids in fixed memory.

    ``depth`` rows of ``width`` 16-bit saturating counters; an id's count is the smallest of
    its cells (never an under-estimate). Conservative update raises only the cells that hold
    that minimum, and every ``width`` touches all counters are halved, so an endless stream of
    new ids cannot fill the sketch up and admit everything: an id is admitted when it comes
    back ``min_count`` times within a few ``width`` touches of other ids.
    """

    def __init__(self, width: int, depth: int = 4, seed: int = 0) -> None:
        if width < 1 or width & (width - 1):
            raise ValueError(f"width must be a power of two, got {width!r}")
        if not 1 <= depth <= 16:
            raise ValueError(f"depth must be in [1, 16], got {depth!r}")
        self.width = width
        self.depth = depth
        self._counts = np.zeros((depth, width), np.uint16)
        salts = np.arange(1, depth + 1, dtype=np.uint64) * _GOLDEN
        self._salts = mix64(salts ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF))
        self._mask = np.uint64(width - 1)
        self._rows = np.arange(depth)[:, None]
        self._touches = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the counters."""
        return self._counts.nbytes

    def _cells(self, ids: np.ndarray) -> np.ndarray:
        keys = ids.astype(np.int64, copy=False).view(np.uint64)
        return (mix64(keys[None, :] ^ self._salts[:, None]) & self._mask).astype(np.intp)

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """Estimated touches of each id (int64)."""
        return self._counts[self._rows, self._cells(ids)].min(axis=0).astype(np.int64)

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count one touch of each of the unique ``ids``; returns their estimates after it."""
        if ids.size == 0:
            return np.empty(0, np.int64)
        cells = self._cells(ids)
        est = self._counts[self._rows, cells].min(axis=0).astype(np.int64) + 1
        new = np.broadcast_to(np.minimum(est, 0xFFFF).astype(np.uint16), cells.shape)
        # np.maximum.at, not fancy assignment: two ids of one call may share a cell.
        np.maximum.at(self._counts, (np.broadcast_to(self._rows, cells.shape), cells), new)
        self._touches += ids.size
        if self._touches >= self.width:
            self._counts >>= 1
            self._touches = 0
        return est


def sketch_width(capacity: int) -> int:
    """Counters per sketch row: ~8 per resident row, 4K..4M (a power of two)."""
    want = 8 * capacity if capacity else 1 << 20
    return 1 << int(min(max(want, 1 << 12), 1 << 22) - 1).bit_length()
