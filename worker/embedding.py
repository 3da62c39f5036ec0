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

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tether.protos.codec import int64_ids, is_id_dtype
from tether.protos.errors import InvalidArgument, UsageError
from tether.worker.client import Handle, PSClient, PullResult, PushAck
from tether.worker.metrics import NullWorkerMetrics
from tether.worker.router import Router
from tether.worker.row_cache import CachedClient, RowCacheConfig
from tether.worker.traffic import TrafficMeter

__all__ = ["PSModel", "Prefetch", "ShardedEmbeddingBag", "flat_grads", "split_flat", "unique_columns"]

log = logging.getLogger(__name__)


class ShardedEmbeddingBag(nn.Module):
    """Embedding bag over rows of a table held on the shards.

    ``forward`` takes what ``torch.nn.EmbeddingBag`` takes, with the table's own ids (any int64
    value, negative 64-bit hashes included, not row numbers; int32, uint8 or any other integer
    tensor is widened to int64, float and bool tensors are refused):

    - ids [B]: one id per sample, returns its row [B, dim];
    - ids [B, L]: a bag of L ids per sample, reduced with ``mode``;
    - ids [N] with ``offsets`` [B]: variable-length bags (bag b is ``ids[offsets[b]:offsets[b+1]]``);
    - ``per_sample_weights`` (``mode="sum"`` only) weight each id of a bag.

    Several features may share a table (give one ``ShardedEmbeddingBag`` per feature with the
    same ``table``, or one module used on each). Ids equal to ``padding_id`` are ignored: they
    are not pulled, add nothing to a bag and do not count in a mean (a bag of padding only is
    a row of zeros).

    In a training step (``PSModel.install(..., train=True)``) every id a forward looks up must
    be among the rows bound for the step, the ones whose gradients are pushed: a table or ids
    that ``sparse(batch)`` did not name stop the step with a ``UsageError`` saying what to add,
    instead of being pulled on demand and never trained. Outside training steps (evaluation,
    or any forward without autograd) ids that were not bound are pulled through the fetcher.
    On a GPU that check of a training step is made once the step's gradients are on the host
    (``PSModel.collect``), not in the forward, which would wait for the GPU in every bag.
    """

    def __init__(self, table: str, dim: int, mode: str = "sum", padding_id: int | None = None) -> None:
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be sum, mean or max, got {mode!r}")
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        if padding_id is not None and (
            isinstance(padding_id, bool) or not isinstance(padding_id, int) or not -(2**63) <= padding_id < 2**63
        ):
            raise ValueError(f"padding_id must be None or an int64 id, got {padding_id!r}")
        self.table = table
        self.dim = dim
        self.mode = mode
        self.padding_id = padding_id
        self._ids: torch.Tensor | None = None  # sorted unique ids of the bound rows (on device)
        self._rows: torch.Tensor | None = None
        # Whether the bound rows are a training step's (their gradients are pushed): then ids
        # that were not bound are an error, not a pull (its rows would never be trained).
        self._train_step = False
        self._fetch: Callable[[str, torch.Tensor], torch.Tensor] | None = None
        # Where a training step's lookups leave their "every id was bound" flags, on the device,
        # for ``PSModel.collect`` to check once (None: checked at once, as on the CPU).
        self._checks: list[tuple[ShardedEmbeddingBag | None, torch.Tensor, torch.Tensor]] | None = None

    def bind(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        train_step: bool = False,
        checks: list[tuple[ShardedEmbeddingBag | None, torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """Use ``rows`` (for sorted unique ``ids``) in the next forward passes. ``PSModel``
        passes a slice of one tensor holding every table's rows, so gradients reach that
        tensor through autograd; ``train_step``: those are the only rows of this training step
        (see the class docstring); ``checks``: a list where a training step's lookups append
        ``(bag, ids, found)`` instead of reading ``found`` (on a GPU, a wait per lookup)."""
        self._ids, self._rows, self._train_step = ids, rows, train_step
        if checks is not self._checks:  # (nn.Module's __setattr__ is not free, and this runs per bag per step)
            self._checks = checks

    def unbind(self, train_step: bool = False) -> None:
        """Drop the bound rows: this step has none of this table (``train_step``: a training
        step, in which a lookup is then an error)."""
        self._ids, self._rows, self._train_step, self._checks = None, None, train_step, None

    def set_fetcher(self, fetch: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """Function ``fetch(table, unique_ids) -> rows`` used for ids that were not bound."""
        self._fetch = fetch

    def wanted(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids of ``ids`` that need a row (padding left out), flattened."""
        flat = ids.reshape(-1)
        return flat if self.padding_id is None else flat[flat != self.padding_id]

    def _lookup(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pos, rows)``: each id's row is ``rows[pos]``, padding's is ``len(rows)``.

        ``rows`` are the bound ones; ids that were not bound are pulled through the fetcher
        (and bound, outside a training step).

        Raises:
            UsageError: in a training step, a table or ids that ``sparse(batch)`` did not name.
            InvalidArgument: ids that were not bound and no fetcher.
        """
        pad = None if self.padding_id is None else flat == self.padding_id
        ids, rows = self._ids, self._rows
        if ids is not None and rows is not None and ids.numel():
            pos = torch.searchsorted(ids, flat).clamp_(max=ids.numel() - 1)
            found = ids[pos] == flat
            if pad is not None:
                found |= pad
            if self._checks is not None and torch.is_grad_enabled():
                # A GPU training step: the flag is read with the gradients, once a step.
                self._checks.append((self, flat, found))
                return (pos if pad is None else torch.where(pad, rows.shape[0], pos)), rows
            if bool(found.all()):
                return (pos if pad is None else torch.where(pad, rows.shape[0], pos)), rows
            missing = flat[~found]
        elif ids is not None and rows is not None and self._checks is not None and torch.is_grad_enabled():
            # No row of this table is bound (all padding, or no id at all): only padding may be looked up.
            self._checks.append((self, flat, pad if pad is not None else torch.zeros_like(flat, dtype=torch.bool)))
            return torch.full_like(flat, rows.shape[0]), rows
        else:
            missing = flat if pad is None else flat[~pad]
            if rows is not None and not missing.numel():
                # Padding only (or no id at all) and this step's (empty) rows: no row is needed.
                return torch.full_like(flat, rows.shape[0]), rows
        if self._train_step and torch.is_grad_enabled():
            self.raise_not_named(missing)
        if self._fetch is None:
            raise InvalidArgument(f"table {self.table!r}: ids were not pulled and no fetcher is set")
        unique = torch.unique(flat if pad is None else flat[~pad])
        fetched = self._fetch(self.table, unique).to(flat.device)
        if not self._train_step:
            # Kept for the next forward passes (evaluation looks the same ids up again); a
            # training step's rows stay bound.
            self.bind(unique, fetched)
        pos = torch.searchsorted(unique, flat).clamp_(max=max(unique.numel() - 1, 0))
        return (pos if pad is None else torch.where(pad, fetched.shape[0], pos)), fetched

    def raise_not_named(self, missing: torch.Tensor) -> None:
        """Stop a training step whose forward looks up rows that were not pulled for it.

        Raises:
            UsageError: always, naming the table and (where it was named) one of the ``missing`` ids.
        """
        t = self.table
        if self._ids is None:
            raise UsageError(
                f"table {t!r} was looked up by the forward pass but sparse(batch) did not name it: add {t!r}: <its ids> to sparse"
            )
        raise UsageError(
            f"table {t!r}: the forward pass looked up {int(torch.unique(missing).numel())} id(s) that sparse(batch) did not name "
            f"(id {int(missing[0])} for one): give sparse every id of {t!r} the forward looks up (a list of tensors for several features)"
        )

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        ids = int64_ids(ids, self.table, UsageError)
        if offsets is not None and ids.dim() != 1:
            raise InvalidArgument(f"table {self.table!r}: ids with offsets must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dim() not in (1, 2):
            raise InvalidArgument(f"table {self.table!r}: ids must be [B], [B, L] or [N] with offsets, got shape {tuple(ids.shape)}")
        flat = ids.reshape(-1).contiguous()
        pos, rows = self._lookup(flat)
        bound = rows
        if self.padding_id is not None:
            rows = torch.cat([rows, rows.new_zeros(1, self.dim)])
        if ids.dim() == 1 and offsets is None:
            if per_sample_weights is not None:
                raise InvalidArgument(f"table {self.table!r}: per_sample_weights need bags (offsets or [B, L] ids)")
            return rows[pos]
        if offsets is None:
            offsets = torch.arange(0, flat.numel(), ids.shape[1], device=flat.device)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        padding_idx = bound.shape[0] if self.padding_id is not None else None
        return F.embedding_bag(pos, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights, padding_idx=padding_idx)


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """Every parameter's gradient (zeros where there is none), concatenated into one tensor."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def split_flat(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each of ``params`` (the inverse of the concatenation)."""
    return [part.view_as(p) for part, p in zip(torch.split(flat, [p.numel() for p in params]), params)]


@dataclass
class Prefetch:
    """A pull in flight for one batch: its unique ids per table and the handle.

    ``pushed`` marks a ``push_pull``: the same round trip also carries a step's gradients,
    whose ``PushAck`` ``install`` puts in ``ack``. ``columns`` and ``inverse`` are set when
    every table's ids were one column of a [B, T] batch: the ids as [T, B] and, for each,
    its row among all tables' unique ids in table order (so one gather looks every table up).
    ``staged`` (CUDA): the transfer thread's work on the pull, which waits for it and copies it
    to the device; for a ``push_pull`` that thread also works out ``ids``, ``columns`` and
    ``inverse`` (set here before it sends), so read them once ``staged`` is done.
    """

    ids: dict[str, torch.Tensor]
    handle: Handle
    pushed: bool = False
    fresh: bool = False  # read from the shards past the row cache (made with the model in eval mode)
    ack: PushAck | None = None
    columns: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    staged: Future[_Staged] | None = None


@dataclass
class _Staged:
    """A pull on the device: what the transfer thread copied there, and the event recorded on
    the side stream after the copies (``install`` makes the compute stream wait for it)."""

    pulled: PullResult
    groups: list[tuple[list[str], torch.Tensor]]  # tables of one row width, and their rows
    ids: torch.Tensor  # every table's unique ids, one table after another
    inverse: torch.Tensor | None  # [B, T]: the row of each id of the batch (see Prefetch)
    flat: torch.Tensor | None  # the dense values
    ready: Any  # torch.cuda.Event

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*(rows for _, rows in self.groups), self.ids, self.inverse, self.flat) if t is not None]


class _Chained:
    """A client call the transfer thread starts: a ``Pending`` whose result is that call's."""

    def __init__(self, started: Future[Handle[Any]]) -> None:
        self._started = started

    def done(self) -> bool:
        return self._started.done() and (self._started.exception() is not None or self._started.result().done())

    def result(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        handle = self._started.result(timeout)
        return handle.result(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _back_to_back(parts: Sequence[torch.Tensor]) -> bool:
    """Whether ``parts`` lie one after another in one storage (slices of one buffer, in order)."""
    storage = parts[0].untyped_storage().data_ptr()
    end = parts[0].storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.storage_offset() != end or p.untyped_storage().data_ptr() != storage:
            return False
        end += p.numel()
    return True


def _pinned(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` joined along dim 0 in pinned memory: a view of them where they already lie back
    to back in one pinned buffer (the router's receive buffers), else one copy into a new one."""
    first = parts[0]
    n = sum(p.shape[0] for p in parts)
    if _back_to_back(parts) and first.is_pinned():
        return first.as_strided((n, *first.shape[1:]), first.stride(), first.storage_offset())
    out = torch.empty((n, *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    return torch.cat(list(parts), out=out) if len(parts) > 1 else out.copy_(first)


def unique_columns(ids: torch.Tensor) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Sorted unique ids of every row of ``ids`` [T, B] in a handful of torch calls.

    Returns:
        ``(unique, counts, inverse)``: row t's sorted unique ids are ``unique`` split by
        ``counts`` (one after another, row order), and ``unique[inverse[t, b]] == ids[t, b]``.
    """
    t, b = ids.shape
    ordered, perm = torch.sort(ids, dim=1)
    first = torch.ones_like(ordered, dtype=torch.bool)
    torch.ne(ordered[:, 1:], ordered[:, :-1], out=first[:, 1:])
    first = first.reshape(-1)
    unique = ordered.reshape(-1)[first]
    rank = torch.cumsum(first, 0).sub_(1).view(t, b)
    inverse = torch.empty_like(rank).scatter_(1, perm, rank)
    return unique, first.view(t, b).sum(1).tolist(), inverse


def _columns(sparse: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The ids as [T, B] if every table has one id per sample of one batch, else None."""
    values = list(sparse.values())
    if not values or any(v.dim() != 1 or v.dtype != torch.int64 or len(v) != len(values[0]) for v in values):
        return None
    return torch.stack([v.cpu() for v in values])


class PSModel:
    """Binds a model to the shards: pull before forward, push after backward.

    On a CUDA device a transfer thread of its own waits for pulls, copies them to the GPU on a
    side stream and sends pushes (see the module docstring); on the CPU every call runs on the
    calling thread.
    """

    def __init__(self, model: nn.Module, client: PSClient, device: torch.device, dense_on_shards: bool = True) -> None:
        self.model = model
        self.client = client
        self.device = device
        # False in sync mode: dense parameters stay on the workers and are all-reduced.
        self.dense_on_shards = dense_on_shards
        # Every module of each table (features that share a table each have their own).
        self.bags: dict[str, list[ShardedEmbeddingBag]] = {}
        for m in model.modules():
            if isinstance(m, ShardedEmbeddingBag):
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
        self._checks: list[tuple[ShardedEmbeddingBag | None, torch.Tensor, torch.Tensor]] | None = None
        self._collected: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]] | None = None
        # The gradients' copies to the host once queued and not yet waited for (``collect``).
        self._copying: tuple[Any, list[torch.Tensor], list[tuple[int, list[tuple[str, torch.Tensor, int, int]]]], int | None,
                             list[tuple[ShardedEmbeddingBag | None, torch.Tensor, torch.Tensor]]] | None = None
        self._fused_ok: bool | None = None
        self._executor: ThreadPoolExecutor | None = None
        if self._cuda:
            self._index = device.index if device.index is not None else torch.cuda.current_device()
            self._side = torch.cuda.Stream(device=self._index)
            router = getattr(client, "router", None)
            if isinstance(router, Router):
                router.pin_memory = True
        for bag in self._all_bags():
            bag.set_fetcher(self._fetch)
        # Training pulls and pushes go through the row cache (tether.worker.row_cache; with none,
        # straight to the client), which counts rows and bytes moved per table.
        metrics = getattr(client, "metrics", None)
        dims = {t: bags[0].dim for t, bags in self.bags.items()}
        wire = getattr(client.config, "wire_dtype", torch.float32)
        self.meter = TrafficMeter(dims, wire.itemsize, metrics, reuse=metrics is not None and not isinstance(metrics, NullWorkerMetrics))
        self.rows = CachedClient(client, getattr(client.config, "cache", None) or RowCacheConfig(), dims, self.meter)
        self._eval_warned = False
        if hasattr(model, "fused_lookup"):
            setattr(model, "fused_lookup", self.lookup)  # noqa: B010 - an attribute torch's Module typing does not know

    def _all_bags(self) -> Iterator[ShardedEmbeddingBag]:
        return (bag for same in self.bags.values() for bag in same)

    # All dense parameters travel as one flat tensor: one block per request instead of one per
    # parameter (a DLRM has a dozen small ones), chunked by the client like any dense tensor.
    FLAT = "dense"

    def dense_tensors(self) -> dict[str, torch.Tensor]:
        """The model's dense parameters as the one flat tensor to declare."""
        return {self.FLAT: torch.cat([p.detach().reshape(-1).cpu() for p in self.dense.values()])}

    def _fetch(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self.client.pull({table: ids.cpu()}).result(self.client.config.call_deadline_s + self.client.config.timeout_s).rows[table]

    def _transfers(self) -> ThreadPoolExecutor:
        """The transfer thread (CUDA): one, so pulls and pushes go out in the order they were asked for."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tether-transfer")
        return self._executor

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
        columns = None if any(self.bags[t][0].padding_id is not None for t in joined) else _columns(joined)
        if columns is None:
            return {t: torch.unique(self.bags[t][0].wanted(ids.cpu())) for t, ids in joined.items()}, None, None
        unique, counts, inverse = unique_columns(columns)
        return dict(zip(joined, torch.split(unique, counts))), columns, inverse

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
        prefetch = Prefetch(unique, Handle([], _first), columns=columns, inverse=inverse, fresh=fresh)
        # Sent from the transfer thread too, so it leaves after the pushes handed to it before.
        prefetch.staged = self._transfers().submit(lambda: self._stage(prefetch, client.pull(unique, names)))
        prefetch.handle = Handle([prefetch.staged], _pulled)
        return prefetch

    def _stage(self, prefetch: Prefetch, handle: Handle[PullResult], timeout: float | None = None) -> _Staged:
        """Wait for a pull and copy it to the device on the side stream, from pinned memory: the
        rows of each width as received (one buffer when the router pinned them, else joined
        into one), every table's ids and the batch's inverse in one buffer, the dense values."""
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
        with torch.cuda.device(self._index), torch.cuda.stream(self._side):
            groups = [
                (tables, _pinned([pulled.rows[t] for t in tables]).to(self.device, non_blocking=True))
                for tables in self._by_width(prefetch, pulled)
            ]
            on_device = host_ids.to(self.device, non_blocking=True)
            dense = None if flat is None else _pinned([flat]).to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._side)
        placed = None if inverse is None else on_device[n:].view(inverse.shape[1], inverse.shape[0])
        return _Staged(pulled, groups, on_device[:n], placed, dense, ready)

    @staticmethod
    def _by_width(prefetch: Prefetch, pulled: PullResult) -> list[list[str]]:
        """The prefetch's tables grouped by row width (tables of one width share one tensor)."""
        by_dim: dict[int, list[str]] = {}
        for table in prefetch.ids:
            by_dim.setdefault(pulled.rows[table].shape[1], []).append(table)
        return list(by_dim.values())

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
            parts = [pulled.rows[t] for t in tables]
            groups.append((tables, self._to_device(parts[0] if len(parts) == 1 else torch.cat(parts))))
        self._bind(prefetch, groups, {t: self._to_device(ids) for t, ids in prefetch.ids.items()}, train)
        self._columns = None if prefetch.columns is None else self._to_device(prefetch.columns)
        self._inverse = None if prefetch.inverse is None else self._to_device(prefetch.inverse.t())
        if self.FLAT in pulled.dense:
            self._load_dense(self._to_device(pulled.dense[self.FLAT]))
        return pulled

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._host else t.to(self.device)

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
        ids = dict(zip(prefetch.ids, torch.split(staged.ids, [len(i) for i in prefetch.ids.values()]))) if prefetch.ids else {}
        self._checks = [] if train else None
        self._bind(prefetch, staged.groups, ids, train)
        self._columns, self._inverse, self._unique_ids = None, staged.inverse, staged.ids
        if staged.flat is not None:
            self._load_dense(staged.flat)
        return pulled

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
            for p, value in zip(params, split_flat(flat, params)):
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
            for rows, slices in self._groups:
                if rows.grad is not None:
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
            for h, t in zip(host, sources):
                h.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self._index))
            self._copying = (copied, host, grouped, dense_at, checks)
        if not wait:
            return
        copied, host, grouped, dense_at, checks = self._copying
        self._copying = None
        if not copied.query():
            copied.synchronize()
        if checks and not bool(host[-1][0]):
            self._unnamed(checks)
        sparse = {t: (ids, host[i][a:b]) for i, slices in grouped for t, ids, a, b in slices}
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
        """
        self.collect(exact=rows is not None)
        sparse, dense = self.gradients()
        if rows is not None:
            sparse = rows(sparse)
        dense = dense if self.dense_on_shards else {}
        if self._cuda:
            handle: Handle = Handle(
                [_Chained(self._transfers().submit(self.rows.push, sparse, dense, clock=clock, versions=versions))], _first
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
        """
        self.collect()
        grads, dense = self.gradients()
        dense = dense if self.dense_on_shards else {}
        names = [self.FLAT] if self.dense_on_shards and self.dense else []
        if not self._cuda:
            unique, columns, inverse = self._unique(sparse)
            handle = self.rows.push_pull(grads, dense, unique, names, clock=clock, versions=versions)
            self._clear()
            return Prefetch(unique, handle, pushed=True, columns=columns, inverse=inverse)
        joined = self._joined(sparse)  # a bad batch fails here, as on the CPU
        prefetch = Prefetch({}, Handle([], _first), pushed=True)

        def send() -> _Staged:
            prefetch.ids, prefetch.columns, prefetch.inverse = self._unique_of(joined)
            started = self.rows.push_pull(grads, dense, prefetch.ids, names, clock=clock, versions=versions)
            return self._stage(prefetch, started)

        prefetch.staged = self._transfers().submit(send)
        prefetch.handle = Handle([prefetch.staged], _pulled)
        self._clear()
        return prefetch

    def parameters(self) -> Iterator[nn.Parameter]:
        """Dense parameters of the model."""
        return iter(self.dense.values())


def _first(answers: list[Any]) -> Any:
    return answers[0]


def _pulled(answers: list[_Staged]) -> PullResult:
    return answers[0].pulled
