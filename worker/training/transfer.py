"""What ``PSModel`` keeps of a pull in flight (``Prefetch``) and the transfer thread's pieces on
CUDA: a pull staged on the device, chained client calls, pinned buffers, and the unique ids of
a [T, B] batch in a handful of torch calls (see tether.worker.training.embedding)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tether.worker.client.results import Handle, PullResult, PushAck

__all__ = ["Chained", "Prefetch", "Staged", "columns_of", "device_joined", "first", "flat_grads", "pinned", "pulled_of", "split_flat",
           "unique_columns"]


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
    staged: Future[Staged] | None = None


@dataclass
class Staged:
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


class Chained:
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


def pinned(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` joined along dim 0 in pinned memory: a view of them where they already lie back
    to back in one pinned buffer (the router's receive buffers), else one copy into a new one."""
    first = parts[0]
    n = sum(p.shape[0] for p in parts)
    if _back_to_back(parts) and first.is_pinned():
        return first.as_strided((n, *first.shape[1:]), first.stride(), first.storage_offset())
    out = torch.empty((n, *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    return torch.cat(list(parts), out=out) if len(parts) > 1 else out.copy_(first)


def device_joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` (on one device) joined along dim 0: a view where they lie back to back in one
    buffer (a device row cache's answer), else one copy there."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if _back_to_back(parts):
        return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride(), first.storage_offset())
    return torch.cat(list(parts))


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


def columns_of(sparse: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The ids as [T, B] if every table has one id per sample of one batch, else None."""
    values = list(sparse.values())
    if not values or any(v.dim() != 1 or v.dtype != torch.int64 or len(v) != len(values[0]) for v in values):
        return None
    return torch.stack([v.cpu() for v in values])


def first(answers: list[Any]) -> Any:
    return answers[0]


def pulled_of(answers: list[Staged]) -> PullResult:
    return answers[0].pulled


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """Every parameter's gradient (zeros where there is none), concatenated into one tensor."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def split_flat(flat: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each of ``params`` (the inverse of the concatenation)."""
    return [part.view_as(p) for part, p in zip(torch.split(flat, [p.numel() for p in params]), params, strict=False)]
