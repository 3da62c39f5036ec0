"""The row cache's splits by shard, so that the router hashes no id the cache has seen to:

- a push's (``RowCache._take``, ``by_shard``): the rows ``cache_batch.take_all`` takes, grouped
  per table by the shard each row's ``Table.shard`` column names, so that
  ``Router.push_requests`` sends them as they are (``router.ShardedPart``): no id hashed again,
  no row gathered;
- a pull's misses (``RowCache.plan``, ``group_ids``): grouped per table by the shard that owns
  each, in one compiled pass, the split ``Router.pull_requests`` takes as it is (``splits``).

Compiled like the cache's other passes (``cache_batch.warm_up`` loads them)."""

from __future__ import annotations

import numpy as np

from tether.rules.kernel_cache import compiled
from tether.worker.cache.kernels import shard_of

__all__ = ["by_shard", "group_ids"]

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


@_jit
def group_ids(ids: np.ndarray, offs: np.ndarray, num_shards: np.int64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A pull's ids (part k's ``ids[offs[k]:offs[k + 1]]``) grouped by the shard that owns each
    (``kernels.shard_of``: ``protos.partition.shard_of_ids``'s hash): per part the positions in
    the part grouped by shard (shard order, each group in position order: ``split_ids``'
    positions), where each shard's group starts (``bounds[k, s]``; ``bounds[k, num_shards]``
    the part's count), and the ids in that order (``split_ids``' ids, one group after another)."""
    nparts = len(offs) - 1
    bounds = np.zeros((nparts, num_shards + 1), np.int64)
    owner = np.empty(len(ids), np.int64)
    order = np.empty(len(ids), np.int64)
    grouped = np.empty(len(ids), np.int64)
    for k in range(nparts):
        for i in range(offs[k], offs[k + 1]):
            s = shard_of(ids[i], num_shards)
            owner[i] = s
            bounds[k, s + 1] += 1
        for s in range(num_shards):
            bounds[k, s + 1] += bounds[k, s]
        fill = bounds[k, :num_shards].copy()
        for i in range(offs[k], offs[k + 1]):
            q = offs[k] + fill[owner[i]]
            fill[owner[i]] += 1
            order[q] = i - offs[k]
            grouped[q] = ids[i]
    return order, bounds, grouped
