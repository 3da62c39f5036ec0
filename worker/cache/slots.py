"""One table's rows in the worker's row cache (``tether.worker.cache.row_cache``): slots in arrays
and an id -> slot hash index (each step's passes over them: ``tether.worker.cache.kernels``), and
the local rule's state for the worker's own gradients applied to its cached rows (``local_rule``).

The index is the shard's own compiled open-addressing table (``tether.server.kernels``:
``index_lookup``/``index_place``/``index_cells``, linear probing over [n, 2] int64 (id, slot)
cells, n a power of two kept at least twice the cells in use): a lookup of a step's ids is one
compiled loop, an eviction marks its cells removed (tombstones), and the index is rebuilt from
the live slots when live rows and tombstones fill half of it.

The slot arrays are allocated for the whole capacity at once but uninitialised (anonymous
memory, in huge pages where the system allows: ``tether.common.pages``; pages the cache never
uses are never touched) and each slot's columns are set when a row is placed in it, so growing
the cache copies nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from tether.common import pages
from tether.protos.specs import OptimizerConfig
from tether.rules.index_kernels import EMPTY_SLOT, REMOVED_SLOT, index_cells, index_lookup, index_place
from tether.rules.kernel_cache import load_kernels
from tether.rules.optimizers import rule
from tether.worker.cache.batch import loads as batch_loads
from tether.worker.cache.kernels import META, mean_squares, oldest_per_shard
from tether.worker.cache.kernels import loads as cache_loads
from tether.worker.client.router import PackedParts

__all__ = ["CACHE_USUAL_S", "EVICT_SHARE", "NONE", "STALE", "Due", "Table", "Taken", "coalesce", "start_warm_up", "wait_warm_up", "warm_up"]

# A full table evicts at least this share of its capacity at once (``Table.victims``), as a shard's does.
EVICT_SHARE = 16
STALE = np.iinfo(np.int64).min // 2  # a read clock no bound reaches: refreshed on the next pull
NONE = np.iinfo(np.int64).max  # no pending gradient / no read version yet
_NO_IDS = np.zeros(0, np.int64)

Due = dict[str, list[tuple[np.ndarray, torch.Tensor, np.ndarray, np.ndarray]]]


# How long compiling the row cache's kernels usually takes on a quiet 2-core machine, the
# first time on a machine (measured 34 s with every rule's row kernel compiled into the hold pass,
# ``rows_by_rule``; 22 s before); from the disk cache: under a second.
CACHE_USUAL_S = 35.0


def _load_index() -> None:
    cells = _cells_for(1)
    ids = np.arange(2, dtype=np.int64)
    index_place(cells, ids, ids.copy())
    index_cells(cells, ids)
    index_lookup(cells, ids)


def warm_up() -> float:
    """Load (or compile, the first time) the index kernels and the passes now, so that no step
    pays for it (warm, from numba's disk cache: under a second on a quiet machine, most of it
    numba's own start; compiling them the first time: ``CACHE_USUAL_S``, shared by the workers
    that start together: ``kernel_cache.load_kernels``); the seconds it took."""
    return load_kernels("the worker row cache's passes", CACHE_USUAL_S, [_load_index, *cache_loads(), *batch_loads()])


WARM_UP_TIMEOUT_S = 900.0  # compiling them the first time on a loaded machine: a minute or two
_warming: list[threading.Thread] = []
_warm_errors: list[BaseException] = []
_warm_lock = threading.Lock()


def _warm_in_thread() -> None:
    try:
        warm_up()
    except BaseException as exc:  # noqa: BLE001 - handed to the first step (wait_warm_up)
        _warm_errors.append(exc)


def start_warm_up() -> None:
    """Start ``warm_up`` in a background thread, once per process (the row cache does when it is
    made, so the load overlaps the worker's start; its first step waits: ``wait_warm_up``)."""
    with _warm_lock:
        if not _warming:
            # Not a daemon: a process that ends at once waits for it rather than ending inside a compile.
            _warming.append(threading.Thread(target=_warm_in_thread, name="tether-row-cache-warm-up"))
            _warming[0].start()


def wait_warm_up(timeout: float = WARM_UP_TIMEOUT_S) -> None:
    """Wait for ``start_warm_up``'s load (starting it if none was); its error raised here."""
    start_warm_up()
    _warming[0].join(timeout)
    if _warming[0].is_alive():
        raise TimeoutError(f"the row cache's compiled kernels were not loaded within {timeout:.0f} s")
    if _warm_errors:
        raise RuntimeError(f"the row cache's compiled kernels failed to load: {_warm_errors[0]}") from _warm_errors[0]


def _lines(n: int, width: int) -> np.ndarray:
    """An uninitialised [n, width] int64 array whose rows start on 64-byte boundaries (width 8:
    one cache line each)."""
    buf = pages.empty(n * width + 8, np.int64)
    skip = (-buf.ctypes.data % 64) // 8
    return buf[skip: skip + n * width].reshape(n, width)


def _cells_for(entries: int) -> np.ndarray:
    n = 1024
    while n < 4 * entries:
        n <<= 1
    cells = pages.empty((n, 2), np.int64)
    cells.fill(EMPTY_SLOT)
    return cells


class Table:
    """One table's cached rows: ``capacity`` slots, the id index, and per slot the row's id,
    shard, read clock and version, last use, use count, and its pending gradient sum with the
    clock and read version of its oldest part. ``queue`` lists (clock, slots) of rows whose
    first held gradient came at that clock, so what is due is found without a scan."""

    def __init__(self, dim: int, capacity: int) -> None:
        self.dim, self.capacity = dim, capacity
        self.top = 0  # slots [top, capacity) were never used
        self.free, self.nfree = np.empty(max(capacity, 1), np.int64), 0  # a stack of evicted slots (free[:nfree]), reused first
        self.max_version: dict[int, int] = {}  # per shard: the largest table version seen
        n = max(capacity, 1)
        # A slot's int64 columns side by side (``cache_batch.META``: one 64-byte row, aligned to a
        # cache line, so a step's passes read one line per row), each also a column view.
        self.meta = _lines(n, len(META))
        (self.ids, self.shard, self.read_clock, self.read_version, self.last_used, self.uses, self.pending_since,
         self.pending_version) = (self.meta[:, c] for c in range(len(META)))
        self.used = np.zeros(n, bool)
        # The per-slot arrays are in huge pages where the system allows (``tether.common.pages``):
        # a step's passes read them at scattered rows.
        self.values = torch.from_numpy(pages.empty((n, dim), np.float32))  # the rows as read, with the worker's own changes
        self.vals = self.values.numpy()  # the same memory
        # A slot's held record (zeroed when placed), one row of 3 * dim + 2 floats, so that a pass
        # reads adjacent lines (bench/slot_layout.py: 1.2-1.25x a hold-like pass, caches cold):
        # the sums of the gradients held and two more columns, the sum of their mean(g * g) and
        # their count (``cache_batch.hold_all``; a combined push's statistics); then the local
        # rule's changes to the row (read-your-own-writes): ``mine``, those of the gradients held
        # (not pushed yet), and ``fresh``, those the answer of the row's refresh in flight lacks
        # (the held ones when it was planned, and every one since). ``kernels.FLOATS``.
        self.held_record = pages.empty((n, 3 * dim + 2), np.float32)
        self.pending = torch.from_numpy(self.held_record)[:, : dim + 2]  # the sums and statistics (a view)
        self.cells = _cells_for(min(capacity, 1024))
        self.filled = 0  # cells holding a row or a tombstone
        # Local updates (``local_rule``): the table's rule, its state per slot and its start.
        self.optimizer: OptimizerConfig | None = None
        self.combined_stats: tuple[str, ...] = ()  # what the table's rule takes beside a combined sum (``combined``)
        self.state: dict[str, np.ndarray] = {}
        self.initial: dict[str, float] = {}

    def local_rule(self, optimizer: OptimizerConfig) -> None:
        """Apply ``optimizer``'s rule to the cached rows as the worker's gradients are held (by
        ``cache_batch.hold_all``), with a state of its own per slot (allocated for the capacity,
        unset: each row's is set to the rule's start when the row is placed)."""
        r = rule(optimizer.name)
        n = max(self.capacity, 1)
        self.optimizer = optimizer
        self.state = {k: pages.empty((n, *shape), np.float32) for k, shape in r.state_shapes(self.dim).items()}
        self.initial = r.initial_state(optimizer)
        if self.top:
            self.reset_state(np.arange(self.top, dtype=np.int64))

    def rate(self, clock: int) -> float:
        """The local rule's learning rate for the push carrying ``clock`` (the table's schedule)."""
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("no local rule: local_rule was not called")
        return opt.lr * opt.schedule.factor(opt.lr, clock)

    def combined(self, ids: torch.Tensor, held: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A push's part of this table from ``held`` (the summed gradients with their two
        statistics columns, one row per id): ``(ids, sums)``, or, where a row sums several
        gradients and the rule takes statistics for that (``UpdateRule.combined_stats``),
        ``(ids, sums, stats)`` with -1 first in the rows of one gradient."""
        d, h = self.dim, held.numpy()
        sums = torch.from_numpy(np.ascontiguousarray(h[:, :d]))
        count = h[:, d + 1]
        many = count > 1
        if not self.combined_stats or not many.any():
            return ids, sums
        stats = np.empty((len(h), len(self.combined_stats)), np.float32)
        for c, name in enumerate(self.combined_stats):
            stats[:, c] = count if name == "count" else h[:, d]
        stats[~many, 0] = -1.0
        return ids, sums, torch.from_numpy(stats)

    def victims(self, n: int, protected: np.ndarray, policy: str) -> np.ndarray:
        """The slots of up to ``n`` rows to evict, at least ``1 / EVICT_SHARE`` of the capacity
        (a full table makes room in batches, as a shard's table does: finding victims scans every
        row, so it runs once per that many placements, not at every pull), none of ``protected``
        (ids): the least recently used (lru) or the least used, ties broken by recency (lfu), ties
        to the lowest slot."""
        n = max(n, self.capacity // EVICT_SHARE)
        mask = self.used[: self.top].copy()
        prot = self.slots_of(protected)
        mask[prot[prot >= 0]] = False
        cand = np.flatnonzero(mask)
        if not len(cand):
            return cand
        if policy == "lru":
            key = self.last_used[cand]
        else:  # lfu, ties broken by recency
            key = self.uses[cand] * (1 << 32) + (self.last_used[cand] & 0xFFFFFFFF)
        if n < len(cand):  # the n smallest keys, ties to the lowest slot (as a stable sort of all)
            kth = np.partition(key, n - 1)[n - 1]
            less = np.flatnonzero(key < kth)
            pick = np.concatenate([less, np.flatnonzero(key == kth)[: n - len(less)]])
            pick.sort()
            return cand[pick[np.argsort(key[pick], kind="stable")]]
        return cand[np.argsort(key, kind="stable")]

    def reset_state(self, slots: np.ndarray) -> None:
        """The local rule's state of ``slots`` back to the rule's start."""
        for k, a in self.state.items():
            a[slots] = self.initial.get(k, 0.0)

    @property
    def size(self) -> int:
        """Slots ever used (the arrays' resident part)."""
        return self.top

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where it is not cached."""
        if not len(ids):
            return np.zeros(0, np.int64)
        return index_lookup(self.cells, np.ascontiguousarray(ids, np.int64))

    def available(self) -> int:
        return self.nfree + self.capacity - self.top

    def room(self, extra: int) -> bool:
        """Make the id index ready for ``extra`` more ids (rebuilt when they would fill half of
        it); True where it was rebuilt (new ``cells``)."""
        if 2 * (self.filled + extra) <= len(self.cells):
            return False
        self._rebuild(extra)
        return True

    def _rebuild(self, extra: int) -> None:
        live = np.flatnonzero(self.used[: self.top])
        self.cells = _cells_for(len(live) + extra)
        index_place(self.cells, self.ids[live], live)
        self.filled = len(live)

    def remove(self, slots: np.ndarray) -> None:
        """Forget the rows of ``slots``: their index cells become tombstones."""
        cells = index_cells(self.cells, self.ids[slots])
        self.cells[cells[cells >= 0], 1] = REMOVED_SLOT
        self.used[slots] = False
        self.pending_since[slots] = self.pending_version[slots] = NONE
        self.read_clock[slots] = STALE
        self.free[self.nfree: self.nfree + len(slots)] = slots
        self.nfree += len(slots)

    def index_entries(self) -> int:
        return len(self.cells)

    def cached_ids(self) -> set[int]:
        return set(self.ids[: self.top][self.used[: self.top]].tolist())

    @property
    def held(self) -> int:
        """Rows cached: the slots ever used but those evicted and not reused (``free``), no scan."""
        return self.top - self.nfree


class Taken(NamedTuple):
    """The held sums taken for a push (``cache_batch.take_all``, ``RowCache._taken``): the push's
    parts as laid out for the shards (per table ``(ids, sums)`` or ``(ids, sums, stats)``,
    ``Table.combined``'s), per table (index g) whether its ids ascend, and each row's sum of
    mean(g * g) (-1 where a row of one gradient's was not computed: ``with_unheld``) and count of
    gradients (table g's rows at ``parts.packed.at[g]``)."""

    parts: PackedParts
    ascending: np.ndarray
    square: np.ndarray
    counts: np.ndarray


def coalesce(due: Due, taken: Taken | None, oldest: np.ndarray | None, names: Sequence[str],
             tables: Mapping[str, Table]) -> tuple[Mapping[str, tuple[torch.Tensor, ...]], dict[tuple[int, str], int]]:
    """One push's sparse part: per table sorted unique ids with their gradients summed (and a
    combined push's statistics, ``Table.combined``), from the sums ``taken`` (``oldest``: their
    oldest read version per table of ``names`` and shard) and the other parts ``due`` (evicted
    rows, rows not cached); and the oldest read version per (shard, table). The usual push (the
    sums alone, each table's ids ascending) is ``taken``'s parts as they are."""
    versions: dict[tuple[int, str], int] = {}
    if oldest is not None:
        gs, ss = np.nonzero(oldest != NONE)
        for g, s, v in zip(gs.tolist(), ss.tolist(), oldest[gs, ss].tolist(), strict=True):
            versions[(s, names[g])] = v
    if taken is not None and not due and taken.ascending.all():
        return taken.parts, versions
    grads: dict[str, tuple[torch.Tensor, ...]] = {}
    if taken is not None:
        at = taken.parts.packed.at
        for t, g, *_ in taken.parts.layout():
            if t in due or not taken.ascending[g]:
                a, b = at[g], at[g + 1]
                part = taken.parts[t]
                square = taken.square[a:b]
                if len(square) and square.min() < 0:  # rows of one gradient whose mean square was not needed until now
                    square = square.copy()
                    late = square < 0
                    square[late] = mean_squares(part[1].numpy()[late])  # a boolean pick: a new C-contiguous array
                held = np.concatenate([part[1].numpy(), square[:, None], taken.counts[a:b, None]], 1)
                due.setdefault(t, []).append((part[0].numpy(), torch.from_numpy(held), _NO_IDS, _NO_IDS))
            else:
                grads[t] = taken.parts[t]
    for t, parts in due.items():
        ids, g = np.concatenate([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        shards, read = np.concatenate([p[2] for p in parts]), np.concatenate([p[3] for p in parts])
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        if len(ids) < 2 or bool((ids[1:] != ids[:-1]).all()):
            # Each id once (the usual case: held sums, rows not cached): its row as the sum (+ 0.0:
            # a sum from zero, as ``np.add.at``'s, which took ~100 ns a float: 0.45 s for a flush
            # of a --preset gpu cache).
            acc = g.numpy()[order] + np.float32(0.0)
        else:
            ids, inverse = np.unique(ids, return_inverse=True)
            acc = np.zeros((len(ids), g.shape[1]), np.float32)
            np.add.at(acc, inverse.reshape(-1), g.numpy()[order])  # an id's rows in the order they came
        grads[t] = tables[t].combined(torch.from_numpy(ids), torch.from_numpy(acc))
        if len(shards):
            first = oldest_per_shard(shards, read, int(shards.max()) + 1)
            for s in np.flatnonzero(first != NONE).tolist():
                versions[(s, t)] = min(int(first[s]), versions.get((s, t), int(first[s])))
    return grads, versions
