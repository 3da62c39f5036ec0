"""``PSModel``'s steps on a CUDA device (issue 26): the transfer thread, a pull staged on the
device from pinned memory, installing it on the compute stream, and bringing a step's gradients
back to the host with one wait for the GPU (``collect``). ``PSModel`` inherits them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from tether.protos.errors import UsageError
from tether.worker.client.results import Handle, PullResult
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.transfer import Prefetch, Staged, device_joined, flat_grads, pinned

__all__ = ["CudaSteps"]

Checks = list[tuple[ShardedEmbeddingBag | None, torch.Tensor, torch.Tensor]]
Slices = list[tuple[str, torch.Tensor, int, int]]


class CudaSteps:
    """The CUDA half of ``PSModel`` (on the CPU ``collect`` does nothing and nothing else here runs)."""

    FLAT = "dense"
    client: Any
    device: torch.device
    dense: dict[str, nn.Parameter]
    dense_on_shards: bool
    _cuda: bool
    _index: int
    _side: Any
    _executor: ThreadPoolExecutor | None
    _groups: list[tuple[torch.Tensor, Slices]]
    _checks: Checks | None
    _collected: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]] | None
    _copying: tuple[Any, list[torch.Tensor], list[tuple[int, Slices]], int | None, Checks, list[tuple[torch.Tensor, Slices]]] | None
    _rows_on_device: bool
    _columns: torch.Tensor | None
    _inverse: torch.Tensor | None
    _unique_ids: torch.Tensor | None

    @staticmethod
    def _by_width(prefetch: Prefetch, pulled: PullResult) -> list[list[str]]:
        """The prefetch's tables grouped by row width (tables of one width share one tensor)."""
        by_dim: dict[int, list[str]] = {}
        for table in prefetch.ids:
            by_dim.setdefault(pulled.rows[table].shape[1], []).append(table)
        return list(by_dim.values())

    def _bind(self, prefetch: Prefetch, groups: list[tuple[list[str], torch.Tensor]], ids: dict[str, torch.Tensor], train: bool) -> None:
        raise NotImplementedError

    def _load_dense(self, flat: torch.Tensor) -> None:
        raise NotImplementedError

    def _transfers(self) -> ThreadPoolExecutor:
        """The transfer thread (CUDA): one, so pulls and pushes go out in the order they were asked for."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tether-transfer")
        return self._executor

    def _stage(self, prefetch: Prefetch, handle: Handle[PullResult], timeout: float | None = None) -> Staged:
        """Wait for a pull and copy it to the device on the side stream, from pinned memory: the
        rows of each width as received (one buffer when the router pinned them, else joined
        into one; none where the pull put them on the device from a shared region), every
        table's ids and the batch's inverse in one buffer, the dense values."""
        pulled = handle.result(timeout)
        ids = list(prefetch.ids.values())
        n = sum(len(i) for i in ids)
        inverse = prefetch.inverse
        host_ids = torch.empty(n + (0 if inverse is None else inverse.numel()), dtype=torch.int64, pin_memory=True)
        if ids:
            torch.cat(ids, out=host_ids[:n])
        if inverse is not None:
            host_ids[n:].view(inverse.shape[1], inverse.shape[0]).copy_(inverse.t())
        flat = pulled.dense.get(self.FLAT)
        # Rows on the device already are joined there: a device cache's answer (its bank's, which
        # it wrote on this thread's stream), or rows that came in a shard's shared region,
        # copied from the region itself on the side stream (``Router.rows_to``), so the event
        # below comes after them. The others are copied from pinned memory.
        widths = self._by_width(prefetch, pulled)
        groups = [(tables, device_joined([pulled.rows[t] for t in tables])) for tables in widths
                  if pulled.rows[tables[0]].device.type == "cuda"]
        with torch.cuda.device(self._index), torch.cuda.stream(self._side):
            groups += [
                (tables, pinned([pulled.rows[t] for t in tables]).to(self.device, non_blocking=True))
                for tables in widths if pulled.rows[tables[0]].device.type != "cuda"
            ]
            on_device = host_ids.to(self.device, non_blocking=True)
            dense = None if flat is None else pinned([flat]).to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._side)
        placed = None if inverse is None else on_device[n:].view(inverse.shape[1], inverse.shape[0])
        return Staged(pulled, groups, on_device[:n], placed, dense, ready)

    def _install_staged(self, prefetch: Prefetch, train: bool, timeout: float | None) -> PullResult:
        """``install`` on CUDA: the compute stream waits (on the GPU, not the host) for the
        transfer thread's copies, and the bags are bound to them."""
        staged = prefetch.staged.result(timeout) if prefetch.staged is not None else self._stage(prefetch, prefetch.handle, timeout)
        pulled = staged.pulled
        if prefetch.pushed:
            prefetch.ack = pulled.ack
        stream = torch.cuda.current_stream(self._index)
        stream.wait_event(staged.ready)
        for t in staged.tensors():
            # Made on the side stream, used on this one: not to be reused before this one is done.
            t.record_stream(stream)
        split = torch.split(staged.ids, [len(i) for i in prefetch.ids.values()])
        ids = dict(zip(prefetch.ids, split, strict=True)) if prefetch.ids else {}
        self._checks = [] if train else None
        self._bind(prefetch, staged.groups, ids, train)
        self._columns, self._inverse, self._unique_ids = None, staged.inverse, staged.ids
        if staged.flat is not None:
            self._load_dense(staged.flat)
        return pulled

    def collect(self, exact: bool = False, wait: bool = True) -> None:
        """Bring this step's gradients to the host, where ``push`` sends them from (call it once
        the backward is done; ``push`` calls it if the caller did not).

        On CUDA each gradient is cast to the wire dtype on the GPU (``exact``: kept in float32,
        for a combiner that sums them first, as sync's does), copied without blocking into
        pinned memory, and the host waits once for those copies: the step's one wait for the
        GPU. The training step's lookup checks come back with them. ``wait=False`` only queues
        the copies; the next call waits for them, and not at all if something else waited for
        the GPU since (sync's all-reduce). Dense gradients come back where they are pushed (not
        in sync mode, whose ranks all-reduce them). On the CPU nothing happens here: ``push``
        reads the gradients where they are.

        Raises:
            UsageError: a lookup of this training step used ids that ``sparse(batch)`` did not name.
        """
        if not self._cuda or self._collected is not None:
            return
        if self._copying is None:
            wire = torch.float32 if exact else self.client.config.wire_dtype
            sources: list[torch.Tensor] = []
            grouped = []
            kept = []  # a device cache's row gradients: they stay on the device (tether.worker.cache.device)
            for rows, slices in self._groups:
                if rows.grad is not None and self._rows_on_device:
                    kept.append((rows.grad.detach(), slices))
                elif rows.grad is not None:
                    grouped.append((len(sources), slices))
                    sources.append(rows.grad.detach().to(wire))
            dense_at = None
            if self.dense_on_shards and self.dense and any(p.grad is not None for p in self.dense.values()):
                dense_at = len(sources)
                sources.append(flat_grads(list(self.dense.values())).detach().to(wire))
            checks = list(self._checks or [])
            if checks:
                sources.append(torch.stack([found.all() for _, _, found in checks]).all().reshape(1))
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in sources]
            for h, t in zip(host, sources, strict=False):
                h.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self._index))
            self._copying = (copied, host, grouped, dense_at, checks, kept)
        if not wait:
            return
        copied, host, grouped, dense_at, checks, kept = self._copying
        self._copying = None
        if not copied.query():
            copied.synchronize()
        if checks and not bool(host[-1][0]):
            self._unnamed(checks)
        sparse = {t: (ids, host[i][a:b]) for i, slices in grouped for t, ids, a, b in slices}
        sparse.update({t: (ids, grad[a:b]) for grad, slices in kept for t, ids, a, b in slices})
        self._collected = (sparse, {} if dense_at is None else {self.FLAT: host[dense_at]})

    @staticmethod
    def _unnamed(checks: list[tuple[ShardedEmbeddingBag | None, torch.Tensor, torch.Tensor]]) -> None:
        """Raise for the first lookup whose ids were not all bound (reading the flags: an error path)."""
        for bag, ids, found in checks:
            if not bool(found.all()):
                if bag is None:
                    raise UsageError(
                        "the model's fused lookup got ids [B, T] of this training step that are not the ones sparse(batch) named "
                        "(column t for table t, in the order sparse gives the tables): give sparse each column of the ids the "
                        "forward looks up, in column order"
                    )
                bag.raise_not_named(ids[~found])
        raise AssertionError("unreachable: a lookup check failed but none was found")
