"""The shard's request handler, whatever carried the request (gRPC or the data plane): decode ->
domain call -> encode, errors as status codes, and the metrics of every call."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import torch

from tether.protos import tether_pb2 as pb
from tether.protos.codec import decode_ids, decode_tensor, encode_tensor, torch_dtype
from tether.protos.errors import FailedPrecondition, InvalidArgument, TetherError, reject_reason, status_of
from tether.protos.framing import PayloadWriter
from tether.protos.names import REMEDY_DECAY
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.protos.ssp import MAX_CLOCK_HOLD_S
from tether.server.checkpoints.checkpoint import Checkpointer
from tether.server.metrics import NullShardMetrics, ShardRecorder
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import DenseDecl, DenseUpdate, PushResult, SparseUpdate
from tether.server.storage.tables import EmbeddingTable

__all__ = ["RequestHandler", "Unparsable"]

log = logging.getLogger(__name__)

# Calls whose refusal is a push not applied (counted by reason).
_PUSHES = ("Push", "PushPull")
# Calls that answer with values (counted as bytes sent).
_PULLS = ("Pull", "PushPull")

Outcome = tuple[Any, grpc.StatusCode, str]


class Unparsable:
    """Stands in for a request whose bytes are not the message they should be."""

    def __init__(self, message: str, size: int, error: str) -> None:
        self.message = message
        self.size = size
        self.error = error

    def ByteSize(self) -> int:  # noqa: N802 - the protobuf name the metrics call
        return self.size


class RequestHandler:
    """Handles the ``tether.v1.ParameterServer`` calls on a ``Shard``, whichever transport carried
    them (``Clock``, with no tensors, comes only over gRPC)."""

    def __init__(self, shard: Shard, metrics: ShardRecorder | None = None, checkpointer: Checkpointer | None = None) -> None:
        self.shard = shard
        self.metrics: ShardRecorder = metrics if metrics is not None else NullShardMetrics()
        self.checkpointer = checkpointer
        # Port of the data plane serving this shard (0: none), told to clients in Declare and Info.
        self.data_port = 0
        # Abstract unix socket of the same data plane ("": none), for clients on this machine.
        self.data_socket = ""
        # Tables whose rows and bytes the metrics export (tables restored from a checkpoint from the start).
        self._watched: set[str] = set()
        self._watch_new_tables()
        self._unary: dict[str, Callable[[Any], Any]] = {
            "Declare": self._declare, "Pull": self._pull, "Push": lambda r: self._push_response(self._push(r)),
            "PushPull": self._push_pull, "Info": self._info, "Checkpoint": self._checkpoint, "Clock": self._clock,
        }
        # The data plane's calls: (request, payload, writer of pulled values) -> response.
        self._data: dict[str, Callable[[Any, memoryview | None, PayloadWriter], Any]] = {
            "Push": lambda r, payload, out: self._push_response(self._push(r, payload)),
            "Pull": lambda r, payload, out: self._pull(r, out),
            "PushPull": self._push_pull,
        }

    def run(self, rpc: str, request: Any, call: Callable[[], Any], extra_bytes: int = 0) -> Outcome:
        """Run ``call`` for ``request`` of ``rpc`` and record metrics.

        Returns:
            (response, OK, "") or (None, the error's status code, its message).
        """
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        message = ""
        response = None
        try:
            if isinstance(request, Unparsable):
                raise InvalidArgument(f"request is not a valid {request.message}: {request.error}")
            response = call()
        except TetherError as exc:  # raised on purpose: a bad request, an unknown table, a push too stale
            code, message = status_of(exc), str(exc)
            self._count_rejected(rpc, code)
        except Exception:  # a bug (a ValueError included): not the client's fault
            code, message = grpc.StatusCode.INTERNAL, f"internal error in {rpc}; see the shard's log"
            log.exception("%s failed with an unexpected error", rpc)
            self.metrics.internal_error(rpc)
        finally:
            self.metrics.request(rpc, code.name, time.perf_counter() - start, request.ByteSize() + extra_bytes)
        return response, code, message

    def call(self, rpc: str, request: Any) -> Outcome:
        """A gRPC call: every tensor is in the request, and the response carries its own."""
        def call() -> Any:
            response = self._unary[rpc](request)
            if rpc in _PULLS:
                self.metrics.sent(rpc, response.ByteSize())
            return response

        return self.run(rpc, request, call)

    def data_call(self, rpc: str, request: Any, payload: memoryview | None, out: PayloadWriter) -> Outcome:
        """A data-plane call: tensors come from ``payload`` and pulled values go to ``out``."""
        def call() -> Any:
            response = self._data[rpc](request, payload, out)
            if rpc in _PULLS:
                self.metrics.sent(rpc, response.ByteSize() + out.nbytes)
            return response

        return self.run(rpc, request, call, extra_bytes=0 if payload is None else len(payload))

    def _count_rejected(self, rpc: str, code: grpc.StatusCode) -> None:
        if rpc in _PUSHES:
            self.metrics.reject(reject_reason(code))

    def _declare(self, request: pb.DeclareRequest) -> pb.DeclareResponse:
        try:  # the specs' own checks: a spec out of range is the request's fault
            tables = [TableConfig.from_proto(t) for t in request.tables]
            optimizers = [OptimizerConfig.from_proto(d.optimizer) for d in request.dense]
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        dense = [
            DenseDecl(name=d.name, index=d.index, init=decode_tensor(d.init), optimizer=optimizer)
            for d, optimizer in zip(request.dense, optimizers, strict=False)
        ]
        self.shard.declare(tables, dense)
        self._watch_new_tables()
        return pb.DeclareResponse(
            shard_index=self.shard.shard_index, num_shards=self.shard.num_shards, data_port=self.data_port, data_socket=self.data_socket
        )

    def _pull(self, request: pb.PullRequest, out: PayloadWriter | None = None) -> pb.PullResponse:
        wire = torch_dtype(request.wire_dtype) if request.wire_dtype else torch.float32
        if not wire.is_floating_point:
            raise InvalidArgument(f"wire_dtype must be a float type, got {wire}")
        sparse = [(b.table, decode_ids(b.ids)) for b in request.sparse]
        dense = [(b.name, b.index) for b in request.dense]
        rows, values = self.shard.pull(sparse, dense)
        self.metrics.pulled([(name, ids.size) for name, ids in sparse])
        response = pb.PullResponse()
        encode = encode_tensor if out is None else out.add
        for (name, _), (source, index, version) in zip(sparse, rows, strict=False):
            msg = response.sparse.add(table=name, read_version=version).values
            if out is None:
                encode_tensor(source if index is None else source.index_select(0, index), msg, dtype=wire)
            else:  # gathered straight into the reply when it is written
                out.add(source, msg, dtype=wire, rows=index)
        for (name, index), (v, version) in zip(dense, values, strict=False):
            encode(v, response.dense.add(name=name, index=index, read_version=version).value, dtype=wire)
        return response

    def _push(self, request: pb.PushRequest, payload: memoryview | None = None) -> PushResult:
        sparse = [
            SparseUpdate(
                b.table, decode_ids(b.ids), decode_tensor(b.values, torch.float32, payload), b.read_version,
                decode_tensor(b.read_values, torch.float32, payload) if b.HasField("read_values") else None,
                decode_tensor(b.combined, torch.float32, payload) if b.HasField("combined") else None,
            )
            for b in request.sparse
        ]
        dense = [
            DenseUpdate(
                b.name, b.index, decode_tensor(b.value, torch.float32, payload), b.read_version,
                decode_tensor(b.read_value, torch.float32, payload) if b.HasField("read_value") else None,
            )
            for b in request.dense
        ]
        result = self.shard.push(
            request.worker_id, request.seq, sparse, dense, clock=request.clock, staleness_aware=request.staleness_aware,
            incarnation=request.incarnation, delay_compensation=request.delay_compensation, dc_adaptive=request.dc_adaptive,
            gap_aware=request.gap_aware, remedy_decay=request.remedy_decay or REMEDY_DECAY,
        )
        if not result.applied:
            self.metrics.reject("duplicate")
        else:
            self.metrics.pushed(
                [(u.table, u.ids.size) for u in sparse], len(dense), result.staleness,
                result.clock_staleness if request.clock else None,
            )
        if request.clock:
            self.update_clock_gauges()
        return result

    @staticmethod
    def _push_response(result: PushResult) -> pb.PushResponse:
        return pb.PushResponse(applied=result.applied, staleness=result.staleness, clock_staleness=result.clock_staleness)

    def _push_pull(
        self, request: pb.PushPullRequest, payload: memoryview | None = None, out: PayloadWriter | None = None
    ) -> pb.PushPullResponse:
        result = self._push(request.push, payload)
        return pb.PushPullResponse(push=self._push_response(result), pull=self._pull(request.pull, out))

    def _info(self, request: pb.InfoRequest) -> pb.InfoResponse:
        s = self.shard
        response = pb.InfoResponse(
            shard_index=s.shard_index,
            num_shards=s.num_shards,
            applied_pushes=s.applied_pushes,
            duplicate_pushes=s.duplicate_pushes,
            rejected_pushes=s.rejected_pushes,
            restored_checkpoint=s.restored_checkpoint,
            last_checkpoint=s.last_checkpoint,
            data_port=self.data_port,
            data_socket=self.data_socket,
        )
        for name, t in sorted(s.tables.items()):
            response.tables.add(
                name=name, dim=t.dim, rows=t.rows, version=t.version, optimizer=t.config.optimizer.name,
                memory_bytes=t.memory_bytes, evicted_rows=t.evicted_rows, dropped_rows=t.dropped_rows,
            )
        for (name, index), c in sorted(s.dense.items()):
            response.dense.add(name=name, index=index, numel=c.numel, version=c.version, optimizer=c.optimizer.name)
        return response

    def _checkpoint(self, request: pb.CheckpointRequest) -> pb.CheckpointResponse:
        if self.checkpointer is None:
            raise FailedPrecondition("this shard has no checkpoint directory (start it with --checkpoint-dir)")
        info = self.checkpointer.checkpoint(request.id)
        return pb.CheckpointResponse(id=info.id, path=info.path, bytes=info.bytes, seconds=info.seconds)

    def _clock(self, request: pb.ClockRequest) -> pb.ClockResponse:
        """Record the worker's clock (``clock`` 0 with no wait: it joins at start-up; ``leave``: it
        is done) and, with ``wait_bound`` >= 0, hold the call until the slowest live worker is at
        most ``wait_bound`` behind ``clock`` (at most ``wait_timeout_ms``, capped at ``MAX_CLOCK_HOLD_S``)."""
        if not request.worker_id:
            raise InvalidArgument("worker_id must be set on a Clock call")
        clocks = self.shard.clocks
        clocks.update(request.worker_id, request.clock, leave=request.leave, join=request.clock == 0 and request.wait_bound < 0)
        if request.wait_bound >= 0 and not request.leave:
            self.metrics.set_staleness_bound(int(request.wait_bound))
            ready, state = clocks.wait(request.clock, request.wait_bound, min(request.wait_timeout_ms / 1000.0, MAX_CLOCK_HOLD_S))
        else:
            ready, state = True, clocks.state()
        self.update_clock_gauges()
        return pb.ClockResponse(
            min_clock=state.min_clock, max_clock=state.max_clock, live_workers=state.live_workers, ready=ready,
            min_other_clock=clocks.min_other(request.worker_id), finished_workers=clocks.finished_since(request.worker_id),
        )

    def update_clock_gauges(self) -> None:
        """Set the clock gauges (live workers, slowest and fastest clock) to the clocks now."""
        state = self.shard.clocks.state()
        self.metrics.clocks(state.live_workers, state.min_clock, state.max_clock)

    def _watch_new_tables(self) -> None:
        """Export the rows and bytes of tables not exported yet, read when Prometheus scrapes.
        Tables are only ever added, by Declare or by a restore (which runs before the handler
        exists), so Declare and ``__init__`` are the only callers."""
        tables = self.shard.tables
        for name in list(tables):
            if name not in self._watched:
                self.metrics.watch_table(name, *_table_gauges(tables, name))
                self._watched.add(name)


def _table_gauges(tables: Mapping[str, EmbeddingTable], name: str) -> tuple[Callable[[], float], Callable[[], float]]:
    """Readers of table ``name``'s resident rows and bytes (looked up each time they are read)."""
    return (lambda: tables[name].rows), (lambda: tables[name].memory_bytes)
