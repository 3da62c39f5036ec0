"""``ShardedEmbeddingBag``: an embedding bag whose rows live on the shards (``PSModel`` binds
it to each step's pulled rows; see tether.worker.training.embedding)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tether.protos.codec import int64_ids
from tether.protos.errors import InvalidArgument, UsageError

__all__ = ["ShardedEmbeddingBag"]


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
