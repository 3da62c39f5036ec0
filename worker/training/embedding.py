"""PyTorch modules whose parameters live on the shards.

``ShardedEmbeddingBag`` looks rows up in rows pulled from the shards. ``PSModel`` binds a
model's embedding bags and dense parameters to a ``PSClient``: it pulls what a batch needs
(ahead of time, so the pull overlaps the previous step's compute), loads every table's rows
into one tensor on the device (each bag holds a slice of it, and a model with a
``fused_lookup`` hook gathers all tables at once), and after the backward hands that tensor's
gradient, split per table, to one push per shard.

On a CUDA device the parameter server's work runs beside the GPU's (issue 26): pulls are
received into pinned buffers, and a transfer thread waits for them, copies them to the GPU on a
side stream and sends the gradients, while the main thread queues the step's kernels. The host
waits for the GPU once a step, in ``collect``, when the step's gradients (cast to the wire dtype
on the GPU) have come back into pinned memory. On the CPU nothing of this exists: every call
runs on the calling thread as it always did.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from tether.common.moved import old_names
from tether.protos.codec import int64_ids, is_id_dtype
from tether.protos.errors import InvalidArgument, UsageError
from tether.rules.push_hooks import finite
from tether.worker.cache.client import CachedClient
from tether.worker.cache.config import RowCacheConfig
from tether.worker.client.api import ShardClient
from tether.worker.client.device_pull import DeviceRows
from tether.worker.client.results import Handle, PullResult
from tether.worker.client.router import JOIN_ELEMENTS, Router
from tether.worker.client.traffic import TrafficMeter
from tether.worker.metrics import NullWorkerMetrics
from tether.worker.training import embedding_bag
from tether.worker.training.cuda_steps import CudaSteps
from tether.worker.training.transfer import Chained, Prefetch, Staged, columns_of, first, flat_grads, pulled_of, split_flat, unique_columns

__all__ = ["PSModel"]

# tether.worker.embedding.ShardedEmbeddingBag, as the old module gave it, until tether 0.2 (with a DeprecationWarning).
__getattr__ = old_names(__name__)

log = logging.getLogger(__name__)


def check_finite(clock: int, sparse: Mapping[str, tuple[torch.Tensor, ...]], dense: Mapping[str, torch.Tensor]) -> None:
    """Refuse a step's gradients with a NaN or Inf before any is pushed (a shard would refuse
    them too, in words that name neither the step nor the cause).

    Raises:
        UsageError: one line naming the step, the first table (or the dense parameters) hit,
            and that the step's loss or inputs were not finite.
    """
    parts = [(f"table {t!r}", g[1]) for t, g in sparse.items()] + [("the dense parameters", g) for g in dense.values()]
    on_device = [g for _, g in parts if g.device.type != "cpu"]
    if len(on_device) > 1 and math.isfinite(float(torch.stack([g.sum().float() for g in on_device]).sum())):
        # Row gradients a device cache kept on the GPU: one read of their sums, not one per table.
        parts = [(what, g) for what, g in parts if g.device.type == "cpu"]
    for what, grad in parts:
        if not finite(grad):
            raise UsageError(
                f"step {clock}: the gradients of {what} contain NaN or Inf, so the step's loss or its inputs (a dense "
                "feature, a label) were not finite; caught on this worker before the step's push, nothing of it "
                "was sent"
            )


def joined_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The tables' rows one after another: a view of the buffer they were received into where
    they lie there back to back (``Router``'s buffer per row width, for pulls of at least
    ``JOIN_ELEMENTS`` floats), else a copy."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if sum(p.numel() for p in parts) < JOIN_ELEMENTS:
        return torch.cat(parts)  # small (Router gave each table a tensor): the checks below cost more than the copy
    storage, at = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if p.dim() != 2 or not p.is_contiguous() or p.untyped_storage().data_ptr() != storage or p.storage_offset() != at:
            return torch.cat(parts)
        at += p.numel()
    return first.as_strided((sum(len(p) for p in parts), first.shape[1]), (first.shape[1], 1))


class PSModel(CudaSteps):
    """Binds a model to the shards: pull before forward, push after backward.

    On a CUDA device a transfer thread of its own waits for pulls, copies them to the GPU on a
    side stream and sends pushes (see the module docstring); on the CPU every call runs on the
    calling thread.
    """

    def __init__(
        self,
        model: nn.Module,
        client: ShardClient,
        device: torch.device,
        dense_on_shards: bool = True,
        cache: RowCacheConfig | None = None,
    ) -> None:
        self.model = model
        self.client = client
        self.device = device
        # False in sync mode: dense parameters stay on the workers and are all-reduced.
        self.dense_on_shards = dense_on_shards
        # Every module of each table (features that share a table each have their own).
        self.bags: dict[str, list[embedding_bag.ShardedEmbeddingBag]] = {}
        for m in model.modules():
            if isinstance(m, embedding_bag.ShardedEmbeddingBag):
                same = self.bags.setdefault(m.table, [])
                if same and (same[0].dim, same[0].padding_id) != (m.dim, m.padding_id):
                    raise ValueError(
                        f"table {m.table!r} is used with dim/padding_id {(same[0].dim, same[0].padding_id)} and {(m.dim, m.padding_id)}"
                    )
                same.append(m)
        self.dense: dict[str, nn.Parameter] = dict(model.named_parameters())
        self._host = device.type == "cpu"
        self._cuda = device.type == "cuda"
        # Every bound table's rows in one tensor per row width (table order of the prefetch),
        # with its tables and their [start, stop) slices; the bags hold slices of it, so its
        # .grad after a backward is those tables' row gradients at once. ``_rows`` is the one
        # tensor when every table has the same width (what a fused lookup gathers from).
        self._groups: list[tuple[torch.Tensor, list[tuple[str, torch.Tensor, int, int]]]] = []
        self._rows: torch.Tensor | None = None
        self._columns: torch.Tensor | None = None
        self._inverse: torch.Tensor | None = None
        # CUDA: every table's unique ids on the device (what a fused lookup checks its ids
        # against), this training step's unread lookup checks, its gradients on the host once
        # collected, and whether the fused lookup matched the first training step's ids.
        self._unique_ids: torch.Tensor | None = None
        self._checks: list[tuple[embedding_bag.ShardedEmbeddingBag | None, torch.Tensor, torch.Tensor]] | None = None
        self._collected: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]] | None = None
        # The gradients' copies to the host once queued and not yet waited for (``collect``).
        self._copying: tuple[Any, list[torch.Tensor], list[tuple[int, list[tuple[str, torch.Tensor, int, int]]]], int | None,
                             list[tuple[embedding_bag.ShardedEmbeddingBag | None, torch.Tensor, torch.Tensor]],
                             list[tuple[torch.Tensor, list[tuple[str, torch.Tensor, int, int]]]]] | None = None
        self._fused_ok: bool | None = None
        self._executor: ThreadPoolExecutor | None = None
        router = getattr(client, "router", None)
        self._router = router if isinstance(router, Router) else None
        if self._cuda:
            self._index = device.index if device.index is not None else torch.cuda.current_device()
            self._side = torch.cuda.Stream(device=self._index)
            if self._router is not None:
                self._router.pin_memory = True
        for bag in self._all_bags():
            bag.set_fetcher(self._fetch)
        # Training pulls and pushes go through the row cache (tether.worker.cache.row_cache; with none,
        # straight to the client), which counts rows and bytes moved per table.
        metrics = getattr(client, "metrics", None)
        dims = {t: bags[0].dim for t, bags in self.bags.items()}
        wire = getattr(client.config, "wire_dtype", torch.float32)
        self.meter = TrafficMeter(dims, wire.itemsize, metrics, reuse=metrics is not None and not isinstance(metrics, NullWorkerMetrics))
        self.rows = CachedClient(client, cache or RowCacheConfig(), dims, self.meter, device=device)
        # A cache on the device (tether.worker.cache.device): the row gradients stay there (``collect``).
        self._rows_on_device = self.rows.cache is not None and hasattr(self.rows.cache, "banks")
        # CUDA without a row cache (which takes its misses on the host): rows that arrive in a
        # shard's shared region go to the GPU from the region itself, on the side stream
        # (``Router.rows_to``); ``_stage`` then finds them there.
        self._pull_to = DeviceRows(torch.device("cuda", self._index), self._side) if (
            self._cuda and self._router is not None and self.rows.cache is None) else None
        self._eval_warned = False
        if hasattr(model, "fused_lookup"):
            setattr(model, "fused_lookup", self.lookup)  # noqa: B010 - an attribute torch's Module typing does not know

    def _all_bags(self) -> Iterator[embedding_bag.ShardedEmbeddingBag]:
        return (bag for same in self.bags.values() for bag in same)

    # All dense parameters travel as one flat tensor: one block per request instead of one per
    # parameter (a DLRM has a dozen small ones), chunked by the client like any dense tensor.
    FLAT = "dense"

    def dense_tensors(self) -> dict[str, torch.Tensor]:
        """The model's dense parameters as the one flat tensor to declare."""
        return {self.FLAT: torch.cat([p.detach().reshape(-1).cpu() for p in self.dense.values()])}

    def _fetch(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self.client.pull({table: ids.cpu()}).result(self.client.config.call_deadline_s + self.client.config.timeout_s).rows[table]

    def _joined(self, sparse: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """int64 ids per table; several tensors for one table (its features) are joined.

        Raises:
            InvalidArgument: a table no bag of the model uses.
            UsageError: ids that are not integers.
        """
        unknown = [t for t in sparse if t not in self.bags]
        if unknown:
            raise InvalidArgument(f"tables {unknown} have no ShardedEmbeddingBag in the model (its tables: {sorted(self.bags)})")
        # Ids of any integer width are widened to int64 (float or bool ids: one line naming the table).
        return {
            t: (
                int64_ids(ids, t, UsageError)
                if isinstance(ids, torch.Tensor)
                else torch.cat([int64_ids(i, t, UsageError).reshape(-1) for i in ids])
            )
            for t, ids in sparse.items()
        }

    def _unique_of(self, joined: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        """Sorted unique ids per table of ``_joined``'s answer (padding left out), and the
        columns and inverse of a [B, T] batch (``Prefetch``)."""
        columns = None if any(self.bags[t][0].padding_id is not None for t in joined) else columns_of(joined)
        if columns is None:
            return {t: torch.unique(self.bags[t][0].wanted(ids.cpu())) for t, ids in joined.items()}, None, None
        unique, counts, inverse = unique_columns(columns)
        return dict(zip(joined, torch.split(unique, counts), strict=False)), columns, inverse

    def _unique(
        self, sparse: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        """Sorted unique int64 ids per table (padding left out); several tensors for one table
        (its features) are joined.

        Raises:
            InvalidArgument: a table no bag of the model uses.
            UsageError: ids that are not integers.
        """
        return self._unique_of(self._joined(sparse))

    def prefetch(self, sparse: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], with_dense: bool = True) -> Prefetch:
        """Start pulling the rows of ``sparse`` (table -> integer ids of any shape, or a list of
        such tensors for features that share the table) and the dense values (on CUDA, the
        transfer thread then receives them and copies them to the device)."""
        unique, columns, inverse = self._unique(sparse)
        names = [self.FLAT] if with_dense and self.dense_on_shards and self.dense else []
        # A model in eval mode (Trainer.evaluate) reads the shards' rows as they are now: the
        # cache's held gradients are pushed first, and the cache neither answers nor counts it.
        fresh = not self.model.training
        if fresh:
            self.flush()
        client: Any = self.client if fresh else self.rows
        if not self._cuda:
            return Prefetch(unique, client.pull(unique, names), columns=columns, inverse=inverse, fresh=fresh)
        prefetch = Prefetch(unique, Handle([], first), columns=columns, inverse=inverse, fresh=fresh)
        # Sent from the transfer thread too, so it leaves after the pushes handed to it before.
        def send() -> Staged:
            with self._pulls_to_device():
                started = client.pull(unique, names)
            return self._stage(prefetch, started)

        prefetch.staged = self._transfers().submit(send)
        prefetch.handle = Handle([prefetch.staged], pulled_of)
        return prefetch

    def install(self, prefetch: Prefetch, train: bool = True, timeout: float | None = None) -> PullResult:
        """Wait for a prefetch and load its rows and dense values into the model.

        Every bag is bound to this step's rows, and those of tables the prefetch did not name
        to none, so no forward looks up another step's rows. ``train``: a training step, whose
        forward may look up only the rows pulled here (those get their gradients pushed).
        """
        self._collected = self._copying = None
        if train and prefetch.fresh and self.rows.cache is not None and not self._eval_warned:
            self._eval_warned = True
            log.warning("a training step's rows were pulled with the model in eval mode: the row cache is not used for them "
                        "(call model.train() before training)")
        if self._cuda:
            return self._install_staged(prefetch, train, timeout)
        pulled = prefetch.handle.result(timeout)
        if prefetch.pushed:
            prefetch.ack = pulled.ack
        groups = []
        for tables in self._by_width(prefetch, pulled):
            groups.append((tables, self._to_device(joined_rows([pulled.rows[t] for t in tables]))))
        self._bind(prefetch, groups, {t: self._to_device(ids) for t, ids in prefetch.ids.items()}, train)
        self._columns = None if prefetch.columns is None else self._to_device(prefetch.columns)
        self._inverse = None if prefetch.inverse is None else self._to_device(prefetch.inverse.t())
        if self.FLAT in pulled.dense:
            self._load_dense(self._to_device(pulled.dense[self.FLAT]))
        return pulled

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._host else t.to(self.device)

    def _pulls_to_device(self) -> contextlib.AbstractContextManager[None]:
        """Around the transfer thread's training pulls: rows in a shared region go to the GPU from
        there. Not with a remedy that sends the rows as read along with the push (DC-ASGD,
        gap-aware): it reads them on the host, where they then already are."""
        if self._pull_to is None or self._router is None or self.client.config.sends_read_values:
            return contextlib.nullcontext()
        return self._router.rows_to(self._pull_to)

    def _bind(self, prefetch: Prefetch, groups: list[tuple[list[str], torch.Tensor]], ids: dict[str, torch.Tensor], train: bool) -> None:
        """Bind every bag of the prefetch's tables to its slice of its width's rows, and the others to none."""
        self._groups = []
        for tables, rows in groups:
            if train:
                rows = rows.detach().requires_grad_(True)
            slices = []
            start = 0
            for table in tables:
                stop = start + len(prefetch.ids[table])
                for bag in self.bags[table]:
                    bag.bind(ids[table], rows[start:stop], train_step=train, checks=self._checks)
                slices.append((table, prefetch.ids[table], start, stop))
                start = stop
            self._groups.append((rows, slices))
        for table, bags in self.bags.items():
            if table not in prefetch.ids:
                for bag in bags:
                    bag.unbind(train_step=train)
        self._rows = self._groups[0][0] if len(self._groups) == 1 else None

    def _load_dense(self, flat: torch.Tensor) -> None:
        params = list(self.dense.values())
        with torch.no_grad():
            for p, value in zip(params, split_flat(flat, params), strict=False):
                p.copy_(value)

    def release(self) -> None:
        """Unbind every bag (the end of training): later forward passes pull the rows they look
        up through the fetcher, instead of failing as a training step's would."""
        for bag in self._all_bags():
            bag.unbind()
        self._groups, self._rows, self._columns, self._inverse, self._unique_ids = [], None, None, None, None
        self._checks, self._collected, self._copying = None, None, None
        if self._executor is not None:
            # Whatever it still has (nothing, after fit) ends on its own; a later pull starts another.
            self._executor.shutdown(wait=False)
            self._executor = None
        # The gradients the cache still holds reach the shards (clock 0: the worker may have left).
        try:
            self.flush(clock=0)
        except Exception as exc:  # noqa: BLE001 - said, with what was lost, not raised over the error that ended training
            log.warning("the row cache could not push the gradients it held at the end of training: %s", exc)

    def flush(self, clock: int | None = None) -> None:
        """Push the gradients the row cache holds and wait for them (evaluation, the end of
        training); nothing without a cache or held gradients."""
        handle = self.rows.flush(clock)
        if handle is not None:
            handle.result(self.client.config.call_deadline_s + self.client.config.timeout_s)

    def lookup(self, sparse: torch.Tensor) -> torch.Tensor | None:
        """Rows [B, T, dim] of every table for ids [B, T] (column t: table t of the bound
        prefetch) in one gather, if those are the ids bound; else None.

        On CUDA, in a training step, whether they are is read with the gradients
        (``collect``), except in the first training step, which reads it at once: a model
        whose ids do not match then looks its tables up one by one from there on.
        """
        if self._inverse is None or self._rows is None or sparse.shape != self._inverse.shape:
            return None
        if not is_id_dtype(sparse.dtype):
            return None
        ids = int64_ids(sparse, "sparse")
        if self._unique_ids is None:
            if self._columns is None or not torch.equal(ids.t(), self._columns):
                return None
            return self._rows[self._inverse]
        checks = self._checks if torch.is_grad_enabled() else None
        deferred = checks is not None
        if deferred and self._fused_ok is False:
            return None
        ok = self._unique_ids[self._inverse] == ids
        if checks is not None and self._fused_ok:
            checks.append((None, ids, ok))
        else:
            # Evaluation, or the first training step: read now (a wait for the GPU).
            good = bool(ok.all())
            if deferred:
                self._fused_ok = good
            if not good:
                return None
        return self._rows[self._inverse]

    def gradients(self) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        """Row gradients of the bound tables (where the backward reached them) and the dense
        gradients, on the host (on CUDA: those ``collect`` brought back, in float32 unless it
        cast them to the wire dtype, and dense ones only where they are pushed)."""
        if self._cuda:
            self.collect(exact=True)
            assert self._collected is not None
            return self._collected
        sparse = {}
        for rows, slices in self._groups:
            if rows.grad is not None:
                grad = rows.grad.to("cpu")
                sparse.update({t: (ids, grad[a:b]) for t, ids, a, b in slices})
        dense = {}
        if self.dense and any(p.grad is not None for p in self.dense.values()):
            dense = {self.FLAT: flat_grads(list(self.dense.values())).to("cpu")}
        return sparse, dense

    def _clear(self) -> None:
        for rows, _ in self._groups:
            rows.grad = None
        for p in self.dense.values():
            p.grad = None
        self._collected = self._copying = None
        if self._checks:
            self._checks.clear()

    def push(
        self,
        clock: int,
        versions: PullResult,
        rows: Callable[[dict[str, tuple[torch.Tensor, torch.Tensor]]], dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None,
    ) -> Handle:
        """Push the collected gradients (one request per shard) and clear them; on CUDA the
        transfer thread encodes and sends them.

        Args:
            clock: this worker's clock once the step is done.
            versions: the pull the gradients were computed from.
            rows: turns the row gradients (table -> (ids, grads)) into those to push (sync
                mode combines the ranks'); they then reach it in float32.

        Raises:
            UsageError: gradients with a NaN or Inf (``check_finite``); nothing is pushed.
        """
        self.collect(exact=rows is not None)
        sparse, dense = self.gradients()
        check_finite(clock, sparse, dense)
        if rows is not None:
            sparse = rows(sparse)
        dense = dense if self.dense_on_shards else {}
        if self._cuda:
            handle: Handle = Handle(
                [Chained(self._transfers().submit(self.rows.push, sparse, dense, clock=clock, versions=versions))], first
            )
        else:
            handle = self.rows.push(sparse, dense, clock=clock, versions=versions)
        self._clear()
        return handle

    def push_pull(self, clock: int, versions: PullResult, sparse: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> Prefetch:
        """Push the collected gradients and pull the rows of ``sparse`` in one round trip.

        The shard applies the push before it reads the pull, so the rows include this step's
        update. ``install`` the result like a ``prefetch``; its ``ack`` is then the push's. On
        CUDA the transfer thread works out the ids, sends, receives and copies the rows to the
        device while the next step computes.

        Args:
            clock: this worker's clock once the step is done.
            versions: the pull the gradients were computed from.
            sparse: table -> ids (any shape) of the batch to pull for.

        Raises:
            UsageError: gradients with a NaN or Inf (``check_finite``); nothing is pushed.
        """
        self.collect()
        grads, dense = self.gradients()
        check_finite(clock, grads, dense)
        dense = dense if self.dense_on_shards else {}
        names = [self.FLAT] if self.dense_on_shards and self.dense else []
        if not self._cuda:
            unique, columns, inverse = self._unique(sparse)
            handle = self.rows.push_pull(grads, dense, unique, names, clock=clock, versions=versions)
            self._clear()
            return Prefetch(unique, handle, pushed=True, columns=columns, inverse=inverse)
        joined = self._joined(sparse)  # a bad batch fails here, as on the CPU
        prefetch = Prefetch({}, Handle([], first), pushed=True)

        def send() -> Staged:
            prefetch.ids, prefetch.columns, prefetch.inverse = self._unique_of(joined)
            with self._pulls_to_device():
                started = self.rows.push_pull(grads, dense, prefetch.ids, names, clock=clock, versions=versions)
            return self._stage(prefetch, started)

        prefetch.staged = self._transfers().submit(send)
        prefetch.handle = Handle([prefetch.staged], pulled_of)
        self._clear()
        return prefetch

    def parameters(self) -> Iterator[nn.Parameter]:
        """Dense parameters of the model."""
        return iter(self.dense.values())
