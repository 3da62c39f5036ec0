"""Compiled pieces the worker row cache's passes share (``tether.worker.cache.batch``, which
makes one call per operation over all tables): every table's columns in typed lists
(``Columns``), an id's slot in a table's index (the shard's index,
``tether.rules.index_kernels``: these only read it), an id's shard, and the oldest read
version per shard. Compiled on first use and cached on disk like the shard's kernels, by
``tether.rules.kernel_cache.compiled``: an entry is keyed by the helpers a pass inlines from
here too (``row_slots.warm_up`` loads them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numba.typed import List

from tether.rules.index_kernels import cell_from, mix64, prefetch
from tether.rules.kernel_cache import compiled

__all__ = ["FLOATS", "HELD", "IDS", "LU", "META", "NONE", "PS", "PV", "RC", "RV", "SHARD", "USES", "VALS", "Columns", "columns",
           "copy_row", "fetch_part", "fetch_row", "loads", "mean_square", "mean_squares", "oldest_per_shard", "probe_from", "set_cells",
           "shard_of", "slot_of", "typed_list", "warm_up", "zero_row"]

_jit = compiled()
NONE = np.iinfo(np.int64).max


# A slot's int64 columns, side by side in one row of 64 bytes (``Table.meta``, one cache line).
META = ("ids", "shard", "read_clock", "read_version", "last_used", "uses", "pending_since", "pending_version")
# A slot's float columns: its row (``vals``), and its held record (``Table.held_record``): the held
# gradients' sum and their two statistics, then the local changes ``mine`` and ``fresh``, side by
# side (a pass that touches them reads adjacent lines: bench/slot_layout.py).
FLOATS = ("vals", "held_record")
IDS, SHARD, RC, RV, LU, USES, PS, PV = range(len(META))
VALS, HELD = range(len(FLOATS))


class Columns(NamedTuple):
    """Every table's column arrays in five typed lists (few arguments: each costs a call its
    typing): ``cells`` (the id index), ``meta`` (the int64 columns ``META``, one row per slot),
    ``used`` and ``free`` (the stack of evicted slots) of table g at index g, the float32 columns
    ``FLOATS[c]`` at ``c * tables + g`` (a table of dim d: ``vals`` d wide, ``held_record`` 3d + 2,
    the held sum and its two statistics at 0, ``mine`` at d + 2, ``fresh`` at 2d + 2). Built once
    (``columns``): the arrays are allocated for the tables' capacity and never replaced, except
    the id index, which the cache puts back after a rebuild."""

    cells: Any
    meta: Any
    floats: Any
    used: Any
    free: Any


@_jit
def _list_of(first: np.ndarray) -> Any:
    """A typed list holding ``first`` (compiled and cached on disk: a typed list built from
    Python compiles numba's own list functions in every process, about a second in all)."""
    items = List()
    items.append(first)
    return items


@_jit
def _append(items: Any, item: np.ndarray) -> None:
    items.append(item)


def typed_list(arrays: list[np.ndarray]) -> Any:
    """``arrays`` (one type, at least one) in a numba typed list, built by compiled appends."""
    items = _list_of(arrays[0])
    for a in arrays[1:]:
        _append(items, a)
    return items


def columns(tables: list[Any]) -> Columns:
    """The ``Columns`` of ``tables`` (``row_slots.Table``), in their order."""
    return Columns(typed_list([tab.cells for tab in tables]), typed_list([tab.meta for tab in tables]),
                   typed_list([getattr(tab, c) for c in FLOATS for tab in tables]), typed_list([tab.used for tab in tables]),
                   typed_list([tab.free for tab in tables]))


@_jit
def set_cells(cells_l: Any, g: np.int64, cells: np.ndarray) -> None:
    """Table ``g``'s id index after a rebuild (compiled: a typed list's item set from Python
    compiles a function the first time, in a step)."""
    cells_l[g] = cells


@compiled(inline="always")
def slot_of(cells: np.ndarray, key: np.int64) -> np.int64:
    """The slot of ``key`` in the index, -1 where absent (``server.index_kernels.index_lookup``'s probe)."""
    return probe_from(cells, key, np.int64(mix64(key) & np.uint64(len(cells) - 1)))


@compiled(inline="always")
def probe_from(cells: np.ndarray, key: np.int64, p: np.int64) -> np.int64:
    """``slot_of``'s probe from cell ``p``, the key's home cell (``index_kernels.cell_from``)."""
    c = cell_from(cells, key, p, np.uint64(len(cells) - 1))
    return np.int64(-1) if c < 0 else cells[c, 1]


@compiled(inline="always")
def fetch_row(flat: np.ndarray, s: np.int64, width: np.int64) -> None:
    """Ask for row ``s`` of a C-contiguous 2-d array of rows ``width`` long, seen flat (``flat``:
    its ``reshape(-1)``): a line every 16 items and its last item (a row may straddle two
    lines). A pass asks for the rows some ids ahead of the one it works on, so that the
    rows of a step, scattered over the cache, arrive several at a time (no effect on results)."""
    start = s * width
    for k in range(0, width, 16):
        prefetch(flat, start + k)
    prefetch(flat, start + width - 1)


@compiled(inline="always")
def fetch_part(flat: np.ndarray, s: np.int64, width: np.int64, count: np.int64) -> None:
    """``fetch_row``'s request for the first ``count`` items of row ``s`` only."""
    start = s * width
    for k in range(0, count, 16):
        prefetch(flat, start + k)
    if count > 0:
        prefetch(flat, start + count - 1)


@compiled(inline="always")
def copy_row(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for a row's floats (``dst`` a slice of ``len(src)``). The passes copy rows
    through slices like this, not ``out[base + j]``: numba wraps an index that may be negative
    around (an offset computed from the arrays' values may be, as far as it knows), and that
    kept every such copy from being vectorised (4x slower at 128 floats a row); a numba slice
    assignment does the same copy at several times the cost a row at 16 floats."""
    for j in range(len(src)):
        dst[j] = src[j]


@compiled(inline="always")
def mean_square(row: np.ndarray) -> np.float32:
    """mean(row * row) in float32, summed in order (what ``hold_all`` holds for a gradient, and
    ``Table.combined`` sends; 0 for an empty row)."""
    sq = np.float32(0.0)
    for j in range(len(row)):
        x = row[j]
        sq += x * x
    if len(row) > 0:
        sq = sq / np.float32(len(row))
    return sq


@_jit
def mean_squares(rows: np.ndarray) -> np.ndarray:
    """``mean_square`` of each row of ``rows`` [n, d] (float32)."""
    out = np.empty(rows.shape[0], np.float32)
    for i in range(rows.shape[0]):
        out[i] = mean_square(rows[i])
    return out


@compiled(inline="always")
def zero_row(dst: np.ndarray) -> None:
    """``dst[:] = 0`` for a row's floats (as ``copy_row``)."""
    for j in range(len(dst)):
        dst[j] = 0.0


@compiled(inline="always")
def shard_of(key: np.int64, num_shards: np.int64) -> np.int64:
    """``protos.partition.shard_of_ids`` for one id: ``mix64(id) % num_shards``."""
    if num_shards == 1:
        return np.int64(0)
    return np.int64(mix64(key) % np.uint64(num_shards))


@_jit
def oldest_per_shard(shards: np.ndarray, versions: np.ndarray, num_shards: np.int64) -> np.ndarray:
    """The smallest of ``versions`` per shard (int64 max where a shard has none)."""
    out = np.full(num_shards, NONE, np.int64)
    for i in range(len(shards)):
        if versions[i] < out[shards[i]]:
            out[shards[i]] = versions[i]
    return out


def loads() -> list[Callable[[], object]]:
    """Calls that each load (or compile, the first time) kernels here for the types the cache
    passes (``row_slots.warm_up`` loads them as one group)."""
    ids = np.zeros(0, np.int64)
    examples = (np.zeros((1, 2), np.int64), np.zeros(1, np.int64), np.zeros((1, 1), np.float32), np.zeros(1, np.bool_))
    return [
        lambda: oldest_per_shard(ids, ids, np.int64(1)),
        lambda: mean_squares(np.zeros((0, 1), np.float32)),
        # A typed list of each kind of column (``columns``).
        *[(lambda e=e: typed_list([e, e])) for e in examples],
        lambda: set_cells(typed_list([np.zeros((1, 2), np.int64)] * 2), np.int64(0), np.zeros((1, 2), np.int64)),
    ]


def warm_up() -> None:
    """Load (or compile, the first time) every kernel here for the types the cache passes."""
    for load in loads():
        load()
