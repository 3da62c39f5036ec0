"""The worker row cache's per-step passes over ALL its tables at once, compiled (numba): one call
per operation and step, whatever the number of tables (``tether.worker.cache.row_cache``).

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
  and oldest read version, and take the local rule's step on the cached rows (the rule's own
  compiled kernel, ``row_kernels.rows_of_rule``), each row's change added to its local changes;
- ``take_all``: the held sums that are due (per table, in table order), cleared, in the layout
  a push takes (sums, and a combined push's statistics, each in one buffer), with each row's
  shard (``cache_split.pack_push`` groups them by it: the push's split and payload, no id hashed again);
- ``with_unheld``: a step's gradients of rows not cached (not admitted, or a full table's) merged
  into ``take_all``'s push in id order, each a row of one gradient.

Compiled on first use and cached on disk like the other kernels (``warm_up`` loads them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tether.rules.index_kernels import EMPTY_SLOT, mix64, prefetch
from tether.rules.kernel_cache import compiled
from tether.rules.rows_by_rule import MAX_CONSTANTS, rows_of_rule
from tether.worker.cache.kernels import (
    FLOATS,
    HELD,
    IDS,
    LU,
    META,
    NONE,
    PS,
    PV,
    RC,
    RV,
    SHARD,
    USES,
    VALS,
    Columns,
    columns,
    copy_row,
    fetch_part,
    fetch_row,
    mean_square,
    probe_from,
    shard_of,
    slot_of,
    typed_list,
    zero_row,
)
from tether.worker.cache.split import group_ids, pack_push

__all__ = ["hold_all", "later_all", "loads", "plan_all", "store_all", "take_all", "warm_up", "with_unheld"]

_jit = compiled()


@compiled(inline="always")
def _in_flight(flights: np.ndarray, ends: np.ndarray, cur: np.ndarray, key: np.int64) -> bool:
    """Whether ``key`` is among the ids the pulls in flight refresh of the table a pass is on
    (``flights``: those pulls' ids, per pull and table sorted; pull p's of this table are
    ``flights[cur[p]:ends[p]]``). The pass asks in ascending order of keys: each pull's cursor
    ``cur[p]`` moves past the ids below ``key`` for good (a merge of sorted runs, no search)."""
    hit = False
    for p in range(len(cur)):
        j, b = cur[p], ends[p]
        while j < b and flights[j] < key:
            j += 1
        cur[p] = j
        if j < b and flights[j] == key:
            hit = True
    return hit


_AHEAD = 16  # how many ids ahead a pass asks for the memory it will read (``prefetch``)


@compiled(inline="always")
def _lookup(cells: np.ndarray, ids: np.ndarray, a: np.int64, b: np.int64, found: np.ndarray) -> None:
    """The slots of ``ids[a:b]`` into ``found[a:b]`` (-1: not cached), before any row is
    touched: each id's home cell first, then the probes, the cell ``_AHEAD`` ids on prefetched
    (so that the reads of one id do not wait for the memory of the one before)."""
    mask = np.uint64(len(cells) - 1)
    flat = cells.reshape(-1)
    for i in range(a, b):
        found[i] = np.int64(mix64(ids[i]) & mask)
    for i in range(a, b):
        if i + _AHEAD < b:
            prefetch(flat, 2 * found[i + _AHEAD])
        found[i] = probe_from(cells, ids[i], found[i])


@_jit
def plan_all(cells_l: Any, meta_l: Any, floats: Any, used_l: Any, free_l: Any, tidx: np.ndarray, ids: np.ndarray, offs: np.ndarray,
             now: np.int64,
             bound: np.int64, flights: np.ndarray,
             foffs: np.ndarray, out: np.ndarray, row_offs: np.ndarray, oldest: np.ndarray, door: np.ndarray,
             window: np.int64) -> tuple[Any, ...]:
    """Split a pull of sorted unique ids per part (table ``tidx[k]``'s ids are ``ids[offs[k]:
    offs[k + 1]]``) at clock ``now``: each id's code (1 hit, 2 refreshed by a pull in flight, 0
    miss), and per part (hits, cached rows missed: refreshed). Hits' rows go into ``out`` (part
    k's answer at ``row_offs[k]``) and their read versions into ``oldest[k, shard]`` (the
    minimum). Cached ids are marked used at ``now``; a cached row pulled again starts its
    ``fresh`` local changes from its held (``mine``) ones: what the answer will lack. Also returns
    each id's slot (-1: not cached; the device cache's gathers, ``tether.worker.cache.device``),
    the positions of the misses and of the refreshed-later rows, where part k's misses start, and
    whether each miss is to be cached (``store_all``'s ``keep``).

    Admission (``window`` > 0): an id not cached is cached only if it was missed within the last
    ``window`` clocks, by the doorkeeper ``door`` (per table, the clock each hash of an id was
    last missed at; a collision admits an id early, never loses one); the others (code 3) are
    pulled and answered, and their gradients pushed in their step (``with_unheld``), as with no
    cache. ``counts``' third column: per part, the misses not admitted."""
    n = len(ids)
    code = np.zeros(n, np.int8)
    found = np.empty(n, np.int64)
    counts = np.zeros((len(tidx), 3), np.int64)
    dmask = np.uint64(door.shape[1] - 1)
    npulls = foffs.shape[0]
    cur = np.empty(npulls, np.int64)
    ends = np.empty(npulls, np.int64)
    for k in range(len(tidx)):
        g = tidx[k]
        nt = len(cells_l)
        cells, rc, lu, us = cells_l[g], meta_l[g][:, RC], meta_l[g][:, LU], meta_l[g][:, USES]
        rv, sh, v = meta_l[g][:, RV], meta_l[g][:, SHARD], floats[VALS * nt + g]
        hd = floats[HELD * nt + g]  # mine at dim + 2, fresh at 2 * dim + 2
        dim = v.shape[1]
        meta_flat, v_flat, width = meta_l[g].reshape(-1), v.reshape(-1), meta_l[g].shape[1]
        for p in range(npulls):  # each pull in flight's ids of this table (``_in_flight``'s cursors)
            cur[p], ends[p] = foffs[p, g], foffs[p, g + 1]
        _lookup(cells, ids, offs[k], offs[k + 1], found)
        for i in range(offs[k], offs[k + 1]):
            if i + _AHEAD < offs[k + 1] and found[i + _AHEAD] >= 0:
                fetch_row(meta_flat, found[i + _AHEAD], width)
                fetch_row(v_flat, found[i + _AHEAD], dim)
            key = ids[i]
            s = found[i]
            if s >= 0:
                lu[s] = now
                us[s] += 1
                if bound > 0 and now - rc[s] <= bound:
                    code[i] = 1
                    counts[k, 0] += 1
                    base = row_offs[k] + (i - offs[k]) * dim
                    copy_row(out[base: base + dim], v[s])
                    if rv[s] < oldest[k, sh[s]]:
                        oldest[k, sh[s]] = rv[s]
                    continue
            if bound > 0 and _in_flight(flights, ends, cur, key):
                code[i] = 2
            elif s >= 0:
                counts[k, 1] += 1
                copy_row(hd[s, 2 * dim + 2: 3 * dim + 2], hd[s, dim + 2: 2 * dim + 2])
            elif window > 0:
                h = np.int64(mix64(key) & dmask)
                if now - door[g, h] > window:
                    code[i] = 3
                    counts[k, 2] += 1
                door[g, h] = now
    # The misses' and the later rows' positions, and where each part's misses start.
    nmiss = nlater = 0
    for i in range(n):
        nmiss += code[i] == 0 or code[i] == 3
        nlater += code[i] == 2
    miss = np.empty(nmiss, np.int64)
    keep = np.empty(nmiss, np.bool_)
    later = np.empty(nlater, np.int64)
    miss_offs = np.zeros(len(tidx) + 1, np.int64)
    a = b = 0
    for k in range(len(tidx)):
        for i in range(offs[k], offs[k + 1]):
            if code[i] == 0 or code[i] == 3:
                miss[a] = i
                keep[a] = code[i] == 0
                a += 1
            elif code[i] == 2:
                later[b] = i
                b += 1
        miss_offs[k + 1] = a
    return code, counts, found, miss, later, miss_offs, keep


@compiled(inline="always")
def _place(cells: np.ndarray, s: np.int64, key: np.int64, now: np.int64, ids_col: np.ndarray, used: np.ndarray,
           uses: np.ndarray, last_used: np.ndarray, pending_since: np.ndarray, pending_version: np.ndarray,
           held: np.ndarray) -> None:
    """New id ``key`` in free slot ``s``: every column set (used once at ``now``, nothing held, no
    local changes) and the id indexed (the caller keeps the index at most half full)."""
    ids_col[s] = key
    used[s] = True
    uses[s] = 1
    last_used[s] = now
    pending_since[s] = NONE
    pending_version[s] = NONE
    held[s, :] = 0.0
    mask = np.uint64(len(cells) - 1)
    p = np.int64(mix64(key) & mask)
    while cells[p, 1] != EMPTY_SLOT:
        p = (p + 1) & np.int64(mask)
    cells[p, 0] = key
    cells[p, 1] = s


@_jit
def store_all(cells_l: Any, meta_l: Any, floats: Any, used_l: Any, free_l: Any, tidx: np.ndarray, keys: np.ndarray, koffs: np.ndarray,
              pos: np.ndarray, got: np.ndarray,
              got_offs: np.ndarray, got_row: np.ndarray, versions: np.ndarray, now: np.int64, num_shards: np.int64,
              top: np.ndarray, nfree: np.ndarray, out: np.ndarray, row_offs: np.ndarray, offs: np.ndarray, states: Any, sfirst: np.ndarray,
              scount: np.ndarray, sinit: np.ndarray, keep: np.ndarray) -> tuple[Any, ...]:
    """Pulled rows into the cache: ``keys`` (per part ``koffs``) at positions ``pos`` of the
    pull's ids (per-part ``offs``: row ``pos - offs[k]`` of part k's answer at ``row_offs[k]`` of
    ``out``), their rows ``got_row`` of part k's pulled rows (``got`` at ``got_offs[k]``).
    Cached ids are refreshed (values plus their ``fresh`` local changes, read clock ``now``,
    shard and that shard's version ``versions[k, shard]``); new ids take a free slot, evicted
    ones first (``free[:nfree[g]]``, taken from the end) then unused ones (from ``top[g]``),
    while there are any; a new id's local rule state (table g's ``scount[g]`` arrays from
    ``states[sfirst[g]]``) starts at the rule's (``sinit``, per state array). ``got_row`` empty:
    key i is row ``i - koffs[k]`` of its part's pulled rows. A new id whose ``keep`` is False (not
    admitted, ``plan_all``; ``keep`` empty: every id kept) is only answered. The answer gets every
    row as stored (as pulled where no slot was left or the id was not kept). Returns (the indexes
    in ``keys`` of the ids no slot was left for, the slots placed, per part how many were placed,
    and each key's slot, -1 where none was left)."""
    n = len(keys)
    stored = np.full(n, -1, np.int64)
    unplaced = np.empty(n, np.int64)
    placed = np.empty(n, np.int64)
    found = np.empty(n, np.int64)
    nplaced = np.zeros(len(tidx), np.int64)
    u = q = 0
    for k in range(len(tidx)):
        g = tidx[k]
        nt = len(cells_l)
        cells, vals, hd, free, rc = cells_l[g], floats[VALS * nt + g], floats[HELD * nt + g], free_l[g], meta_l[g][:, RC]
        ids_col, used, uses, lu, since, pv = (meta_l[g][:, IDS], used_l[g], meta_l[g][:, USES], meta_l[g][:, LU],
                                              meta_l[g][:, PS], meta_l[g][:, PV])
        shard, rv = meta_l[g][:, SHARD], meta_l[g][:, RV]
        dim = vals.shape[1]
        fresh0 = 2 * dim + 2  # where a held record's fresh changes start
        meta_flat, v_flat, h_flat, width = meta_l[g].reshape(-1), vals.reshape(-1), hd.reshape(-1), meta_l[g].shape[1]
        _lookup(cells, keys, koffs[k], koffs[k + 1], found)  # a part's keys are unique: placing one moves no other's slot
        for i in range(koffs[k], koffs[k + 1]):
            if i + _AHEAD < koffs[k + 1] and found[i + _AHEAD] >= 0:
                ahead = found[i + _AHEAD]
                fetch_row(meta_flat, ahead, width)
                fetch_row(v_flat, ahead, dim)
                fetch_row(h_flat, ahead, 3 * dim + 2)
            key = keys[i]
            src = got_offs[k] + (got_row[i] if len(got_row) else i - koffs[k]) * dim
            dst = row_offs[k] + (pos[i] - offs[k]) * dim
            s = found[i]
            if s < 0 and len(keep) and not keep[i]:
                copy_row(out[dst: dst + dim], got[src: src + dim])
                continue
            if s < 0:
                if nfree[g] > 0:
                    nfree[g] -= 1
                    s = free[nfree[g]]
                elif top[g] < len(vals):
                    s = top[g]
                    top[g] += 1
                if s < 0:
                    copy_row(out[dst: dst + dim], got[src: src + dim])
                    unplaced[u] = i
                    u += 1
                    continue
                _place(cells, s, key, now, ids_col, used, uses, lu, since, pv, hd)
                for c in range(sfirst[g], sfirst[g] + scount[g]):
                    states[c][s, :] = sinit[c]
                placed[q] = s
                q += 1
                nplaced[k] += 1
            stored[i] = s
            row, pulled, fresh = vals[s], got[src: src + dim], hd[s, fresh0: fresh0 + dim]
            for j in range(dim):
                row[j] = pulled[j] + fresh[j]
            copy_row(out[dst: dst + dim], row)
            rc[s] = now
            sh = shard_of(key, num_shards)
            shard[s] = sh
            rv[s] = versions[k, sh]
    return unplaced[:u], placed[:q], nplaced, stored


@_jit
def hold_all(cells_l: Any, meta_l: Any, floats: Any, used_l: Any, free_l: Any, tidx: np.ndarray, ids: np.ndarray, offs: np.ndarray,
             g: np.ndarray, g_offs: np.ndarray, versions: np.ndarray, clock: np.int64, num_shards: np.int64, rules: np.ndarray,
             lrs: np.ndarray, states: Any, sbase: np.ndarray, consts: np.ndarray) -> tuple[Any, ...]:
    """Add gradient rows (part k's at ``g_offs[k]`` of ``g``, one per id) to the held sums of the
    cached ids (their oldest read version the minimum with ``versions[k, shard]``); the two
    columns of the held record past the sums hold a row's sum of mean(g * g) and its count of
    gradients (a combined push's statistics). Where ``rules[k] >= 0``, the local rule's step too, part by part while
    its rows are in the CPU's caches: rule ``rules[k]`` (``row_kernels.rows_of_rule``, at rate
    ``lrs[k]``, its state ``states[sbase[k]:]``, its constants ``consts[k]``) on the part's
    cached rows from their gradients, and each row's change added to its ``mine`` and ``fresh``
    local changes. Returns (the slots of the cached ids and their indexes in ``ids``, the slots
    first held now, the indexes of the ids not cached and their shards, and per part the
    counts of those three)."""
    n = len(ids)
    slots = np.empty(n, np.int64)
    where = np.empty(n, np.int64)
    first = np.empty(n, np.int64)
    missing = np.empty(n, np.int64)
    missing_shards = np.empty(n, np.int64)
    found = np.empty(n, np.int64)
    counts = np.zeros((len(tidx), 3), np.int64)
    local = False
    for k in range(len(tidx)):
        local = local or rules[k] >= 0
    # The local step's inputs: the cached rows' values before it, and their gradients, one after another.
    before = np.empty(len(g) if local else 0, np.float32)
    grads = np.empty(len(g) if local else 0, np.float32)
    h = f = m = 0
    for k in range(len(tidx)):
        t = tidx[k]
        nt = len(cells_l)
        cells, hd, since, pv = cells_l[t], floats[HELD * nt + t], meta_l[t][:, PS], meta_l[t][:, PV]
        shard, vals = meta_l[t][:, SHARD], floats[VALS * nt + t]
        dim = vals.shape[1]
        step = rules[k] >= 0
        # The held record's sums and statistics (at 0), and with a local step its mine and fresh changes too.
        reach = 3 * dim + 2 if step else dim + 2
        meta_flat, h_flat, v_flat, width = meta_l[t].reshape(-1), hd.reshape(-1), vals.reshape(-1), meta_l[t].shape[1]
        _lookup(cells, ids, offs[k], offs[k + 1], found)
        h0 = h
        for i in range(offs[k], offs[k + 1]):
            if i + _AHEAD < offs[k + 1] and found[i + _AHEAD] >= 0:
                ahead = found[i + _AHEAD]
                fetch_row(meta_flat, ahead, width)
                fetch_part(h_flat, ahead, 3 * dim + 2, reach)
                if step:
                    fetch_row(v_flat, ahead, dim)
            s = found[i]
            if s < 0:
                missing[m] = i
                missing_shards[m] = shard_of(ids[i], num_shards)
                m += 1
                counts[k, 2] += 1
                continue
            src = g_offs[k] + (i - offs[k]) * dim
            grad = g[src: src + dim]
            if step:
                dst = g_offs[k] + counts[k, 0] * dim
                copy_row(before[dst: dst + dim], vals[s])
                copy_row(grads[dst: dst + dim], grad)
            slots[h] = s
            where[h] = i
            h += 1
            counts[k, 0] += 1
            square = np.float32(0.0)
            held = hd[s]
            for j in range(dim):
                x = grad[j]
                held[j] += x
                square += x * x
            if dim > 0:  # 0: the device cache's host columns (its sums are on the device)
                hd[s, dim] += square / np.float32(dim)
            hd[s, dim + 1] += np.float32(1.0)
            if since[s] == NONE:
                since[s] = clock
                first[f] = s
                f += 1
                counts[k, 1] += 1
            v = versions[k, shard[s]]
            if v < pv[s]:
                pv[s] = v
        rows = h - h0
        if step and rows > 0:
            a = g_offs[k]
            rows_of_rule(rules[k], vals, slots[h0:h], grads[a: a + rows * dim].reshape(rows, dim), np.full(rows, lrs[k], np.float32),
                         states, sbase[k], consts[k])
            for r in range(h0, h):
                s = slots[r]
                base = a + (r - h0) * dim
                row, old, mine, fresh = vals[s], before[base: base + dim], hd[s, dim + 2: 2 * dim + 2], hd[s, 2 * dim + 2: 3 * dim + 2]
                for j in range(dim):
                    d = row[j] - old[j]
                    mine[j] += d
                    fresh[j] += d
    return slots[:h], where[:h], first[:f], missing[:m], missing_shards[:m], counts


@_jit
def take_all(cells_l: Any, meta_l: Any, floats: Any, used_l: Any, free_l: Any, tables: np.ndarray, slots: np.ndarray, since: np.ndarray,
             num_shards: np.int64, kinds: np.ndarray) -> tuple[Any, ...]:
    """The held sums of ``slots`` (of table ``tables[i]`` each) still held since ``since[i]``,
    which stop holding (their ``mine`` local changes are now the shard's too), in the layout a
    push takes. Returns, grouped by table in table order (each table's in the order given): their
    ids; their sums (flat: table g's rows of ``dim`` floats one after another); their combined
    push's statistics (flat: table g's rows of as many columns as ``kinds[g]`` names, column c the
    sum of mean(g * g) where ``kinds[g, c]`` is 0, the count of gradients where 1; -1 first in a
    row of one gradient: ``UpdateRule.combined_stats``); each row's sum of mean(g * g) and count
    (the two columns held past the sum); each row's shard; and per table the number of rows,
    whether its ids ascend, whether any row sums several gradients, the oldest read version
    per shard, and each row's slot (the device cache gathers its sums by them)."""
    nt = len(cells_l)
    n = len(slots)
    count = np.zeros(nt, np.int64)
    valid = np.zeros(n, np.bool_)
    t = -1
    meta = meta_l[0]
    width = meta.shape[1]
    for i in range(n):
        if tables[i] != t:
            t = tables[i]
            meta = meta_l[t]
        if i + _AHEAD < n and tables[i + _AHEAD] == t:
            fetch_row(meta.reshape(-1), slots[i + _AHEAD], width)
        if meta[slots[i], PS] == since[i]:
            valid[i] = True
            count[t] += 1
    nstats = np.zeros(nt, np.int64)
    at = np.zeros(nt, np.int64)  # per table: where its next row goes, in rows,
    flat = np.zeros(nt, np.int64)  # in floats of sums
    sflat = np.zeros(nt, np.int64)  # and of statistics
    rows = total = ntotal = 0
    for t in range(nt):
        for c in range(kinds.shape[1]):
            if kinds[t, c] >= 0:
                nstats[t] += 1
        at[t], flat[t], sflat[t] = rows, total, ntotal
        rows += count[t]
        total += count[t] * floats[VALS * nt + t].shape[1]
        ntotal += count[t] * nstats[t]
    out_ids = np.empty(rows, np.int64)
    sums = np.empty(total, np.float32)
    stats = np.empty(ntotal, np.float32)
    square = np.empty(rows, np.float32)
    grads = np.empty(rows, np.float32)
    shards = np.empty(rows, np.int64)
    out_slots = np.empty(rows, np.int64)
    ascending = np.ones(nt, np.bool_)
    many = np.zeros(nt, np.bool_)
    oldest = np.full((nt, num_shards), NONE, np.int64)
    start = at.copy()
    t = -1
    hd = floats[HELD * nt]
    for i in range(n):
        if not valid[i]:
            continue
        s = slots[i]
        if tables[i] != t:  # a step's slots come grouped by table: its columns fetched once per group
            t = tables[i]
            meta, hd = meta_l[t], floats[HELD * nt + t]
        dim = (hd.shape[1] - 2) // 3
        if i + _AHEAD < n and tables[i + _AHEAD] == t:  # the first loop brought the meta rows
            fetch_part(hd.reshape(-1), slots[i + _AHEAD], 3 * dim + 2, 2 * dim + 2)  # the sums, statistics and mine
        r, f, q = at[t], flat[t], sflat[t]
        key = meta[s, IDS]
        if r > start[t] and out_ids[r - 1] >= key:
            ascending[t] = False
        out_ids[r] = key
        out_slots[r] = s
        copy_row(sums[f: f + dim], hd[s, :dim])
        sq, k = hd[s, dim], hd[s, dim + 1]
        square[r], grads[r] = sq, k
        if k > 1:
            many[t] = True
        for c in range(nstats[t]):
            stats[q + c] = k if kinds[t, c] == 1 else sq
        if nstats[t] > 0 and not k > 1:
            stats[q] = np.float32(-1.0)
        at[t], flat[t], sflat[t] = r + 1, f + dim, q + nstats[t]
        zero_row(hd[s, : 2 * dim + 2])  # the sums, their statistics and mine: now the shard's too
        shards[r] = meta[s, SHARD]
        if meta[s, PV] < oldest[t, shards[r]]:
            oldest[t, shards[r]] = meta[s, PV]
        meta[s, PS] = NONE
        meta[s, PV] = NONE
    return out_ids, sums, stats, square, grads, shards, count, ascending, many, oldest, out_slots


@_jit
def with_unheld(ids: np.ndarray, sums: np.ndarray, stats: np.ndarray, square: np.ndarray, grads: np.ndarray, shards: np.ndarray,
                count: np.ndarray, ascending: np.ndarray, oldest: np.ndarray, dims: np.ndarray, kinds: np.ndarray, tidx: np.ndarray,
                step_ids: np.ndarray, offs: np.ndarray, g: np.ndarray, g_offs: np.ndarray, missing: np.ndarray,
                missing_shards: np.ndarray, read: np.ndarray) -> tuple[Any, ...]:
    """``take_all``'s push (per table in table order: ids, sums, statistics, each row's mean
    square and count, shards, rows per table, whether its ids ascend, the oldest read version per
    table and shard) with a step's gradients of rows not cached merged in (``hold_all``'s
    ``missing``, ascending: positions in ``step_ids``, part k of table ``tidx[k]`` at ``offs[k]``,
    its gradients at ``g_offs[k]`` of ``g``; their shards; their read versions ``read[k, shard]``),
    each one gradient: -1 first in its statistics, as ``Table.combined`` writes a row of one
    gradient. Where a table's taken ids ascend, the two sorted runs are merged by id (a row not
    cached holds nothing, so no id is in both), else the step's rows follow the taken ones.
    Returns the same eight, merged. A step's row's mean square is computed only where its table's
    statistics carry it past their first column (the -1 of one gradient); elsewhere it is -1, not
    computed (``mean_squares`` gives it from the row, bit for bit, where it is wanted)."""
    nt = len(count)
    nstats = np.zeros(nt, np.int64)
    need = np.zeros(nt, np.bool_)  # a row of one gradient carries its mean square
    for t in range(nt):
        for c in range(kinds.shape[1]):
            if kinds[t, c] >= 0:
                nstats[t] += 1
                if c > 0 and kinds[t, c] == 0:
                    need[t] = True
    part = np.full(nt, -1, np.int64)
    lo = np.zeros(nt, np.int64)  # table t's rows of ``missing``: lo[t]:hi[t]
    hi = np.zeros(nt, np.int64)
    for k in range(len(tidx)):
        part[tidx[k]] = k
        lo[tidx[k]] = np.searchsorted(missing, offs[k])
        hi[tidx[k]] = np.searchsorted(missing, offs[k + 1])
    o_count = count + (hi - lo)
    total = ntotal = 0
    for t in range(nt):
        total += o_count[t] * dims[t]
        ntotal += o_count[t] * nstats[t]
    rows = len(ids) + len(missing)
    o_ids = np.empty(rows, np.int64)
    o_sums = np.empty(total, np.float32)
    o_stats = np.empty(ntotal, np.float32)
    o_square = np.empty(rows, np.float32)
    o_grads = np.empty(rows, np.float32)
    o_shards = np.empty(rows, np.int64)
    o_asc = ascending.copy()
    o_oldest = oldest.copy()
    r = i = f = q = 0  # the next row out (its sums at f, statistics at q); the next taken row
    tf = tq = 0  # where the next taken row's sums and statistics are
    for t in range(nt):
        d, ns, k = dims[t], nstats[t], part[t]
        first, iend, m = r, i + count[t], lo[t]
        while i < iend or m < hi[t]:
            if m < hi[t] and (i >= iend or (ascending[t] and step_ids[missing[m]] < ids[i])):
                at = missing[m]
                key = step_ids[at]
                src = g_offs[k] + (at - offs[k]) * d
                grad = g[src: src + d]
                copy_row(o_sums[f: f + d], grad)
                # A chain of float adds, a quarter of this merge's time at 128 floats a row: only where sent.
                sq = mean_square(grad) if need[t] else np.float32(-1.0)
                o_square[r], o_grads[r] = sq, np.float32(1.0)
                for c in range(ns):
                    o_stats[q + c] = np.float32(1.0) if kinds[t, c] == 1 else sq
                if ns > 0:
                    o_stats[q] = np.float32(-1.0)
                sh = missing_shards[m]
                o_shards[r] = sh
                if read[k, sh] < o_oldest[t, sh]:
                    o_oldest[t, sh] = read[k, sh]
                m += 1
            else:
                key = ids[i]
                copy_row(o_sums[f: f + d], sums[tf: tf + d])
                for c in range(ns):
                    o_stats[q + c] = stats[tq + c]
                o_square[r], o_grads[r], o_shards[r] = square[i], grads[i], shards[i]
                i += 1
                tf += d
                tq += ns
            if r > first and o_ids[r - 1] >= key:
                o_asc[t] = False
            o_ids[r] = key
            r += 1
            f += d
            q += ns
    return o_ids, o_sums, o_stats, o_square, o_grads, o_shards, o_count, o_asc, o_oldest


@_jit
def later_all(cells_l: Any, meta_l: Any, floats: Any, used_l: Any, free_l: Any, tidx: np.ndarray, ids: np.ndarray, offs: np.ndarray,
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
        cells, vals, rc, rv, shard = cells_l[t], floats[VALS * nt + t], meta_l[t][:, RC], meta_l[t][:, RV], meta_l[t][:, SHARD]
        dim = vals.shape[1]
        for r in range(loffs[k], loffs[k + 1]):
            i = later[r]
            s = slot_of(cells, ids[i])
            if s >= 0 and rc[s] >= min_clock:
                base = row_offs[k] + (i - offs[k]) * dim
                copy_row(out[base: base + dim], vals[s])
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
        table.meta = np.zeros((4, len(META)), np.int64)
        table.free = np.zeros(4, np.int64)
        for name in FLOATS:
            setattr(table, name, np.zeros((4, 5 if name == "held_record" else 1), np.float32))
        table.used = np.zeros(4, np.bool_)
        tables.append(table)
    return columns(tables), tables[0].cells


def loads() -> list[Callable[[], object]]:
    """Calls that each load (or compile, the first time) one kernel here for the types the cache
    passes (``row_slots.warm_up`` loads them as one group)."""
    none = np.zeros(0, np.int64)
    zero, one = np.int64(0), np.int64(1)
    part, offs = np.zeros(1, np.int64), np.zeros(2, np.int64)
    f32 = np.zeros(0, np.float32)

    def oldest() -> np.ndarray:
        return np.zeros((1, 1), np.int64)

    return [
        lambda: plan_all(*_example()[0], part, none, offs, zero, one, none, np.zeros((0, 2), np.int64), f32, part, oldest(), oldest(),
                         zero),
        lambda: store_all(*_example()[0], part, none, offs, none, f32, part, none, oldest(), zero, one, part.copy(), part.copy(), f32, part,
                          offs, typed_list([np.zeros((1, 1), np.float32)]), part, part, np.zeros(1, np.float32), np.zeros(0, np.bool_)),
        lambda: later_all(*_example()[0], part, none, offs, none, offs, zero, f32, part, oldest()),
        lambda: hold_all(*_example()[0], part, none, offs, f32, part, oldest(), zero, one, part, np.zeros(1, np.float32),
                         typed_list([np.zeros((1, 1), np.float32)]), part, np.zeros((1, MAX_CONSTANTS))),
        lambda: take_all(*_example()[0], none, none, none, one, np.full((2, 1), -1, np.int64)),
        lambda: with_unheld(none, f32, f32, f32, f32, none, part, np.ones(1, np.bool_), oldest(), part, np.full((1, 1), -1, np.int64), part,
                            none, offs, f32, part, none, none, oldest()),
        lambda: pack_push(none, part, one, none, f32, f32, part, np.full((1, 1), -1, np.int64), np.zeros(1, np.bool_), np.int64(16)),
        lambda: group_ids(none, offs, one),
    ]


def warm_up() -> None:
    """Load (or compile, the first time) every kernel here for the types the cache passes."""
    for load in loads():
        load()
