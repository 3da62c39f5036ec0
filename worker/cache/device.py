"""The worker row cache with its rows on the training device (issue 41; FBGEMM's UVM cache keeps
its rows in HBM the same way): ``DeviceRowCache``.

The host keeps what it keeps for ``RowCache`` (``tether.worker.cache.row_cache``): each table's id
index and per-slot columns (ids, shards, read clocks and versions, uses, the clock and version of
the oldest held gradient, the count of held gradients), and the same compiled passes run over
them (``tether.worker.cache.batch``: plan, store, later, hold, take), with no float columns
(their width is 0). The floats live on ``device``, one tensor per row width for all tables of
that width (a "bank": table g's slot s is row ``base[g] + s`` of its bank):

- ``values``: the rows as read, with the worker's own changes;
- ``pend``: per row the sum of the held gradients, then the sum of their mean(g * g) and their
  count (``RowCache``'s ``pending`` layout, so an evicted row's part is what the host's is);
- ``mine`` and ``fresh``: the local rule's changes (held; lacked by a refresh in flight);
- the local rule's state (per rule of the bank's tables: ``UpdateRule.state_shapes``).

Per step only int64 indices go to the device (one copy per pass: positions in the answer and
bank rows), and the work is a few torch index ops per bank: a hit is gathered on the device into
the step's answer (``index_select``), the step's gradients are added to the held sums
(``_add_rows``) and the local rule is applied there (its torch form, ``UpdateRule.apply``).
Rows missed or refreshed come from the host (the pull's answer, copied once to the device on a
side stream on CUDA) into their slots; held sums go to the host only when they are due (or
their row is evicted), one copy per bank; the gradients of rows not cached go to the host once a
step, one copy per bank, and join the push in the host cache's compiled pass (``with_unheld``).
On the CPU the same code runs on CPU tensors.

The guarantees are ``RowCache``'s: bound 0 sends exactly what no cache sends, combined pushes
carry the rule's statistics, a restarted shard's rows are refreshed, and sync has no cache. What
differs: the local rule's step is its torch form (the host's is its compiled kernel: equal within
float rounding), and a combined push's mean(g * g) is torch's mean (the host sums in order).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.optimizers import rule
from tether.worker.cache.batch import hold_all, later_all, store_all
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.kernels import set_cells
from tether.worker.cache.parts import NO_IDS, NO_KEEP, NO_ROWS, Plan, Pushed, joined_ids, offsets, read_versions
from tether.worker.cache.row_cache import RowCache
from tether.worker.cache.slots import NONE, Due, coalesce
from tether.worker.client.results import PullResult
from tether.worker.training.transfer import pinned

__all__ = ["DeviceRowCache", "device_capacity"]

log = logging.getLogger(__name__)

# Share of the device's free memory a device cache may take by default (``device_capacity``).
FREE_SHARE = 0.5


def _row_bytes(dim: int) -> int:
    """Device bytes per cached row: values, held sums (+2 columns), two local-change columns,
    and the largest rule state (Adam's two moments and count)."""
    return 4 * (dim + (dim + 2) + 2 * dim + (2 * dim + 1))


def device_capacity(rows: int, dims: Mapping[str, int], device: torch.device) -> int:
    """Rows per table a device cache holds: ``rows`` (``--cache-rows``), capped on CUDA so that
    every table's rows take at most ``FREE_SHARE`` of the device's free memory."""
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch.cuda, "mem_get_info"):
        return rows
    try:
        free, _ = torch.cuda.mem_get_info(device)
    except (RuntimeError, AssertionError, TypeError):  # a device torch cannot ask (tests/fake_cuda.py's stand-in)
        return rows
    per_row = sum(_row_bytes(d) for d in dims.values()) or 1
    fit = int(FREE_SHARE * free // per_row)
    if fit < rows:
        log.warning("the row cache on %s holds %d rows per table, not %d (--cache-rows): that is %.0f%% of the device's free "
                    "memory (%.1f GiB)", device, fit, rows, 100 * FREE_SHARE, free / 2**30)
        return max(fit, 1)
    return rows


@dataclass
class DevicePlan(Plan):
    """A device cache's ``Plan``: the answer is one device tensor per bank (``outs``; part k's rows
    start at row ``starts[k]`` of its bank's), filled as the host's ``out`` is."""

    outs: dict[int, torch.Tensor] = field(default_factory=dict)
    starts: np.ndarray = field(default_factory=lambda: NO_IDS)


class _Bank:
    """The device tensors of every table of one row width (see the module docstring)."""

    def __init__(self, width: int, tables: list[int], capacity: int, device: torch.device) -> None:
        self.width, self.tables = width, tables
        n = max(len(tables) * max(capacity, 1), 1)
        # Unset (memory never touched until used): a slot's rows are set when a row is placed in it.
        self.values = torch.empty(n, width, device=device)
        self.pend = torch.empty(n, width + 2, device=device)
        self.mine = torch.empty(n, width, device=device)
        self.fresh = torch.empty(n, width, device=device)
        # The local rules (``use_tables``): (rule, its optimizer, its state over the bank's rows,
        # the initial values), one per distinct optimizer of the bank's tables.
        self.rules: list[tuple[Any, OptimizerConfig, dict[str, torch.Tensor], dict[str, float]]] = []


class _Indexes:
    """int64 index arrays for the device, sent in one copy (from pinned memory on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.arrays: list[np.ndarray] = []

    def add(self, a: np.ndarray) -> int:
        self.arrays.append(np.ascontiguousarray(a, np.int64))
        return len(self.arrays) - 1

    def send(self) -> list[torch.Tensor]:
        if not self.arrays:
            return []
        flat = np.concatenate(self.arrays) if len(self.arrays) > 1 else self.arrays[0]
        if self.device.type == "cpu":
            host = torch.from_numpy(flat)
            on = host
        else:
            host = torch.empty(len(flat), dtype=torch.int64, pin_memory=True)
            host.numpy()[:] = flat
            on = host.to(self.device, non_blocking=True)
        return list(torch.split(on, [len(a) for a in self.arrays]))


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` (2-d, one width) one after another: a view where they already lie so, else a copy."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    storage, at = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != storage or p.storage_offset() != at:
            return torch.cat(list(parts))
        at += p.numel()
    return first.as_strided((sum(len(p) for p in parts), first.shape[1]), (first.shape[1], 1), first.storage_offset())


class DeviceRowCache(RowCache):
    """``RowCache`` with its rows, held sums and local rule state on ``device`` (see the module
    docstring). Thread-safe like ``RowCache``: on CUDA the transfer thread calls it."""

    def __init__(self, config: RowCacheConfig, dims: Mapping[str, int], num_shards: int, device: torch.device | str) -> None:
        if config.hot:
            raise ValueError("--cache-hot: the host row cache only (not on the device yet)")
        self.device = torch.device(device)
        capacity = device_capacity(config.rows, dims, self.device)
        if capacity != config.rows:
            config = RowCacheConfig(capacity, config.bound, config.write_bound, config.policy, config.on_device, admission=config.admission)
        # The host's tables hold no floats (width 0): their compiled passes do the bookkeeping only.
        super().__init__(config, dict.fromkeys(dims, 0), num_shards)
        for tab, d in zip(self._tabs, dims.values(), strict=False):
            tab.dim = d
        self._dims = np.array(list(dims.values()), np.int64)
        self._dim_list = [int(d) for d in dims.values()]
        widths = sorted(set(self._dim_list))
        self._bank_of = np.array([widths.index(d) for d in self._dim_list], np.int64)
        self._base = np.zeros(len(dims), np.int64)
        self.banks: list[_Bank] = []
        cap = max(config.rows, 1)
        for w in widths:
            members = [g for g in range(len(dims)) if self._dim_list[g] == w]
            self._base[members] = np.arange(len(members), dtype=np.int64) * cap
            self.banks.append(_Bank(w, members, config.rows, self.device))
        self._local = np.zeros(len(dims), np.bool_)  # per table: its rule applied to the cached rows (on the device)
        self._rule_of = np.full(len(dims), -1, np.int64)  # per table: its rule's index in its bank's ``rules``
        self._optimizers: list[OptimizerConfig | None] = [None] * len(dims)
        self._side = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    # -- setup -------------------------------------------------------------------------------------

    def use_tables(self, tables: Sequence[TableConfig]) -> None:
        """``RowCache.use_tables``, with the local rules' state on the device."""
        self._columns()
        with self._lock:
            for spec in tables:
                g = self._index.get(spec.name)
                if g is None:
                    continue
                self._tabs[g].combined_stats = rule(spec.optimizer.name).combined_stats
                if self.config.bound > 0:
                    self._optimizers[g] = spec.optimizer
                    self._local[g] = True
            stats = [tab.combined_stats for tab in self._tabs]
            self._kinds = np.full((len(stats), max([1, *map(len, stats)])), -1, np.int64)
            for g, names in enumerate(stats):
                self._kinds[g, : len(names)] = [1 if n == "count" else 0 for n in names]
            self._nstats = [len(names) for names in stats]
            for bank in self.banks:
                bank.rules = []
                n = len(bank.values)
                for g in bank.tables:
                    opt = self._optimizers[g]
                    if opt is None:
                        continue
                    known = [i for i, (_, o, _, _) in enumerate(bank.rules) if o == opt]
                    if known:
                        self._rule_of[g] = known[0]
                        continue
                    r = rule(opt.name)
                    initial = r.initial_state(opt)
                    state = {k: torch.empty((n, *shape), device=self.device) for k, shape in r.state_shapes(bank.width).items()}
                    self._rule_of[g] = len(bank.rules)
                    bank.rules.append((r, opt, state, initial))
            # Rows cached before the rules were known start from the rules' initial state.
            for g, tab in enumerate(self._tabs):
                if tab.top:
                    self._reset(self._base[g] + np.arange(tab.top, dtype=np.int64), np.full(tab.top, g, np.int64), state_only=True)

    # -- pulls ---------------------------------------------------------------------------------------

    def _starts(self, parts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
        """Where each part's rows start in its bank's answer, and each bank's rows."""
        starts = np.zeros(len(parts), np.int64)
        sizes: dict[int, int] = {}
        for k, g in enumerate(parts.tolist()):
            b = int(self._bank_of[g])
            starts[k] = sizes.get(b, 0)
            sizes[b] = starts[k] + int(counts[k])
        return starts, sizes

    def _rows_at(self, parts: np.ndarray, offs: np.ndarray, starts: np.ndarray, at: np.ndarray,
                 slots: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For positions ``at`` of a step's ids (sorted): their parts' banks, their rows in their
        banks' answers, and (given their ``slots``) their rows in their banks."""
        k = np.searchsorted(offs, at, side="right") - 1
        g = parts[k]
        rows = starts[k] + at - offs[k]
        return self._bank_of[g], rows, (self._base[g] + slots if slots is not None else NO_IDS)

    def plan(self, sparse: Mapping[str, torch.Tensor], now: int) -> DevicePlan:
        """``RowCache.plan``; the hits are gathered on the device into the answer."""
        names, parts, ids, counts, offs = self._pull_ids(sparse)
        starts, sizes = self._starts(parts, counts)
        outs = {b: torch.empty(n, self.banks[b].width, device=self.device) for b, n in sizes.items()}
        oldest = np.full((len(names), self.num_shards), NONE, np.int64)
        zeros = np.zeros(len(names) + 1, np.int64)
        with self._lock:
            code, miss, later, miss_offs, miss_ids, found, keep = self._plan_ids(names, parts, ids, offs, now, NO_ROWS, zeros, oldest,
                                                                                 id(outs))
            hits = np.flatnonzero(code == 1)
            again = miss[found[miss] >= 0]
            if len(hits) or len(again):
                self._gather_hits(parts, offs, starts, outs, hits, found[hits], again, found[again])
        plan = DevicePlan(now, names, parts, ids, offs, torch.empty(0), zeros, oldest, later, miss, miss_offs, keep, outs=outs,
                          starts=starts)
        plan.miss = {t: torch.from_numpy(miss_ids[miss_offs[k]: miss_offs[k + 1]]) for k, t in enumerate(names)}
        plan.splits = self._miss_splits(names, miss_ids, miss_offs)
        return plan

    def _gather_hits(self, parts: np.ndarray, offs: np.ndarray, starts: np.ndarray, outs: dict[int, torch.Tensor], hits: np.ndarray,
                     hit_slots: np.ndarray, again: np.ndarray, again_slots: np.ndarray) -> None:
        """The rows at positions ``hits`` (of slots ``hit_slots``) into the answer; cached rows
        pulled again (``again``) start their ``fresh`` local changes from their held ones
        (``plan_all``'s float part of both)."""
        send = _Indexes(self.device)
        hb, hrow, hslot = self._rows_at(parts, offs, starts, hits, hit_slots)
        ab, _, aslot = self._rows_at(parts, offs, starts, again, again_slots)
        jobs = []
        for b in np.unique(np.concatenate([hb, ab])).tolist():
            sel, asel = hb == b, ab == b
            jobs.append((b, send.add(hrow[sel]), send.add(hslot[sel]), send.add(aslot[asel]), int(sel.sum()), int(asel.sum())))
        sent = send.send()
        for b, r, s, a, nh, na in jobs:
            bank = self.banks[b]
            if na:
                bank.fresh.index_copy_(0, sent[a], bank.mine.index_select(0, sent[a]))
            if nh:
                if nh == len(outs[b]):  # every row of the bank's answer a hit, in order
                    torch.index_select(bank.values, 0, sent[s], out=outs[b])
                else:
                    outs[b].index_copy_(0, sent[r], bank.values.index_select(0, sent[s]))

    # ``RowCache.merge``'s parts: the answer's rows are device tensors (views of the bank's answer).

    def _flight_key(self, plan: Plan) -> int:
        assert isinstance(plan, DevicePlan)
        return id(plan.outs)

    def _later(self, plan: Plan, loffs: np.ndarray) -> np.ndarray:
        assert isinstance(plan, DevicePlan)
        zeros = np.zeros(len(plan.names) + 1, np.int64)
        gone = later_all(*self._columns(), plan.parts, plan.ids, plan.offs, plan.later, loffs, plan.now - self.config.bound, NO_ROWS,
                         zeros, plan.oldest)
        keep = np.ones(len(plan.later), bool)
        keep[gone] = False
        self._gather_later(plan, plan.later[keep])
        return gone

    def _answer_rows(self, plan: Plan, pulled: PullResult) -> dict[str, torch.Tensor]:
        assert isinstance(plan, DevicePlan)
        rows: dict[str, torch.Tensor] = {}
        counts = np.diff(plan.offs).tolist()
        for k, (t, g) in enumerate(zip(plan.names, plan.parts.tolist(), strict=False)):
            got = pulled.rows.get(t)
            a = int(plan.starts[k])
            part = plan.outs[int(self._bank_of[g])][a: a + counts[k]]
            rows[t] = part if got is None or got.dtype == torch.float32 else part.to(got.dtype)
        return rows

    def _gather_later(self, plan: DevicePlan, at: np.ndarray) -> None:
        """The rows another pull refreshed (positions ``at``, found read recently enough) from the cache."""
        if not len(at):
            return
        k = np.searchsorted(plan.offs, at, side="right") - 1
        slots = np.empty(len(at), np.int64)
        for kk in np.unique(k).tolist():
            sel = k == kk
            slots[sel] = self._tabs[int(plan.parts[kk])].slots_of(plan.ids[at[sel]])
        self._gather_hits(plan.parts, plan.offs, plan.starts, plan.outs, at, slots, NO_IDS, NO_IDS)

    def _store(self, plan: Plan, pulled: PullResult) -> None:
        """``RowCache._store``: the pulled rows copied once to the device (on the side stream on
        CUDA) and written into their slots (plus their ``fresh`` local changes) and the answer."""
        assert isinstance(plan, DevicePlan)
        names, parts, moffs = plan.names, plan.parts, plan.miss_offs
        versions = self._read_versions(pulled, names)
        keys, pos = plan.ids[plan.miss_pos], plan.miss_pos
        got_row = np.arange(len(keys), dtype=np.int64) - np.repeat(moffs[:-1], np.diff(moffs))
        koffs = moffs
        where = np.arange(len(keys), dtype=np.int64)  # each key's index among the pull's misses
        slots = np.full(len(keys), -1, np.int64)
        zeros = np.zeros(len(names) + 1, np.int64)
        for attempt in range(2):
            for g, n in zip(parts.tolist(), np.diff(koffs).tolist(), strict=False):
                if self._tabs[g].room(n):
                    set_cells(self._columns().cells, g, self._tabs[g].cells)
            top = np.array([tab.top for tab in self._tabs], np.int64)
            nfree = np.array([tab.nfree for tab in self._tabs], np.int64)
            unplaced, placed, nplaced, stored = store_all(*self._columns(), parts, keys, koffs, pos, NO_ROWS, zeros, got_row, versions,
                                                          plan.now, self.num_shards, top, nfree, NO_ROWS, zeros, plan.offs, self._states,
                                                          self._sbase, self._scount, self._sinit, plan.keep if not attempt else NO_KEEP)
            slots[where] = stored
            self._placed(parts, top, nfree, nplaced)
            self._reset(self._base[np.repeat(parts, nplaced)] + placed, np.repeat(parts, nplaced))
            if not len(unplaced) or attempt:
                break
            at = np.searchsorted(koffs, unplaced, side="right") - 1
            for k in np.unique(at).tolist():
                g = int(parts[k])
                self._evict(names[k], self._tabs[g], int((at == k).sum()), plan.ids[plan.offs[k]: plan.offs[k + 1]])
            keys, pos, got_row, koffs = keys[unplaced], pos[unplaced], got_row[unplaced], np.searchsorted(unplaced, koffs)
            where = where[unplaced]
        self._write_pulled(plan, pulled, slots)

    def _reset(self, rows: np.ndarray, tables: np.ndarray, state_only: bool = False) -> None:
        """Bank rows of new slots: nothing held, no local changes, the rule's initial state
        (``state_only``: that state alone)."""
        if not len(rows):
            return
        banks = self._bank_of[tables]
        send = _Indexes(self.device)
        jobs = [(b, send.add(rows[banks == b]), tables[banks == b]) for b in np.unique(banks).tolist()]
        sent = send.send()
        for b, i, tabs in jobs:
            bank = self.banks[b]
            for t in () if state_only else (bank.pend, bank.mine, bank.fresh):
                t.index_fill_(0, sent[i], 0.0)
            for r, (_, _, state, initial) in enumerate(bank.rules):
                mine = self._rule_of[tabs] == r
                idx = sent[i] if mine.all() else sent[i][torch.from_numpy(np.flatnonzero(mine)).to(self.device)]
                for k, s in state.items():
                    s.index_fill_(0, idx, float(initial.get(k, 0.0)))

    def _write_pulled(self, plan: DevicePlan, pulled: PullResult, slots: np.ndarray) -> None:
        """The pull's rows (the misses, part k's at ``miss_offs[k]``; ``slots``: their slots, -1
        where none was left) into their slots and the answer."""
        moffs, parts = plan.miss_offs, plan.parts
        kpart = np.repeat(np.arange(len(parts)), np.diff(moffs))
        banks = self._bank_of[parts[kpart]]
        rows_in = plan.starts[kpart] + plan.miss_pos - plan.offs[kpart]
        send = _Indexes(self.device)
        jobs = []
        for b in np.unique(banks).tolist():
            ks = [k for k in range(len(parts)) if self._bank_of[parts[k]] == b and moffs[k + 1] > moffs[k]]
            got = self._to_device([pulled.rows[plan.names[k]] for k in ks])
            # Each miss's row in ``got`` (the bank's parts' pulled rows one after another).
            first = np.zeros(len(parts), np.int64)
            first[ks] = offsets([int(moffs[k + 1] - moffs[k]) for k in ks])[:-1]
            sel = banks == b
            src = first[kpart[sel]] + np.arange(len(kpart))[sel] - moffs[kpart[sel]]
            s = slots[sel]
            at = s >= 0
            gs = self._base[parts[kpart[sel]]][at] + s[at]
            jobs.append((b, got, send.add(src[at]), send.add(gs), send.add(rows_in[sel][at]), send.add(src[~at]),
                         send.add(rows_in[sel][~at]), int(at.sum()), int((~at).sum())))
        sent = send.send()
        for b, got, src, gs, out_rows, src_u, out_u, n, nu in jobs:
            bank, out = self.banks[b], plan.outs[b]
            if n:
                value = got.index_select(0, sent[src]).add_(bank.fresh.index_select(0, sent[gs]))
                bank.values.index_copy_(0, sent[gs], value)
                out.index_copy_(0, sent[out_rows], value)
            if nu:
                out.index_copy_(0, sent[out_u], got.index_select(0, sent[src_u]))

    def _to_device(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Pulled rows (host, one width) on the device as float32: one copy, from pinned memory
        on the side stream on CUDA (the compute stream waits for it on the device)."""
        if self.device.type == "cpu":
            return _joined(parts).float()
        host = pinned(parts)
        assert self._side is not None
        with torch.cuda.stream(self._side):
            got = host.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._side)
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(ready)
        got.record_stream(stream)
        return got.float()

    def _evict(self, t: str, tab: Any, n: int, protected: np.ndarray) -> None:
        victims = tab.victims(n, protected, self.config.policy)
        if not len(victims):
            return
        held = victims[tab.pending_since[victims] != NONE]
        if len(held):
            g = self._index[t]
            idx = _Indexes(self.device)
            idx.add(self._base[g] + held)
            sums = self.banks[int(self._bank_of[g])].pend.index_select(0, idx.send()[0])
            self._evicted.append((t, tab.ids[held].copy(), sums, tab.shard[held].copy(), tab.pending_version[held].copy()))
            self._holding[g] -= len(held)
        tab.remove(victims)
        self.evictions[t] += len(victims)

    # -- pushes ----------------------------------------------------------------------------------------

    def accumulate(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], clock: int,
                   versions: PullResult | None, flush: bool = False) -> tuple[Pushed, dict[tuple[int, str], int]]:
        """``RowCache.accumulate`` with the gradients on the device (rows of tables not cached,
        and held sums due, come to the host)."""
        due: Due = {}
        with self._lock:
            if grads:
                self._hold(grads, clock, versions, due)
            for t, e_ids, e_grads, e_shards, e_read in self._evicted:
                due.setdefault(t, []).append((e_ids, _host(e_grads)[0], e_shards, e_read))
            self._evicted.clear()
            taken, oldest = self._take(clock, flush)
        return coalesce(due, taken, oldest, self._names, self.tables)

    def _hold(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], clock: int, versions: PullResult | None, due: Due) -> None:
        """``RowCache._hold``: the sums, statistics and local rule's steps on the device."""
        names, parts = self._split(list(grads))
        ids, offs = joined_ids([grads[t][0] for t in names])
        counts = np.diff(offs)
        read = read_versions(versions, names, self.num_shards)
        zeros = np.zeros(len(names) + 1, np.int64)
        none = np.full(len(names), -1, np.int64)  # no local rule here: the device takes its steps
        slots, where, first, missing, missing_shards, got = hold_all(*self._columns(), parts, ids, offs, NO_ROWS, zeros, read, clock,
                                                                     self.num_shards, none, NO_ROWS, self._states, zeros[:-1],
                                                                     self._consts[parts])
        if len(first):
            self._holding[parts] += got[:, 1]
            self._queued(clock, first, np.repeat(parts, got[:, 1]))
        starts, _ = self._starts(parts, counts)
        send = _Indexes(self.device)
        hb, hrow, hslot = self._rows_at(parts, offs, starts, where, slots)
        mb, mrow, _ = self._rows_at(parts, offs, starts, missing)
        jobs = []
        for b in np.unique(self._bank_of[parts]).tolist():
            ks = [k for k in range(len(parts)) if self._bank_of[parts[k]] == b]
            rows = _joined([grads[names[k]][1].detach() for k in ks]).float()
            sel = hb == b
            tabs = parts[np.searchsorted(offs, where[sel], side="right") - 1]
            whole = int(sel.sum()) == len(rows)  # every row of the bank held (in order: positions ascend)
            jobs.append((b, rows, send.add(hrow[sel]), send.add(hslot[sel]), tabs, whole, send.add(mrow[mb == b])))
        sent = send.send()
        lost: dict[int, np.ndarray] = {}  # per bank: the gradients of its rows not cached, on the host
        for b, rows, r, s, tabs, whole, m in jobs:
            bank = self.banks[b]
            if len(sent[s]):
                g = rows if whole else rows.index_select(0, sent[r])
                add = torch.empty(len(g), bank.width + 2, device=self.device)
                add[:, : bank.width] = g
                add[:, bank.width] = (g * g).mean(1)
                add[:, bank.width + 1] = 1.0
                _add_rows(bank.pend, sent[s], add)
                self._local_steps(bank, sent[s], g, tabs, clock)
            if len(sent[m]):
                lost[b] = _host(rows.index_select(0, sent[m]))[0].numpy()
        if len(missing):  # pushed with this step's take, each row one gradient (``with_unheld``), as the host cache's
            self._unheld_now = self._unheld(parts, ids, offs, missing, missing_shards, read, lost)

    def _unheld(self, parts: np.ndarray, ids: np.ndarray, offs: np.ndarray, missing: np.ndarray, missing_shards: np.ndarray,
                read: np.ndarray, lost: dict[int, np.ndarray]) -> tuple[np.ndarray, ...]:
        """A step's gradients of rows not cached (``missing``: their positions in ``ids``, part k's
        at ``offs[k]``; ``lost[b]``: bank b's rows of them, in that order) as ``with_unheld`` takes
        a step's (``RowCache._unheld_now``), with only those rows: their ids one part after
        another, and their gradients flat in the same order."""
        n = np.bincount(np.searchsorted(offs, missing, side="right") - 1, minlength=len(parts))
        if len(lost) == 1:  # the usual case, one row width: the bank's rows are the parts' in order
            flat = next(iter(lost.values())).reshape(-1)
        else:
            at, pieces = dict.fromkeys(lost, 0), []
            for k, c in enumerate(n.tolist()):
                if c:
                    b = int(self._bank_of[parts[k]])
                    pieces.append(lost[b][at[b]: at[b] + c].reshape(-1))
                    at[b] += c
            flat = np.concatenate(pieces)
        return (parts, ids[missing], offsets(n), np.ascontiguousarray(flat, np.float32), offsets(n * self._dims[parts]),
                np.arange(len(missing), dtype=np.int64), missing_shards, read)

    def _local_steps(self, bank: _Bank, rows: torch.Tensor, g: torch.Tensor, tabs: np.ndarray, clock: int) -> None:
        """The tables' rules applied to their held rows (``rows`` of the bank, gradients ``g``;
        ``tabs``: each row's table), and each row's change added to its local changes."""
        local = self._local[tabs]
        if not local.any():
            return
        for r, (upd, opt, state, _) in enumerate(bank.rules):
            mine = local & (self._rule_of[tabs] == r)
            if not mine.any():
                continue
            if mine.all():
                idx, grad = rows, g
            else:
                pick = torch.from_numpy(np.flatnonzero(mine)).to(self.device)
                idx, grad = rows.index_select(0, pick), g.index_select(0, pick)
            before = bank.values.index_select(0, idx)
            w = before.clone()
            st = {k: s.index_select(0, idx) for k, s in state.items()}
            upd.apply(opt, w, grad, st, lr_scale=opt.schedule.factor(opt.lr, clock))
            bank.values.index_copy_(0, idx, w)
            for k, s in state.items():
                s.index_copy_(0, idx, st[k])
            change = w.sub_(before)
            _add_rows(bank.mine, idx, change)
            _add_rows(bank.fresh, idx, change)

    def _held_sums(self, sums: np.ndarray, stats: np.ndarray, square: np.ndarray, grads: np.ndarray, count: np.ndarray,
                   slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``RowCache._held_sums``: the due sums gathered on the device and copied to the host (one
        copy per bank), their slots' held sums and local changes cleared there."""
        tab_of = np.repeat(np.arange(len(self._tabs)), count)
        rows = self._base[tab_of] + slots
        banks = self._bank_of[tab_of]
        send = _Indexes(self.device)
        jobs = [(b, send.add(rows[banks == b])) for b in np.unique(banks).tolist()]
        sent = send.send()
        gathered: dict[int, torch.Tensor] = {}
        for b, i in jobs:
            bank = self.banks[b]
            gathered[b] = bank.pend.index_select(0, sent[i])  # read before the fills below, in the stream's order
            bank.pend.index_fill_(0, sent[i], 0.0)
            bank.mine.index_fill_(0, sent[i], 0.0)
        if len(gathered) == 1:
            # One row width: the sums and their mean squares split on the device, each copied to
            # the host as the take needs it (no host copy of the held columns, one wait).
            (b, got), = gathered.items()
            w = self.banks[b].width
            host_sums, host_square = _host(got[:, :w].contiguous(), got[:, w].contiguous())
            sums, square = host_sums.numpy().reshape(-1), host_square.numpy()
        else:
            held = {b: _host(got)[0].numpy() for b, got in gathered.items()}
            parts_s, parts_q, at = [], [], dict.fromkeys(held, 0)
            for g, n in enumerate(count.tolist()):
                if n:
                    b = int(self._bank_of[g])
                    h = held[b][at[b]: at[b] + n]
                    at[b] += n
                    parts_s.append(h[:, : self._dim_list[g]].reshape(-1))
                    parts_q.append(h[:, self._dim_list[g]])
            sums = np.concatenate(parts_s) if parts_s else NO_ROWS
            square = np.concatenate(parts_q).astype(np.float32) if parts_q else NO_ROWS
        return sums, self._stats(stats, square, grads, count), square

    def _stats(self, stats: np.ndarray, square: np.ndarray, grads: np.ndarray, count: np.ndarray) -> np.ndarray:
        """``take_all``'s statistics with each row's sum of mean(g * g) from the device (the
        host's columns hold none): per table, column c its ``kinds``' column."""
        at = q = 0
        for g, n in enumerate(count.tolist()):
            k = self._nstats[g]
            if n and k:
                block = stats[q: q + n * k].reshape(n, k)
                for c in range(k):
                    if self._kinds[g, c] == 0:
                        block[:, c] = square[at: at + n]
                block[grads[at: at + n] <= 1, 0] = -1.0
            at, q = at + n, q + n * k
        return stats

    def memory_bytes(self) -> dict[str, int]:
        """Bytes each table's cache holds: on the device (its bank's rows for its slots in use)
        and on the host (the slots' columns, the id index, the admission's doorkeeper)."""
        out = {}
        door = self._door.shape[1] * 8 if self._window else 0
        for t, tab in self.tables.items():
            bank = self.banks[int(self._bank_of[self._index[t]])]
            per_row = 4 * (bank.values.shape[1] + bank.pend.shape[1] + 2 * bank.width) + sum(
                4 * int(np.prod(s.shape[1:])) for _, _, state, _ in bank.rules for s in state.values())
            out[t] = tab.size * (per_row + 8 * 9) + tab.index_entries() * 16 + door
        return out


def _add_rows(t: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    """``t[idx] += rows`` for unique ``idx``: ``index_add_``'s sums (one float add each), as a
    gather, an add and a scatter (the CPU's ``index_add_`` into a large tensor takes ~50 ms)."""
    t.index_copy_(0, idx, t.index_select(0, idx).add_(rows))


def _host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Device tensors' values on the host (through pinned memory on CUDA, one wait for them all)."""
    on_device = [t for t in tensors if t.device.type != "cpu"]
    if not on_device:
        return list(tensors)
    out = []
    for t in tensors:
        if t.device.type != "cpu":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            t = host
        out.append(t)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(on_device[0].device))
    done.synchronize()
    return out
