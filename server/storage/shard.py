"""The shard's domain logic: declare, pull and push, independent of gRPC.

Every request is validated completely before anything is applied, so a rejected request
changes no parameter. A push carries ``(worker_id, incarnation, seq)``; one that was applied
before is acknowledged and not applied again. The incarnation is a random id of the client
process, so a worker that restarts under the same id (and numbers its pushes from 1 again) is
never taken for a retry of its old self. ``export_state`` copies everything a checkpoint holds
(rows, dense chunks and those dedup windows) at one point between pushes, so a restored shard
never holds a push's effect without its sequence number, or the number without the effect.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from tether.protos.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, TooStale
from tether.protos.names import REMEDY_DECAY
from tether.protos.partition import dense_shard, shard_of_ids
from tether.protos.specs import TableConfig, optimizer_conflict, table_conflict
from tether.protos.ssp import COORDINATOR_SHARD
from tether.rules.push_hooks import (
    Remedies,
    adjusted,
    check_compensation,
    check_dense,
    check_read,
    check_remedies,
    has_duplicates,
    observe_step,
    part_rows,
    raise_fault,
)
from tether.rules.row_kernels import NO_ROWS
from tether.server.metrics import NullShardMetrics, ShardRecorder
from tether.server.storage.clocks import WorkerClocks
from tether.server.storage.dedup import AppliedPushes
from tether.server.storage.dense import DenseChunk
from tether.server.storage.gate import Gate
from tether.server.storage.shard_records import DenseDecl, DenseState, DenseUpdate, PushResult, ShardState, SparseUpdate, TableState
from tether.server.storage.tables import EmbeddingTable, Pulled

__all__ = ["Shard", "staleness_scale"]

log = logging.getLogger(__name__)

# Weight of each push in the running mean of a table's or chunk's staleness (staleness_scale).
_TYPICAL_WEIGHT = 0.1


def staleness_scale(stale: int | np.ndarray | None, typical: float) -> float | np.ndarray:
    """The learning-rate factor of ``--staleness-aware`` for a block ``stale`` updates stale.

    Zhang et al. (2016) divide the step by the staleness; tether divides by the staleness
    relative to the ``typical`` one of the table or chunk (a running mean), because the learning
    rate was chosen for a job in which the other workers' pushes overtake every read: a block
    at most as stale as usual (or overtaken at most once) keeps its full step, a staler one gets
    ``max(typical, 1) / stale``. So the rule damps only unusually stale gradients, and is a
    no-op where nothing overtook a read.

    Args:
        stale: updates since the read, per row (int64 array), for the whole block (int), or
            None (no update since).
        typical: the running mean of the block's staleness.
    """
    ref = max(typical, 1.0)
    if isinstance(stale, np.ndarray):
        return np.minimum(1.0, ref / np.maximum(stale, 1)) if (stale > ref).any() else 1.0
    return ref / stale if stale and stale > ref else 1.0


class Shard:
    """Embedding tables and dense chunks owned by one shard."""

    def __init__(
        self,
        shard_index: int = 0,
        num_shards: int = 1,
        metrics: ShardRecorder | None = None,
        lease_s: float = 10.0,
        max_staleness: int | None = None,
    ) -> None:
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index!r} is not in [0, num_shards={num_shards!r})")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness!r}")
        self.clocks = WorkerClocks(lease_s)
        self.max_staleness = max_staleness
        self.shard_index = shard_index
        self.num_shards = num_shards
        # Where tables report evicted rows and dropped row gradients (the handler records the rest).
        self.metrics: ShardRecorder = metrics if metrics is not None else NullShardMetrics()
        self.tables: dict[str, EmbeddingTable] = {}
        self.dense: dict[tuple[str, int], DenseChunk] = {}
        self.applied_pushes = 0
        self.duplicate_pushes = 0
        self.rejected_pushes = 0
        self._declare_lock = threading.Lock()
        self._applied = AppliedPushes()
        self._gate = Gate()
        # (table,) or (chunk name, index) -> running mean of its pushes' staleness.
        self._typical: dict[tuple[object, ...], float] = {}
        # Pushes applied and specs declared; a periodic checkpoint skips an unchanged shard.
        self.mutations = 0
        self.restored_checkpoint = ""
        self.last_checkpoint = ""

    # -- declare -----------------------------------------------------------------------------

    def declare(self, tables: list[TableConfig], dense: list[DenseDecl]) -> None:
        """Create tables and dense chunks; re-declaring the same spec is a no-op.

        Raises:
            FailedPrecondition: a spec conflicts with an existing one, or a chunk belongs to
                another shard.
            InvalidArgument: a malformed initial value.
        """
        with self._declare_lock:
            for cfg in tables:
                have = self.tables.get(cfg.name)
                if have is not None and have.config != cfg:
                    raise FailedPrecondition(table_conflict(have.config, cfg))
            for d in dense:
                owner = dense_shard(d.name, d.index, self.num_shards)
                if owner != self.shard_index:
                    raise FailedPrecondition(f"dense chunk {d.name}[{d.index}] belongs to shard {owner}, not {self.shard_index}")
                if d.init.dim() != 1 or d.init.numel() == 0 or not d.init.is_floating_point():
                    raise InvalidArgument(f"dense chunk {d.name}[{d.index}] init must be a non-empty 1-D float tensor")
                if not torch.isfinite(d.init).all():
                    raise InvalidArgument(f"dense chunk {d.name}[{d.index}] init has NaN or Inf values")
                have_chunk = self.dense.get((d.name, d.index))
                if have_chunk is not None and have_chunk.optimizer != d.optimizer:
                    raise FailedPrecondition(optimizer_conflict(f"dense chunk {d.name}[{d.index}]", have_chunk.optimizer, d.optimizer))
                if have_chunk is not None and have_chunk.numel != d.init.numel():
                    raise FailedPrecondition(
                        f"dense chunk {d.name}[{d.index}] exists with {have_chunk.numel} elements, not {d.init.numel()}"
                    )
            for cfg in tables:
                if cfg.name not in self.tables:
                    self.tables[cfg.name] = self._new_table(cfg)
                    self.mutations += 1
                    log.info("created table %s (dim %d, %s)", cfg.name, cfg.dim, cfg.optimizer.name)
            for d in dense:
                if (d.name, d.index) not in self.dense:
                    self.dense[(d.name, d.index)] = DenseChunk(d.name, d.index, d.init, d.optimizer)
                    self.mutations += 1

    def _new_table(self, cfg: TableConfig) -> EmbeddingTable:
        m, name = self.metrics, cfg.name
        return EmbeddingTable(cfg, on_evict=lambda n: m.evicted(name, n), on_drop=lambda n: m.dropped(name, n))

    # -- checkpoint state ----------------------------------------------------------------------

    def export_state(self) -> ShardState:
        """Copy every table, dense chunk and dedup window at one point between pushes.

        Raises:
            Unavailable: pushes in flight did not finish within the gate's timeout.
        """
        with self._declare_lock, self._gate.exclusive():
            tables = []
            for _name, table in sorted(self.tables.items()):
                snap = table.snapshot()
                tables.append(TableState(table.config, snap["ids"], snap["weights"], snap["state"], snap["version"]))
            dense = []
            for (name, index), chunk in sorted(self.dense.items()):
                snap = chunk.snapshot()
                dense.append(DenseState(name, index, chunk.optimizer, snap["value"], snap["state"], snap["version"]))
            return ShardState(tables, dense, self._applied.export(), self.applied_pushes)

    def import_state(self, state: ShardState) -> None:
        """Load restored tables, chunks and dedup windows into this (fresh) shard.

        Raises:
            FailedPrecondition: the shard already holds a table or chunk of another spec.
            ValueError: restored arrays of the wrong shape.
        """
        with self._declare_lock, self._gate.exclusive():
            for t in state.tables:
                table = self.tables.get(t.config.name)
                if table is not None and table.config != t.config:
                    raise FailedPrecondition(f"table {t.config.name!r} exists with another spec: {table.config} != {t.config}")
                table = table or self._new_table(t.config)
                table.load(t.ids, t.weights, t.state, t.version)
                self.tables[t.config.name] = table
            for d in state.dense:
                chunk = DenseChunk(d.name, d.index, d.value, d.optimizer)
                chunk.load(d.value, d.state, d.version)
                self.dense[(d.name, d.index)] = chunk
            self._applied.load(state.seqs)
            self.applied_pushes = max(self.applied_pushes, state.applied_pushes)

    # -- validation --------------------------------------------------------------------------

    def _table(self, name: str) -> EmbeddingTable:
        try:
            return self.tables[name]
        except KeyError:
            raise NotFound(f"unknown table {name!r}") from None

    def _chunk(self, name: str, index: int) -> DenseChunk:
        try:
            return self.dense[(name, index)]
        except KeyError:
            raise NotFound(f"unknown dense chunk {name}[{index}]") from None

    def _check_ids(self, table: str, ids: np.ndarray, unique: bool = True) -> None:
        if ids.size == 0:
            return
        # A push must not name a row twice (one gradient per row); a pull may.
        if unique and has_duplicates(ids):
            raise InvalidArgument(f"table {table!r}: ids in one push must be unique")
        if self.num_shards > 1:
            owners = shard_of_ids(ids, self.num_shards)
            wrong = owners != self.shard_index
            if wrong.any():
                raise FailedPrecondition(
                    f"table {table!r}: id {int(ids[wrong][0])} belongs to shard {int(owners[wrong][0])}, not {self.shard_index}"
                )

    def _check_sparse(self, u: SparseUpdate) -> tuple[EmbeddingTable, Pulled | None, np.ndarray | None, np.ndarray]:
        table = self._table(u.table)
        if table.capacity and u.ids.size > table.capacity:
            # Evicting every other row would not make room: refused whole, not trained in part.
            raise ResourceExhausted(
                f"table {u.table!r}: a push of {u.ids.size} rows, more than the table's capacity of {table.capacity} rows "
                "per shard; raise its capacity or push fewer rows at once"
            )
        # As local mode checks a part (``check_rows``): its layout, its ids, then its values. Ids that
        # are rows already were checked when they were created; only their uniqueness is left to
        # check, in the compiled call that finds their slots and checks the values.
        what = f"table {u.table!r}"
        grads, stats, low = part_rows(what, u.ids, u.grads, table.dim, u.combined, table.update_rule)
        pulled, fault = table.checked(u.ids, grads, NO_ROWS if stats is None else stats, low)
        if pulled is None:
            self._check_ids(u.table, u.ids)
        elif not pulled.unique:
            raise InvalidArgument(f"{what}: ids in one push must be unique")
        raise_fault(what, fault, low)
        check_read(what, u.read_values, u.grads)
        return table, pulled, stats, grads

    def _check_dense(self, u: DenseUpdate) -> DenseChunk:
        chunk = self._chunk(u.name, u.index)
        check_dense(f"dense chunk {u.name}[{u.index}]", u.grad, (chunk.numel,))
        check_read(f"dense chunk {u.name}[{u.index}]", u.read_value, u.grad)
        return chunk

    # -- pull / push -------------------------------------------------------------------------

    def pull(
        self, sparse: list[tuple[str, np.ndarray]], dense: list[tuple[str, int]]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None, int]], list[tuple[torch.Tensor, int]]]:
        """Rows for each (table, ids) and values for each (name, index), with versions.

        Rows come as ``EmbeddingTable.locate`` gives them, ``(source, index, version)``: the
        caller copies ``source[index]`` out (``index`` None: ``source`` is the rows).

        Raises:
            NotFound: unknown table or chunk.
            InvalidArgument: malformed ids.
            FailedPrecondition: ids that belong to another shard.
        """
        tables = [self._table(t) for t, _ in sparse]
        chunks = [self._chunk(n, i) for n, i in dense]
        for (name, ids) in sparse:
            self._check_ids(name, ids, unique=False)
        rows = [table.locate(ids) for table, (_, ids) in zip(tables, sparse, strict=False)]
        values = [chunk.pull() for chunk in chunks]
        return rows, values

    def push(
        self,
        worker_id: str,
        seq: int,
        sparse: list[SparseUpdate],
        dense: list[DenseUpdate],
        clock: int = 0,
        staleness_aware: bool = False,
        *,
        incarnation: int,
        delay_compensation: float = 0.0,
        dc_adaptive: bool = False,
        gap_aware: bool = False,
        remedy_decay: float = REMEDY_DECAY,
    ) -> PushResult:
        """Validate every block, check staleness, then apply them all.

        Args:
            worker_id, seq: identify the push; a repeated pair is acknowledged, not applied.
            incarnation: the pushing client process's random non-zero id; sequence numbers
                are deduplicated within one incarnation only.
            sparse, dense: the gradients.
            clock: the pushing worker's clock after this step (0: not tracked).
            staleness_aware: damp the step of rows and chunks staler than usual (staleness_scale).
            delay_compensation: DC-ASGD's lambda for blocks that carry their read values (0: off);
                each table's or chunk's schedule is followed by ``clock`` (push_hooks.adjusted).
            dc_adaptive: DC-ASGD-a: ``delay_compensation`` is its lambda0, scaled per row and
                element by the running root mean square of the gradient.
            gap_aware: divide the gradient of blocks with read values by their gap (gap-aware).
            remedy_decay: the decay of the running means the last two keep per row and element.

        Raises:
            NotFound, InvalidArgument, FailedPrecondition: malformed; nothing was applied.
            TooStale: a block is staler than the hard limit; nothing was applied.
        """
        try:
            if not worker_id:
                raise InvalidArgument("worker_id must be set on a push")
            if not 0 < incarnation < 1 << 64:
                raise InvalidArgument(f"push from {worker_id!r}: incarnation must be a non-zero 64-bit id, got {incarnation!r}")
            check_compensation(worker_id, delay_compensation)
            remedies = Remedies(delay_compensation, bool(dc_adaptive), bool(gap_aware), remedy_decay)
            check_remedies(worker_id, remedies)
            checked = [self._check_sparse(u) for u in sparse]
            chunks = [self._check_dense(u) for u in dense]
        except Exception:
            self.rejected_pushes += 1
            raise
        # Staleness in updates: per dense chunk, that chunk's updates since the push's read; per
        # row, how many updates that row received since (None: none did). Rows are counted one
        # by one only for --staleness-aware; otherwise only the push's largest staleness is
        # wanted (hard limit, metric, ack), and a table's updates since the read bound every
        # row's, so a table whose count does not exceed what the push has shown is skipped.
        intervals = [max(t.version - u.read_version, 0) for (t, _, _, _), u in zip(checked, sparse, strict=False)]
        intervals += [max(c.version - u.read_version, 0) for c, u in zip(chunks, dense, strict=False)]
        stale: list[int | np.ndarray | None] = [None] * len(sparse)
        stale += intervals[len(sparse):]
        staleness = max(intervals[len(sparse):], default=0)
        # Tables with the most updates since their read first: their count is the likeliest to
        # reach what the others' intervals allow (hot rows take every update), so those are skipped.
        order = sorted(range(len(sparse)), key=lambda k: -intervals[k])
        # With no hard limit to check before anything is applied, the largest staleness is only
        # reported: each table counts it under the same hold of its lock as its update.
        count_first = staleness_aware or self.max_staleness is not None
        for i in order if count_first else ():
            (t, p, _, _), u = checked[i], sparse[i]
            if not u.ids.size or not intervals[i]:
                continue
            if staleness_aware:
                rows = stale[i] = t.staleness(u.ids, u.read_version, p)
                staleness = max(staleness, int(rows.max()) if rows is not None else 0)
            elif intervals[i] > staleness:
                staleness = max(staleness, t.largest_staleness(u.ids, u.read_version, p))
        if self.max_staleness is not None and staleness > self.max_staleness:
            self.rejected_pushes += 1
            raise TooStale(f"push from {worker_id!r} is {staleness} updates stale; this shard's limit is {self.max_staleness}")
        with self._gate.shared():
            fresh = self._applied.add(worker_id, incarnation, seq)
            if not fresh:
                self.duplicate_pushes += 1
                return PushResult(applied=False, staleness=0)
            # Clock staleness is measured on the coordinator ssp waits on, where clocks move only
            # once a step is applied on every shard.
            clock_lag = self.clocks.lag(clock) if clock and self.shard_index == COORDINATOR_SHARD else 0
            # (table or chunk, ids or None, gradient, the slots found of ids that are all rows)
            blocks: list[tuple[Any, np.ndarray | None, torch.Tensor, Pulled | None]] = [
                (t, u.ids, u.grads, p) for (t, p, _, _), u in zip(checked, sparse, strict=False)
            ] + [(c, None, u.grad, None) for c, u in zip(chunks, dense, strict=False)]
            reads = [u.read_values for u in sparse] + [u.read_value for u in dense]
            combined = [c[2] for c in checked] + [None] * len(dense)  # as checked: float32 arrays
            # Each part's gradient rows as checked (float32 arrays, or NO_ROWS), applied where no remedy changed them.
            checked_rows = [c[3] for c in checked]
            for k in order + list(range(len(sparse), len(blocks))):
                (target, ids, grad, pulled), s, n, read, stats = blocks[k], stale[k], intervals[k], reads[k], combined[k]
                # The typical staleness of this table or chunk: a running mean of its updates
                # between a push's read and its apply, over every push (a racy update loses at
                # most one sample).
                key = (target.config.name,) if ids is not None else (target.name, target.index)
                typical = self._typical.get(key, float(n))
                self._typical[key] = typical + _TYPICAL_WEIGHT * (n - typical)
                scale: float | np.ndarray = 1.0
                # Per remedy, the rows (of a table) or elements (of a chunk) whose update it changed.
                acted: dict[str, int] = {}
                if staleness_aware:
                    scale = staleness_scale(s, typical)
                    damped = int(np.count_nonzero(scale < 1.0)) if isinstance(scale, np.ndarray) else 0
                    if not isinstance(scale, np.ndarray) and scale < 1.0:
                        damped = ids.size if ids is not None else grad.numel()
                    if damped:
                        acted["staleness_aware"] = damped
                opt = target.config.optimizer if ids is not None else target.optimizer
                given = grad
                grad, scale, before, step_scale = adjusted(target, opt, ids, grad, read, scale, clock, remedies,
                                                           acted if remedies.on else None)
                if ids is None:
                    target.push(grad, scale, step_scale)
                else:
                    values = checked_rows[k] if grad is given and checked_rows[k] is not NO_ROWS else grad
                    if count_first:
                        target.push(ids, values, scale, pulled, stats)
                    else:
                        _, counted = target.push_counted(ids, values, scale, pulled, stats, sparse[k].read_version, staleness)
                        staleness = max(staleness, counted)
                observe_step(target, ids, before, remedies.decay)
                for remedy, n in acted.items():
                    self.metrics.remedied(target.config.name if ids is not None else None, remedy, n)
            if clock:
                self.clocks.update(worker_id, clock, from_push=True)
            self.applied_pushes += 1
            self.mutations += 1
        return PushResult(applied=True, staleness=staleness, clock_staleness=clock_lag)
