"""One table's rows in the worker's row cache (``tether.worker.row_cache``): slots in arrays
and an id -> slot hash index (each step's passes over them: ``tether.worker.cache_kernels``), and
the local rule that applies the worker's own gradients to its cached rows (``local_rule``, ``step``).

The index is the shard's own compiled open-addressing table (``tether.server.kernels``:
``index_lookup``/``index_place``/``index_cells``, linear probing over [n, 2] int64 (id, slot)
cells, n a power of two kept at least twice the cells in use): a lookup of a step's ids is one
compiled loop, an eviction marks its cells removed (tombstones), and the index is rebuilt from
the live slots when live rows and tombstones fill half of it.

The slot arrays are allocated for the whole capacity at once but uninitialised (``np.empty``,
``torch.empty``: pages the cache never uses are never touched) and each slot's columns are set
when a row is placed in it, so growing the cache copies nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from tether.protos.optimizers import OptimizerConfig, rule
from tether.worker.cache_kernels import add_deltas, gather_rows, oldest_per_shard, place_rows
from tether.worker.cache_kernels import warm_up as warm_up_cache
from tether.server.kernels import EMPTY_SLOT, REMOVED_SLOT, RowUpdate, index_cells, index_lookup, index_place, row_update

__all__ = ["NONE", "STALE", "Due", "Grads", "Table", "coalesce", "warm_up"]

STALE = np.iinfo(np.int64).min // 2  # a read clock no bound reaches: refreshed on the next pull
NONE = np.iinfo(np.int64).max  # no pending gradient / no read version yet

Grads = dict[str, tuple[torch.Tensor, torch.Tensor]]  # per table: ids, summed gradients (and statistics columns)
Due = dict[str, list[tuple[np.ndarray, torch.Tensor, np.ndarray, np.ndarray]]]


def warm_up() -> None:
    """Load (or compile, the first time) the index kernels now, so that no step pays for it
    (about a second on a loaded machine: the row cache calls this when it is made)."""
    cells = _cells_for(1)
    ids = np.arange(2, dtype=np.int64)
    index_place(cells, ids, ids.copy())
    index_cells(cells, ids)
    index_lookup(cells, ids)
    warm_up_cache()


def _cells_for(entries: int) -> np.ndarray:
    n = 1024
    while n < 4 * entries:
        n <<= 1
    return np.full((n, 2), EMPTY_SLOT, np.int64)


class Table:
    """One table's cached rows: ``capacity`` slots, the id index, and per slot the row's id,
    shard, read clock and version, last use, use count, and its pending gradient sum with the
    clock and read version of its oldest part. ``queue`` lists (clock, slots) of rows whose
    first held gradient came at that clock, so what is due is found without a scan."""

    def __init__(self, dim: int, capacity: int) -> None:
        self.dim, self.capacity = dim, capacity
        self.top = 0  # slots [top, capacity) were never used
        self.free: list[int] = []  # evicted slots, reused first
        self.max_version: dict[int, int] = {}  # per shard: the largest table version seen
        n = max(capacity, 1)
        self.ids, self.shard = np.empty(n, np.int64), np.empty(n, np.int64)
        self.read_clock, self.read_version = np.empty(n, np.int64), np.empty(n, np.int64)
        self.last_used, self.uses = np.empty(n, np.int64), np.empty(n, np.int64)
        self.pending_since, self.pending_version = np.empty(n, np.int64), np.empty(n, np.int64)
        self.used = np.zeros(n, bool)
        self.values = torch.empty(n, dim)  # the rows as read, with the worker's own changes
        # The sums of the gradients held (zeroed when placed), and two more columns: the sum of
        # their mean(g * g) and their count (``cache_kernels.hold_rows``; a combined push's statistics).
        self.pending = torch.empty(n, dim + 2)
        self.vals, self.pend = self.values.numpy(), self.pending.numpy()  # the same memory
        # The local rule's changes to each row (read-your-own-writes; zeroed when placed): ``mine``,
        # those of the gradients held (not pushed yet); ``fresh``, those the answer of the row's
        # refresh in flight lacks (the held ones when it was planned, and every one since).
        self.mine = np.empty((n, dim), np.float32)
        self.fresh = np.empty((n, dim), np.float32)
        self.queue: list[tuple[int, np.ndarray]] = []
        self.holding = 0  # slots whose gradients are held
        self.cells = _cells_for(min(capacity, 1024))
        self.filled = 0  # cells holding a row or a tombstone
        # Local updates (``local_rule``): the table's rule, its constants and its state per slot.
        self.update: RowUpdate | None = None
        self.optimizer: OptimizerConfig | None = None
        self.combined_stats: tuple[str, ...] = ()  # what the table's rule takes beside a combined sum (``combined``)
        self.state: dict[str, np.ndarray] = {}
        self.initial: dict[str, float] = {}

    def local_rule(self, optimizer: OptimizerConfig) -> None:
        """Apply ``optimizer``'s rule to the cached rows as the worker's gradients are held
        (``step``), with a state of its own per slot (allocated for the capacity, unset)."""
        r = rule(optimizer.name)
        n = max(self.capacity, 1)
        self.update, self.optimizer = row_update(r, optimizer, self.dim), optimizer
        self.state = {k: np.empty((n, *shape), np.float32) for k, shape in r.state_shapes(self.dim).items()}
        self.initial = r.initial_state(optimizer)
        if self.top:
            self.reset_state(np.arange(self.top, dtype=np.int64))

    def combined(self, ids: torch.Tensor, held: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A push's part of this table from ``held`` (the summed gradients with their two
        statistics columns, one row per id): ``(ids, sums)``, or, where a row sums several
        gradients and the rule takes statistics for that (``UpdateRule.combined_stats``),
        ``(ids, sums, stats)`` with -1 first in the rows of one gradient."""
        d = self.dim
        sums = held[:, :d].contiguous()
        count = held[:, d + 1]
        many = count > 1
        if not self.combined_stats or not bool(many.any()):
            return ids, sums
        columns = [count if name == "count" else held[:, d] for name in self.combined_stats]
        columns[0] = torch.where(many, columns[0], -1.0)
        return ids, sums, torch.stack(columns, 1)

    def reset_state(self, slots: np.ndarray) -> None:
        """The local rule's state of ``slots`` back to the rule's start."""
        for k, a in self.state.items():
            a[slots] = self.initial.get(k, 0.0)

    def step(self, slots: np.ndarray, grads: np.ndarray, clock: int) -> None:
        """One local step of the rule on rows ``slots`` (unique) from ``grads`` (float32, one row
        each) at the rate of the push carrying ``clock`` (the table's schedule); each row's change
        is added to its ``mine`` and ``fresh`` changes."""
        if self.update is None or self.optimizer is None or not len(slots):
            return
        opt = self.optimizer
        lr = np.full(len(slots), opt.lr * opt.schedule.factor(opt.lr, clock), np.float32)
        before = gather_rows(self.vals, slots)
        self.update(self.vals, self.state, slots, np.ascontiguousarray(grads, np.float32), lr)
        add_deltas(self.vals, before, slots, self.mine, self.fresh)

    @property
    def size(self) -> int:
        """Slots ever used (the arrays' resident part)."""
        return self.top

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where it is not cached."""
        if not len(ids):
            return np.zeros(0, np.int64)
        return index_lookup(self.cells, np.ascontiguousarray(ids, np.int64))

    def take(self, want: int) -> np.ndarray:
        """Up to ``want`` free slots (evicted ones first)."""
        k = min(want, len(self.free))
        slots = np.array(self.free[len(self.free) - k:][::-1], np.int64)
        del self.free[len(self.free) - k:]
        fresh = min(want - k, self.capacity - self.top)
        if fresh > 0:
            slots = np.concatenate([slots, np.arange(self.top, self.top + fresh, dtype=np.int64)])
            self.top += fresh
        return slots

    def available(self) -> int:
        return len(self.free) + self.capacity - self.top

    def place(self, ids: np.ndarray, slots: np.ndarray, now: int) -> None:
        """Put new ids (not cached, unique) in free ``slots``: every column of those slots set."""
        if 2 * (self.filled + len(ids)) > len(self.cells):
            self._rebuild(extra=len(ids))
        place_rows(slots, ids, now, self.ids, self.used, self.uses, self.last_used, self.pending_since, self.pending_version,
                   self.read_clock, self.read_version, self.pend, self.mine, self.fresh, STALE)
        if self.state:
            self.reset_state(slots)
        index_place(self.cells, np.ascontiguousarray(ids, np.int64), slots)
        self.filled += len(ids)

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
        self.free.extend(slots.tolist())

    def hold(self, slots: np.ndarray, clock: int) -> None:
        """Note that ``slots`` (not held before; ``hold_rows`` set their clock) hold gradients
        from ``clock`` on."""
        if len(slots):
            self.holding += len(slots)
            self.queue.append((clock, slots))

    def due(self, clock: int, writes: int, flush: bool) -> np.ndarray:
        """Slots whose held gradients are due at ``clock`` (``flush``: every held one), taken
        off the queue. A queue entry's slot counts only while it is held since that clock."""
        ready, keep = [], []
        for since, slots in self.queue:
            if flush or clock - since >= writes:
                ready.append(slots[self.pending_since[slots] == since])
            else:
                keep.append((since, slots))
        self.queue = keep
        if not ready:
            return np.zeros(0, np.int64)
        out = np.concatenate(ready)
        return np.unique(out) if len(ready) > 1 else out

    def index_entries(self) -> int:
        return len(self.cells)

    def cached_ids(self) -> set[int]:
        return set(self.ids[: self.top][self.used[: self.top]].tolist())

    @property
    def held(self) -> int:
        return int(self.used[: self.top].sum())


def coalesce(due: Due) -> tuple[Grads, dict[tuple[int, str], int]]:
    """One push's sparse part: per table sorted unique ids with their gradients summed, and
    the oldest read version per (shard, table)."""
    grads: Grads = {}
    versions: dict[tuple[int, str], int] = {}
    for t, parts in due.items():
        if len(parts) == 1:
            ids, g, shards, read = parts[0]
        else:
            ids, g = np.concatenate([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            shards, read = np.concatenate([p[2] for p in parts]), np.concatenate([p[3] for p in parts])
        if len(parts) == 1 and (len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1]))):
            uniq, summed = torch.from_numpy(ids), g
        else:
            uniq_np, inverse = np.unique(ids, return_inverse=True)
            acc = np.zeros((len(uniq_np), g.shape[1]), np.float32)
            np.add.at(acc, inverse.reshape(-1), g.numpy())
            uniq, summed = torch.from_numpy(uniq_np), torch.from_numpy(acc)
        grads[t] = (uniq, summed)
        if len(shards):
            oldest = oldest_per_shard(shards, read, int(shards.max()) + 1)
            for s in np.flatnonzero(oldest != NONE).tolist():
                versions[(s, t)] = int(oldest[s])
    return grads, versions
