"""A worker-side cache of embedding rows with per-row staleness bounds (HET's two bounds).

``RowCache`` keeps up to ``rows`` rows per table. Each cached row remembers the worker clock it
was read at and the table version the shard read it at. With read bound R > 0 a pull at clock
``now`` is answered from the cache for every row read at a clock >= ``now - R``; the others are
pulled (refreshed). A step's row gradients are added to the rows' pending sums; a row's sum is
pushed once its oldest gradient is W (the write bound) clocks old, when the row is evicted, or
at a flush (evaluation, the end of training). R = W = 0 sends exactly what no cache sends (every
row pulled, every gradient pushed in the step it was made).

Read-your-own-writes (once ``use_tables`` names the tables' rules, as ``Trainer`` does after it
declares them; read bound > 0): each step's gradients are applied to the cached rows as they are
held, by the table's rule with its learning rate, schedule and weight decay, and with a rule state
of the worker's own per cached row (Adagrad's sum, Adam's moments and count, FTRL's z and n),
started at the rule's initial state when the row is cached and kept while it stays (the shard's
state is never pulled). For SGD that is the shard's step exactly; for the others an estimate
from this worker's gradients alone (with one worker the shard's own state, the row never evicted;
with several, short of the other workers' gradients). A refresh stores the shard's answer plus the worker's own
changes that answer lacks: those of the gradients still held when the refresh was planned and
of every step since (so with SGD a refreshed row is the shard's value once the held gradients
land).

A combined push is the **sum** of the row's pending gradients, sent as one gradient, and, once
``use_tables`` named the rules, what the table's rule needs to update its state as if it had taken
the k steps (``UpdateRule.combined_stats``, ``SparseBlock.combined``): for Adagrad, row-wise
Adagrad and FTRL one float per row, the sum over the k gradients of mean(g * g); for Adam that
and the count k; nothing for SGD, whose step on the sum is the k steps. A row that holds one
gradient sends -1 there and takes the ordinary step; a push none of whose rows combine (write
bound 0) sends nothing, so it is exactly what no cache sends. The shard applies the rule's
``combine`` (``protos.update_rules``, ``protos.ctr_rules``). The sum is what the shard's state
stays authoritative on; the local copy's own steps are never pushed. Its read version is the
oldest read version of the rows it combines, so shards count its staleness from the oldest read
(conservative).

A pull whose table version for a shard went back (a restarted shard, a reset table) marks every
cached row of that shard and table stale: they are refreshed by the next pull that wants them.

``CachedClient`` puts the cache in front of a ``PSClient`` (pull, push, push_pull, flush) and
counts the traffic (``tether.worker.traffic``); with no cache it passes calls through unchanged.
Each table's slots and id index (a compiled hash table) are ``tether.worker.row_slots.Table``;
each step's passes over a table (plan, store, hold, take) are compiled loops,
``tether.worker.cache_kernels``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from typing import TYPE_CHECKING, Any

from tether.protos.optimizers import rule
from tether.protos.specs import TableConfig
from tether.worker.results import Handle, PullResult, PushAck
from tether.worker.cache_kernels import assemble, hold_rows, later_rows, oldest_per_shard, plan_rows, store_rows, take_rows
from tether.worker.row_slots import NONE, STALE, Due, Table, coalesce, warm_up
from tether.worker.traffic import TrafficMeter

if TYPE_CHECKING:
    from tether.worker.client import PSClient

__all__ = ["POLICIES", "CachedClient", "RowCache", "RowCacheConfig"]

log = logging.getLogger(__name__)

POLICIES = ("lru", "lfu")


@dataclass(frozen=True)
class RowCacheConfig:
    """``rows``: rows cached per table (0: no cache); ``bound``: read bound R in this worker's
    clocks (0: every pull reads the shards); ``write_bound``: W, clocks a row's gradients may be
    held before they are pushed (None: the same as ``bound``); ``policy``: eviction, lru or lfu."""

    rows: int = 0
    bound: int = 0
    write_bound: int | None = None
    policy: str = "lru"

    def __post_init__(self) -> None:
        for name in ("rows", "bound"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"cache_{name} (--cache-{name}) must be an int >= 0, got {value!r}")
        if self.write_bound is not None and (not isinstance(self.write_bound, int) or self.write_bound < 0):
            raise ValueError(f"cache_write_bound (--cache-write-bound) must be empty or an int >= 0, got {self.write_bound!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"cache_policy (--cache-policy) must be one of {', '.join(POLICIES)}, got {self.policy!r}")

    @property
    def active(self) -> bool:
        return self.rows > 0

    @property
    def writes(self) -> int:
        return self.bound if self.write_bound is None else self.write_bound


@dataclass
class _Plan:
    """A pull's split per table, as positions in its sorted ids: which the cache answers
    (``hit``, with ``values`` copied at plan time), which an earlier pull still in flight is
    refreshing (``later``: read from the cache once that pull is stored) and which go to the
    shards (``miss_pos``; their ids ``miss``)."""

    now: int
    ids: dict[str, torch.Tensor]
    hit: dict[str, np.ndarray] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    versions: dict[str, np.ndarray] = field(default_factory=dict)  # read versions of the hits
    shards: dict[str, np.ndarray] = field(default_factory=dict)  # the hits' shards
    later: dict[str, np.ndarray] = field(default_factory=dict)
    miss_pos: dict[str, np.ndarray] = field(default_factory=dict)
    miss: dict[str, torch.Tensor] = field(default_factory=dict)


_NO_IDS = np.zeros(0, np.int64)
Pushed = dict[str, tuple[torch.Tensor, ...]]  # per table: ids, summed gradients (and a combined push's statistics)
_NO_FLIGHTS = np.zeros(1, np.int64)


class RowCache:
    """Cached rows of every table with their read clocks, versions and pending gradients
    (see the module docstring). Thread-safe: on CUDA the transfer thread calls it too."""

    def __init__(self, config: RowCacheConfig, dims: Mapping[str, int], num_shards: int) -> None:
        self.config = config
        self.num_shards = max(num_shards, 1)
        self.tables = {t: Table(d, config.rows) for t, d in dims.items()}
        warm_up()  # the compiled index and passes loaded before the first step, not in it
        self._lock = threading.Lock()
        self._evicted: list[tuple[str, np.ndarray, torch.Tensor, np.ndarray, np.ndarray]] = []
        # Per table: the pulls in flight (their plans' ids, clocks and the ids they refresh).
        self._inflight: dict[str, list[tuple[int, int, np.ndarray]]] = {t: [] for t in dims}
        self.hits = dict.fromkeys(dims, 0)
        self.refreshed = dict.fromkeys(dims, 0)
        self.evictions = dict.fromkeys(dims, 0)
        self.invalidated = dict.fromkeys(dims, 0)

    def use_tables(self, tables: Sequence[TableConfig]) -> None:
        """The rules the shards apply to the tables (the specs the worker declared): from now on
        the worker's own gradients are applied to its cached rows (read-your-own-writes). Not
        with read bound 0, whose every pull answers with the shards' rows as they are."""
        with self._lock:
            for spec in tables:
                if spec.name in self.tables:
                    self.tables[spec.name].combined_stats = rule(spec.optimizer.name).combined_stats
                    if self.config.bound > 0:
                        self.tables[spec.name].local_rule(spec.optimizer)

    def plan(self, sparse: Mapping[str, torch.Tensor], now: int) -> _Plan:
        """Split a pull of ``sparse`` (table -> sorted unique ids) at clock ``now``."""
        plan = _Plan(now, dict(sparse))
        bound = self.config.bound
        with self._lock:
            for t, ids in sparse.items():
                tab, inflight = self.tables[t], self._inflight[t]
                arr = np.ascontiguousarray(ids.numpy(), np.int64)
                flights, offsets = _NO_IDS, _NO_FLIGHTS
                if bound > 0:
                    inflight[:] = [e for e in inflight if now - e[1] <= bound]
                    if inflight:  # each pull's refreshed ids are sorted (a subset of sorted ids)
                        flights = inflight[0][2] if len(inflight) == 1 else np.concatenate([e[2] for e in inflight])
                        offsets = np.cumsum([0] + [len(e[2]) for e in inflight], dtype=np.int64)
                hit, values, versions, shards, later, miss, refreshed = plan_rows(
                    tab.cells, arr, now, bound, tab.read_clock, tab.last_used, tab.uses, tab.read_version, tab.shard, tab.vals,
                    flights, offsets, tab.mine, tab.fresh)
                miss_ids = arr[miss]
                if bound > 0:
                    inflight.append((id(plan), now, miss_ids))
                plan.hit[t], plan.values[t], plan.versions[t], plan.shards[t] = hit, values, versions, shards
                plan.later[t], plan.miss_pos[t], plan.miss[t] = later, miss, torch.from_numpy(miss_ids)
                self.hits[t] += len(hit)
                self.refreshed[t] += int(refreshed)
        return plan

    def merge(self, plan: _Plan, pulled: PullResult) -> tuple[PullResult, dict[str, torch.Tensor]]:
        """The pull's answer for every id of the plan (cached rows and pulled ones), and the
        pulled rows stored. Its table versions are, per shard and table, the oldest of any row's.
        Also returns, per table, the ids of ``later`` rows the cache still lacks (an earlier pull
        that never came back): the caller pulls those and ``fill``s them in."""
        rows: dict[str, torch.Tensor] = {}
        versions = dict(pulled.table_versions)
        lacking: dict[str, torch.Tensor] = {}
        with self._lock:
            for t, ids in plan.ids.items():
                tab = self.tables[t]
                hit, miss, later = plan.hit[t], plan.miss_pos[t], plan.later[t]
                got = pulled.rows.get(t)
                out = torch.empty(len(ids), tab.dim)
                assemble(out.numpy(), hit, plan.values[t])
                if len(miss):
                    assert got is not None
                    self._store(t, tab, plan.miss[t].numpy(), np.ascontiguousarray(got.float().numpy()), pulled, plan.now,
                                ids.numpy(), out.numpy(), miss)
                    self._inflight[t][:] = [e for e in self._inflight[t] if e[0] != id(plan)]
                read, read_shards = plan.versions[t], plan.shards[t]
                if len(later):
                    read, read_shards = self._later(t, tab, plan, out, lacking, read, read_shards)
                rows[t] = out if got is None or got.dtype == torch.float32 else out.to(got.dtype)
                if len(read):
                    oldest = oldest_per_shard(read_shards, read, self.num_shards)
                    for sh in np.flatnonzero(oldest != NONE).tolist():
                        v = int(oldest[sh])
                        versions[(sh, t)] = min(v, versions.get((sh, t), v))
        return PullResult(rows, pulled.dense, versions, pulled.dense_versions, pulled.ack), lacking

    def _later(self, t: str, tab: Table, plan: _Plan, out: torch.Tensor, lacking: dict[str, torch.Tensor], read: np.ndarray,
               read_shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``out`` that an earlier pull was refreshing, from the cache where it has them
        (the others go to ``lacking``); the read versions and shards with theirs added."""
        where = plan.later[t]
        wanted = plan.ids[t].numpy()[where]
        missing, versions, shards = later_rows(tab.cells, wanted, where, plan.now - self.config.bound, tab.vals, tab.read_clock,
                                               tab.read_version, tab.shard, out.numpy())
        if len(missing):
            lacking[t] = torch.from_numpy(wanted[missing])
        return np.concatenate([read, versions]), np.concatenate([read_shards, shards])

    @staticmethod
    def fill(result: PullResult, plan: _Plan, lacking: Mapping[str, torch.Tensor], pulled: PullResult) -> None:
        """Put the rows of ``lacking`` (pulled on their own) into ``result``."""
        for t, ids in lacking.items():
            pos = torch.searchsorted(plan.ids[t], ids)
            result.rows[t][pos] = pulled.rows[t].to(result.rows[t].dtype)
            for key, v in pulled.table_versions.items():
                if key[1] == t:
                    result.table_versions[key] = min(v, result.table_versions.get(key, v))

    def _store(self, t: str, tab: Table, ids: np.ndarray, got: np.ndarray, pulled: PullResult, now: int,
               protected: np.ndarray, out: np.ndarray, pos: np.ndarray) -> None:
        """Pulled rows ``got`` (float32) of ``ids`` into the cache: refreshed where cached,
        placed (evicting if the table is full) where not; rows ``pos`` of the answer ``out`` are
        them as stored (with the worker's own changes the shard's answer lacks)."""
        for (s, table), v in pulled.table_versions.items():
            if table != t:
                continue
            if v < tab.max_version.get(s, v):
                # The shard's table went back (restarted from a checkpoint, or reset): whatever
                # was read from it before is refreshed on its next pull.
                stale = np.flatnonzero(tab.used[: tab.top] & (tab.shard[: tab.top] == s))
                tab.read_clock[stale] = STALE
                self.invalidated[t] += len(stale)
                tab.max_version[s] = v
            tab.max_version[s] = max(v, tab.max_version.get(s, v))
        table_versions = self._versions(pulled, t)
        args = (tab.vals, tab.read_clock, tab.shard, tab.read_version, table_versions, now, self.num_shards, tab.fresh, out)
        new = store_rows(tab.cells, ids, got, *args, pos)
        if len(new):
            placed = new[self._place(t, tab, ids[new], protected, now) >= 0]
            if len(placed):
                store_rows(tab.cells, ids[placed], got[placed], *args, pos[placed])

    def _versions(self, pulled: PullResult | None, t: str) -> np.ndarray:
        """The read version of ``t`` per shard (0 where none)."""
        if pulled is None:
            return np.zeros(self.num_shards, np.int64)
        return np.array([pulled.table_versions.get((s, t), 0) for s in range(self.num_shards)], np.int64)

    def _place(self, t: str, tab: Table, ids: np.ndarray, protected: np.ndarray, now: int) -> np.ndarray:
        """Slots for new ids (-1 where none is left: that row is not cached), evicting
        rows the current pull does not want when the table is full."""
        want = len(ids)
        short = want - tab.available()
        if short > 0:
            self._evict(t, tab, short, protected)
        slots = tab.take(want)
        out = np.full(want, -1, np.int64)
        k = len(slots)
        if k:
            out[:k] = slots
            tab.place(ids[:k], slots, now)
        return out

    def _evict(self, t: str, tab: Table, n: int, protected: np.ndarray) -> None:
        mask = tab.used[: tab.top].copy()
        prot = tab.slots_of(protected)
        mask[prot[prot >= 0]] = False
        cand = np.flatnonzero(mask)
        if not len(cand):
            return
        if self.config.policy == "lru":
            key = tab.last_used[cand]
        else:  # lfu, ties broken by recency
            key = tab.uses[cand] * (1 << 32) + (tab.last_used[cand] & 0xFFFFFFFF)
        if n < len(cand):  # the n smallest keys, ties to the lowest slot (as a stable sort of all)
            kth = np.partition(key, n - 1)[n - 1]
            less = np.flatnonzero(key < kth)
            pick = np.concatenate([less, np.flatnonzero(key == kth)[: n - len(less)]])
            pick.sort()
            victims = cand[pick[np.argsort(key[pick], kind="stable")]]
        else:
            victims = cand[np.argsort(key, kind="stable")]
        held = victims[tab.pending_since[victims] != NONE]
        if len(held):
            self._evicted.append((t, tab.ids[held].copy(), tab.pending[torch.from_numpy(held)].clone(),
                                  tab.shard[held].copy(), tab.pending_version[held].copy()))
            tab.holding -= len(held)
        tab.remove(victims)
        self.evictions[t] += len(victims)

    def accumulate(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], clock: int,
                   versions: PullResult | None, flush: bool = False) -> tuple[Pushed, dict[tuple[int, str], int]]:
        """Add a step's row gradients (pushed at ``clock``) to the pending sums and return what
        is due now (``flush``: everything held), with the read version per shard and table: per
        table ``(ids, sums)``, or ``(ids, sums, stats)`` where rows combine several gradients
        (``Table.combined``)."""
        due: Due = {}
        with self._lock:
            for t, (step_ids, g) in grads.items():
                self._hold(t, np.ascontiguousarray(step_ids.numpy(), np.int64), g, clock, versions, due)
            for t, e_ids, e_grads, e_shards, e_read in self._evicted:
                due.setdefault(t, []).append((e_ids, e_grads, e_shards, e_read))
            self._evicted.clear()
            for t, tab in self.tables.items():
                ready = tab.due(clock, self.config.writes, flush)
                if len(ready):
                    ids, summed, shards, read = take_rows(ready, tab.ids, tab.pend, tab.shard, tab.pending_since, tab.pending_version,
                                                          tab.mine)
                    tab.holding -= len(ready)
                    due.setdefault(t, []).append((ids, torch.from_numpy(summed), shards, read))
        grads, oldest = coalesce(due)
        return {t: self.tables[t].combined(ids, held) for t, (ids, held) in grads.items()}, oldest

    def _hold(self, t: str, arr: np.ndarray, g: torch.Tensor, clock: int, versions: PullResult | None, due: Due) -> None:
        """Add one table's step gradients to its rows' pending sums and apply them to the cached
        rows by the table's rule (rows not cached: due at once)."""
        tab = self.tables[t]
        read = self._versions(versions, t)
        grads = np.ascontiguousarray(g.detach().float().numpy())
        slots, pos, first, missing, missing_shards = hold_rows(tab.cells, arr, grads, tab.pend, tab.pending_since, tab.pending_version,
                                                               tab.shard, read, clock, self.num_shards)
        if len(missing):  # not cached (the table was full): pushed at once, each row one gradient
            rows = grads[missing]
            extra = np.stack([(rows * rows).mean(1), np.ones(len(rows), np.float32)], 1)
            due.setdefault(t, []).append((arr[missing], torch.from_numpy(np.concatenate([rows, extra], 1)), missing_shards,
                                          read[missing_shards]))
        tab.hold(first, clock)
        tab.step(slots, grads if len(slots) == len(arr) else grads[pos], clock)

    def pending_rows(self) -> int:
        """Rows whose gradients are held (counted as they are held and pushed: no scan)."""
        with self._lock:
            return sum(tab.holding for tab in self.tables.values()) + sum(len(e[1]) for e in self._evicted)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes each table's cache holds (the slots used: values, pending sums, the local
        changes held and in flight, the local rule's state, their columns; the id index)."""
        return {t: tab.size * ((tab.dim * 4 + 2) * 4 + sum(a[0].nbytes for a in tab.state.values()) + 8 * 9) + tab.index_entries() * 16
                for t, tab in self.tables.items()}


class CachedClient:
    """A ``PSClient``'s pull, push and push_pull through a ``RowCache`` (or straight through,
    with none), counting rows and bytes moved per table (``TrafficMeter``)."""

    def __init__(self, inner: PSClient, config: RowCacheConfig, dims: Mapping[str, int], meter: TrafficMeter) -> None:
        self.inner = inner
        self.cache = RowCache(config, dims, inner.num_shards) if config.active else None
        self.meter = meter
        self.clock = 0  # the last clock pushed: the "now" of the next pull

    def use_tables(self, tables: Sequence[TableConfig]) -> None:
        """The specs the worker declared: the cache applies their rules to its rows (``RowCache.use_tables``)."""
        if self.cache is not None:
            self.cache.use_tables(tables)

    @property
    def config(self) -> Any:
        """The client's ``ClientConfig`` (deadlines, wire dtype)."""
        return self.inner.config

    def _plan(self, sparse: Mapping[str, torch.Tensor]) -> _Plan | None:
        self.meter.wanted(sparse, self.clock)
        if self.cache is None:
            self.meter.pulled(sparse)
            return None
        plan = self.cache.plan(sparse, self.clock)
        self.meter.pulled(plan.miss)
        self.meter.cache(self.cache)
        return plan

    def _answer(self, plan: _Plan | None, handle: Handle[PullResult]) -> Handle[PullResult]:
        if plan is None or self.cache is None:
            return handle
        cache, inner = self.cache, self.inner

        def combine(answers: list[PullResult]) -> PullResult:
            result, lacking = cache.merge(plan, answers[0])
            if lacking:
                # Rows another pull was refreshing, which never came back: pulled now, on their own.
                self.meter.pulled(lacking)
                extra = inner.pull(dict(lacking)).result(inner.config.call_deadline_s + inner.config.timeout_s)
                cache.fill(result, plan, lacking, extra)
            return result

        return Handle([handle], combine)

    def _due(self, sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None, clock: int,
             versions: PullResult | None, flush: bool = False) -> tuple[Mapping[str, tuple[torch.Tensor, ...]], PullResult | None]:
        if self.cache is None:
            self.meter.pushed(sparse or {})
            return sparse or {}, versions
        grads, table_versions = self.cache.accumulate(sparse or {}, clock, versions, flush)
        self.meter.pushed(grads)
        if versions is not None and sparse is not None and grads.keys() == sparse.keys() and all(
                len(grads[t]) == 2 and torch.equal(grads[t][0], sparse[t][0]) for t in grads):
            # Every row's gradient goes as it was made (write bound 0): the step's own versions
            # (and, for DC-ASGD, the values it read), as without a cache.
            return grads, versions
        # Combined gradients: their oldest read versions; no read values (DC-ASGD is not applied to them).
        return grads, PullResult({}, {}, table_versions, dict(versions.dense_versions) if versions else {})

    def pull(self, sparse: Mapping[str, torch.Tensor] | None = None, dense: Sequence[str] = ()) -> Handle[PullResult]:
        plan = self._plan(sparse or {})
        ask = dict(sparse or {}) if plan is None else {t: ids for t, ids in plan.miss.items() if len(ids)}
        return self._answer(plan, self.inner.pull(ask, dense))

    def push(self, sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
             dense: Mapping[str, torch.Tensor] | None = None, clock: int = 0, versions: PullResult | None = None) -> Handle[PushAck]:
        self.clock = max(self.clock, clock)
        grads, read = self._due(sparse, clock, versions)
        return self.inner.push(grads, dense, clock=clock, versions=read)

    def push_pull(self, push_sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                  push_dense: Mapping[str, torch.Tensor] | None = None, pull_sparse: Mapping[str, torch.Tensor] | None = None,
                  pull_dense: Sequence[str] = (), clock: int = 0, versions: PullResult | None = None) -> Handle[PullResult]:
        self.clock = max(self.clock, clock)
        grads, read = self._due(push_sparse, clock, versions)
        plan = self._plan(pull_sparse or {})
        ask = dict(pull_sparse or {}) if plan is None else {t: ids for t, ids in plan.miss.items() if len(ids)}
        return self._answer(plan, self.inner.push_pull(grads, push_dense, ask, pull_dense, clock=clock, versions=read))

    def flush(self, clock: int | None = None) -> Handle[PushAck] | None:
        """Push every held gradient now (at ``clock``; None: the last clock pushed), or None
        when nothing is held."""
        if self.cache is None or not self.cache.pending_rows():
            return None
        at = self.clock if clock is None else clock
        grads, read = self._due({}, at, None, flush=True)
        return self.inner.push(grads, {}, clock=at, versions=read)
