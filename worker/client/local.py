"""Local mode: a client whose tables live in this process, with the shards' rules and no shards.

``LocalClient`` answers the calls a ``PSClient`` makes (``declare``, ``pull``, ``push``,
``push_pull``, ``clock``, ``wait``, ``checkpoint``) in process, so the same training script runs
with no cluster (``TETHER_LOCAL=1``, ``--local``): the one-process baseline of a model, and unit
tests of it. It keeps what makes the result a shard's:

- a row is created on its first pull (or push) with the shards' initial values
  (``tether.rules.initial.init_rows``: from the table's seed, its name and the id alone);
- rows and dense parameters are updated with the shards' rules (``tether.rules.optimizers``):
  the table's own optimizer and its constants, the rule's per-row state (Adagrad's sum starting
  at ``initial_accumulator``, Adam's moments and a step count per row), weight decay, and the
  learning-rate schedule at each push's clock (``tether.protos.schedules``; DC-ASGD is refused:
  nothing here is stale);
- a step reads what the previous pushes wrote, as a 1-shard 1-worker job does (with prefetching
  on, the next batch's rows are read before this step's push, as there too).

One worker and no network: ``clock`` answers at once as the only live worker (so ``ssp:S`` never
waits and ``--staleness-aware`` never damps a step: nothing is staler than one update), ``sync``
is refused (it needs torchrun ranks), checkpoints are refused like a shard's without a checkpoint
directory (a ``Trainer``'s ``checkpoint_every_steps`` at its start: with ``out`` set it writes
the data positions alone, else it is refused), and nothing goes on a wire (``wire_dtype`` does not round anything). Bounded tables
(``capacity``) and admission (``min_count``) need shards.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from tether.protos import tether_pb2 as pb
from tether.protos.codec import int64_ids
from tether.protos.errors import FailedPrecondition, InvalidArgument, TetherError, UsageError
from tether.protos.specs import OptimizerConfig, TableConfig, table_conflict
from tether.rules.push_hooks import check_dense, check_rows
from tether.worker.client.config import ClientConfig
from tether.worker.client.local_table import LocalDense, LocalTable
from tether.worker.client.results import CheckpointResult, ClockReply, Handle, PullResult, PushAck, Splits
from tether.worker.config import TrainingConfig
from tether.worker.metrics import NullWorkerMetrics, WorkerRecorder

__all__ = ["LocalClient", "LocalClientConfig"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# A push's rows of one table as checked: the table, ids, gradients, a combined push's statistics (or None).
_Row = tuple[LocalTable, np.ndarray, torch.Tensor, torch.Tensor | None]

@dataclass(frozen=True)
class LocalClientConfig(ClientConfig):
    """A ``LocalClient``'s config: no shard addresses (nothing is dialled); the deadlines bound
    waits on handles as a ``PSClient``'s do."""

    def __post_init__(self) -> None:
        if self.addresses:
            raise ValueError(f"a local client has no shards, got addresses {self.addresses!r}")
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if not self.timeout_s > 0 or not 0 < self.call_deadline_s < float("inf"):
            raise ValueError(f"timeout_s and call_deadline_s must be > 0, got {self.timeout_s!r}, {self.call_deadline_s!r}")


class _Resolved:
    """A call that is already answered (or failed): a ``Pending`` for ``Handle``."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


def _answered(value: T) -> Handle[T]:
    return Handle([_Resolved(value)], lambda answers: answers[0])


def _failed(error: BaseException) -> Handle[Any]:
    """What a shard's refusal looks like to a caller: raised by ``result``, not by the call."""
    return Handle([_Resolved(error=error)], lambda answers: answers[0])


def _ids(table: str, ids: torch.Tensor) -> np.ndarray:
    """The ids of a 1-D integer tensor as int64, as a ``PSClient`` takes them (narrower integers widened)."""
    if ids.dim() != 1:
        raise InvalidArgument(f"table {table!r}: ids must be a 1-D tensor, got shape {tuple(ids.shape)}")
    return np.ascontiguousarray(int64_ids(ids.detach(), table).cpu().numpy())


class LocalClient:
    """A ``ShardClient`` (``tether.worker.client.api``) with no shards: every call is answered in this process, against
    in-process tables and dense parameters (see the module's docstring). Its handles are
    answered when the call returns; a refusal a shard would send (duplicate ids in a push, a
    gradient with NaN) is raised by the handle's ``result``, as a shard's is.

    Args:
        worker_id: the name it answers clocks for.
        metrics: kept for the trainer; no call is recorded (none leaves the process).
        timeout_s, call_deadline_s: what ``config`` says (callers size their waits with them).
    """

    def __init__(
        self,
        worker_id: str = "local",
        metrics: WorkerRecorder | None = None,
        *,
        timeout_s: float = ClientConfig.timeout_s,
        call_deadline_s: float = ClientConfig.call_deadline_s,
    ) -> None:
        self.metrics = metrics if metrics is not None else NullWorkerMetrics()
        self.num_shards = 0
        self._config: ClientConfig = LocalClientConfig(
            addresses=(), worker_id=worker_id, timeout_s=timeout_s, call_deadline_s=call_deadline_s
        )
        self.tables: dict[str, LocalTable] = {}
        self.dense: dict[str, LocalDense] = {}
        self._clock = 0
        self._live = False
        self._lock = threading.Lock()
        # A Trainer's checkpoint_every_steps with an out folder: said at the start that the
        # tables are not checkpointed; each checkpoint is then one of no shards (its data positions alone).
        self._positions_only = False

    @classmethod
    def for_training(cls, config: TrainingConfig, metrics: WorkerRecorder | None = None) -> LocalClient:
        """The client of a ``Trainer`` in local mode (``config.local``).

        Raises:
            UsageError: a mode or worker count that needs other processes, or
                ``checkpoint_every_steps`` with no ``out`` (nothing would be written).
        """
        if config.mode.kind == "sync":
            raise UsageError(
                "local mode (TETHER_LOCAL, --local) trains one worker in this process: mode 'sync' needs torchrun ranks "
                "and shards; use mode async or ssp:S, or give shards"
            )
        if config.num_workers != 1:
            raise UsageError(f"local mode (TETHER_LOCAL, --local) trains one worker in this process, got num_workers={config.num_workers}")
        every = config.checkpoint_every_steps
        if every and not config.out:
            raise UsageError(
                f"local mode (TETHER_LOCAL, --local) has no shards to checkpoint: checkpoint_every_steps={every} "
                "(TETHER_CHECKPOINT_EVERY_STEPS, --checkpoint-every-steps) would write nothing; unset it, or set out "
                "(TETHER_OUT, --out) to write only the data positions"
            )
        client = cls(config.worker_name, metrics, timeout_s=config.timeout_s, call_deadline_s=config.call_deadline_s)
        if every:
            log.warning("local mode: the tables live in this process and are not checkpointed; checkpoint_every_steps=%d "
                        "writes only the data positions (%s/positions)", every, config.out)
            client._positions_only = True
        return client

    @property
    def config(self) -> ClientConfig:
        """The deadlines callers size their waits with (no addresses)."""
        return self._config

    @config.setter
    def config(self, config: ClientConfig) -> None:
        self._config = config

    def close(self) -> None:
        """Nothing to close: no channel, connection or thread."""

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def wait(handle: Handle[T], timeout: float | None = None) -> T:
        """Wait for ``handle`` (answered already: its result, or the refusal it holds)."""
        return handle.result(timeout)

    def transports(self) -> list[str]:
        """No shard is reached, so none: ``[]``."""
        return []

    def declare(
        self,
        tables: Sequence[TableConfig] = (),
        dense: Mapping[str, torch.Tensor] | None = None,
        dense_optimizer: OptimizerConfig | None = None,
    ) -> None:
        """Create tables and dense parameters; re-declaring the same spec is a no-op, and the
        first declaration of a dense parameter sets its value.

        Raises:
            FailedPrecondition: a table or dense parameter exists with another spec.
            InvalidArgument: a dense initial value that is empty or not finite.
            UsageError: a table with ``capacity`` or ``min_count`` (they need shards).
        """
        opt = dense_optimizer or OptimizerConfig()
        dense = dense or {}
        with self._lock:
            for t in tables:
                have = self.tables.get(t.name)
                if have is not None and have.config != t:
                    raise FailedPrecondition(table_conflict(have.config, t))
            for name, init in dense.items():
                if init.numel() == 0 or not init.is_floating_point() or not bool(torch.isfinite(init).all()):
                    raise InvalidArgument(f"dense {name!r}: the initial value must be a non-empty finite float tensor")
                d = self.dense.get(name)
                if d is not None and (d.shape != tuple(init.shape) or d.optimizer != opt):
                    raise FailedPrecondition(f"dense {name!r} exists with another shape or optimizer")
            new = {t.name: LocalTable(t) for t in tables if t.name not in self.tables}
            self.tables.update(new)
            for name, init in dense.items():
                self.dense.setdefault(name, LocalDense(init, opt))

    def _table(self, name: str) -> LocalTable:
        try:
            return self.tables[name]
        except KeyError:
            raise InvalidArgument(f"table {name!r} was not declared by this client") from None

    def _dense(self, name: str) -> LocalDense:
        try:
            return self.dense[name]
        except KeyError:
            raise InvalidArgument(f"dense parameter {name!r} was not declared by this client") from None

    def _read(self, sparse: Mapping[str, torch.Tensor], dense: Sequence[str]) -> PullResult:
        checked = [(self._table(t), _ids(t, ids)) for t, ids in sparse.items()]
        params = [(name, self._dense(name)) for name in dense]
        rows = {table.config.name: table.pull(ids) for table, ids in checked}
        values = {name: d.value.clone().view(d.shape) for name, d in params}
        return PullResult(
            rows, values, {(0, t.config.name): t.version for t, _ in checked}, {(name, 0): d.version for name, d in params}
        )

    def pull(self, sparse: Mapping[str, torch.Tensor] | None = None, dense: Sequence[str] = (),
             splits: Splits | None = None) -> Handle[PullResult]:
        """Rows of ``sparse`` (table -> ids, any int64 value, narrower integers widened; missing
        rows are created) and dense values. ``splits`` (by shard) is unused: the tables are here.

        Raises:
            InvalidArgument: undeclared table or tensor, or ids that are not a 1-D integer tensor.
        """
        with self._lock:
            return _answered(self._read(sparse or {}, dense))

    def _check_push(
        self, sparse: Mapping[str, tuple[torch.Tensor, ...]], dense: Mapping[str, torch.Tensor]
    ) -> tuple[list[_Row], list[tuple[str, LocalDense, torch.Tensor]]]:
        """What the client checks before sending a push (raised at once)."""
        rows = []
        for name, part in sparse.items():
            ids, grads = part[0], part[1]
            table, arr = self._table(name), _ids(name, ids)
            if tuple(grads.shape) != (arr.size, table.dim):
                raise InvalidArgument(f"table {name!r}: gradient shape {tuple(grads.shape)} != ({arr.size}, {table.dim})")
            stats = part[2].detach().to("cpu", torch.float32) if len(part) > 2 else None
            rows.append((table, arr, grads.detach().to("cpu", torch.float32), stats))
        params = []
        for name, grad in dense.items():
            d = self._dense(name)
            if tuple(grad.shape) != d.shape:
                raise InvalidArgument(f"dense {name!r}: gradient shape {tuple(grad.shape)} != {d.shape}")
            params.append((name, d, grad.detach().reshape(-1).to("cpu", torch.float32)))
        return rows, params

    @staticmethod
    def _refusal(
        rows: list[_Row], params: list[tuple[str, LocalDense, torch.Tensor]]
    ) -> TetherError | None:
        """What a shard refuses a push for (nothing of it is then applied)."""
        try:
            for table, ids, grads, stats in rows:
                what = f"table {table.config.name!r}"
                check_rows(what, ids, grads, table.dim, combined=stats, update_rule=table.rule)
            for name, d, grad in params:
                check_dense(f"dense {name!r}", grad, (d.value.numel(),))
        except InvalidArgument as e:
            return e
        return None

    def _apply(
        self,
        rows: list[_Row],
        params: list[tuple[str, LocalDense, torch.Tensor]],
        clock: int,
        versions: PullResult | None,
    ) -> PushAck:
        staleness = 0
        for table, ids, _, _ in rows:
            read = versions.table_versions.get((0, table.config.name), 0) if versions else 0
            staleness = max(staleness, table.staleness(ids, read))
        for name, d, _ in params:
            read = versions.dense_versions.get((name, 0), 0) if versions else 0
            staleness = max(staleness, d.version - read)
        for table, ids, grads, stats in rows:
            if len(ids):
                table.push(ids, grads, clock, stats)
        for _, d, grad in params:
            d.push(grad, clock)
        if clock:
            self._clock, self._live = max(self._clock, clock), True
        # The only worker is never behind itself.
        return PushAck(staleness=staleness, clock_staleness=0, duplicates=0)

    def push(
        self,
        sparse: Mapping[str, tuple[torch.Tensor, ...]] | None = None,
        dense: Mapping[str, torch.Tensor] | None = None,
        clock: int = 0,
        versions: PullResult | None = None,
    ) -> Handle[PushAck]:
        """Apply row gradients (table -> (unique ids, grads)) and dense gradients, each with its
        rule; ``versions``: the pull they were computed from (for the ack's staleness).

        Raises:
            InvalidArgument: undeclared table or tensor, or a gradient of the wrong shape (at
                once); ids repeated in a table, or a gradient with NaN or Inf (from the handle,
                nothing applied).
        """
        with self._lock:
            rows, params = self._check_push(sparse or {}, dense or {})
            refusal = self._refusal(rows, params)
            if refusal is not None:
                return _failed(refusal)
            return _answered(self._apply(rows, params, clock, versions))

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
        """Push, then pull what the push left (a shard applies the push before it reads);
        ``pull_splits`` (by shard) is unused: the tables are here.

        Returns:
            A handle whose result is a ``PullResult`` whose ``ack`` is the push's.
        """
        with self._lock:
            rows, params = self._check_push(push_sparse or {}, push_dense or {})
            for t, ids in (pull_sparse or {}).items():
                self._table(t)
                _ids(t, ids)
            for name in pull_dense:
                self._dense(name)
            refusal = self._refusal(rows, params)
            if refusal is not None:
                return _failed(refusal)
            ack = self._apply(rows, params, clock, versions)
            result = self._read(pull_sparse or {}, pull_dense)
            result.ack = ack
            return _answered(result)

    def clock(self, clock: int, wait_bound: int = -1, timeout_s: float = 60.0, leave: bool = False) -> ClockReply:
        """Record this worker's clock and answer at once: it is the only worker, so every
        bound holds (``leave``: no live worker is left)."""
        with self._lock:
            self._clock = max(self._clock, clock)
            self._live = not leave
            live = int(self._live)
            return ClockReply(min_clock=self._clock if live else 0, max_clock=self._clock if live else 0, live_workers=live,
                              ready=True, min_other_clock=0)

    def checkpoint(self, ckpt_id: str, timeout_s: float = 600.0) -> list[CheckpointResult]:
        """Refused: no shard writes checkpoints in local mode. A trainer's client that said at
        its start that only data positions are written (``for_training``) answers with no parts.

        Raises:
            FailedPrecondition: as from a shard without a checkpoint directory.
        """
        if self._positions_only:
            return []
        raise FailedPrecondition(
            f"checkpoint {ckpt_id!r}: local mode has no shards and no checkpoint directory (the tables live in this process)"
        )

    def info(self) -> list[pb.InfoResponse]:
        """One ``Info``, as from shard 0 of 1: each table's dim, rows, version and rule, and each
        dense parameter's size, version and rule (what a script checks on the shards, here too)."""
        response = pb.InfoResponse(shard_index=0, num_shards=1)
        with self._lock:
            for name, t in sorted(self.tables.items()):
                response.tables.add(name=name, dim=t.dim, rows=t.rows, version=t.version, optimizer=t.config.optimizer.name)
            for name, d in sorted(self.dense.items()):
                response.dense.add(name=name, index=0, numel=d.value.numel(), version=d.version, optimizer=d.optimizer.name)
        return [response]
