"""The push side of the worker row cache (``tether.worker.cache.row_cache.RowCache``): a step's
gradients held in the cached rows' pending sums, with the local rule's step on the cached rows
(``_hold``), and the sums that are due taken for a push in the layout the wire takes
(``_take``: one buffer of sums and one of a combined push's statistics, per-table views of
them), with the rows evicted or not cached (``accumulate``, ``row_slots.coalesce``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import numpy as np
import torch

from tether.worker.cache.batch import deltas_all, hold_all, take_all
from tether.worker.cache.kernels import Columns
from tether.worker.cache.parts import NO_ROWS, Pushed, RowCacheConfig, as_ids, offsets, read_versions
from tether.worker.cache.split import by_shard
from tether.worker.client.results import PullResult
from tether.worker.client.router import ShardedPart
from tether.worker.cache.slots import Due, Table, Taken, coalesce

__all__ = ["PushSide"]


class PushSide:
    """``RowCache``'s push side (its state is made by ``RowCache.__init__``)."""

    config: RowCacheConfig
    num_shards: int
    tables: dict[str, Table]
    _tabs: list[Table]
    _names: list[str]
    _dims: np.ndarray
    _dim_list: list[int]
    _kinds: np.ndarray
    _nstats: list[int]
    _holding: np.ndarray
    _local: np.ndarray
    _lock: threading.Lock
    _evicted: list[tuple[str, np.ndarray, torch.Tensor, np.ndarray, np.ndarray]]
    _queue: list[tuple[int, np.ndarray, np.ndarray]]
    _columns: Callable[[], Columns]
    _split: Callable[[list[str]], tuple[list[str], np.ndarray]]

    def accumulate(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], clock: int,
                   versions: PullResult | None, flush: bool = False) -> tuple[Pushed, dict[tuple[int, str], int]]:
        """Add a step's row gradients (pushed at ``clock``) to the pending sums and return what
        is due now (``flush``: everything held), with the read version per shard and table: per
        table ``(ids, sums)``, or ``(ids, sums, stats)`` where rows combine several gradients
        (``Table.combined``)."""
        due: Due = {}
        with self._lock:
            if grads:
                self._hold(grads, clock, versions, due)
            for t, e_ids, e_grads, e_shards, e_read in self._evicted:
                due.setdefault(t, []).append((e_ids, e_grads, e_shards, e_read))
            self._evicted.clear()
            taken, oldest = self._take(clock, flush)
        return coalesce(due, taken, oldest, self._names, self.tables)

    def _take(self, clock: int, flush: bool) -> tuple[dict[str, Taken], np.ndarray | None]:
        """The held sums due at ``clock`` (``flush``: every one), per table (``Taken``: ids, the
        push's part, whether the ids ascend, each row's two statistics columns), and the oldest
        read version per table and shard."""
        due = self._ready(clock, flush)
        if due is None:
            return {}, None
        tables, slots, since = due
        ids, sums, stats, square, grads, shards, count, ascending, many, oldest, _ = take_all(*self._columns(), tables, slots, since,
                                                                                           self.num_shards, self._kinds)
        return self._taken(ids, sums, stats, square, grads, shards, count, ascending, many), oldest

    def _ready(self, clock: int, flush: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The held rows due at ``clock`` (``flush``: every one), out of the queue: their tables,
        slots and first held clocks (``take_all`` takes those still held since then); None if none."""
        writes = self.config.writes
        ready = [e for e in self._queue if flush or clock - e[0] >= writes]
        if not ready:
            return None
        self._queue = [e for e in self._queue if not (flush or clock - e[0] >= writes)]
        slots = ready[0][1] if len(ready) == 1 else np.concatenate([e[1] for e in ready])
        tables = ready[0][2] if len(ready) == 1 else np.concatenate([e[2] for e in ready])
        since = np.concatenate([np.full(len(e[1]), e[0], np.int64) for e in ready])
        return tables, slots, since

    def _taken(self, ids: np.ndarray, sums: np.ndarray, stats: np.ndarray, square: np.ndarray, grads: np.ndarray, shards: np.ndarray,
               count: np.ndarray, ascending: np.ndarray, many: np.ndarray) -> dict[str, Taken]:
        """``take_all``'s rows per table as a push's parts (``Taken``), split by their known shards."""
        # The push's split, from the rows' known shards, and each shard's rows one after another.
        order, bounds, gids, gsums, gstats = by_shard(shards, count, self.num_shards, ids, sums, stats, self._dims, self._kinds)
        self._holding -= count
        out: dict[str, Taken] = {}
        at = flat = sflat = 0
        for g, n in enumerate(count.tolist()):
            if not n:
                continue
            d, k = self._dim_list[g], self._nstats[g]
            ids_g = ids[at: at + n]
            part: tuple[torch.Tensor, ...] = (torch.from_numpy(ids_g), torch.from_numpy(sums[flat: flat + n * d].reshape(n, d)))
            grouped: tuple[np.ndarray, ...] = (gids[at: at + n], gsums[flat: flat + n * d].reshape(n, d))
            if k and many[g]:
                part = (*part, torch.from_numpy(stats[sflat: sflat + n * k].reshape(n, k)))
                grouped = (*grouped, gstats[sflat: sflat + n * k].reshape(n, k))
            part = ShardedPart(part, order[at: at + n], bounds[g], grouped)
            out[self._names[g]] = Taken(ids_g, part, bool(ascending[g]), square[at: at + n], grads[at: at + n])
            at, flat, sflat = at + n, flat + n * d, sflat + n * k
        return out

    def _hold(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], clock: int, versions: PullResult | None, due: Due) -> None:
        """Add the step's gradients to their rows' pending sums and apply them to the cached rows
        by the tables' rules (rows not cached: due at once)."""
        names, parts = self._split(list(grads))
        arrays = [as_ids(grads[t][0]) for t in names]
        rows = [np.ascontiguousarray(grads[t][1].detach().float().numpy()) for t in names]
        ids = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        flat = rows[0].reshape(-1) if len(rows) == 1 else np.concatenate([r.reshape(-1) for r in rows])
        offs = offsets([len(a) for a in arrays])
        g_offs = offsets([r.size for r in rows])
        read = read_versions(versions, names, self.num_shards)
        local = self._local[parts]
        before = np.empty(len(flat), np.float32) if local.any() else NO_ROWS
        slots, where, first, missing, missing_shards, counts = hold_all(*self._columns(), parts, ids, offs, flat, g_offs, read, clock,
                                                                        self.num_shards, local, before)
        if len(first):
            self._holding[parts] += counts[:, 1]
            self._queue.append((clock, first, np.repeat(parts, counts[:, 1])))
        if len(missing):  # not cached (the table was full): pushed at once, each row one gradient
            self._unheld(names, offs, rows, ids, missing, missing_shards, read, due)
        if local.any():
            soffs = offsets(counts[:, 0])
            for k in np.flatnonzero(local).tolist():
                a, b = int(soffs[k]), int(soffs[k + 1])
                if a < b:
                    g = rows[k] if b - a == len(rows[k]) else rows[k][where[a:b] - offs[k]]
                    self._tabs[int(parts[k])].step(slots[a:b], g, clock)
            deltas_all(*self._columns(), parts, slots, soffs, before, g_offs, local)

    def _unheld(self, names: list[str], offs: np.ndarray, rows: list[np.ndarray], ids: np.ndarray, missing: np.ndarray,
                missing_shards: np.ndarray, read: np.ndarray, due: Due) -> None:
        """Gradients of rows not cached, due at once with their statistics (one gradient each)."""
        at = np.searchsorted(offs, missing, side="right") - 1
        for k in np.unique(at).tolist():
            mine = missing[at == k]
            g = rows[k][mine - offs[k]]
            extra = np.stack([(g * g).mean(1), np.ones(len(g), np.float32)], 1)
            shards = missing_shards[at == k]
            due.setdefault(names[k], []).append((ids[mine], torch.from_numpy(np.concatenate([g, extra], 1)), shards, read[k][shards]))
