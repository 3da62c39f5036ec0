"""The records a shard takes and gives: a dense declaration, the updates of a push, a push's
result, and what a checkpoint holds of a shard (``Shard.export_state``/``import_state``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tether.protos.specs import OptimizerConfig, TableConfig

__all__ = ["DenseDecl", "DenseState", "DenseUpdate", "PushResult", "ShardState", "SparseUpdate", "TableState"]


@dataclass(frozen=True)
class DenseDecl:
    """A dense chunk to create, with its initial value."""

    name: str
    index: int
    init: torch.Tensor
    optimizer: OptimizerConfig


@dataclass(frozen=True)
class SparseUpdate:
    """Gradients for rows of one table."""

    table: str
    ids: np.ndarray
    grads: torch.Tensor
    read_version: int = 0
    # The rows as the worker read them (DC-ASGD's w_read; None: not sent).
    read_values: torch.Tensor | None = None
    # A combined push's statistics per row (``UpdateRule.combined_stats``; None: not sent, every
    # row one gradient).
    combined: torch.Tensor | None = None


@dataclass(frozen=True)
class DenseUpdate:
    """Gradient for one dense chunk."""

    name: str
    index: int
    grad: torch.Tensor
    read_version: int = 0
    # The chunk as the worker read it (DC-ASGD's w_read; None: not sent).
    read_value: torch.Tensor | None = None


@dataclass(frozen=True)
class PushResult:
    """Outcome of a push."""

    applied: bool
    # The largest staleness in updates among its blocks (what --max-staleness limits).
    staleness: int
    clock_staleness: int = 0


@dataclass(frozen=True)
class TableState:
    """A table's spec and its rows as ``EmbeddingTable.snapshot`` gives them."""

    config: TableConfig
    ids: np.ndarray
    weights: torch.Tensor
    state: dict[str, torch.Tensor]
    version: int


@dataclass(frozen=True)
class DenseState:
    """A dense chunk's update rule, value, optimizer state and version."""

    name: str
    index: int
    optimizer: OptimizerConfig
    value: torch.Tensor
    state: dict[str, torch.Tensor]
    version: int


@dataclass(frozen=True)
class ShardState:
    """Everything a checkpoint holds of one shard, copied at one point between pushes."""

    tables: list[TableState]
    dense: list[DenseState]
    # Applied push sequence numbers per client incarnation (``dedup_key``), oldest first (uint64).
    seqs: dict[str, np.ndarray]
    applied_pushes: int = 0
