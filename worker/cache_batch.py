"""The worker row cache's per-step passes over ALL its tables at once, compiled (numba): one call
per operation and step, whatever the number of tables (``tether.worker.row_cache``).

Every table's columns are in numba typed lists (``Columns``: one list per column, table ``g`` at
index ``g``), so a pass reaches any table's arrays. A step's ids of several tables travel as one
int64 array, the tables' ids one after another in table order, with ``offs`` (where each
table's ids start, the end last) and ``tidx`` (the table of each part); rows of floats of
several tables (a pull's answer, gradients) as one flat float32 array with ``row_offs``
(where each table's rows start in it) and each table's ``dims``.

- ``plan_all``: look a pull's ids up, mark them used, copy the hits' rows into the answer, and
  code each id: a hit (1), a row an earlier pull in flight refreshes (2), or a miss (0);
- ``store_all``: write pulled rows into their slots, placing new ids in free slots (evicted ones
  first) while there are any, and answer the rows an earlier pull refreshed (``later``);
- ``hold_all``: add a step's gradients to the held sums, noting each row's first held clock
  and oldest read version, and copy the rows' values before the local rule's step;
- ``deltas_all``: after the local steps, add each row's change to its local changes;
- ``take_all``: the held sums that are due (per table, in table order), cleared.

Compiled on first use and cached on disk like the other kernels (``warm_up`` loads them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numba.typed import List

from tether.server.kernels import EMPTY_SLOT, mix64
from tether.worker.cache_kernels import _NONE, _compiled, _shard, _slot

__all__ = ["Columns", "columns", "deltas_all", "hold_all", "later_all", "plan_all", "set_cells", "store_all", "take_all", "warm_up"]

_jit = _compiled()


INTS = ("ids", "shard", "read_clock", "read_version", "last_used", "uses", "pending_since", "pending_version", "free")
FLOATS = ("vals", "pend", "mine", "fresh")
_IDS, _SHARD, _RC, _RV, _LU, _USES, _PS, _PV, _FREE = range(len(INTS))
_VALS, _PEND, _MINE, _FRESH = range(len(FLOATS))


class Columns(NamedTuple):
    """Every table's column arrays in four typed lists (few arguments: each costs a call its
    typing): ``cells`` (the id index) and ``used`` of table g at index g, the int64 columns
    ``INTS[c]`` at ``c * tables + g``, the float32 ones ``FLOATS[c]`` likewise. Built once
    (``columns``): the arrays are allocated for the tables' capacity and never replaced, except
    the id index, which the cache puts back after a rebuild."""

    cells: Any
    ints: Any
    floats: Any
    used: Any


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


def _typed(arrays: list[np.ndarray]) -> Any:
    items = _list_of(arrays[0])
    for a in arrays[1:]:
        _append(items, a)
    return items


def columns(tables: list[Any]) -> Columns:
    """The ``Columns`` of ``tables`` (``row_slots.Table``), in their order."""
    return Columns(_typed([tab.cells for tab in tables]), _typed([getattr(tab, c) for c in INTS for tab in tables]),
                   _typed([getattr(tab, c) for c in FLOATS for tab in tables]), _typed([tab.used for tab in tables]))


@_jit
def set_cells(cells_l: Any, g: np.int64, cells: np.ndarray) -> None:
    """Table ``g``'s id index after a rebuild (compiled: a typed list's item set from Python
    compiles a function the first time, in a step)."""
    cells_l[g] = cells


@_compiled(inline="always")
def _in_flight(flights: np.ndarray, foffs: np.ndarray, g: np.int64, key: np.int64) -> bool:
    """Whether ``key`` of table ``g`` is among the ids a pull in flight refreshes (``flights``:
    those pulls' ids, per pull and table sorted; ``foffs[p, g]``: where pull p's ids of table g start)."""
    for p in range(foffs.shape[0]):
        a, b = foffs[p, g], foffs[p, g + 1]
        if a < b:
            j = a + np.searchsorted(flights[a:b], key)
            if j < b and flights[j] == key:
                return True
    return False


@_jit
def plan_all(cells_l: Any, ints: Any, floats: Any, used_l: Any, tidx: np.ndarray, ids: np.ndarray, offs: np.ndarray, now: np.int64,
             bound: np.int64, flights: np.ndarray,
             foffs: np.ndarray, out: np.ndarray, row_offs: np.ndarray, oldest: np.ndarray) -> tuple[Any, ...]:
    """Split a pull of sorted unique ids per part (table ``tidx[k]``'s ids are ``ids[offs[k]:
    offs[k + 1]]``) at clock ``now``: each id's code (1 hit, 2 refreshed by a pull in flight, 0
    miss), and per part (hits, cached rows missed: refreshed). Hits' rows go into ``out`` (part
    k's answer at ``row_offs[k]``) and their read versions into ``oldest[k, shard]`` (the
    minimum). Cached ids are marked used at ``now``; a cached row pulled again starts its
    ``fresh`` local changes from its held (``mine``) ones: what the answer will lack."""
    n = len(ids)
    code = np.zeros(n, np.int8)
    counts = np.zeros((len(tidx), 2), np.int64)
    for k in range(len(tidx)):
        g = tidx[k]
        nt = len(cells_l)
        cells, rc, lu, us = cells_l[g], ints[_RC * nt + g], ints[_LU * nt + g], ints[_USES * nt + g]
        rv, sh, v = ints[_RV * nt + g], ints[_SHARD * nt + g], floats[_VALS * nt + g]
        mi, fr = floats[_MINE * nt + g], floats[_FRESH * nt + g]
        dim = v.shape[1]
        for i in range(offs[k], offs[k + 1]):
            key = ids[i]
            s = _slot(cells, key)
            if s >= 0:
                lu[s] = now
                us[s] += 1
                if bound > 0 and now - rc[s] <= bound:
                    code[i] = 1
                    counts[k, 0] += 1
                    base = row_offs[k] + (i - offs[k]) * dim
                    for j in range(dim):
                        out[base + j] = v[s, j]
                    if rv[s] < oldest[k, sh[s]]:
                        oldest[k, sh[s]] = rv[s]
                    continue
            if bound > 0 and _in_flight(flights, foffs, g, key):
                code[i] = 2
            elif s >= 0:
                counts[k, 1] += 1
                fr[s, :] = mi[s, :]
    return code, counts


@_compiled(inline="always")
def _place(cells: np.ndarray, s: np.int64, key: np.int64, now: np.int64, ids_col: np.ndarray, used: np.ndarray,
           uses: np.ndarray, last_used: np.ndarray, pending_since: np.ndarray, pending_version: np.ndarray,
           pend: np.ndarray, mine: np.ndarray, fresh: np.ndarray) -> None:
    """New id ``key`` in free slot ``s``: every column set (used once at ``now``, nothing held, no
    local changes) and the id indexed (the caller keeps the index at most half full)."""
    ids_col[s] = key
    used[s] = True
    uses[s] = 1
    last_used[s] = now
    pending_since[s] = _NONE
    pending_version[s] = _NONE
    pend[s, :] = 0.0
    mine[s, :] = 0.0
    fresh[s, :] = 0.0
    mask = np.uint64(len(cells) - 1)
    p = np.int64(mix64(key) & mask)
    while cells[p, 1] != EMPTY_SLOT:
        p = (p + 1) & np.int64(mask)
    cells[p, 0] = key
    cells[p, 1] = s


@_jit
def store_all(cells_l: Any, ints: Any, floats: Any, used_l: Any, tidx: np.ndarray, keys: np.ndarray, koffs: np.ndarray,
              pos: np.ndarray, got: np.ndarray,
              got_offs: np.ndarray, got_row: np.ndarray, versions: np.ndarray, now: np.int64, num_shards: np.int64,
              top: np.ndarray, nfree: np.ndarray, out: np.ndarray, row_offs: np.ndarray, offs: np.ndarray) -> tuple[Any, ...]:
    """Pulled rows into the cache: ``keys`` (per part ``koffs``) at positions ``pos`` of the
    pull's ids (per-part ``offs``: row ``pos - offs[k]`` of part k's answer at ``row_offs[k]`` of
    ``out``), their rows ``got_row`` of part k's pulled rows (``got`` at ``got_offs[k]``).
    Cached ids are refreshed (values plus their ``fresh`` local changes, read clock ``now``,
    shard and that shard's version ``versions[k, shard]``); new ids take a free slot, evicted
    ones first (``free[:nfree[g]]``, taken from the end) then unused ones (from ``top[g]``),
    while there are any. The answer gets every row as stored (as pulled where no slot was left).
    Returns (the indexes in ``keys`` of the ids no slot was left for, the slots placed, and per
    part how many were placed)."""
    n = len(keys)
    unplaced = np.empty(n, np.int64)
    placed = np.empty(n, np.int64)
    nplaced = np.zeros(len(tidx), np.int64)
    u = q = 0
    for k in range(len(tidx)):
        g = tidx[k]
        nt = len(cells_l)
        cells, vals, fresh, free, rc = cells_l[g], floats[_VALS * nt + g], floats[_FRESH * nt + g], ints[_FREE * nt + g], ints[_RC * nt + g]
        ids_col, used, uses, lu, since, pv = (ints[_IDS * nt + g], used_l[g], ints[_USES * nt + g], ints[_LU * nt + g],
                                              ints[_PS * nt + g], ints[_PV * nt + g])
        pend, mine, shard, rv = floats[_PEND * nt + g], floats[_MINE * nt + g], ints[_SHARD * nt + g], ints[_RV * nt + g]
        dim = vals.shape[1]
        for i in range(koffs[k], koffs[k + 1]):
            key = keys[i]
            src = got_offs[k] + got_row[i] * dim
            dst = row_offs[k] + (pos[i] - offs[k]) * dim
            s = _slot(cells, key)
            if s < 0:
                if nfree[g] > 0:
                    nfree[g] -= 1
                    s = free[nfree[g]]
                elif top[g] < len(vals):
                    s = top[g]
                    top[g] += 1
                if s < 0:
                    for j in range(dim):
                        out[dst + j] = got[src + j]
                    unplaced[u] = i
                    u += 1
                    continue
                _place(cells, s, key, now, ids_col, used, uses, lu, since, pv, pend, mine, fresh)
                placed[q] = s
                q += 1
                nplaced[k] += 1
            for j in range(dim):
                vals[s, j] = got[src + j] + fresh[s, j]
                out[dst + j] = vals[s, j]
            rc[s] = now
            sh = _shard(key, num_shards)
            shard[s] = sh
            rv[s] = versions[k, sh]
    return unplaced[:u], placed[:q], nplaced


@_jit
def hold_all(cells_l: Any, ints: Any, floats: Any, used_l: Any, tidx: np.ndarray, ids: np.ndarray, offs: np.ndarray, g: np.ndarray,
             g_offs: np.ndarray,
             versions: np.ndarray, clock: np.int64, num_shards: np.int64, local: np.ndarray, before: np.ndarray) -> tuple[Any, ...]:
    """Add gradient rows (part k's at ``g_offs[k]`` of ``g``, one per id) to the held sums of the
    cached ids (their oldest read version the minimum with ``versions[k, shard]``); ``pend``'s two
    columns past a row's hold its sum of mean(g * g) and its count of gradients (a combined
    push's statistics). Where ``local[k]``, the rows' values are copied to ``before`` (part k's
    cached rows at ``g_offs[k]``, in order) for ``deltas_all``. Returns (the slots of the cached
    ids and their indexes in ``ids``, the slots first held now, the indexes of the ids not cached
    and their shards, and per part the counts of those three)."""
    n = len(ids)
    slots = np.empty(n, np.int64)
    where = np.empty(n, np.int64)
    first = np.empty(n, np.int64)
    missing = np.empty(n, np.int64)
    missing_shards = np.empty(n, np.int64)
    counts = np.zeros((len(tidx), 3), np.int64)
    h = f = m = 0
    for k in range(len(tidx)):
        t = tidx[k]
        nt = len(cells_l)
        cells, pend, since, pv = cells_l[t], floats[_PEND * nt + t], ints[_PS * nt + t], ints[_PV * nt + t]
        shard, vals = ints[_SHARD * nt + t], floats[_VALS * nt + t]
        dim = vals.shape[1]
        for i in range(offs[k], offs[k + 1]):
            s = _slot(cells, ids[i])
            if s < 0:
                missing[m] = i
                missing_shards[m] = _shard(ids[i], num_shards)
                m += 1
                counts[k, 2] += 1
                continue
            src = g_offs[k] + (i - offs[k]) * dim
            if local[k]:
                dst = g_offs[k] + counts[k, 0] * dim
                for j in range(dim):
                    before[dst + j] = vals[s, j]
            slots[h] = s
            where[h] = i
            h += 1
            counts[k, 0] += 1
            square = np.float32(0.0)
            for j in range(dim):
                x = g[src + j]
                pend[s, j] += x
                square += x * x
            pend[s, dim] += square / np.float32(dim)
            pend[s, dim + 1] += np.float32(1.0)
            if since[s] == _NONE:
                since[s] = clock
                first[f] = s
                f += 1
                counts[k, 1] += 1
            v = versions[k, shard[s]]
            if v < pv[s]:
                pv[s] = v
    return slots[:h], where[:h], first[:f], missing[:m], missing_shards[:m], counts


@_jit
def deltas_all(cells_l: Any, ints: Any, floats: Any, used_l: Any, tidx: np.ndarray, slots: np.ndarray, soffs: np.ndarray,
               before: np.ndarray, g_offs: np.ndarray,
               local: np.ndarray) -> None:
    """After the local rule's steps of rows ``slots`` (part k's ``soffs[k]:soffs[k + 1]``, their
    values before the step in ``before`` as ``hold_all`` left them): each row's change added to its
    ``mine`` and ``fresh`` local changes."""
    for k in range(len(tidx)):
        if not local[k]:
            continue
        t = tidx[k]
        nt = len(cells_l)
        vals, mine, fresh = floats[_VALS * nt + t], floats[_MINE * nt + t], floats[_FRESH * nt + t]
        dim = vals.shape[1]
        for r in range(soffs[k], soffs[k + 1]):
            s = slots[r]
            base = g_offs[k] + (r - soffs[k]) * dim
            for j in range(dim):
                d = vals[s, j] - before[base + j]
                mine[s, j] += d
                fresh[s, j] += d


@_jit
def take_all(cells_l: Any, ints: Any, floats: Any, used_l: Any, tables: np.ndarray, slots: np.ndarray, since: np.ndarray,
             num_shards: np.int64) -> tuple[Any, ...]:
    """The held sums of ``slots`` (of table ``tables[i]`` each) still held since ``since[i]``,
    which stop holding (their ``mine`` local changes are now the shard's too). Returns, grouped by
    table in table order (each table's in the order given): their ids, and their sums with the two
    statistics columns (flat: table g's rows of ``dim + 2`` floats one after another), and per
    table the number of rows, whether its ids ascend, and the oldest read version per shard."""
    nt = len(cells_l)
    count = np.zeros(nt, np.int64)
    for i in range(len(slots)):
        t = tables[i]
        if ints[_PS * nt + t][slots[i]] == since[i]:
            count[t] += 1
    total = rows = 0
    for t in range(nt):
        rows += count[t]
        total += count[t] * floats[_PEND * nt + t].shape[1]
    out_ids = np.empty(rows, np.int64)
    held = np.empty(total, np.float32)
    ascending = np.ones(nt, np.bool_)
    oldest = np.full((nt, num_shards), _NONE, np.int64)
    r = f = 0
    for t in range(nt):
        if count[t] == 0:
            continue
        ids_col, pend, mine, ps, pv, shard = (ints[_IDS * nt + t], floats[_PEND * nt + t], floats[_MINE * nt + t], ints[_PS * nt + t],
                                              ints[_PV * nt + t], ints[_SHARD * nt + t])
        width = pend.shape[1]
        first = r
        for i in range(len(slots)):
            s = slots[i]
            if tables[i] != t or ps[s] != since[i]:
                continue
            key = ids_col[s]
            if r > first and out_ids[r - 1] >= key:
                ascending[t] = False
            out_ids[r] = key
            r += 1
            for j in range(width):
                held[f + j] = pend[s, j]
                pend[s, j] = 0.0
            f += width
            mine[s, :] = 0.0
            if pv[s] < oldest[t, shard[s]]:
                oldest[t, shard[s]] = pv[s]
            ps[s] = _NONE
            pv[s] = _NONE
    return out_ids, held, count, ascending, oldest


@_jit
def later_all(cells_l: Any, ints: Any, floats: Any, used_l: Any, tidx: np.ndarray, ids: np.ndarray, offs: np.ndarray,
              later: np.ndarray, loffs: np.ndarray,
              min_clock: np.int64, out: np.ndarray, row_offs: np.ndarray, oldest: np.ndarray) -> np.ndarray:
    """The answer's rows at positions ``later`` of ``ids`` (part k's ``loffs[k]:loffs[k + 1]``),
    which another pull was refreshing: from the cache where it holds them read at ``min_clock`` or
    later (their read versions into ``oldest[k, shard]``). Returns the indexes in ``later`` of
    the others."""
    lacking = np.empty(len(later), np.int64)
    m = 0
    for k in range(len(tidx)):
        t = tidx[k]
        nt = len(cells_l)
        cells, vals, rc, rv, shard = cells_l[t], floats[_VALS * nt + t], ints[_RC * nt + t], ints[_RV * nt + t], ints[_SHARD * nt + t]
        dim = vals.shape[1]
        for r in range(loffs[k], loffs[k + 1]):
            i = later[r]
            s = _slot(cells, ids[i])
            if s >= 0 and rc[s] >= min_clock:
                base = row_offs[k] + (i - offs[k]) * dim
                for j in range(dim):
                    out[base + j] = vals[s, j]
                if rv[s] < oldest[k, shard[s]]:
                    oldest[k, shard[s]] = rv[s]
            else:
                lacking[m] = r
                m += 1
    return lacking[:m]


def _example() -> tuple[Columns, np.ndarray]:
    """Columns of two small tables (two: a list's append is compiled apart from its first item)."""
    tables = []
    for _ in range(2):
        table = type("T", (), {})()
        table.cells = np.full((16, 2), EMPTY_SLOT, np.int64)
        for name in INTS:
            setattr(table, name, np.zeros(4, np.int64))
        for name in FLOATS:
            setattr(table, name, np.zeros((4, 3 if name == "pend" else 1), np.float32))
        table.used = np.zeros(4, np.bool_)
        tables.append(table)
    return columns(tables), tables[0].cells


def warm_up() -> None:
    """Load (or compile, the first time) every kernel here for the types the cache passes."""
    c, cells = _example()
    set_cells(c.cells, np.int64(0), cells)
    none = np.zeros(0, np.int64)
    zero, one = np.int64(0), np.int64(1)
    part, offs = np.zeros(1, np.int64), np.zeros(2, np.int64)
    f32 = np.zeros(0, np.float32)
    oldest = np.zeros((1, 1), np.int64)
    plan_all(*c, part, none, offs, zero, one, none, np.zeros((0, 2), np.int64), f32, part, oldest)
    store_all(*c, part, none, offs, none, f32, part, none, oldest, zero, one, part.copy(), part.copy(), f32, part, offs)
    later_all(*c, part, none, offs, none, offs, zero, f32, part, oldest)
    flags = np.ones(1, np.bool_)
    hold_all(*c, part, none, offs, f32, part, oldest, zero, one, flags, f32)
    deltas_all(*c, part, none, offs, f32, part, flags)
    take_all(*c, none, none, none, one)
