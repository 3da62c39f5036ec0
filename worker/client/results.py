"""What the client's calls answer: pull and push results, clock replies and the ``Handle``."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

__all__ = ["CheckpointResult", "ClockReply", "Handle", "Pending", "PullResult", "PushAck", "Splits"]

# A pull's ids already split by shard, per table: (positions, ids) for each shard, as
# ``protos.partition.split_ids`` gives them (a row cache knows them: ``Plan.splits``).
Splits = Mapping[str, Sequence[tuple[np.ndarray, np.ndarray]]]

T = TypeVar("T")


@dataclass
class PullResult:
    """Pulled rows per table (in the order of the ids asked for) and dense tensors."""

    rows: dict[str, torch.Tensor]
    dense: dict[str, torch.Tensor]
    # Versions the values were read at, to be sent back with the gradients they produce.
    table_versions: dict[tuple[int, str], int]
    dense_versions: dict[tuple[str, int], int]
    # What the shards said of the push, for the result of a ``push_pull`` (None for a pull).
    ack: PushAck | None = None


@dataclass(frozen=True)
class PushAck:
    """What the shards said of a push."""

    staleness: int  # largest number of updates a block's values were behind
    clock_staleness: int  # ticks the slowest live worker was behind this step
    duplicates: int  # shards that had already applied it (a retried push)


@dataclass(frozen=True)
class CheckpointResult:
    """One shard's part of a checkpoint."""

    shard: int
    id: str
    path: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ClockReply:
    """Clocks of the live workers as the coordinating shard sees them."""

    min_clock: int
    max_clock: int
    live_workers: int
    ready: bool
    min_other_clock: int = 0
    finished_workers: int = 0  # left (done) since this worker joined: the start-up barrier counts them


class Pending(Protocol):
    """One shard's part of a call: a ``concurrent.futures.Future`` or a data-plane call."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Any: ...


class Handle(Generic[T]):
    """An operation in flight on one or more shards."""

    def __init__(self, futures: Sequence[Pending], combine: Callable[[list[Any]], T]) -> None:
        self._futures = list(futures)
        self._combine = combine

    def done(self) -> bool:
        """Whether every shard has answered."""
        return all(f.done() for f in self._futures)

    def result(self, timeout: float | None = None) -> T:
        """Wait for every shard and return the combined answer.

        Raises:
            TetherError: the first shard error (after retries).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        answers = []
        for f in self._futures:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            answers.append(f.result(remaining))
        return self._combine(answers)
