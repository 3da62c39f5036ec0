"""PyTorch modules whose parameters live on the shards.

``ShardedEmbeddingBag`` looks rows up in rows pulled from the shards. ``PSModel`` binds a
model's embedding bags and dense parameters to a ``PSClient``: it pulls what a batch needs
(ahead of time, so the pull overlaps the previous step's compute), loads every table's rows
into one tensor on the device (each bag holds a slice of it, and a model with a
``fused_lookup`` hook gathers all tables at once), and after the backward hands that tensor's
gradient, split per table, to one push per shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tether.protos.errors import InvalidArgument
from tether.worker.client import Handle, PSClient, PullResult, PushAck

__all__ = ["PSModel", "Prefetch", "ShardedEmbeddingBag", "flat_grads", "split_flat", "unique_columns"]


class ShardedEmbeddingBag(nn.Module):
    """Embedding bag over rows of a table held on the shards.

    ``forward(ids)`` takes int64 ids of shape [B] (one id per sample) or [B, L] (a bag of L
    ids per sample, reduced with ``mode``) and returns [B, dim].
    """

    def __init__(self, table: str, dim: int, mode: str = "sum") -> None:
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be sum, mean or max, got {mode!r}")
        self.table = table
        self.dim = dim
        self.mode = mode
        self._ids: torch.Tensor | None = None  # sorted unique ids of the bound rows (on device)
        self._rows: torch.Tensor | None = None
        self._fetch: Callable[[str, torch.Tensor], torch.Tensor] | None = None

    def bind(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Use ``rows`` (for sorted unique ``ids``) in the next forward passes. ``PSModel``
        passes a slice of one tensor holding every table's rows, so gradients reach that
        tensor through autograd."""
        self._ids, self._rows = ids, rows

    def set_fetcher(self, fetch: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """Function ``fetch(table, unique_ids) -> rows`` used for ids that were not bound."""
        self._fetch = fetch

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype != torch.int64:
            raise InvalidArgument(f"table {self.table!r}: ids must be int64, got {ids.dtype}")
        flat = ids.reshape(-1).contiguous()
        pos = None
        if self._ids is not None and self._ids.numel():
            pos = torch.searchsorted(self._ids, flat).clamp_(max=self._ids.numel() - 1)
            if not torch.equal(self._ids[pos], flat):
                pos = None
        if pos is None:
            if self._fetch is None:
                raise InvalidArgument(f"table {self.table!r}: ids were not pulled and no fetcher is set")
            unique = torch.unique(flat)
            self.bind(unique, self._fetch(self.table, unique).to(flat.device))
            pos = torch.searchsorted(self._ids, flat)
        rows = self._rows[pos]
        if ids.dim() == 1:
            return rows
        rows = rows.view(*ids.shape, self.dim)
        if self.mode == "sum":
            return rows.sum(dim=-2)
        if self.mode == "mean":
            return rows.mean(dim=-2)
        return rows.max(dim=-2).values


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
    """

    ids: dict[str, torch.Tensor]
    handle: Handle
    pushed: bool = False
    ack: PushAck | None = None
    columns: torch.Tensor | None = None
    inverse: torch.Tensor | None = None


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
    """Binds a model to the shards: pull before forward, push after backward."""

    def __init__(self, model: nn.Module, client: PSClient, device: torch.device, dense_on_shards: bool = True) -> None:
        self.model = model
        self.client = client
        self.device = device
        # False in sync mode: dense parameters stay on the workers and are all-reduced.
        self.dense_on_shards = dense_on_shards
        self.bags: dict[str, ShardedEmbeddingBag] = {
            m.table: m for m in model.modules() if isinstance(m, ShardedEmbeddingBag)
        }
        self.dense: dict[str, nn.Parameter] = dict(model.named_parameters())
        self._pin = device.type == "cuda"
        # Every bound table's rows in one tensor (table order of the prefetch), its tables
        # and their [start, stop) slices; the bags hold slices of it, so its .grad after a
        # backward is every table's row gradients at once.
        self._rows: torch.Tensor | None = None
        self._slices: list[tuple[str, torch.Tensor, int, int]] = []
        self._columns: torch.Tensor | None = None
        self._inverse: torch.Tensor | None = None
        for bag in self.bags.values():
            bag.set_fetcher(self._fetch)
        if hasattr(model, "fused_lookup"):
            model.fused_lookup = self.lookup

    # All dense parameters travel as one flat tensor: one block per request instead of one per
    # parameter (a DLRM has a dozen small ones), chunked by the client like any dense tensor.
    FLAT = "dense"

    def dense_tensors(self) -> dict[str, torch.Tensor]:
        """The model's dense parameters as the one flat tensor to declare."""
        return {self.FLAT: torch.cat([p.detach().reshape(-1).cpu() for p in self.dense.values()])}

    def _fetch(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self.client.pull({table: ids.cpu()}).result(self.client.config.timeout_s * 2).rows[table]

    def _unique(self, sparse: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        columns = _columns(sparse)
        if columns is None:
            return {t: torch.unique(ids.reshape(-1).cpu()) for t, ids in sparse.items()}, None, None
        unique, counts, inverse = unique_columns(columns)
        return dict(zip(sparse, torch.split(unique, counts))), columns, inverse

    def prefetch(self, sparse: Mapping[str, torch.Tensor], with_dense: bool = True) -> Prefetch:
        """Start pulling the rows of ``sparse`` (table -> ids of any shape) and the dense values."""
        unique, columns, inverse = self._unique(sparse)
        names = [self.FLAT] if with_dense and self.dense_on_shards and self.dense else []
        return Prefetch(unique, self.client.pull(unique, names), columns=columns, inverse=inverse)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self._pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def install(self, prefetch: Prefetch, train: bool = True, timeout: float | None = None) -> PullResult:
        """Wait for a prefetch and load its rows and dense values into the model."""
        pulled = prefetch.handle.result(timeout)
        if prefetch.pushed:
            prefetch.ack = pulled.ack
        tables = list(prefetch.ids)
        parts = [pulled.rows[t] for t in tables]
        rows = self._to_device(parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else None
        if rows is not None and train:
            rows = rows.detach().requires_grad_(True)
        self._rows, self._slices = rows, []
        start = 0
        for table, part in zip(tables, parts):
            stop = start + len(part)
            ids = self._to_device(prefetch.ids[table])
            self.bags[table].bind(ids, rows[start:stop])
            self._slices.append((table, prefetch.ids[table], start, stop))
            start = stop
        self._columns = None if prefetch.columns is None else self._to_device(prefetch.columns)
        self._inverse = None if prefetch.inverse is None else self._to_device(prefetch.inverse.t())
        if self.FLAT in pulled.dense:
            flat = self._to_device(pulled.dense[self.FLAT])
            params = list(self.dense.values())
            with torch.no_grad():
                for p, value in zip(params, split_flat(flat, params)):
                    p.copy_(value)
        return pulled

    def lookup(self, sparse: torch.Tensor) -> torch.Tensor | None:
        """Rows [B, T, dim] of every table for ids [B, T] (column t: table t of the bound
        prefetch) in one gather, if those are the ids bound; else None."""
        if self._inverse is None or self._rows is None or sparse.shape != self._inverse.shape:
            return None
        if not torch.equal(sparse.t(), self._columns):
            return None
        return self._rows[self._inverse]

    def gradients(self) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        """Row gradients of the bound tables (where the backward reached them) and the dense
        gradients."""
        sparse = {}
        grad = None if self._rows is None else self._rows.grad
        if grad is not None:
            grad = grad.to("cpu")
            sparse = {t: (ids, grad[a:b]) for t, ids, a, b in self._slices}
        dense = {}
        if self.dense and any(p.grad is not None for p in self.dense.values()):
            dense = {self.FLAT: flat_grads(list(self.dense.values())).to("cpu")}
        return sparse, dense

    def _clear(self) -> None:
        if self._rows is not None:
            self._rows.grad = None
        for p in self.dense.values():
            p.grad = None

    def push(self, clock: int, versions: PullResult, sparse_scale: float = 1.0) -> Handle:
        """Push the collected gradients (one request per shard) and clear them.

        Args:
            clock: this worker's clock once the step is done.
            versions: the pull the gradients were computed from.
            sparse_scale: factor on row gradients (sync mode averages over ranks).
        """
        sparse, dense = self.gradients()
        if sparse_scale != 1.0:
            sparse = {t: (ids, g * sparse_scale) for t, (ids, g) in sparse.items()}
        handle = self.client.push(sparse, dense if self.dense_on_shards else {}, clock=clock, versions=versions)
        self._clear()
        return handle

    def push_pull(self, clock: int, versions: PullResult, sparse: Mapping[str, torch.Tensor]) -> Prefetch:
        """Push the collected gradients and pull the rows of ``sparse`` in one round trip.

        The shard applies the push before it reads the pull, so the rows include this step's
        update. ``install`` the result like a ``prefetch``; its ``ack`` is then the push's.

        Args:
            clock: this worker's clock once the step is done.
            versions: the pull the gradients were computed from.
            sparse: table -> ids (any shape) of the batch to pull for.
        """
        grads, dense = self.gradients()
        unique, columns, inverse = self._unique(sparse)
        names = [self.FLAT] if self.dense_on_shards and self.dense else []
        handle = self.client.push_pull(
            grads, dense if self.dense_on_shards else {}, unique, names, clock=clock, versions=versions
        )
        self._clear()
        return Prefetch(unique, handle, pushed=True, columns=columns, inverse=inverse)

    def parameters(self) -> Iterator[nn.Parameter]:
        """Dense parameters of the model."""
        return iter(self.dense.values())
