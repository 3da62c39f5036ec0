"""The worker row cache's per-step passes, compiled (numba): one call per table per operation
instead of a dozen numpy calls each (``tether.worker.row_cache`` and ``row_slots``).

- ``plan_rows``: look a pull's ids up, mark them used, and split them into hits (their values,
  read versions and shards gathered), rows an earlier pull in flight is refreshing, and misses;
- ``store_rows``: write pulled rows into their slots (values, read clock, shard, read version),
  answering which ids have no slot yet;
- ``hold_rows``: add a step's gradients to the held sums, noting each row's first held clock and
  oldest read version, answering which ids are not cached;
- ``take_rows``: gather the held sums that are due and clear them;
- ``assemble``: the hits' rows of a pull's answer (``store_rows`` writes the pulled ones);
- ``oldest_per_shard``: the oldest read version per shard.

The id index they probe is the shard's (``tether.server.kernels``); these kernels only read it.
Compiled on first use and cached on disk like the shard's (``row_slots.warm_up`` loads them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from tether.server.kernels import EMPTY_SLOT, mix64

__all__ = ["add_deltas", "assemble", "gather_rows", "hold_rows", "later_rows", "oldest_per_shard", "place_rows", "plan_rows",
           "store_rows", "take_rows", "warm_up"]

log = logging.getLogger(__name__)


def _compiled(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=True, nogil=True)``, in memory only (one warning) where no disk cache
    location is writable, as the shard's kernels."""

    def decorate(fn: Callable[..., Any]) -> Any:
        try:
            return numba.njit(cache=True, nogil=True, **options)(fn)
        except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available"
            log.warning("row cache kernel %s is not cached on disk (%s)", fn.__name__, exc)
            return numba.njit(cache=False, nogil=True, **options)(fn)

    return decorate


_jit = _compiled()
_NONE = np.iinfo(np.int64).max


@_compiled(inline="always")
def _slot(cells: np.ndarray, key: np.int64) -> np.int64:
    """The slot of ``key`` in the index, -1 where absent (``server.kernels.index_lookup``'s probe)."""
    mask = np.uint64(len(cells) - 1)
    p = np.int64(mix64(key) & mask)
    while True:
        s = cells[p, 1]
        if s == EMPTY_SLOT:
            return np.int64(-1)
        if s >= 0 and cells[p, 0] == key:
            return s
        p = (p + 1) & np.int64(mask)


@_compiled(inline="always")
def _shard(key: np.int64, num_shards: np.int64) -> np.int64:
    """``protos.partition.shard_of_ids`` for one id: ``mix64(id) % num_shards``."""
    if num_shards == 1:
        return np.int64(0)
    return np.int64(mix64(key) % np.uint64(num_shards))


@_jit
def plan_rows(cells: np.ndarray, ids: np.ndarray, now: np.int64, bound: np.int64, read_clock: np.ndarray, last_used: np.ndarray,
              uses: np.ndarray, read_version: np.ndarray, shard: np.ndarray, values: np.ndarray, inflight: np.ndarray,
              offsets: np.ndarray, held: np.ndarray, fresh: np.ndarray) -> tuple[Any, ...]:
    """Split sorted unique ``ids`` at clock ``now``: (positions of the hits, their values, read
    versions and shards, positions of ids an in-flight pull refreshes (``inflight``: those pulls'
    sorted ids, one after another, ``offsets`` where each starts, with the end last), positions
    of the misses, and how many misses were cached rows). Cached ids are marked used at ``now``;
    a cached row pulled again starts its ``fresh`` local changes from its ``held`` ones (what the
    answer will lack)."""
    n = len(ids)
    code = np.zeros(n, np.int8)  # 0 miss, 1 hit, 2 later
    slots = np.empty(n, np.int64)
    nhit = 0
    nlater = 0
    refreshed = 0
    for i in range(n):
        key = ids[i]
        s = _slot(cells, key)
        slots[i] = s
        if s >= 0:
            last_used[s] = now
            uses[s] += 1
            if bound > 0 and now - read_clock[s] <= bound:
                code[i] = 1
                nhit += 1
                continue
        if bound > 0:
            for k in range(len(offsets) - 1):
                a, b = offsets[k], offsets[k + 1]
                if a < b:
                    j = a + np.searchsorted(inflight[a:b], key)
                    if j < b and inflight[j] == key:
                        code[i] = 2
                        nlater += 1
                        break
        if code[i] == 0 and s >= 0:
            refreshed += 1
            fresh[s, :] = held[s, :]
    dim = values.shape[1]
    hit_pos = np.empty(nhit, np.int64)
    hit_values = np.empty((nhit, dim), np.float32)
    hit_versions = np.empty(nhit, np.int64)
    hit_shards = np.empty(nhit, np.int64)
    later_pos = np.empty(nlater, np.int64)
    miss_pos = np.empty(n - nhit - nlater, np.int64)
    h = m = lt = 0
    for i in range(n):
        c = code[i]
        if c == 1:
            s = slots[i]
            hit_pos[h] = i
            hit_values[h, :] = values[s, :]
            hit_versions[h] = read_version[s]
            hit_shards[h] = shard[s]
            h += 1
        elif c == 2:
            later_pos[lt] = i
            lt += 1
        else:
            miss_pos[m] = i
            m += 1
    return hit_pos, hit_values, hit_versions, hit_shards, later_pos, miss_pos, np.int64(refreshed)


@_jit
def store_rows(cells: np.ndarray, ids: np.ndarray, got: np.ndarray, values: np.ndarray, read_clock: np.ndarray, shard: np.ndarray,
               read_version: np.ndarray, versions: np.ndarray, now: np.int64, num_shards: np.int64, fresh: np.ndarray,
               out: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Write pulled rows ``got`` (one per id) into the slots of their cached ``ids``: values (plus
    the row's ``fresh`` local changes, which the shard's answer lacks), read clock ``now``, shard
    and that shard's table version (``versions``); row ``pos[i]`` of the pull's answer ``out`` is
    id ``i``'s row as stored (as pulled where it has no slot). Returns the positions of the ids
    with no slot."""
    n = len(ids)
    missing = np.empty(n, np.int64)
    k = 0
    dim = values.shape[1]
    for i in range(n):
        s = _slot(cells, ids[i])
        if s < 0:
            out[pos[i], :] = got[i, :]
            missing[k] = i
            k += 1
            continue
        for j in range(dim):
            values[s, j] = got[i, j] + fresh[s, j]
            out[pos[i], j] = values[s, j]
        read_clock[s] = now
        sh = _shard(ids[i], num_shards)
        shard[s] = sh
        read_version[s] = versions[sh]
    return missing[:k]


@_jit
def hold_rows(cells: np.ndarray, ids: np.ndarray, g: np.ndarray, pending: np.ndarray, pending_since: np.ndarray,
              pending_version: np.ndarray, shard: np.ndarray, versions: np.ndarray, clock: np.int64,
              num_shards: np.int64) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Add gradient rows ``g`` to the held sums of the cached ``ids`` (their oldest read version
    the minimum with ``versions`` of their shard); ``pending``'s two columns past ``g``'s hold each
    row's sum of mean(g * g) and its count of gradients (a combined push's statistics). Returns (the slots of the cached ids, their
    positions, the slots first held now, the positions of the ids not cached, and those ids'
    shards)."""
    n = len(ids)
    slots = np.empty(n, np.int64)
    pos = np.empty(n, np.int64)
    first = np.empty(n, np.int64)
    missing = np.empty(n, np.int64)
    missing_shards = np.empty(n, np.int64)
    c = f = k = 0
    dim = g.shape[1]
    for i in range(n):
        s = _slot(cells, ids[i])
        if s < 0:
            missing[k] = i
            missing_shards[k] = _shard(ids[i], num_shards)
            k += 1
            continue
        slots[c] = s
        pos[c] = i
        c += 1
        square = np.float32(0.0)
        for j in range(dim):
            pending[s, j] += g[i, j]
            square += g[i, j] * g[i, j]
        pending[s, dim] += square / np.float32(dim)
        pending[s, dim + 1] += np.float32(1.0)
        if pending_since[s] == _NONE:
            pending_since[s] = clock
            first[f] = s
            f += 1
        v = versions[shard[s]]
        if v < pending_version[s]:
            pending_version[s] = v
    return slots[:c], pos[:c], first[:f], missing[:k], missing_shards[:k]


@_jit
def take_rows(slots: np.ndarray, ids: np.ndarray, pending: np.ndarray, shard: np.ndarray, pending_since: np.ndarray,
              pending_version: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ids, held sums (with their statistics columns), shards and oldest read versions of
    ``slots``, which stop holding (and whose ``held`` local changes are now the shard's too)."""
    n = len(slots)
    dim = pending.shape[1]
    width = held.shape[1]
    out_ids = np.empty(n, np.int64)
    out_g = np.empty((n, dim), np.float32)
    out_shards = np.empty(n, np.int64)
    out_versions = np.empty(n, np.int64)
    for i in range(n):
        s = slots[i]
        out_ids[i] = ids[s]
        out_shards[i] = shard[s]
        out_versions[i] = pending_version[s]
        for j in range(dim):
            out_g[i, j] = pending[s, j]
            pending[s, j] = 0.0
        for j in range(width):
            held[s, j] = 0.0
        pending_since[s] = _NONE
        pending_version[s] = _NONE
    return out_ids, out_g, out_shards, out_versions


@_jit
def assemble(out: np.ndarray, hit_pos: np.ndarray, hit_values: np.ndarray) -> None:
    """Rows ``hit_pos`` of ``out`` from ``hit_values``."""
    for i in range(len(hit_pos)):
        out[hit_pos[i], :] = hit_values[i, :]


@_jit
def oldest_per_shard(shards: np.ndarray, versions: np.ndarray, num_shards: np.int64) -> np.ndarray:
    """The smallest of ``versions`` per shard (int64 max where a shard has none)."""
    out = np.full(num_shards, _NONE, np.int64)
    for i in range(len(shards)):
        if versions[i] < out[shards[i]]:
            out[shards[i]] = versions[i]
    return out


def warm_up() -> None:
    """Load (or compile, the first time) every kernel here for the types the cache passes."""
    cells = np.full((16, 2), EMPTY_SLOT, np.int64)
    ids = np.zeros(0, np.int64)
    i64, f32 = np.zeros(1, np.int64), np.zeros((1, 1), np.float32)
    zero = np.int64(0)
    plan_rows(cells, ids, zero, zero, i64, i64, i64, i64, i64, f32, ids, np.zeros(1, np.int64), f32, f32)
    store_rows(cells, ids, f32[:0], f32, i64, i64, i64, i64, zero, np.int64(1), f32, f32, ids)
    hold_rows(cells, ids, f32[:0], f32, i64, i64, i64, i64, zero, np.int64(1))
    take_rows(ids, i64, f32, i64, i64, i64, f32)
    add_deltas(f32, f32[:0], ids, f32, f32)
    gather_rows(f32, ids)
    later_rows(cells, ids, ids, zero, f32, i64, i64, i64, f32)
    place_rows(ids, ids, zero, i64, np.zeros(1, np.bool_), i64, i64, i64, i64, i64, i64, f32, f32, f32, zero)
    assemble(f32, ids, f32[:0])
    oldest_per_shard(ids, ids, np.int64(1))


@_jit
def add_deltas(values: np.ndarray, before: np.ndarray, slots: np.ndarray, held: np.ndarray, fresh: np.ndarray) -> None:
    """After a local step of rows ``slots`` (``before``: their values before it): add each row's
    change to its ``held`` and ``fresh`` sums of local changes."""
    dim = values.shape[1]
    for i in range(len(slots)):
        s = slots[i]
        for j in range(dim):
            d = values[s, j] - before[i, j]
            held[s, j] += d
            fresh[s, j] += d


@_jit
def later_rows(cells: np.ndarray, ids: np.ndarray, pos: np.ndarray, min_clock: np.int64, values: np.ndarray, read_clock: np.ndarray,
               read_version: np.ndarray, shard: np.ndarray, out: np.ndarray) -> tuple[Any, ...]:
    """Rows ``pos`` of ``out`` for ``ids`` that another pull was refreshing: from the cache where
    it holds them read at ``min_clock`` or later. Returns (the positions in ``ids`` of the others,
    the read versions and shards of those answered)."""
    n = len(ids)
    lacking = np.empty(n, np.int64)
    versions = np.empty(n, np.int64)
    shards = np.empty(n, np.int64)
    k = a = 0
    for i in range(n):
        s = _slot(cells, ids[i])
        if s >= 0 and read_clock[s] >= min_clock:
            out[pos[i], :] = values[s, :]
            versions[a] = read_version[s]
            shards[a] = shard[s]
            a += 1
        else:
            lacking[k] = i
            k += 1
    return lacking[:k], versions[:a], shards[:a]


@_jit
def place_rows(slots: np.ndarray, ids: np.ndarray, now: np.int64, ids_col: np.ndarray, used: np.ndarray, uses: np.ndarray,
               last_used: np.ndarray, pending_since: np.ndarray, pending_version: np.ndarray, read_clock: np.ndarray,
               read_version: np.ndarray, pend: np.ndarray, mine: np.ndarray, fresh: np.ndarray, stale: np.int64) -> None:
    """Every column of new rows ``ids`` in ``slots``: used once at ``now``, nothing held, never
    read (``stale``), no local changes."""
    dim = mine.shape[1]
    for i in range(len(slots)):
        s = slots[i]
        ids_col[s] = ids[i]
        used[s] = True
        uses[s] = 1
        last_used[s] = now
        pending_since[s] = _NONE
        pending_version[s] = _NONE
        read_clock[s] = stale
        read_version[s] = _NONE
        for j in range(pend.shape[1]):
            pend[s, j] = 0.0
        for j in range(dim):
            mine[s, j] = 0.0
            fresh[s, j] = 0.0


@_jit
def gather_rows(values: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Rows ``slots`` of ``values``, copied."""
    out = np.empty((len(slots), values.shape[1]), np.float32)
    for i in range(len(slots)):
        out[i, :] = values[slots[i], :]
    return out
