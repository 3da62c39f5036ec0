"""Embedding tables of one shard: rows keyed by int64 id, their optimizer state and versions.

Embedding rows live in one contiguous tensor per table (plus one per optimizer state), and
ids map to row slots through a vectorised hash index (``tether.server.storage.index``): no Python
object per row and no Python loop over ids. Updates to one table are applied in place by the
rule's compiled row kernel, in a short critical section under that table's own lock, so
concurrent pushes never lose an update while pushes to other tables and dense chunks, and all
pulls, go on in parallel (pulls of an unbounded table read without a lock, Hogwild-style).

A table may be bounded (``TableConfig.capacity``): when a new row would not fit, the least
recently touched rows are evicted in one batch (``numpy.argpartition`` over last-touch ticks)
(tombstoned in the index) and their slots reused. Admission (``TableConfig.min_count``) keeps ids that were seen fewer
than N times out of the table altogether; their counts live in a fixed-size count-min sketch
(``tether.server.storage.admission``). Dense chunks live in ``tether.server.storage.dense``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tether.protos.specs import TableConfig
from tether.rules import row_kernels
from tether.rules.initial import column_steps, init_rows
from tether.rules.initial import salt as initial_salt
from tether.rules.optimizers import rule
from tether.rules.push_hooks import apply_rows, running_mean, stats_array
from tether.rules.row_kernels import NO_ROWS
from tether.rules.update_rules import UpdateRule
from tether.server.storage.admission import CountMinSketch, sketch_width
from tether.server.storage.index import IdIndex, lookup_ids
from tether.server.storage.update_log import RowVersions, UpdateLog
from tether.server.storage.zeroed import float_rows, grow_rows, zeros

__all__ = ["EmbeddingTable", "Pulled"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pulled:
    """What ``EmbeddingTable.pulled`` found of a push's ids: every one a row, at ``slots`` of
    ``index``, and whether they are unique."""

    index: IdIndex
    slots: np.ndarray
    unique: bool

_GROWTH = 1.5
# An empty table starts with at most this many bytes of rows, whatever its dim.
_INITIAL_BYTES = 4 << 20
# Evict at least this fraction of the capacity at once, so the O(rows) selection runs rarely.
_EVICT_BATCH = 1 / 16
# The last updates' row slots (int32, each with an int32 link to its row's entry before), kept
# to count how many updates each row of a push missed since its read (per-row staleness): at
# most this many updates and this many slots in all (2 MiB). A read older than the log counts
# each row updated since as stale by the whole table's updates.
_LOG_UPDATES = 256
_LOG_SLOTS = 1 << 18
# Row versions are int32 offsets from a base version that moves up by half this span when the
# table's version runs this far past it (``RowVersions``).
_VERSION_SPAN = 2**31 - 1


def _init_constants(cfg: TableConfig) -> tuple[np.uint64, np.ndarray, np.float32, np.float32]:
    """What ``row_kernels.init_rows_into`` takes beside the ids for a table's new rows (``init_rows``'s
    salt, column steps, step and scale), made once per table."""
    scale = cfg.init_scale
    return initial_salt(cfg.seed, cfg.name), column_steps(cfg.dim)[0], np.float32(2 * scale / (1 << 24)), np.float32(scale)


class EmbeddingTable:
    """Rows of one table owned by this shard, created on first touch (or after admission)."""

    def __init__(
        self,
        config: TableConfig,
        initial_capacity: int = 1024,
        on_evict: Callable[[int], None] | None = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.dim = config.dim
        self.capacity = config.capacity
        self.version = 0
        self.evicted_rows = 0
        self.dropped_rows = 0
        # Told how many rows were evicted / row gradients dropped (metrics).
        self._on_evict = on_evict
        self._on_drop = on_drop
        self._lock = threading.Lock()
        # The update rule (its state, its row kernel), and what a new row's state starts at.
        self._rule = rule(config.optimizer.name)
        self._state_shapes = self._rule.state_shapes(config.dim)
        self._initial_state = self._rule.initial_state(config.optimizer)
        self._update_rows = row_kernels.row_update(self._rule, config.optimizer, config.dim)
        row_kernels.load_rule_in_background(self._rule)  # compiled the first time on this machine, while the first pull runs
        # Slots handed out so far; a slot below this is a row or sits in the free list.
        self._used = 0
        self._free = np.empty(0, np.int64)
        cap = max(1, min(initial_capacity, max(16, _INITIAL_BYTES // (4 * config.dim))))
        if self.capacity:
            cap = min(cap, self.capacity)
        self._index = IdIndex(cap)
        self._set_rows(float_rows(cap, (config.dim,)), {k: float_rows(cap, s) for k, s in self._state_shapes.items()})
        self._lr_rows = np.empty(0, np.float32)  # a push's rates, reused under the lock (``_rates``)
        self._init_args = _init_constants(config)
        # Bounded tables reuse slots, so a lock-free reader could read a slot after it was
        # given to another id: they read under the lock, and track last touches for LRU.
        self._locked_reads = self.capacity > 0
        self._tick = 0
        self._touched = zeros(cap, np.int64) if self.capacity else None
        self._sketch = CountMinSketch(sketch_width(self.capacity), seed=config.seed) if config.min_count > 1 else None
        # Where a row's slot never changes once it exists (no capacity, no admission), a pull
        # hands out the table's storage and a push's slots, once found, stay right.
        self._fixed_slots = not self.capacity and self._sketch is None
        # Per-row staleness: the table version of each row's last update, and the slots of the
        # last updates.
        self._versions = RowVersions(cap, _VERSION_SPAN)
        self._updates = UpdateLog(_LOG_UPDATES, _LOG_SLOTS)
        # Per-row running means the push remedies keep (push_hooks: DC-ASGD-a, gap-aware), by
        # name, made on first use; -1: none yet. Not in checkpoints (running statistics).
        self._means: dict[str, np.ndarray] = {}

    @property
    def rows(self) -> int:
        """Number of resident rows."""
        return self._index.size

    @property
    def memory_bytes(self) -> int:
        """Bytes allocated for rows, optimizer state, the id index and the per-row bookkeeping
        (row versions; LRU ticks and the admission sketch where used; not the update log's
        entries, at most 2 MiB, the size of the last pushes). Storage beyond the rows
        (room to grow) is counted here but is not resident until rows are written there."""
        total = self._weights.nbytes + self._index.nbytes + self._free.nbytes + self._versions.nbytes
        if self._touched is not None:
            total += self._touched.nbytes
        if self._sketch is not None:
            total += self._sketch.nbytes
        return total + sum(t.nbytes for t in self._state.values()) + sum(a.nbytes for a in self._means.values())

    def _grow(self, need: int) -> None:
        cap = len(self._arrays[0])  # the rows' array: a tensor's shape costs more
        if need <= cap:
            return
        new_cap = max(need, int(cap * _GROWTH) + 1)
        if self.capacity:
            new_cap = max(need, min(new_cap, self.capacity))
        n = self._used
        # Within the arrays' reserved room this copies nothing (tether.server.storage.zeroed).
        w = grow_rows(self._weights, new_cap, n)
        state = {k: grow_rows(self._state[k], new_cap, n) for k in self._state_shapes}
        if self._touched is not None:
            touched = zeros(new_cap, np.int64)
            touched[:n] = self._touched[:n]
            self._touched = touched
        self._versions.grow(new_cap, n)
        self._set_rows(w, state)

    def _set_rows(self, weights: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """The table's rows and optimizer state, and their arrays (the same memory) as the row
        kernels take them (``tensor.numpy()`` costs about a microsecond a call, a push part several)."""
        self._weights, self._state = weights, state
        self._arrays = (weights.numpy(), {k: t.numpy() for k, t in state.items()})

    def _alloc(self, k: int) -> np.ndarray:
        """``k`` free slots: evicted ones first, then new ones. Caller holds the lock."""
        start = self._used
        if not len(self._free):
            self._grow(start + k)
            self._used += k
            return np.arange(start, start + k, dtype=np.int64)
        reuse, self._free = self._free[:k], self._free[k:]
        fresh = k - len(reuse)
        self._grow(start + fresh)
        self._used += fresh
        return np.concatenate([reuse, np.arange(start, start + fresh, dtype=np.int64)])

    def _insert(self, new_ids: np.ndarray) -> np.ndarray:
        """Create rows for unique ids that are not present; returns their slots. Caller holds the lock."""
        k = len(new_ids)
        start = self._used
        # With no evicted slot to reuse, the new slots are the next ``k`` in order: the rows are
        # written in place there.
        run = not len(self._free)
        slots = self._alloc(k)
        rows = slice(start, start + k) if run else slots
        weights, state = self._arrays
        new_ids = np.ascontiguousarray(new_ids, np.int64)
        if run:
            row_kernels.init_rows_into(new_ids, *self._init_args, weights[rows])
        else:
            out = np.empty((k, self.dim), np.float32)
            row_kernels.init_rows_into(new_ids, *self._init_args, out)
            weights[rows] = out
        for name, a in state.items():
            # A reused slot still holds the evicted row's state.
            a[rows] = self._initial_state.get(name, 0.0)
        if self._touched is not None:
            self._touched[slots] = self._tick
        # A reused slot's updates were the evicted row's: the new row was never updated.
        self._versions.array[slots] = 0
        for means in self._means.values():
            means[slots[slots < len(means)]] = -1
        self._index.insert(new_ids, slots, (start, start + k - 1) if run else None)
        return slots

    def _evict(self, want: int) -> int:
        """Evict up to ``want`` least recently touched rows not touched by the current call."""
        if self._touched is None:  # only bounded tables evict, and they track touches
            return 0
        keys, slots = self._index.items(sort=False)
        touched = self._touched[slots]
        candidates = np.flatnonzero(touched < self._tick)
        n = min(want, len(candidates))
        if n <= 0:
            return 0
        if n < len(candidates):
            victims = candidates[np.argpartition(touched[candidates], n - 1)[:n]]
        else:
            victims = candidates
        self._index.remove(keys[victims])
        self._free = np.concatenate([self._free, slots[victims]])
        self.evicted_rows += n
        if self._on_evict is not None:
            self._on_evict(n)
        return n

    def _admit(self, fresh: np.ndarray) -> np.ndarray:
        """Create rows for the sorted, unique, absent ``fresh`` ids that pass admission and fit;
        returns their slots (-1: left out)."""
        if self._sketch is None and not self.capacity:
            return self._insert(fresh)
        take = np.arange(len(fresh))
        if self._sketch is not None:
            take = take[self._sketch.add(fresh) >= self.config.min_count]
        if self.capacity:
            room = self.capacity - self.rows
            if len(take) > room:
                self._evict(max(len(take) - room, int(self.capacity * _EVICT_BATCH)))
                room = self.capacity - self.rows
                # More new ids in one call than the rows not in use by it: the rest stay out,
                # like ids not admitted yet.
                take = take[:room]
        slots = np.full(len(fresh), -1, np.int64)
        if len(take):
            slots[take] = self._insert(fresh[take])
        return slots

    def _resolve(self, ids: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """Slots of ``ids`` (-1: not a row), admitting and evicting. Caller holds the lock.

        ``slots``: the index's answer for ``ids`` if the caller already has it (taken under
        the lock, or known to be unchanged since). A pull may name an id more than once; each
        distinct id is counted and created once.
        """
        self._tick += 1
        if slots is None:
            slots = self._index.lookup(ids)
        found = slots >= 0
        if self._touched is not None:
            self._touched[slots[found]] = self._tick
        if not found.all():
            missing = ids[~found]
            if len(missing) < 2 or bool((missing[1:] > missing[:-1]).all()):
                # Already sorted and unique (a client's pull is): no np.unique needed.
                slots[~found] = self._admit(missing)
            else:
                fresh, where = np.unique(missing, return_inverse=True)
                slots[~found] = self._admit(fresh)[where]
        return slots

    def _gather(self, ids: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        present = slots >= 0
        if present.all():
            return self._weights.index_select(0, torch.from_numpy(slots))
        out = torch.empty(len(ids), self.dim)
        mask = torch.from_numpy(present)
        out[mask] = self._weights.index_select(0, torch.from_numpy(slots[present]))
        cfg = self.config
        out[~mask] = init_rows(ids[~present], self.dim, cfg.seed, cfg.name, cfg.init_scale)
        return out

    def slots(self, ids: np.ndarray) -> torch.Tensor:
        """Row slots of ``ids`` (int64, any value), creating missing rows (-1: not admitted)."""
        if not self._locked_reads:
            slots = self._index.lookup(ids)
            if (slots >= 0).all():
                return torch.from_numpy(slots)
        with self._lock:
            return torch.from_numpy(self._resolve(ids))

    def pull(self, ids: np.ndarray) -> tuple[torch.Tensor, int]:
        """Rows of ``ids`` (a copy; not admitted ids get their initial row) and the table version."""
        source, index, version = self.locate(ids)
        return (source if index is None else source.index_select(0, index)), version

    def locate(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Where the rows of ``ids`` are, for a caller that copies them out itself (straight
        into a reply, with no temporary): ``(source, index, version)``, the rows being
        ``source[index]`` (``index`` None: ``source`` holds exactly the rows, a fresh tensor).

        Only tables that read without a lock hand out their storage; copying from it later is
        a Hogwild read like any other (a row may be mid-update, never another id's row).
        """
        if self._locked_reads:
            with self._lock:
                return self._gather(ids, self._resolve(ids)), None, self.version
        version = self.version
        index = self._index
        size = index.size
        slots = index.lookup(ids)
        missing = slots < 0
        if missing.any():
            # Rows are never removed from a table without a capacity, so only the ids missing
            # from the lock-free read need resolving under the lock, and if no row was added
            # since that read, they are still missing.
            with self._lock:
                unchanged = index is self._index and index.size == size
                absent = np.full(int(missing.sum()), -1, np.int64) if unchanged else None
                slots[missing] = self._resolve(ids[missing], absent)
        if not self._fixed_slots:
            # Admission may have left ids out: they get their initial rows.
            return self._gather(ids, slots), None, version
        # Every id of a table with fixed slots is a row by now (no admission, no capacity).
        return self._weights, torch.from_numpy(slots), version

    @property
    def update_rule(self) -> UpdateRule:
        """The rule of the table's optimizer."""
        return self._rule

    def pulled(self, ids: np.ndarray) -> Pulled | None:
        """If every id of ``ids`` is a row already (a push's ids usually are: its step's pull
        created them): their slots, and whether they are unique. Only tables whose rows never
        move or go (no capacity, no admission) answer; None otherwise, or if an id is not a row.

        A row exists only for an id that passed a pull's or push's checks (owned by this
        shard; restored rows were filtered by owner), so a push of such ids needs only the
        uniqueness check. Read without the lock: a row's slot never changes.
        """
        return self.checked(ids, NO_ROWS, NO_ROWS, np.float32(0))[0]

    def checked(self, ids: np.ndarray, grads: np.ndarray, stats: np.ndarray, low: np.float32) -> tuple[Pulled | None, int]:
        """``pulled(ids)``, and ``row_kernels.combined_push_fault``'s code for a push part's
        gradients and statistics (as ``push_hooks.part_rows`` gives them; ``NO_ROWS`` where
        there are none), in one compiled call where the table answers ``pulled``."""
        if not self._fixed_slots or not len(ids):
            return None, int(row_kernels.combined_push_fault(grads, stats, low))
        index = self._index
        cells, keys, bits = index.snapshot
        slots, found, unique, fault = row_kernels.push_part_fault(cells, keys, bits, lookup_ids(ids), grads, stats, low)
        return (Pulled(index, slots, unique) if found else None), int(fault)

    def staleness(self, ids: np.ndarray, read_version: int, pulled: Pulled | None = None) -> np.ndarray | None:
        """How many updates each row of ``ids`` received since a read at table version
        ``read_version`` (int64 per id); None when no row was updated since (all zero).

        Only rows newer than the read are counted, over the log of the last updates; a read
        older than that log counts each such row as stale by every update since the read.
        """
        return self._staleness(ids, read_version, pulled, per_row=True)  # type: ignore[return-value]

    def largest_staleness(self, ids: np.ndarray, read_version: int, pulled: Pulled | None = None) -> int:
        """The largest of ``staleness(ids, read_version)``, without an array per id (0: none)."""
        return self._staleness(ids, read_version, pulled, per_row=False)  # type: ignore[return-value]

    def _staleness(self, ids: np.ndarray, read_version: int, pulled: Pulled | None, per_row: bool) -> np.ndarray | int | None:
        with self._lock:
            return self._count(ids, read_version, pulled, per_row)

    def _count(self, ids: np.ndarray, read_version: int, pulled: Pulled | None, per_row: bool) -> np.ndarray | int | None:
        """``_staleness``'s count; the caller holds the lock."""
        # Rows not there yet (-1) were never updated.
        slots = pulled.slots if pulled is not None and pulled.index is self._index else self._index.lookup(ids)
        return self._updates.count(slots, self._versions, self.version, read_version, per_row)

    def push(self, ids: np.ndarray, grads: torch.Tensor | np.ndarray, lr_scale: float | np.ndarray = 1.0, pulled: Pulled | None = None,
             combined: np.ndarray | torch.Tensor | None = None) -> int:
        """Apply row gradients with the table's optimizer; returns the new version.

        Gradients of ids that are not admitted (or do not fit in the capacity) are dropped and
        counted in ``dropped_rows``. ``grads``: a tensor, or float32 rows as ``part_rows`` gives
        them. ``pulled``: what ``pulled(ids)`` said, if the caller asked.
        ``lr_scale``: one factor for every row, or one per id (float64 array). ``combined``: a
        combined push's statistics per row (``push_hooks.apply_rows``; None: one gradient each).
        """
        with self._lock:
            return self._apply(ids, grads, lr_scale, pulled, combined)[0]

    def push_counted(self, ids: np.ndarray, grads: torch.Tensor | np.ndarray, lr_scale: float | np.ndarray, pulled: Pulled | None,
                     combined: np.ndarray | torch.Tensor | None, read_version: int, shown: int) -> tuple[int, int]:
        """``push``, and the largest staleness of ``ids`` since a read at ``read_version``
        (``largest_staleness`` just before the update), counted under the same hold of the lock,
        in the pass that logs the update: for a push that needs its staleness only to report it
        (no hard limit to check first).
        Where the table's updates since the read (which bound every row's) do not exceed
        ``shown``, the staleness the push has shown already, rows are not counted (0)."""
        with self._lock:
            count = bool(ids.size) and self.version - read_version > shown
            return self._apply(ids, grads, lr_scale, pulled, combined, read_version if count else None)

    def _apply(self, ids: np.ndarray, grads: torch.Tensor | np.ndarray, lr_scale: float | np.ndarray, pulled: Pulled | None,
               combined: np.ndarray | torch.Tensor | None, read_version: int | None = None) -> tuple[int, int]:
        """``push``'s update; the caller holds the lock. Returns the new version and, with
        ``read_version``, the largest staleness of the rows updated since that read
        (``largest_staleness`` just before; 0 without), counted as the update is logged."""
        opt = self.config.optimizer
        known = pulled is not None and pulled.index is self._index  # every id a row (``pulled``)
        slots = pulled.slots if known else self._resolve(ids)  # type: ignore[union-attr]
        keep = None if known else slots >= 0
        if keep is not None and not keep.all():
            dropped = int((~keep).sum())
            self.dropped_rows += dropped
            if self._on_drop is not None:
                self._on_drop(dropped)
            slots, grads = slots[keep], grads[keep if isinstance(grads, np.ndarray) else torch.from_numpy(keep)]
            combined = None if combined is None else stats_array(combined)[keep]
            if isinstance(lr_scale, np.ndarray):
                lr_scale = lr_scale[keep]
        # Ids are unique: each row and its state are updated in place, in one pass of the
        # rule's compiled row kernel (tether.rules.row_kernels), row by row with its own
        # learning rate (a combined push's in one pass of the rule's compiled combine, which
        # takes its rows of one gradient with the row kernel's step: push_hooks.apply_rows).
        if isinstance(lr_scale, np.ndarray):
            lr = (opt.lr * lr_scale).astype(np.float32)
        else:
            lr = self._rates(len(slots), opt.lr * lr_scale)
        grads_np = grads if isinstance(grads, np.ndarray) else np.ascontiguousarray(grads.detach().numpy(), np.float32)
        apply_rows(self._rule, opt, self._update_rows, *self._arrays, np.ascontiguousarray(slots, np.int64), grads_np, lr, combined)
        self.version += 1
        return self.version, self._updates.record(self.version, slots, self._versions, self._used, read_version)

    def _rates(self, n: int, rate: float) -> np.ndarray:
        """``n`` rows' learning rate, all ``rate`` (float32), in the table's reused array (the
        caller holds the lock; ``np.full`` costs a part more than the rest of its arrays)."""
        if len(self._lr_rows) < n:
            self._lr_rows = np.empty(max(n, 2 * len(self._lr_rows)), np.float32)
        lr = self._lr_rows[:n]
        lr.fill(rate)
        return lr

    def running_means(self, name: str, ids: np.ndarray, x: np.ndarray | None = None, decay: float = 0.95) -> np.ndarray:
        """A per-row running mean kept beside the rows for a push remedy (``push_hooks``: DC-ASGD-a's
        mean square of the gradient, gap-aware's size of one update), one float32 per id, -1 where
        none was taken yet. With ``x`` (one value per id) each row's mean takes it first
        (``push_hooks.running_mean``). Ids that are not rows get ``x`` (or -1) and keep nothing.
        A new row, an evicted row's slot and a restore start again at -1 (not checkpointed)."""
        with self._lock:
            cap = self._weights.shape[0]
            means = self._means.get(name)
            if means is None or len(means) < cap:
                grown = np.full(cap, -1, np.float32)
                if means is not None:
                    grown[: len(means)] = means
                means = self._means[name] = grown
            slots = self._index.lookup(np.ascontiguousarray(ids, np.int64))
            present = slots >= 0
            out = np.full(len(ids), -1, np.float32) if x is None else np.array(x, np.float32)
            if x is None:
                out[present] = means[slots[present]]
            else:
                out[present] = means[slots[present]] = running_mean(means[slots[present]], out[present], decay)
            return out

    def snapshot(self) -> dict[str, Any]:
        """Ids, rows, optimizer state and version, sorted by id (for checkpoints and tests)."""
        with self._lock:
            keys, slots = self._index.items()
            idx = torch.from_numpy(slots)
            return {
                "ids": keys,
                "weights": self._weights.index_select(0, idx),
                "state": {k: t.index_select(0, idx) for k, t in self._state.items()},
                "version": self.version,
            }

    def load(self, ids: np.ndarray, weights: torch.Tensor, state: dict[str, torch.Tensor], version: int) -> None:
        """Replace every row with restored ones (``ids`` sorted and unique, as ``snapshot`` gives).

        Raises:
            ValueError: shapes that do not fit the table, or missing optimizer state.
        """
        n = len(ids)
        if tuple(weights.shape) != (n, self.dim):
            raise ValueError(f"table {self.config.name!r}: restored rows have shape {tuple(weights.shape)}, expected ({n}, {self.dim})")
        if set(state) != set(self._state_shapes):
            raise ValueError(f"table {self.config.name!r}: restored optimizer state {sorted(state)} != {sorted(self._state_shapes)}")
        for k, shape in self._state_shapes.items():
            if tuple(state[k].shape) != (n, *shape):
                raise ValueError(f"table {self.config.name!r}: restored state {k!r} has shape {tuple(state[k].shape)}")
        if n > 1 and not np.all(np.diff(ids) > 0):
            raise ValueError(f"table {self.config.name!r}: restored ids must be sorted and unique")
        with self._lock:
            if self.capacity and n > self.capacity:
                # The checkpoint holds no recency: keep the first rows by id and count the rest.
                log.warning(
                    "table %s: %d restored rows exceed the capacity %d; evicting %d", self.config.name, n, self.capacity, n - self.capacity
                )
                self.evicted_rows += n - self.capacity
                if self._on_evict is not None:
                    self._on_evict(n - self.capacity)
                n = self.capacity
                ids, weights, state = ids[:n], weights[:n], {k: t[:n] for k, t in state.items()}
            cap = max(n, 1)
            self._set_rows(
                weights.to(torch.float32).clone().reshape(n, self.dim) if n else float_rows(cap, (self.dim,)),
                {k: (state[k].to(torch.float32).clone() if n else float_rows(cap, s)) for k, s in self._state_shapes.items()},
            )
            self._used = n
            self._free = np.empty(0, np.int64)
            if self._touched is not None:
                self._touched = np.zeros(max(n, 1), np.int64)
            index = IdIndex(max(n, 16))
            index.insert(np.ascontiguousarray(ids, dtype=np.int64), np.arange(n, dtype=np.int64))
            self._index = index
            # Restored rows were not updated since the restore, for any read.
            self._versions.reset(n, int(version))
            self._updates.clear()
            self._means = {}
            self.version = int(version)
