"""The row cache's push split by its rows' known shards (``RowCache._take``): the rows
``cache_batch.take_all`` takes, grouped per table by the shard each row's ``Table.shard`` column
names, so that ``Router.push_requests`` sends them as they are (``router.ShardedPart``): no id
hashed again, no row gathered. Compiled like the cache's other passes (``cache_batch.warm_up``
loads it)."""

from __future__ import annotations

import numpy as np

from tether.rules.kernel_cache import compiled

__all__ = ["by_shard"]

_jit = compiled()


@_jit
def by_shard(shards: np.ndarray, count: np.ndarray, num_shards: np.int64, ids: np.ndarray, sums: np.ndarray, stats: np.ndarray,
             dims: np.ndarray, kinds: np.ndarray) -> tuple[np.ndarray, ...]:
    """``take_all``'s rows (table g's ``count[g]`` rows one after another, in table order; its
    ``ids``, ``sums`` and ``stats``, rows of ``dims[g]`` and of as many columns as ``kinds[g]``
    names) grouped by their ``shards``. Returns per table the rows' positions in the table's part
    grouped by shard (shard order, each group in row order: ``protos.partition.split_ids``'s
    positions) and where each shard's group starts (``bounds[g, s]``; ``bounds[g, num_shards]``
    the table's count), and the ids, sums and statistics again in that order (each shard's rows
    one after another: what a push sends it)."""
    nt = len(count)
    bounds = np.zeros((nt, num_shards + 1), np.int64)
    order = np.empty(len(shards), np.int64)
    gids, gsums, gstats = np.empty_like(ids), np.empty_like(sums), np.empty_like(stats)
    at = flat = sflat = 0
    for t in range(nt):
        d = dims[t]
        k = 0
        for c in range(kinds.shape[1]):
            if kinds[t, c] >= 0:
                k += 1
        for r in range(at, at + count[t]):
            bounds[t, shards[r] + 1] += 1
        for s in range(num_shards):
            bounds[t, s + 1] += bounds[t, s]
        fill = bounds[t, :num_shards].copy()
        for r in range(at, at + count[t]):
            q = fill[shards[r]]
            fill[shards[r]] += 1
            order[at + q] = r - at
            gids[at + q] = ids[r]
            for j in range(d):
                gsums[flat + q * d + j] = sums[flat + (r - at) * d + j]
            for j in range(k):
                gstats[sflat + q * k + j] = stats[sflat + (r - at) * k + j]
        at, flat, sflat = at + count[t], flat + count[t] * d, sflat + count[t] * k
    return order, bounds, gids, gsums, gstats
