"""A user's batches on the training device: picking the device, moving any nested batch there,
and counting its samples."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from tether.protos.errors import UsageError

__all__ = ["batch_size_of", "pick_device", "to_device"]


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
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from _tensors(getattr(batch, f.name))


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the length of its first tensor (0 if it holds none)."""
    for t in _tensors(batch):
        return int(t.shape[0]) if t.dim() else 1
    return 0
