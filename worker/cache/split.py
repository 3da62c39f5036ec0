"""The row cache's splits by shard, so that the router hashes no id the cache has seen to:

- a push's (``RowCache._take``, ``pack_push``): the rows ``cache_batch.take_all`` takes, grouped
  per table by the shard each row's ``Table.shard`` column names and laid out as each shard's
  payload, so that ``Router.push_requests`` sends them as they are (``router.ShardedPart``,
  ``router.PackedPush``): no id hashed again, no row gathered, one payload part a shard;
- a pull's misses (``RowCache.plan``, ``group_ids``): grouped per table by the shard that owns
  each, in one compiled pass, the split ``Router.pull_requests`` takes as it is (``splits``).

Compiled like the cache's other passes (``cache_batch.warm_up`` loads them)."""

from __future__ import annotations

import numpy as np

from tether.rules.kernel_cache import compiled
from tether.worker.cache.kernels import copy_row, shard_of

__all__ = ["group_ids", "pack_push"]

_jit = compiled()


@_jit
def pack_push(shards: np.ndarray, count: np.ndarray, num_shards: np.int64, ids: np.ndarray, sums: np.ndarray, stats: np.ndarray,
              dims: np.ndarray, kinds: np.ndarray, combined: np.ndarray, align: np.int64) -> tuple[np.ndarray, ...]:
    """``take_all``'s rows (table g's ``count[g]`` rows one after another, in table order; its
    ``ids``, ``sums`` and ``stats``, rows of ``dims[g]`` and of as many columns as ``kinds[g]``
    names) grouped by their ``shards`` and laid out as each shard's push payload. Returns per
    table the rows' positions in the table's part grouped by shard (shard order, each group in
    row order: ``protos.partition.split_ids``'s positions) and where each shard's group starts
    (``bounds[g, s]``; ``bounds[g, num_shards]`` the table's count); the ids in that order (table
    by table, each shard's one after another); and ``payload``, float32, shard s's run at
    ``starts[s]:starts[s + 1]``: table by table (those with rows for it), the sums of its rows,
    then, where ``combined[g]``, their statistics, each block starting on a multiple of ``align``
    floats from the run's start (``framing.ALIGN``, as ``PayloadWriter.add`` places tensors one
    after another) with zeros between, at ``voff[g, s]`` and ``soff[g, s]`` floats into the run (-1:
    none); a run ends where its last block ends."""
    nt = len(count)
    bounds = np.zeros((nt, num_shards + 1), np.int64)
    order = np.empty(len(shards), np.int64)
    gids = np.empty_like(ids)
    nstats = np.zeros(nt, np.int64)
    for t in range(nt):
        for c in range(kinds.shape[1]):
            if kinds[t, c] >= 0:
                nstats[t] += 1
    at = 0
    for t in range(nt):
        for r in range(at, at + count[t]):
            bounds[t, shards[r] + 1] += 1
        for s in range(num_shards):
            bounds[t, s + 1] += bounds[t, s]
        at += count[t]
    # Each shard's run: its blocks' offsets, and where the runs start in the payload.
    voff = np.full((nt, num_shards), -1, np.int64)
    soff = np.full((nt, num_shards), -1, np.int64)
    starts = np.zeros(num_shards + 1, np.int64)
    base = 0
    for s in range(num_shards):
        starts[s] = base
        pos = 0
        for t in range(nt):
            n = bounds[t, s + 1] - bounds[t, s]
            if n == 0:
                continue
            pos = (pos + align - 1) // align * align
            voff[t, s] = pos
            pos += n * dims[t]
            if combined[t]:
                pos = (pos + align - 1) // align * align
                soff[t, s] = pos
                pos += n * nstats[t]
        base += pos
        starts[s + 1] = base
    # Every float is written below but the padding before a block: only that is zeroed (a
    # --preset gpu push's payload is ~18 MB, and zeroing it all first cost a pass over it).
    payload = np.empty(base, np.float32)
    for s in range(num_shards):
        pos = 0
        for t in range(nt):
            for off, n in ((voff[t, s], (bounds[t, s + 1] - bounds[t, s]) * dims[t]),
                           (soff[t, s], (bounds[t, s + 1] - bounds[t, s]) * nstats[t])):
                if off >= 0:
                    payload[starts[s] + pos: starts[s] + off] = 0.0
                    pos = off + n
    at = flat = sflat = 0
    for t in range(nt):
        d, k = dims[t], nstats[t]
        fill = bounds[t, :num_shards].copy()
        for r in range(at, at + count[t]):
            sh = shards[r]
            q = fill[sh]
            fill[sh] += 1
            order[at + q] = r - at
            gids[at + q] = ids[r]
            dst, src = starts[sh] + voff[t, sh] + (q - bounds[t, sh]) * d, flat + (r - at) * d
            copy_row(payload[dst: dst + d], sums[src: src + d])  # through slices: vectorised (``copy_row``)
            if combined[t]:
                dst, src = starts[sh] + soff[t, sh] + (q - bounds[t, sh]) * k, sflat + (r - at) * k
                copy_row(payload[dst: dst + k], stats[src: src + k])
        at, flat, sflat = at + count[t], flat + count[t] * d, sflat + count[t] * k
    return order, bounds, gids, payload, starts, voff, soff


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
