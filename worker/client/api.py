"""The client contract: the verbs every client of tether's tables answers, whatever holds them.

``Client`` is the data path (ps-lite's ``Pull``, ``Push``, ``PushPull``; each returns a ``Handle``
to ``wait`` on): ``PSClient`` (the shards), ``LocalClient`` (tables in this process) and the row
cache's ``CachedClient`` (in front of either) answer it. ``ShardClient`` adds what a job does with
the tables' owner: declare them, report and wait on clocks, checkpoint, close; ``PSClient`` and
``LocalClient`` answer it, and the training loop, ``PSModel`` and the row cache take one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.client.config import ClientConfig
from tether.worker.client.results import CheckpointResult, ClockReply, Handle, PullResult, PushAck, Splits
from tether.worker.metrics import WorkerRecorder

__all__ = ["Client", "ShardClient"]


@runtime_checkable
class Client(Protocol):
    """Pull rows and dense values, push gradients, or both in one round trip."""

    @property
    def config(self) -> ClientConfig:
        """Deadlines and wire settings (callers size their waits with them)."""
        ...

    def pull(self, sparse: Mapping[str, torch.Tensor] | None = None, dense: Sequence[str] = (),
             splits: Splits | None = None) -> Handle[PullResult]:
        """Rows of ``sparse`` (table -> unique int64 ids) and the dense values named; ``splits``:
        per table, the ids already split by shard as ``protos.partition.split_ids`` would (a row
        cache knows them), which a client over shards may take instead of hashing the ids."""
        ...

    def push(
        self,
        sparse: Mapping[str, tuple[torch.Tensor, ...]] | None = None,
        dense: Mapping[str, torch.Tensor] | None = None,
        clock: int = 0,
        versions: PullResult | None = None,
    ) -> Handle[PushAck]:
        """Gradients of rows (table -> (ids, grads), or (ids, grads, statistics): a row cache's combined
        push) and of dense values, computed on ``versions``."""
        ...

    def push_pull(
        self,
        push_sparse: Mapping[str, tuple[torch.Tensor, ...]] | None = None,
        push_dense: Mapping[str, torch.Tensor] | None = None,
        pull_sparse: Mapping[str, torch.Tensor] | None = None,
        pull_dense: Sequence[str] = (),
        clock: int = 0,
        versions: PullResult | None = None,
        pull_splits: Splits | None = None,
    ) -> Handle[PullResult]:
        """A push, then a pull in the same round trip (the answer carries the push's ack;
        ``pull_splits``: the pull's, as ``pull``'s ``splits``)."""
        ...


@runtime_checkable
class ShardClient(Client, Protocol):
    """A ``Client`` that owns the tables' life: declaration, clocks, checkpoints."""

    num_shards: int
    metrics: WorkerRecorder

    def declare(
        self,
        tables: Sequence[TableConfig] = (),
        dense: Mapping[str, torch.Tensor] | None = None,
        dense_optimizer: OptimizerConfig | None = None,
    ) -> None:
        """Create the tables and dense parameters (again: the same specs are a no-op)."""
        ...

    def clock(self, clock: int, wait_bound: int = -1, timeout_s: float = 60.0, leave: bool = False) -> ClockReply:
        """Report this worker's clock; with ``wait_bound`` >= 0 wait until the slowest live worker is within it."""
        ...

    def checkpoint(self, ckpt_id: str, timeout_s: float = 600.0) -> list[CheckpointResult]:
        """Write checkpoint ``ckpt_id`` of the tables."""
        ...

    def close(self) -> None:
        """Release connections and threads (a later call opens them again)."""
        ...
