"""The row cache in front of a client (``CachedClient``): a ``ShardClient``'s pull, push and
push_pull answered through a ``RowCache`` on the host (``tether.worker.cache.row_cache``) or a
``DeviceRowCache`` on the training device (``tether.worker.cache.device``), or straight through
with no cache."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tether.protos.specs import TableConfig
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.device import DeviceRowCache
from tether.worker.cache.parts import Plan, fill
from tether.worker.cache.row_cache import RowCache
from tether.worker.client.api import ShardClient
from tether.worker.client.results import Handle, PullResult, PushAck, Splits
from tether.worker.client.traffic import TrafficMeter

__all__ = ["CachedClient"]


class CachedClient:
    """A ``ShardClient``'s pull, push and push_pull through a ``RowCache`` (or straight through,
    with none), counting rows and bytes moved per table and the time the cache's own calls take
    (``TrafficMeter``, ``cache_seconds``)."""

    def __init__(self, inner: ShardClient, config: RowCacheConfig, dims: Mapping[str, int], meter: TrafficMeter,
                 device: torch.device | None = None) -> None:
        self.inner = inner
        self.cache: RowCache | None = None
        if config.active:
            # On a GPU worker (``device``: the training device) the rows live on the GPU.
            on_device = config.on_device if config.on_device is not None else device is not None and device.type == "cuda"
            if on_device and device is not None:
                self.cache = DeviceRowCache(config, dims, inner.num_shards, device)
            else:
                self.cache = RowCache(config, dims, inner.num_shards)
        self.meter = meter
        if self.cache is not None:
            meter.watch(self.cache)
        self.clock = 0  # the last clock pushed: the "now" of the next pull

    def use_tables(self, tables: Sequence[TableConfig]) -> None:
        """The specs the worker declared: the cache applies their rules to its rows (``RowCache.use_tables``)."""
        if self.cache is not None:
            self.cache.use_tables(tables)

    @property
    def config(self) -> Any:
        """The client's ``ClientConfig`` (deadlines, wire dtype)."""
        return self.inner.config

    def _plan(self, sparse: Mapping[str, torch.Tensor]) -> Plan | None:
        self.meter.wanted(sparse, self.clock)
        if self.cache is None:
            self.meter.pulled(sparse)
            return None
        start = time.perf_counter()
        plan = self.cache.plan(sparse, self.clock)
        self.meter.cache_time(time.perf_counter() - start)
        self.meter.pulled(plan.miss)
        return plan

    def _answer(self, plan: Plan | None, handle: Handle[PullResult]) -> Handle[PullResult]:
        if plan is None or self.cache is None:
            return handle
        cache, inner = self.cache, self.inner

        def combine(answers: list[PullResult]) -> PullResult:
            start = time.perf_counter()
            result, lacking = cache.merge(plan, answers[0])
            self.meter.cache_time(time.perf_counter() - start)
            if lacking:
                # Rows another pull was refreshing, which never came back: pulled now, on their own.
                self.meter.pulled(lacking)
                extra = inner.pull(dict(lacking)).result(inner.config.call_deadline_s + inner.config.timeout_s)
                fill(result, plan, lacking, extra)
            return result

        return Handle([handle], combine)

    def _due(self, sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None, clock: int,
             versions: PullResult | None, flush: bool = False) -> tuple[Mapping[str, tuple[torch.Tensor, ...]], PullResult | None]:
        if self.cache is None:
            self.meter.pushed(sparse or {})
            return sparse or {}, versions
        start = time.perf_counter()
        grads, table_versions = self.cache.accumulate(sparse or {}, clock, versions, flush)
        self.meter.cache_time(time.perf_counter() - start)
        self.meter.pushed(grads)
        if self.cache.config.writes == 0 and versions is not None and sparse is not None and grads.keys() == sparse.keys() and all(
                len(grads[t]) == 2 and len(grads[t][0]) == len(sparse[t][0]) and torch.equal(grads[t][0], sparse[t][0]) for t in grads):
            # Every row's gradient goes as it was made (write bound 0): the step's own versions
            # (and, for DC-ASGD, the values it read), as without a cache. With a write bound the
            # sums are never the step's own gradients, even where their ids are the step's (a
            # rule with no statistics, SGD, sends none to tell them apart).
            return grads, versions
        # Combined gradients: their oldest read versions and no read values, so DC-ASGD, DC-ASGD-a
        # and gap-aware leave their rows as they are. The dense gradients are the step's own: the
        # values they were computed on go along (what those remedies apply to).
        return grads, PullResult({}, dict(versions.dense) if versions else {}, table_versions,
                                 dict(versions.dense_versions) if versions else {})

    def pull(self, sparse: Mapping[str, torch.Tensor] | None = None, dense: Sequence[str] = (),
             splits: Splits | None = None) -> Handle[PullResult]:
        """``Client.pull`` through the cache (``splits`` unused: the cache splits the ids it pulls, ``Plan.splits``)."""
        plan = self._plan(sparse or {})
        if plan is None:
            return self._answer(plan, self.inner.pull(dict(sparse or {}), dense))
        ask = {t: ids for t, ids in plan.miss.items() if ids.shape[0]}
        return self._answer(plan, self.inner.pull(ask, dense, splits=plan.splits))

    def push(self, sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
             dense: Mapping[str, torch.Tensor] | None = None, clock: int = 0, versions: PullResult | None = None) -> Handle[PushAck]:
        self.clock = max(self.clock, clock)
        grads, read = self._due(sparse, clock, versions)
        return self.inner.push(grads, dense, clock=clock, versions=read)

    def push_pull(self, push_sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                  push_dense: Mapping[str, torch.Tensor] | None = None, pull_sparse: Mapping[str, torch.Tensor] | None = None,
                  pull_dense: Sequence[str] = (), clock: int = 0, versions: PullResult | None = None,
                  pull_splits: Splits | None = None) -> Handle[PullResult]:
        """``Client.push_pull`` through the cache (``pull_splits`` unused, as ``pull``'s ``splits``)."""
        self.clock = max(self.clock, clock)
        grads, read = self._due(push_sparse, clock, versions)
        plan = self._plan(pull_sparse or {})
        ask = dict(pull_sparse or {}) if plan is None else {t: ids for t, ids in plan.miss.items() if ids.shape[0]}
        return self._answer(plan, self.inner.push_pull(grads, push_dense, ask, pull_dense, clock=clock, versions=read,
                                                       pull_splits=plan.splits if plan is not None else None))

    def flush(self, clock: int | None = None) -> Handle[PushAck] | None:
        """Push every held gradient now (at ``clock``; None: the last clock pushed), or None
        when nothing is held."""
        if self.cache is None or not self.cache.pending_rows():
            return None
        at = self.clock if clock is None else clock
        grads, read = self._due({}, at, None, flush=True)
        return self.inner.push(grads, {}, clock=at, versions=read)
