"""Parameter storage of one shard: embedding tables and dense chunks.

Embedding rows live in one contiguous tensor per table (plus one per optimizer state), and
ids map to row slots through a vectorised hash index (``tether.server.index``): no Python
object per row and no Python loop over ids. Updates to one table are applied in a
short vectorised critical section (gather, update, scatter) under that table's own lock, so
concurrent pushes never lose an update while pushes to other tables and dense chunks, and all
pulls, go on in parallel (pulls of an unbounded table read without a lock, Hogwild-style).

A table may be bounded (``TableConfig.capacity``): when a new row would not fit, the least
recently touched rows are evicted in one batch (``numpy.argpartition`` over last-touch ticks)
(tombstoned in the index) and their slots reused. Admission (``TableConfig.min_count``) keeps ids that were seen fewer
than N times out of the table altogether; their counts live in a fixed-size count-min sketch.
"""

from __future__ import annotations

import functools
import logging
import threading
import zlib
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from tether.protos.errors import InvalidArgument
from tether.protos.partition import mix64, mix64_
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.index import IdIndex
from tether.server.optimizers import state_shapes, step

__all__ = ["CountMinSketch", "DenseChunk", "EmbeddingTable", "Pulled", "TableConfig", "init_rows"]

log = logging.getLogger(__name__)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_GROWTH = 1.5
# An empty table starts with at most this many bytes of rows, whatever its dim.
_INITIAL_BYTES = 4 << 20
# Evict at least this fraction of the capacity at once, so the O(rows) selection runs rarely.
_EVICT_BATCH = 1 / 16
# Pulls remembered for the pushes that follow (a few per worker) and the largest one kept.
_RECENT_PULLS = 16
_RECENT_MAX_IDS = 1 << 16
# The last updates' row slots, kept to count how many updates each row of a push missed since
# its read (per-row staleness): at most this many updates and this many slots in all. A read
# older than the log counts each row updated since as stale by the whole table's updates.
_LOG_UPDATES = 256
_LOG_SLOTS = 1 << 21


def init_rows(ids: np.ndarray, dim: int, seed: int, table: str, scale: float, out: np.ndarray | None = None) -> torch.Tensor:
    """Deterministic initial rows, uniform in [-scale, scale), from (seed, table, id) alone.

    ``out``: a float32 ``[len(ids), dim]`` array to write them into (returned as a tensor view).
    """
    base = mix64_(ids.astype(np.int64, copy=False).view(np.uint64) ^ _salt(seed, table))
    h = mix64_(base[:, None] + _column_steps(dim))
    h >>= np.uint64(40)
    # h < 2**24, exactly representable: u = h * 2 * scale / 2**24 - scale.
    u = np.multiply(h, np.float32(2 * scale / (1 << 24)), out=out, dtype=np.float32, casting="unsafe")
    u -= np.float32(scale)
    return torch.from_numpy(u)


@functools.lru_cache(maxsize=256)
def _salt(seed: int, table: str) -> np.uint64:
    return np.uint64((zlib.crc32(table.encode()) << 32) ^ (seed & 0xFFFFFFFF))


@functools.lru_cache(maxsize=64)
def _column_steps(dim: int) -> np.ndarray:
    steps = np.arange(1, dim + 1, dtype=np.uint64)[None, :] * _GOLDEN
    steps.flags.writeable = False
    return steps


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


def _sketch_width(capacity: int) -> int:
    """Counters per sketch row: ~8 per resident row, 4K..4M (a power of two)."""
    want = 8 * capacity if capacity else 1 << 20
    return 1 << int(min(max(want, 1 << 12), 1 << 22) - 1).bit_length()


class Pulled(NamedTuple):
    """Slots a recent pull found for a push's ids (``EmbeddingTable.pulled``)."""

    index: IdIndex
    slots: np.ndarray
    unique: bool


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
        self._state_shapes = state_shapes(config.optimizer, config.dim)
        # Slots handed out so far; a slot below this is a row or sits in the free list.
        self._used = 0
        self._free = np.empty(0, np.int64)
        cap = max(1, min(initial_capacity, max(16, _INITIAL_BYTES // (4 * config.dim))))
        if self.capacity:
            cap = min(cap, self.capacity)
        self._index = IdIndex(cap)
        self._weights = torch.empty(cap, config.dim)
        self._state = {k: torch.zeros(cap, *s) for k, s in self._state_shapes.items()}
        # Bounded tables reuse slots, so a lock-free reader could read a slot after it was
        # given to another id: they read under the lock, and track last touches for LRU.
        self._locked_reads = self.capacity > 0
        self._tick = 0
        self._touched = np.zeros(cap, np.int64) if self.capacity else None
        self._sketch = CountMinSketch(_sketch_width(self.capacity), seed=config.seed) if config.min_count > 1 else None
        # (index, ids, slots) of the last pulls, for the pushes that follow them: only where a
        # row's slot never changes once it exists (no capacity, no admission).
        self._recent: deque[tuple[IdIndex, np.ndarray, np.ndarray]] | None = (
            deque(maxlen=_RECENT_PULLS) if not self.capacity and self._sketch is None else None
        )
        # Scratch for the uniqueness check of ``pulled`` (one int32 per row, under the lock).
        self._marks = np.zeros(0, np.int32)
        # Per-row staleness: the table version of each row's last update, and the slots of the
        # last updates (version, slots), oldest first; ``_hits`` is scratch for counting them.
        self._row_version = np.zeros(cap, np.int64)
        self._log: deque[tuple[int, np.ndarray]] = deque()
        self._log_slots = 0
        self._hits = np.zeros(0, np.int32)

    @property
    def rows(self) -> int:
        """Number of resident rows."""
        return self._index.size

    @property
    def memory_bytes(self) -> int:
        """Bytes held by rows, optimizer state, the id index and the LRU/admission bookkeeping."""
        total = self._weights.nbytes + self._index.nbytes + self._free.nbytes
        if self._touched is not None:
            total += self._touched.nbytes
        if self._sketch is not None:
            total += self._sketch.nbytes
        return total + sum(t.nbytes for t in self._state.values())

    def _grow(self, need: int) -> None:
        cap = self._weights.shape[0]
        if need <= cap:
            return
        new_cap = max(need, int(cap * _GROWTH) + 1)
        if self.capacity:
            new_cap = max(need, min(new_cap, self.capacity))
        n = self._used
        w = torch.empty(new_cap, self.dim)
        w[:n] = self._weights[:n]
        state = {}
        for k, s in self._state_shapes.items():
            t = torch.zeros(new_cap, *s)
            t[:n] = self._state[k][:n]
            state[k] = t
        if self._touched is not None:
            touched = np.zeros(new_cap, np.int64)
            touched[:n] = self._touched[:n]
            self._touched = touched
        row_version = np.zeros(new_cap, np.int64)
        row_version[:n] = self._row_version[:n]
        self._row_version = row_version
        self._weights, self._state = w, state

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
        slots = self._alloc(k)
        cfg = self.config
        # New slots are usually the next ``k`` in order: the rows are written in place there.
        rows = slice(start, start + k) if k and slots[0] == start and slots[-1] == start + k - 1 else slots
        weights = self._weights.numpy()
        if isinstance(rows, slice):
            init_rows(new_ids, self.dim, cfg.seed, cfg.name, cfg.init_scale, out=weights[rows])
        else:
            weights[rows] = init_rows(new_ids, self.dim, cfg.seed, cfg.name, cfg.init_scale).numpy()
        for name, t in self._state.items():
            # A reused slot still holds the evicted row's state.
            t.numpy()[rows] = cfg.optimizer.initial_accumulator if name == "sum" else 0.0
        if self._touched is not None:
            self._touched[slots] = self._tick
        # A reused slot's updates were the evicted row's: the new row was never updated.
        self._row_version[slots] = 0
        self._index.insert(new_ids, slots)
        return slots

    def _evict(self, want: int) -> int:
        """Evict up to ``want`` least recently touched rows not touched by the current call."""
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
        """Row slots of ``ids`` (non-negative int64), creating missing rows (-1: not admitted)."""
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
        if self._recent is None:
            # Admission may have left ids out: they get their initial rows.
            return self._gather(ids, slots), None, version
        # Every id of a table that keeps recent pulls is a row by now (no admission, no capacity).
        if len(ids) <= _RECENT_MAX_IDS:
            self._recent.append((index, ids.copy(), slots))
        return self._weights, torch.from_numpy(slots), version

    def _recent_slots(self, ids: np.ndarray) -> np.ndarray | None:
        """Slots of ``ids`` if a recent pull named exactly these ids (a push's ids are usually
        those of its step's pull). Only tables that never move or drop rows keep this. The
        array is shared with the cache: callers only read it."""
        if self._recent is None:
            return None
        for index, seen, slots in reversed(list(self._recent)):
            if index is self._index and len(seen) == len(ids) and np.array_equal(seen, ids):
                return slots
        return None

    def pulled(self, ids: np.ndarray) -> Pulled | None:
        """If a recent pull named exactly ``ids``: their slots, and whether they are unique.

        Such ids passed a pull's checks (non-negative, owned by this shard), so a push of them
        needs only the uniqueness check, which on slots is two vectorised passes, not a sort.
        """
        if self._recent is None:
            return None
        with self._lock:
            slots = self._recent_slots(ids)
            if slots is None:
                return None
            if len(self._marks) < self._weights.shape[0]:
                self._marks = np.zeros(self._weights.shape[0], np.int32)
            # Write each slot's position, read them back: a slot named twice keeps only its
            # last position, so an earlier one reads back different.
            order = np.arange(len(slots), dtype=np.int32)
            self._marks[slots] = order
            unique = bool(np.array_equal(self._marks[slots], order))
            return Pulled(self._index, slots, unique)

    def staleness(self, ids: np.ndarray, read_version: int, pulled: Pulled | None = None) -> np.ndarray | None:
        """How many updates each row of ``ids`` received since a read at table version
        ``read_version`` (int64 per id); None when no row was updated since (all zero).

        Only rows newer than the read are counted, over the log of the last updates; a read
        older than that log counts each such row as stale by every update since the read.
        """
        return self._staleness(ids, read_version, pulled, per_row=True)  # type: ignore[return-value]

    def max_staleness(self, ids: np.ndarray, read_version: int, pulled: Pulled | None = None) -> int:
        """The largest of ``staleness(ids, read_version)``, without an array per id (0: none)."""
        return self._staleness(ids, read_version, pulled, per_row=False)  # type: ignore[return-value]

    def _staleness(self, ids: np.ndarray, read_version: int, pulled: Pulled | None, per_row: bool) -> np.ndarray | int | None:
        with self._lock:
            slots = pulled.slots if pulled is not None and pulled.index is self._index else self._recent_slots(ids)
            present = None
            if slots is None:
                slots = self._index.lookup(ids)
                present = slots >= 0
                if present.all():
                    present = None
                else:  # rows not there yet were never updated
                    slots = np.where(present, slots, 0)
            newer = self._row_version[slots] > read_version
            if present is not None:
                newer &= present
            if not newer.any():
                return None if per_row else 0
            log = self._log
            if not log or log[0][0] > read_version + 1:
                if not per_row:
                    return self.version - read_version
                return np.where(newer, self.version - read_version, 0).astype(np.int64)
            if len(self._hits) < self._weights.shape[0]:
                self._hits = np.zeros(self._weights.shape[0], np.int32)
            hits = self._hits
            since = []
            for version, updated in reversed(log):
                if version <= read_version:
                    break
                since.append(updated)
            for updated in since:
                hits[updated] += 1
            counted = hits[slots[newer]]
            for updated in since:
                hits[updated] = 0
            if not per_row:
                return int(counted.max())
            out = np.zeros(len(slots), np.int64)
            out[newer] = counted
            return out

    def push(
        self, ids: np.ndarray, grads: torch.Tensor, lr_scale: float | np.ndarray = 1.0, pulled: Pulled | None = None
    ) -> int:
        """Apply row gradients with the table's optimizer; returns the new version.

        Gradients of ids that are not admitted (or do not fit in the capacity) are dropped and
        counted in ``dropped_rows``. ``pulled``: what ``pulled(ids)`` said, if the caller asked.
        ``lr_scale``: one factor for every row, or one per id (float64 array).
        """
        opt = self.config.optimizer
        with self._lock:
            slots = pulled.slots if pulled is not None and pulled.index is self._index else self._recent_slots(ids)
            if slots is None:
                slots = self._resolve(ids)
            keep = slots >= 0
            if not keep.all():
                dropped = int((~keep).sum())
                self.dropped_rows += dropped
                if self._on_drop is not None:
                    self._on_drop(dropped)
                slots, grads = slots[keep], grads[torch.from_numpy(keep)]
                if isinstance(lr_scale, np.ndarray):
                    lr_scale = lr_scale[keep]
            # Ids are unique: gather the rows, update them, scatter them back (for SGD too, where
            # this beats index_add_ by ~20%).
            idx = torch.from_numpy(slots)
            w = self._weights.index_select(0, idx)
            state = {k: t.index_select(0, idx) for k, t in self._state.items()}
            if isinstance(lr_scale, np.ndarray):
                # Per-row factors: every rule's step is linear in the learning rate and its state
                # does not depend on it, so a row's step scaled afterwards is the scaled rule.
                scaled = torch.from_numpy(np.flatnonzero(lr_scale != 1.0))
                before = w.index_select(0, scaled)
                step(opt, w, grads, state, 1.0)
                factor = torch.from_numpy(lr_scale[scaled.numpy()].astype(np.float32))[:, None]
                w[scaled] = before + (w.index_select(0, scaled) - before) * factor
            else:
                step(opt, w, grads, state, lr_scale)
            # NumPy scatters rows 2-3x faster than index_copy_ (a memcpy per row, not per
            # element); it holds the GIL for those few tens of microseconds.
            self._weights.numpy()[slots] = w.numpy()
            for k, t in state.items():
                self._state[k].numpy()[slots] = t.numpy()
            self.version += 1
            self._row_version[slots] = self.version
            self._log.append((self.version, slots))
            self._log_slots += len(slots)
            while len(self._log) > _LOG_UPDATES or self._log_slots > _LOG_SLOTS:
                self._log_slots -= len(self._log.popleft()[1])
            return self.version

    def snapshot(self) -> dict[str, object]:
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
                log.warning("table %s: %d restored rows exceed the capacity %d; evicting %d", self.config.name, n, self.capacity, n - self.capacity)
                self.evicted_rows += n - self.capacity
                if self._on_evict is not None:
                    self._on_evict(n - self.capacity)
                n = self.capacity
                ids, weights, state = ids[:n], weights[:n], {k: t[:n] for k, t in state.items()}
            cap = max(n, 1)
            self._weights = weights.to(torch.float32).clone().reshape(n, self.dim) if n else torch.empty(cap, self.dim)
            self._state = {
                k: (state[k].to(torch.float32).clone() if n else torch.zeros(cap, *s)) for k, s in self._state_shapes.items()
            }
            self._used = n
            self._free = np.empty(0, np.int64)
            if self._touched is not None:
                self._touched = np.zeros(max(n, 1), np.int64)
            index = IdIndex(max(2 * n, 16))
            index.insert(np.ascontiguousarray(ids, dtype=np.int64), np.arange(n, dtype=np.int64))
            self._index = index
            if self._recent is not None:
                self._recent.clear()
            self._row_version = np.zeros(max(n, 1), np.int64)
            self._log.clear()
            self._log_slots = 0
            self.version = int(version)


class DenseChunk:
    """One chunk of a dense parameter (flat float32) and its optimizer state."""

    def __init__(self, name: str, index: int, init: torch.Tensor, optimizer: OptimizerConfig) -> None:
        if init.dim() != 1 or init.numel() == 0:
            raise InvalidArgument(f"dense chunk {name}[{index}] must be a non-empty 1-D tensor, got shape {tuple(init.shape)}")
        self.name = name
        self.index = index
        self.optimizer = optimizer
        self.value = init.to(torch.float32).clone()
        self.version = 0
        self._lock = threading.Lock()
        # Per-element state; Adam's step count is one scalar for the whole chunk.
        self._state = {k: torch.zeros(() if k == "t" else init.numel()) for k in state_shapes(optimizer, 1)}

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.value.numel()

    def pull(self) -> tuple[torch.Tensor, int]:
        """The chunk's values (read without a lock) and their version."""
        return self.value, self.version

    def push(self, grad: torch.Tensor, lr_scale: float = 1.0) -> int:
        """Apply a gradient with the chunk's optimizer; returns the new version."""
        with self._lock:
            step(self.optimizer, self.value, grad, self._state, lr_scale)
            self.version += 1
            return self.version

    def snapshot(self) -> dict[str, object]:
        """Value, optimizer state and version (copies)."""
        with self._lock:
            return {"value": self.value.clone(), "state": {k: t.clone() for k, t in self._state.items()}, "version": self.version}

    def load(self, value: torch.Tensor, state: dict[str, torch.Tensor], version: int) -> None:
        """Replace value, optimizer state and version with restored ones.

        Raises:
            ValueError: a value or state of another shape.
        """
        if tuple(value.shape) != (self.numel,):
            raise ValueError(f"dense chunk {self.name}[{self.index}]: restored value has shape {tuple(value.shape)}, expected ({self.numel},)")
        if set(state) != set(self._state) or any(state[k].shape != t.shape for k, t in self._state.items()):
            raise ValueError(f"dense chunk {self.name}[{self.index}]: restored optimizer state does not match {self.optimizer.name}")
        with self._lock:
            self.value = value.to(torch.float32).clone()
            self._state = {k: t.to(torch.float32).clone() for k, t in state.items()}
            self.version = int(version)
