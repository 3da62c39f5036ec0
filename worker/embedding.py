"""PyTorch modules whose parameters live on the shards.

``ShardedEmbeddingBag`` looks rows up in rows pulled from the shards. ``PSModel`` binds a
model's embedding bags and dense parameters to a ``PSClient``: it pulls what a batch needs
(ahead of time, so the pull overlaps the previous step's compute), loads every table's rows
into one tensor on the device (each bag holds a slice of it, and a model with a
``fused_lookup`` hook gathers all tables at once), and after the backward hands that tensor's
gradient, split per table, to one push per shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tether.protos.codec import int64_ids, is_id_dtype
from tether.protos.errors import InvalidArgument, UsageError
from tether.worker.client import Handle, PSClient, PullResult, PushAck

__all__ = ["PSModel", "Prefetch", "ShardedEmbeddingBag", "flat_grads", "split_flat", "unique_columns"]


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
    """

    def __init__(self, table: str, dim: int, mode: str = "sum", padding_id: int | None = None) -> None:
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be sum, mean or max, got {mode!r}")
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        if padding_id is not None and (isinstance(padding_id, bool) or not isinstance(padding_id, int) or not -(2**63) <= padding_id < 2**63):
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

    def bind(self, ids: torch.Tensor, rows: torch.Tensor, train_step: bool = False) -> None:
        """Use ``rows`` (for sorted unique ``ids``) in the next forward passes. ``PSModel``
        passes a slice of one tensor holding every table's rows, so gradients reach that
        tensor through autograd; ``train_step``: those are the only rows of this training step
        (see the class docstring)."""
        self._ids, self._rows, self._train_step = ids, rows, train_step

    def unbind(self, train_step: bool = False) -> None:
        """Drop the bound rows: this step has none of this table (``train_step``: a training
        step, in which a lookup is then an error)."""
        self._ids, self._rows, self._train_step = None, None, train_step

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
            if bool(found.all()):
                return (pos if pad is None else torch.where(pad, rows.shape[0], pos)), rows
            missing = flat[~found]
        else:
            missing = flat if pad is None else flat[~pad]
            if rows is not None and not missing.numel():
                # Padding only (or no id at all) and this step's (empty) rows: no row is needed.
                return torch.full_like(flat, rows.shape[0]), rows
        if self._train_step and torch.is_grad_enabled():
            self._not_named(missing)
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

    def _not_named(self, missing: torch.Tensor) -> None:
        """Stop a training step whose forward looks up rows that were not pulled for it."""
        t = self.table
        if self._ids is None:
            raise UsageError(f"table {t!r} was looked up by the forward pass but sparse(batch) did not name it: add {t!r}: <its ids> to sparse")
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
        self._pin = device.type == "cuda"
        # Every bound table's rows in one tensor per row width (table order of the prefetch),
        # with its tables and their [start, stop) slices; the bags hold slices of it, so its
        # .grad after a backward is those tables' row gradients at once. ``_rows`` is the one
        # tensor when every table has the same width (what a fused lookup gathers from).
        self._groups: list[tuple[torch.Tensor, list[tuple[str, torch.Tensor, int, int]]]] = []
        self._rows: torch.Tensor | None = None
        self._columns: torch.Tensor | None = None
        self._inverse: torch.Tensor | None = None
        for bag in self._all_bags():
            bag.set_fetcher(self._fetch)
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

    def _unique(
        self, sparse: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
        """Sorted unique int64 ids per table (padding left out); several tensors for one table
        (its features) are joined.

        Raises:
            InvalidArgument: a table no bag of the model uses.
            UsageError: ids that are not integers.
        """
        unknown = [t for t in sparse if t not in self.bags]
        if unknown:
            raise InvalidArgument(f"tables {unknown} have no ShardedEmbeddingBag in the model (its tables: {sorted(self.bags)})")
        # Ids of any integer width are widened to int64 (float or bool ids: one line naming the table).
        joined = {
            t: int64_ids(ids, t, UsageError) if isinstance(ids, torch.Tensor) else torch.cat([int64_ids(i, t, UsageError).reshape(-1) for i in ids])
            for t, ids in sparse.items()
        }
        columns = None if any(self.bags[t][0].padding_id is not None for t in joined) else _columns(joined)
        if columns is None:
            return {t: torch.unique(self.bags[t][0].wanted(ids.cpu())) for t, ids in joined.items()}, None, None
        unique, counts, inverse = unique_columns(columns)
        return dict(zip(sparse, torch.split(unique, counts))), columns, inverse

    def prefetch(self, sparse: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], with_dense: bool = True) -> Prefetch:
        """Start pulling the rows of ``sparse`` (table -> integer ids of any shape, or a list of
        such tensors for features that share the table) and the dense values."""
        unique, columns, inverse = self._unique(sparse)
        names = [self.FLAT] if with_dense and self.dense_on_shards and self.dense else []
        return Prefetch(unique, self.client.pull(unique, names), columns=columns, inverse=inverse)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self._pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def install(self, prefetch: Prefetch, train: bool = True, timeout: float | None = None) -> PullResult:
        """Wait for a prefetch and load its rows and dense values into the model.

        Every bag is bound to this step's rows, and those of tables the prefetch did not name
        to none, so no forward looks up another step's rows. ``train``: a training step, whose
        forward may look up only the rows pulled here (those get their gradients pushed).
        """
        pulled = prefetch.handle.result(timeout)
        if prefetch.pushed:
            prefetch.ack = pulled.ack
        # Tables of one width share one tensor (one for the common case of a single width).
        by_dim: dict[int, list[str]] = {}
        for table in prefetch.ids:
            by_dim.setdefault(pulled.rows[table].shape[1], []).append(table)
        self._groups = []
        for tables in by_dim.values():
            parts = [pulled.rows[t] for t in tables]
            rows = self._to_device(parts[0] if len(parts) == 1 else torch.cat(parts))
            if train:
                rows = rows.detach().requires_grad_(True)
            slices = []
            start = 0
            for table, part in zip(tables, parts):
                stop = start + len(part)
                ids = self._to_device(prefetch.ids[table])
                for bag in self.bags[table]:
                    bag.bind(ids, rows[start:stop], train_step=train)
                slices.append((table, prefetch.ids[table], start, stop))
                start = stop
            self._groups.append((rows, slices))
        for table, bags in self.bags.items():
            if table not in prefetch.ids:
                for bag in bags:
                    bag.unbind(train_step=train)
        self._rows = self._groups[0][0] if len(self._groups) == 1 else None
        self._columns = None if prefetch.columns is None else self._to_device(prefetch.columns)
        self._inverse = None if prefetch.inverse is None else self._to_device(prefetch.inverse.t())
        if self.FLAT in pulled.dense:
            flat = self._to_device(pulled.dense[self.FLAT])
            params = list(self.dense.values())
            with torch.no_grad():
                for p, value in zip(params, split_flat(flat, params)):
                    p.copy_(value)
        return pulled

    def release(self) -> None:
        """Unbind every bag (the end of training): later forward passes pull the rows they look
        up through the fetcher, instead of failing as a training step's would."""
        for bag in self._all_bags():
            bag.unbind()
        self._groups, self._rows, self._columns, self._inverse = [], None, None, None

    def lookup(self, sparse: torch.Tensor) -> torch.Tensor | None:
        """Rows [B, T, dim] of every table for ids [B, T] (column t: table t of the bound
        prefetch) in one gather, if those are the ids bound; else None."""
        if self._inverse is None or self._rows is None or self._columns is None or sparse.shape != self._inverse.shape:
            return None
        if not is_id_dtype(sparse.dtype) or not torch.equal(int64_ids(sparse, "sparse").t(), self._columns):
            return None
        return self._rows[self._inverse]

    def gradients(self) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        """Row gradients of the bound tables (where the backward reached them) and the dense
        gradients."""
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

    def push(
        self,
        clock: int,
        versions: PullResult,
        rows: Callable[[dict[str, tuple[torch.Tensor, torch.Tensor]]], dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None,
    ) -> Handle:
        """Push the collected gradients (one request per shard) and clear them.

        Args:
            clock: this worker's clock once the step is done.
            versions: the pull the gradients were computed from.
            rows: turns the row gradients (table -> (ids, grads)) into those to push (sync
                mode combines the ranks').
        """
        sparse, dense = self.gradients()
        if rows is not None:
            sparse = rows(sparse)
        handle = self.client.push(sparse, dense if self.dense_on_shards else {}, clock=clock, versions=versions)
        self._clear()
        return handle

    def push_pull(self, clock: int, versions: PullResult, sparse: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> Prefetch:
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
