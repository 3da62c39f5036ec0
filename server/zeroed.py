"""Zeroed storage that costs memory only where it is written: a table's per-row arrays.

A table allocates room beyond its rows (it grows by half at a time), counting on the pages of
that room not being resident until rows are written there. That holds for memory fresh from
the kernel, not for a block malloc hands back from its heap: a shard keeps freed blocks of up to
32 MiB in its heap (``tether.common.allocator``), so an array that size may come back already
written, every page of it resident, and ``calloc`` then writes zeros over all of it. Arrays of at
least ``MAPPED_BYTES`` therefore get their own private anonymous mapping: the kernel backs a page
only when it is first written, and the mapping goes back to it when the array is freed.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

__all__ = ["MAPPED_BYTES", "float_rows", "zeros"]

# Smaller arrays come from malloc (a mapping per array would cost more than it saves).
MAPPED_BYTES = 1 << 20


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
    that no row used)."""
    return torch.from_numpy(zeros((rows, *shape), np.float32))
