"""A user's batches on the training device: picking the device, moving any nested batch there,
and counting its samples."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from tether.protos.errors import UsageError

__all__ = ["batch_size_of", "count_samples", "pick_device", "to_device"]


def pick_device(name: str) -> torch.device:
    """``auto`` means CUDA when there is a GPU, else the CPU.

    Raises:
        UsageError: CUDA asked for but not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: torch sees no CUDA device")
    return device


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it on ``device`` (tensors, mappings, sequences, named
    tuples and dataclasses are walked; anything else is left as it is)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if device.type == "cpu" and _all_cpu(batch):
        return batch
    kind: Any = type(batch)  # the batch's own container type, rebuilt around moved tensors
    if isinstance(batch, Mapping):
        return kind({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return replace(batch, **{f.name: to_device(getattr(batch, f.name), device) for f in dataclasses.fields(batch) if f.init})
    return batch


def _all_cpu(batch: Any) -> bool:
    return all(t.device.type == "cpu" for t in _tensors(batch))


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    return (t for _, t in _named_tensors(batch, ""))


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the length most of its tensors share (see ``count_samples``)."""
    return count_samples(batch)[0]


def count_samples(batch: Any) -> tuple[int, str | None]:
    """Samples in ``batch`` and, when its tensors disagree on their length, why that count.

    The count is the leading length most of the batch's tensors share, the smaller on a tie: a
    jagged tensor (the ids of variable-length bags, longer than the batch) or offsets with one
    entry more than the bags are outvoted by the labels and the other per-sample tensors.
    Scalars count as one sample; a batch with no tensor has none.

    Returns:
        ``(samples, note)``: ``note`` is None when every tensor has the same length, else one
        line naming the lengths seen and the count taken.
    """
    lengths: dict[str, int] = {}
    for path, t in _named_tensors(batch, "batch"):
        lengths[path] = int(t.shape[0]) if t.dim() else 1
    if not lengths:
        return 0, None
    votes: dict[int, int] = {}
    for n in lengths.values():
        votes[n] = votes.get(n, 0) + 1
    count = min(votes, key=lambda n: (-votes[n], n))
    if len(votes) == 1:
        return count, None
    seen = ", ".join(f"{path} {n}" for path, n in lengths.items())
    return count, (f"the batch's tensors differ in length ({seen}): counting {count} samples a batch (the length most share); "
                   "pass Trainer(batch_size=lambda batch: ...) to count them yourself")


def _named_tensors(batch: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``batch`` with where it sits (``batch['ids']``, ``batch[0]``, ``batch.x``)."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _named_tensors(v, f"{path}[{k!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            yield from _named_tensors(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from _named_tensors(getattr(batch, f.name), f"{path}.{f.name}")
