"""A worker-side cache of embedding rows with per-row staleness bounds (HET's two bounds).

``RowCache`` keeps up to ``rows`` rows per table. Each cached row remembers the worker clock it
was read at and the table version the shard read it at. With read bound R > 0 a pull at clock
``now`` is answered from the cache for every row read at a clock >= ``now - R``; the others are
pulled (refreshed). A step's row gradients are added to the rows' pending sums; a row's sum is
pushed once its oldest gradient is W (the write bound) clocks old, when the row is evicted, or
at a flush (evaluation, the end of training). R = W = 0 sends exactly what no cache sends (every
row pulled, every gradient pushed in the step it was made).

The cached copy is the shard's value as read: the worker's own pending gradients are not applied
to it (with Adagrad or Adam that would need the shard's optimizer state, which is never pulled).
A combined push is the **sum** of the row's pending gradients, sent as one gradient: the shard
applies its rule once to that sum (for SGD the same as the separate steps; for Adagrad/Adam one
step on the sum, not k steps). Its read version is the oldest read version of the rows it
combines, so shards count its staleness from the oldest read (conservative).

A pull whose table version for a shard went back (a restarted shard, a reset table) marks every
cached row of that shard and table stale: they are refreshed by the next pull that wants them.

``CachedClient`` puts the cache in front of a ``PSClient`` (pull, push, push_pull, flush) and
counts the traffic (``tether.worker.traffic``); with no cache it passes calls through unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from typing import TYPE_CHECKING, Any

from tether.protos.partition import shard_of_ids
from tether.worker.results import Handle, PullResult, PushAck
from tether.worker.traffic import TrafficMeter

if TYPE_CHECKING:
    from tether.worker.client import PSClient

__all__ = ["POLICIES", "CachedClient", "RowCache", "RowCacheConfig"]

log = logging.getLogger(__name__)

POLICIES = ("lru", "lfu")
_STALE = np.iinfo(np.int64).min // 2  # a read clock no bound reaches: refreshed on the next pull
_NONE = np.iinfo(np.int64).max  # no pending gradient / no read version yet

Grads = dict[str, tuple[torch.Tensor, torch.Tensor]]


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


class _Table:
    """One table's cached rows: slots in arrays that grow (doubling) up to the capacity."""

    _COLUMNS: dict[str, int] = {"ids": 0, "shard": 0, "read_clock": int(_STALE), "read_version": int(_NONE), "last_used": 0,
                                "uses": 0, "pending_since": int(_NONE), "pending_version": int(_NONE)}

    def __init__(self, dim: int, capacity: int) -> None:
        self.dim, self.capacity, self.size = dim, capacity, 0
        self.free: list[int] = []
        # Id -> slot: sorted ids and their slots, and a small sorted array of recent inserts
        # merged into it (rebuilt from the live slots) once it outgrows a sixteenth of it. An
        # evicted row's entry may linger in the large one: a slot counts only while it holds that id.
        self._keys, self._kslots = np.zeros(0, np.int64), np.zeros(0, np.int64)
        self._new_keys, self._new_slots = np.zeros(0, np.int64), np.zeros(0, np.int64)
        self.max_version: dict[int, int] = {}  # per shard: the largest table version seen
        empty = np.zeros(0, np.int64)
        self.ids, self.shard, self.read_clock, self.read_version = empty, empty, empty, empty
        self.last_used, self.uses, self.pending_since, self.pending_version = empty, empty, empty, empty
        self.used = np.zeros(0, bool)
        self.values = torch.zeros(0, dim)  # the rows as read
        self.pending = torch.zeros(0, dim)  # the sums of the gradients held
        self.alloc(min(capacity, 1024))

    def alloc(self, n: int) -> None:
        grow = n - self.size
        for name, fill in self._COLUMNS.items():
            setattr(self, name, np.concatenate([getattr(self, name), np.full(grow, fill, np.int64)]))
        self.used = np.concatenate([self.used, np.zeros(grow, bool)])
        self.values = torch.cat([self.values, torch.zeros(grow, self.dim)])
        self.pending = torch.cat([self.pending, torch.zeros(grow, self.dim)])
        self.free.extend(range(n - 1, self.size - 1, -1))
        self.size = n

    def _find(self, keys: np.ndarray, slots: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
        if not len(keys) or not len(ids):
            return
        pos = np.searchsorted(keys, ids).clip(max=len(keys) - 1)
        found = keys[pos] == ids
        s = slots[pos[found]]
        live = self.used[s] & (self.ids[s] == ids[found])
        out[np.flatnonzero(found)[live]] = s[live]

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where it is not cached."""
        out = np.full(len(ids), -1, np.int64)
        self._find(self._keys, self._kslots, ids, out)
        self._find(self._new_keys, self._new_slots, ids, out)
        return out

    def verify(self, ids: np.ndarray, guess: np.ndarray) -> np.ndarray:
        """``slots_of(ids)``, given slots found earlier: those still holding their id are kept,
        the others looked up again."""
        ok = guess >= 0
        g = guess[ok]
        ok[ok] = self.used[g] & (self.ids[g] == ids[ok])
        out = np.where(ok, guess, -1)
        if not ok.all():
            rest = np.flatnonzero(~ok)
            out[rest] = self.slots_of(ids[rest])
        return out

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Index new ids (not cached) at their slots."""
        order = np.argsort(ids, kind="stable")
        ids, slots = ids[order], slots[order]
        at = np.searchsorted(self._new_keys, ids)
        self._new_keys, self._new_slots = np.insert(self._new_keys, at, ids), np.insert(self._new_slots, at, slots)
        if len(self._new_keys) > max(4096, len(self._keys) >> 4):
            live = np.flatnonzero(self.used)
            order = np.argsort(self.ids[live], kind="stable")
            self._keys, self._kslots = self.ids[live][order], live[order]
            self._new_keys, self._new_slots = self._new_keys[:0], self._new_slots[:0]

    def remove(self, slots: np.ndarray) -> None:
        """Forget the rows of ``slots`` (their entries in the small array go; the large one's stay, dead)."""
        self.used[slots] = False
        if len(self._new_keys):
            keep = ~np.isin(self._new_slots, slots)
            self._new_keys, self._new_slots = self._new_keys[keep], self._new_slots[keep]

    def index_entries(self) -> int:
        return len(self._keys) + len(self._new_keys)

    def cached_ids(self) -> set[int]:
        return set(self.ids[self.used].tolist())

    @property
    def held(self) -> int:
        return int(self.used.sum())


@dataclass
class _Plan:
    """A pull's split per table: which of its ids the cache answers (``hit``, with ``values``
    copied at plan time), which an earlier pull still in flight is refreshing (``later``: read
    from the cache once that pull is stored) and which go to the shards (``miss``)."""

    now: int
    ids: dict[str, torch.Tensor]
    hit: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    versions: dict[str, np.ndarray] = field(default_factory=dict)  # read versions of the hits
    shards: dict[str, np.ndarray] = field(default_factory=dict)  # the hits' shards
    slots: dict[str, np.ndarray] = field(default_factory=dict)  # every id's slot at plan time (-1: none)
    later: dict[str, torch.Tensor] = field(default_factory=dict)
    miss: dict[str, torch.Tensor] = field(default_factory=dict)


class RowCache:
    """Cached rows of every table with their read clocks, versions and pending gradients
    (see the module docstring). Thread-safe: on CUDA the transfer thread calls it too."""

    def __init__(self, config: RowCacheConfig, dims: Mapping[str, int], num_shards: int) -> None:
        self.config = config
        self.num_shards = max(num_shards, 1)
        self.tables = {t: _Table(d, config.rows) for t, d in dims.items()}
        self._lock = threading.Lock()
        self._evicted: list[tuple[str, np.ndarray, torch.Tensor, np.ndarray, np.ndarray]] = []
        # Per table: the slots of the last merged pull's ids (its ids' data pointer and count),
        # where that step's gradients most likely go.
        self._memo: dict[str, tuple[int, int, np.ndarray]] = {}
        # Per table: the pulls in flight (their plans' ids, clocks and the ids they refresh).
        self._inflight: dict[str, list[tuple[int, int, np.ndarray]]] = {t: [] for t in dims}
        self.hits = dict.fromkeys(dims, 0)
        self.refreshed = dict.fromkeys(dims, 0)
        self.evictions = dict.fromkeys(dims, 0)
        self.invalidated = dict.fromkeys(dims, 0)

    def plan(self, sparse: Mapping[str, torch.Tensor], now: int) -> _Plan:
        """Split a pull of ``sparse`` (table -> sorted unique ids) at clock ``now``."""
        plan = _Plan(now, dict(sparse))
        bound = self.config.bound
        with self._lock:
            for t, ids in sparse.items():
                tab, inflight = self.tables[t], self._inflight[t]
                arr = ids.numpy()
                slots = tab.slots_of(arr)
                found = slots >= 0
                s = slots[found]
                tab.last_used[s] = now
                tab.uses[s] += 1
                hit = np.zeros(len(arr), bool)
                later = np.zeros(len(arr), bool)
                if bound > 0:
                    hit[found] = now - tab.read_clock[s] <= bound
                    inflight[:] = [e for e in inflight if now - e[1] <= bound]
                    if inflight:
                        later = ~hit & np.isin(arr, np.concatenate([e[2] for e in inflight]))
                miss = ~(hit | later)
                if bound > 0:
                    inflight.append((id(plan), now, arr[miss]))
                hs = slots[hit]
                plan.hit[t] = torch.from_numpy(hit)
                plan.values[t] = tab.values.index_select(0, torch.from_numpy(hs))
                plan.versions[t] = tab.read_version[hs].copy()
                plan.shards[t] = tab.shard[hs].copy()
                plan.slots[t] = slots
                plan.later[t] = torch.from_numpy(later)
                plan.miss[t] = ids[torch.from_numpy(miss)]
                self.hits[t] += len(hs)
                self.refreshed[t] += int((found & miss).sum())
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
                hit, miss, later = plan.hit[t], plan.miss[t], plan.later[t]
                got = pulled.rows.get(t)
                out = torch.empty(len(ids), tab.dim, dtype=got.dtype if got is not None else torch.float32)
                out[hit] = plan.values[t].to(out.dtype)
                if len(miss):
                    assert got is not None
                    out[~(hit | later)] = got
                    self._store(t, tab, miss.numpy(), got, pulled, plan)
                    self._inflight[t][:] = [e for e in self._inflight[t] if e[0] != id(plan)]
                read, read_shards = plan.versions[t], plan.shards[t]
                if bool(later.any()):
                    wanted = ids.numpy()[later.numpy()]
                    slots = tab.slots_of(wanted)
                    ok = (slots >= 0) & (tab.read_clock[np.maximum(slots, 0)] >= plan.now - self.config.bound)
                    where = torch.nonzero(later).flatten()
                    out[where[torch.from_numpy(ok)]] = tab.values[torch.from_numpy(slots[ok])].to(out.dtype)
                    if not ok.all():
                        lacking[t] = torch.from_numpy(wanted[~ok])
                    hit = hit | later
                    read = np.concatenate([read, tab.read_version[slots[ok]]])
                    read_shards = np.concatenate([read_shards, tab.shard[slots[ok]]])
                rows[t] = out
                if len(read):
                    oldest = np.full(self.num_shards, _NONE, np.int64)
                    np.minimum.at(oldest, read_shards, read)
                    for sh in np.flatnonzero(oldest != _NONE).tolist():
                        v = int(oldest[sh])
                        versions[(sh, t)] = min(v, versions.get((sh, t), v))
                self._memo[t] = (ids.data_ptr(), len(ids), tab.verify(ids.numpy(), plan.slots[t]))
        return PullResult(rows, pulled.dense, versions, pulled.dense_versions, pulled.ack), lacking

    @staticmethod
    def fill(result: PullResult, plan: _Plan, lacking: Mapping[str, torch.Tensor], pulled: PullResult) -> None:
        """Put the rows of ``lacking`` (pulled on their own) into ``result``."""
        for t, ids in lacking.items():
            pos = torch.searchsorted(plan.ids[t], ids)
            result.rows[t][pos] = pulled.rows[t].to(result.rows[t].dtype)
            for key, v in pulled.table_versions.items():
                if key[1] == t:
                    result.table_versions[key] = min(v, result.table_versions.get(key, v))

    def _store(self, t: str, tab: _Table, ids: np.ndarray, got: torch.Tensor, pulled: PullResult, plan: _Plan) -> None:
        shards = shard_of_ids(ids, self.num_shards)
        for s in np.unique(shards).tolist():
            v = pulled.table_versions.get((s, t))
            if v is None:
                continue
            if v < tab.max_version.get(s, v):
                # The shard's table went back (restarted from a checkpoint, or reset): whatever
                # was read from it before is refreshed on its next pull.
                stale = np.flatnonzero(tab.used & (tab.shard == s))
                tab.read_clock[stale] = _STALE
                self.invalidated[t] += len(stale)
                tab.max_version[s] = v
            tab.max_version[s] = max(v, tab.max_version.get(s, v))
        slots = tab.verify(ids, plan.slots[t][~(plan.hit[t] | plan.later[t]).numpy()])
        new = np.flatnonzero(slots < 0)
        if len(new):
            slots[new] = self._place(t, tab, ids[new], plan.ids[t].numpy(), plan.now)
        keep = slots >= 0
        s = slots[keep]
        tab.values[torch.from_numpy(s)] = got[torch.from_numpy(keep)].float()
        tab.read_clock[s] = plan.now
        tab.shard[s] = shards[keep]
        tab.read_version[s] = self._versions(pulled, t)[shards[keep]]

    def _versions(self, pulled: PullResult | None, t: str) -> np.ndarray:
        """The read version of ``t`` per shard (0 where none)."""
        if pulled is None:
            return np.zeros(self.num_shards, np.int64)
        return np.array([pulled.table_versions.get((s, t), 0) for s in range(self.num_shards)], np.int64)

    def _place(self, t: str, tab: _Table, ids: np.ndarray, protected: np.ndarray, now: int) -> np.ndarray:
        """Slots for new ids (-1 where none is left: that row is not cached), evicting
        rows the current pull does not want when the table is full."""
        want = len(ids)
        if len(tab.free) < want and tab.size < tab.capacity:
            tab.alloc(min(tab.capacity, max(tab.size * 2, tab.size + want)))
        short = want - len(tab.free)
        if short > 0:
            self._evict(t, tab, short, protected)
        k = min(want, len(tab.free))
        out = np.full(want, -1, np.int64)
        if k:
            slots = np.array(tab.free[-k:][::-1], np.int64)
            del tab.free[-k:]
            out[:k] = slots
            tab.ids[slots], tab.used[slots], tab.uses[slots], tab.last_used[slots] = ids[:k], True, 1, now
            tab.pending_since[slots] = tab.pending_version[slots] = _NONE
            tab.insert(ids[:k], slots)
        return out

    def _evict(self, t: str, tab: _Table, n: int, protected: np.ndarray) -> None:
        cand = np.flatnonzero(tab.used)
        cand = cand[~np.isin(tab.ids[cand], protected)]
        if not len(cand):
            return
        if self.config.policy == "lru":
            key = tab.last_used[cand]
        else:  # lfu, ties broken by recency
            key = tab.uses[cand] * (1 << 32) + (tab.last_used[cand] & 0xFFFFFFFF)
        victims = cand[np.argsort(key, kind="stable")[:n]]
        held = victims[tab.pending_since[victims] != _NONE]
        if len(held):
            self._evicted.append((t, tab.ids[held].copy(), tab.pending[torch.from_numpy(held)].clone(),
                                  tab.shard[held].copy(), tab.pending_version[held].copy()))
        tab.remove(victims)
        tab.pending_since[victims] = tab.pending_version[victims] = _NONE
        tab.read_clock[victims] = _STALE
        tab.pending[torch.from_numpy(victims)] = 0.0
        tab.free.extend(victims.tolist())
        self.evictions[t] += len(victims)

    def accumulate(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], clock: int,
                   versions: PullResult | None, flush: bool = False) -> tuple[Grads, dict[tuple[int, str], int]]:
        """Add a step's row gradients (pushed at ``clock``) to the pending sums and return what
        is due now (``flush``: everything held), with the read version per shard and table."""
        w = self.config.writes
        due: dict[str, list[tuple[np.ndarray, torch.Tensor, np.ndarray, np.ndarray]]] = {}
        with self._lock:
            for t, (step_ids, g) in grads.items():
                tab = self.tables[t]
                arr = step_ids.numpy()
                memo = self._memo.get(t)
                if memo is not None and memo[0] == step_ids.data_ptr() and memo[1] == len(arr):
                    slots = tab.verify(arr, memo[2])
                else:
                    slots = tab.slots_of(arr)
                cached = slots >= 0
                shards = tab.shard[np.maximum(slots, 0)]
                if not cached.all():
                    shards[~cached] = shard_of_ids(arr[~cached], self.num_shards)
                read = self._versions(versions, t)[shards]
                if not cached.all():  # not cached (the table was full): pushed at once
                    miss = torch.from_numpy(~cached)
                    due.setdefault(t, []).append((arr[~cached], g[miss].float(), shards[~cached], read[~cached]))
                s = slots[cached]
                st = torch.from_numpy(s)
                first = tab.pending_since[s] == _NONE
                tab.pending[st] += g[torch.from_numpy(cached)].float()  # the slots are distinct: the ids are
                tab.pending_since[s[first]] = clock
                tab.pending_version[s] = np.minimum(tab.pending_version[s], read[cached])
            for t, e_ids, e_grads, e_shards, e_read in self._evicted:
                due.setdefault(t, []).append((e_ids, e_grads, e_shards, e_read))
            self._evicted.clear()
            for t, tab in self.tables.items():
                held = np.flatnonzero(tab.pending_since != _NONE)  # (a free slot's is _NONE)
                if not len(held):
                    continue
                ready = held if flush else held[clock - tab.pending_since[held] >= w]
                if len(ready):
                    rt = torch.from_numpy(ready)
                    due.setdefault(t, []).append((tab.ids[ready].copy(), tab.pending[rt].clone(), tab.shard[ready].copy(),
                                                  tab.pending_version[ready].copy()))
                    tab.pending[rt] = 0.0
                    tab.pending_since[ready] = tab.pending_version[ready] = _NONE
        return _coalesce(due)

    def pending_rows(self) -> int:
        with self._lock:
            return sum(int((tab.pending_since[tab.used] != _NONE).sum()) for tab in self.tables.values()) + sum(
                len(e[1]) for e in self._evicted)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes each table's cache holds (values and pending sums, allocated)."""
        return {t: tab.size * tab.dim * 4 * 2 + tab.size * 8 * 9 + tab.index_entries() * 16 for t, tab in self.tables.items()}


def _coalesce(due: dict[str, list[tuple[np.ndarray, torch.Tensor, np.ndarray, np.ndarray]]]) -> tuple[Grads, dict[tuple[int, str], int]]:
    """One push's sparse part: per table sorted unique ids with their gradients summed, and
    the oldest read version per (shard, table)."""
    grads: Grads = {}
    versions: dict[tuple[int, str], int] = {}
    for t, parts in due.items():
        if len(parts) == 1:
            ids, g, shards, read = parts[0]
        else:
            ids, g = np.concatenate([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            shards, read = np.concatenate([p[2] for p in parts]), np.concatenate([p[3] for p in parts])
        if len(parts) == 1 and (len(ids) < 2 or bool(np.all(ids[1:] > ids[:-1]))):
            uniq, summed = torch.from_numpy(ids), g
        else:
            uniq_np, inverse = np.unique(ids, return_inverse=True)
            acc = np.zeros((len(uniq_np), g.shape[1]), np.float32)
            np.add.at(acc, inverse.reshape(-1), g.numpy())
            uniq, summed = torch.from_numpy(uniq_np), torch.from_numpy(acc)
        grads[t] = (uniq, summed)
        for s in np.unique(shards).tolist():
            versions[(s, t)] = int(read[shards == s].min())
    return grads, versions


class CachedClient:
    """A ``PSClient``'s pull, push and push_pull through a ``RowCache`` (or straight through,
    with none), counting rows and bytes moved per table (``TrafficMeter``)."""

    def __init__(self, inner: PSClient, config: RowCacheConfig, dims: Mapping[str, int], meter: TrafficMeter) -> None:
        self.inner = inner
        self.cache = RowCache(config, dims, inner.num_shards) if config.active else None
        self.meter = meter
        self.clock = 0  # the last clock pushed: the "now" of the next pull

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
             versions: PullResult | None, flush: bool = False) -> tuple[Mapping[str, tuple[torch.Tensor, torch.Tensor]], PullResult | None]:
        if self.cache is None:
            self.meter.pushed(sparse or {})
            return sparse or {}, versions
        grads, table_versions = self.cache.accumulate(sparse or {}, clock, versions, flush)
        self.meter.pushed(grads)
        if versions is not None and sparse is not None and grads.keys() == sparse.keys() and all(
                torch.equal(grads[t][0], sparse[t][0]) for t in grads):
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
