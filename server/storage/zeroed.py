"""Zeroed storage that costs memory only where it is written: a table's per-row arrays.

A table allocates room beyond its rows (it grows by half at a time), counting on the pages of
that room not being resident until rows are written there. That holds for memory fresh from
the kernel, not for a block malloc hands back from its heap: a shard keeps freed blocks of up to
32 MiB in its heap (``tether.common.allocator``), so an array that size may come back already
written, every page of it resident, and ``calloc`` then writes zeros over all of it. Arrays of at
least ``MAPPED_BYTES`` therefore get their own private anonymous mapping: the kernel backs a page
only when it is first written, and the mapping goes back to it when the array is freed.

A table's row arrays grow by half at a time as rows come. So that growing copies nothing, the
mapping of a row array reserves address space (not memory: ``MAP_NORESERVE``, and no page is
backed until written) for ``RESERVE_FACTOR`` times the rows asked for: ``grow_rows`` then hands
out a longer view of the same pages. Readers holding the shorter view read the same memory.
Only past the reservation (or where the system refuses one) is a bigger array made and the rows
copied, as every growth did before.
"""

from __future__ import annotations

import math
import mmap
import sys
import weakref

import numpy as np
import torch

__all__ = ["MAPPED_BYTES", "RESERVE_FACTOR", "float_rows", "grow_rows", "zeros"]

# Smaller arrays come from malloc (a mapping per array would cost more than it saves).
MAPPED_BYTES = 1 << 20
# A row array's mapping reserves address space for this many times its rows, at most
# ``_RESERVE_MAX`` bytes (a table of 4 MiB of rows can reach 256 MiB without a copy).
RESERVE_FACTOR = 64
_RESERVE_MAX = 1 << 36
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
# Row arrays with room reserved beyond them: their address -> (their mapping, weakly, and the
# bytes of one row). An entry goes when its mapping does.
_reserved: dict[int, tuple[weakref.ref[mmap.mmap], int]] = {}


def zeros(shape: int | tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """A zeroed, writable, C-contiguous array; pages not written are not resident (arrays of at
    least ``MAPPED_BYTES``: see the module doc)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < MAPPED_BYTES:
        return np.zeros(shape, dt)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dt).reshape(shape)


def float_rows(rows: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeroed float32 storage for ``rows`` rows of a table's weights or of a state tensor: the
    room beyond the rows costs no memory until rows are written there (``torch.zeros`` would
    write every byte: a table that had just grown by half held half its state again in memory
    that no row used). Storage of at least ``MAPPED_BYTES`` reserves room to grow
    (``grow_rows``)."""
    row_bytes = math.prod(shape) * 4
    nbytes = rows * row_bytes
    if nbytes < MAPPED_BYTES or not _NORESERVE:
        return torch.from_numpy(zeros((rows, *shape), np.float32))
    try:
        pages = mmap.mmap(-1, max(nbytes, min(nbytes * RESERVE_FACTOR, _RESERVE_MAX)),
                          flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    except OSError:  # no room for the reservation (a strict overcommit policy, an address-space limit)
        return torch.from_numpy(zeros((rows, *shape), np.float32))
    out = torch.from_numpy(np.frombuffer(pages, np.float32, count=nbytes // 4).reshape(rows, *shape))
    address = out.data_ptr()
    _reserved[address] = (weakref.ref(pages, lambda _: _reserved.pop(address, None)), row_bytes)
    return out


def grow_rows(rows: torch.Tensor, capacity: int, used: int) -> torch.Tensor:
    """Storage of ``capacity`` rows (shaped as ``rows``'s) whose first ``used`` rows are those of
    ``rows`` and the rest zero: a longer view of the same pages where ``rows`` came from
    ``float_rows`` and its reservation has room (no copy; nothing past ``used`` was written
    there), else fresh storage with the rows copied."""
    entry = _reserved.get(rows.data_ptr())
    pages = entry[0]() if entry is not None else None
    shape = tuple(rows.shape[1:])
    if pages is not None and entry is not None and entry[1] == math.prod(shape) * 4 and capacity * entry[1] <= len(pages):
        return torch.from_numpy(np.frombuffer(pages, np.float32, count=capacity * entry[1] // 4).reshape(capacity, *shape))
    out = float_rows(capacity, shape)
    out[:used] = rows[:used]
    return out
