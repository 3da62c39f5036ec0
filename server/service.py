"""gRPC adapter of a shard: request -> domain call -> response, and nothing else."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.allocator import tune_malloc
from tether.protos.codec import decode_ids, decode_tensor, encode_tensor, torch_dtype
from tether.protos.dataplane import PayloadWriter
from tether.protos.errors import FailedPrecondition, InvalidArgument, TetherError, status_of
from tether.protos.security import server_credentials, server_ssl_context
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.auth import TokenAuthInterceptor
from tether.server.checkpoint import CheckpointInfo, Checkpointer
from tether.server.config import ShardConfig
from tether.server.dataplane import DataPlaneServer
from tether.server.shard import DenseDecl, DenseUpdate, PushResult, Shard, SparseUpdate

__all__ = ["RunningShard", "ShardServicer", "add_servicer", "start_shard"]

log = logging.getLogger(__name__)

SERVICE_NAME = "tether.v1.ParameterServer"
# Longest a Clock call waits on the shard before answering ready=false; clients loop.
MAX_CLOCK_WAIT_S = 5.0
_REJECT_REASON = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.FAILED_PRECONDITION: "failed_precondition",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.ABORTED: "too_stale",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
}


class _Unparsable:
    """Stands in for a request whose bytes are not the message they should be."""

    def __init__(self, message: str, size: int, error: str) -> None:
        self.message = message
        self.size = size
        self.error = error

    def ByteSize(self) -> int:  # noqa: N802 - the protobuf name the metrics call
        return self.size


def _lenient(cls: type) -> Callable[[bytes], object]:
    """A request deserializer that hands bad bytes to the servicer instead of failing in grpc."""

    def parse(data: bytes) -> object:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return _Unparsable(cls.DESCRIPTOR.full_name, len(data), str(exc))

    return parse


def add_servicer(servicer: ShardServicer, server: grpc.Server) -> None:
    """Register ``servicer`` like the generated ``add_ParameterServerServicer_to_server``, except
    that undecodable requests reach it, to be answered INVALID_ARGUMENT (grpc says INTERNAL)."""
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, m.name),
            request_deserializer=_lenient(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
        for m in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _domain(fn: Callable[..., object]) -> Callable[..., object]:
    """Turn tether errors (and config ValueErrors) into status codes; record metrics."""
    rpc = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: ShardServicer, request: object, context: grpc.ServicerContext) -> object:
        response, code, message = self.run(rpc, request, lambda: fn(self, request, context))
        if code != grpc.StatusCode.OK:
            context.abort(code, message)
        return response

    return wrapper


class ShardServicer(pb_grpc.ParameterServerServicer):
    """Implements ``tether.v1.ParameterServer`` over a ``Shard``."""

    def __init__(self, shard: Shard, metrics: object | None = None, checkpointer: Checkpointer | None = None) -> None:
        self.shard = shard
        self.metrics = metrics
        self.checkpointer = checkpointer
        # Port of the data plane serving this servicer (0: none), told to clients in Declare and Info.
        self.data_port = 0
        # Abstract unix socket of the same data plane ("": none), for clients on this machine.
        self.data_socket = ""
        # Tables whose rows and bytes the metrics export (tables restored from a checkpoint from the start).
        self._watched: set[str] = set()
        self._watch_new_tables()

    def run(
        self, rpc: str, request: object, call: Callable[[], object], extra_bytes: int = 0
    ) -> tuple[object | None, grpc.StatusCode, str]:
        """Run ``call`` for ``request`` of ``rpc`` (over gRPC or the data plane) and record metrics.

        Returns:
            (response, OK, "") or (None, the error's status code, its message).
        """
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        message = ""
        response = None
        try:
            if isinstance(request, _Unparsable):
                raise InvalidArgument(f"request is not a valid {request.message}: {request.error}")
            response = call()
        except TetherError as exc:
            code, message = status_of(exc), str(exc)
            self._count_rejected(rpc, code)
        except ValueError as exc:  # a config dataclass refused a declared spec
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
            self._count_rejected(rpc, code)
        except Exception:
            code, message = grpc.StatusCode.INTERNAL, f"internal error in {rpc}; see the shard's log"
            log.exception("%s failed", rpc)
        finally:
            m = self.metrics
            if m is not None:
                m.series(m.requests, rpc, code.name).inc()
                m.series(m.request_seconds, rpc).observe(time.perf_counter() - start)
                m.series(m.received_bytes, rpc).inc(request.ByteSize() + extra_bytes)
        return response, code, message

    def data_call(self, rpc: str, request: object, payload: memoryview | None, out: PayloadWriter) -> tuple[object | None, grpc.StatusCode, str]:
        """A data-plane call: tensors come from ``payload`` and pulled values go to ``out``."""
        def call() -> object:
            if rpc == "Push":
                return self._push_response(self._push(request, payload))
            if rpc == "Pull":
                response = self._pull(request, out)
            else:
                response = self._push_pull(request, payload, out)
            if self.metrics is not None:
                self.metrics.series(self.metrics.sent_bytes, rpc).inc(response.ByteSize() + out.nbytes)
            return response

        return self.run(rpc, request, call, extra_bytes=0 if payload is None else len(payload))

    def _count_rejected(self, rpc: str, code: grpc.StatusCode) -> None:
        if self.metrics is not None and rpc in ("Push", "PushPull"):
            self.metrics.reject(_REJECT_REASON.get(code, "invalid_argument"))

    def _sent(self, rpc: str, response: object) -> object:
        if self.metrics is not None:
            self.metrics.series(self.metrics.sent_bytes, rpc).inc(response.ByteSize())
        return response

    @_domain
    def Declare(self, request: pb.DeclareRequest, context: grpc.ServicerContext) -> pb.DeclareResponse:
        tables = [TableConfig.from_proto(t) for t in request.tables]
        dense = [
            DenseDecl(name=d.name, index=d.index, init=decode_tensor(d.init), optimizer=OptimizerConfig.from_proto(d.optimizer))
            for d in request.dense
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
        response = pb.PullResponse()
        encode = encode_tensor if out is None else out.add
        for (name, _), (source, index, version) in zip(sparse, rows):
            msg = response.sparse.add(table=name, read_version=version).values
            if out is None:
                encode_tensor(source if index is None else source.index_select(0, index), msg, dtype=wire)
            else:  # gathered straight into the reply when it is written
                out.add(source, msg, dtype=wire, rows=index)
        for (name, index), (v, version) in zip(dense, values):
            encode(v, response.dense.add(name=name, index=index, read_version=version).value, dtype=wire)
        return response

    def _push(self, request: pb.PushRequest, payload: memoryview | None = None) -> PushResult:
        sparse = [
            SparseUpdate(b.table, decode_ids(b.ids), decode_tensor(b.values, torch.float32, payload), b.read_version)
            for b in request.sparse
        ]
        dense = [
            DenseUpdate(b.name, b.index, decode_tensor(b.value, torch.float32, payload), b.read_version) for b in request.dense
        ]
        result = self.shard.push(
            request.worker_id, request.seq, sparse, dense, clock=request.clock, staleness_aware=request.staleness_aware,
            incarnation=request.incarnation,
        )
        if request.clock:
            self._update_clock_gauges()
        return result

    @_domain
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> pb.PullResponse:
        return self._sent("Pull", self._pull(request))

    @staticmethod
    def _push_response(result: PushResult) -> pb.PushResponse:
        return pb.PushResponse(applied=result.applied, max_staleness=result.max_staleness, clock_staleness=result.clock_staleness)

    def _push_pull(self, request: pb.PushPullRequest, payload: memoryview | None = None, out: PayloadWriter | None = None) -> pb.PushPullResponse:
        result = self._push(request.push, payload)
        return pb.PushPullResponse(push=self._push_response(result), pull=self._pull(request.pull, out))

    @_domain
    def Push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushResponse:
        return self._push_response(self._push(request))

    @_domain
    def PushPull(self, request: pb.PushPullRequest, context: grpc.ServicerContext) -> pb.PushPullResponse:
        return self._sent("PushPull", self._push_pull(request))

    @_domain
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
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

    @_domain
    def Clock(self, request: pb.ClockRequest, context: grpc.ServicerContext) -> pb.ClockResponse:
        if not request.worker_id:
            raise InvalidArgument("worker_id must be set on a Clock call")
        clocks = self.shard.clocks
        # A report of clock 0 with no wait is a worker joining at start-up (Trainer's start barrier).
        clocks.update(request.worker_id, request.clock, leave=request.leave, join=request.clock == 0 and request.wait_bound < 0)
        if request.wait_bound >= 0 and not request.leave:
            if self.metrics is not None:
                self.metrics.set_staleness_bound(int(request.wait_bound))
            timeout = min(request.wait_timeout_ms / 1000.0, MAX_CLOCK_WAIT_S)
            ready, state = clocks.wait(request.clock, request.wait_bound, timeout)
        else:
            ready, state = True, clocks.state()
        self._update_clock_gauges()
        return pb.ClockResponse(
            min_clock=state.min_clock,
            max_clock=state.max_clock,
            live_workers=state.live_workers,
            ready=ready,
            min_other_clock=clocks.min_other(request.worker_id),
        )

    @_domain
    def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.ServicerContext) -> pb.CheckpointResponse:
        if self.checkpointer is None:
            raise FailedPrecondition("this shard has no checkpoint directory (start it with --checkpoint-dir)")
        info = self.checkpointer.checkpoint(request.id)
        return pb.CheckpointResponse(id=info.id, path=info.path, bytes=info.bytes, seconds=info.seconds)

    def _update_clock_gauges(self) -> None:
        if self.metrics is None:
            return
        state = self.shard.clocks.state()
        self.metrics.live_workers.set(state.live_workers)
        self.metrics.worker_clock_min.set(state.min_clock)
        self.metrics.worker_clock_max.set(state.max_clock)

    def _watch_new_tables(self) -> None:
        """Export the rows and bytes of tables not exported yet, read when Prometheus scrapes.
        Tables are only ever added, by Declare or by a restore (which runs before the servicer
        exists), so Declare and ``__init__`` are the only callers."""
        if self.metrics is None:
            return
        tables = self.shard.tables
        for name in list(tables):
            if name not in self._watched:
                self.metrics.watch_table(name, lambda n=name: tables[n].rows, lambda n=name: tables[n].memory_bytes)
                self._watched.add(name)


@dataclass
class RunningShard:
    """A started gRPC server and what it serves."""

    server: grpc.Server
    port: int
    shard: Shard
    health: health.HealthServicer
    checkpointer: Checkpointer | None = None
    health_server: grpc.Server | None = None
    health_port: int | None = None
    dataplane: DataPlaneServer | None = None

    @property
    def data_port(self) -> int:
        """Port of the data plane (0: none)."""
        return 0 if self.dataplane is None else self.dataplane.port

    def stop(self, grace: float | None = None) -> None:
        """Mark NOT_SERVING, let in-flight calls finish for ``grace`` seconds, and stop."""
        self.health.enter_graceful_shutdown()
        if self.dataplane is not None:
            self.dataplane.drain()
        # grpc cancels what is still running when the grace period ends; the margin covers that.
        self.server.stop(grace).wait(None if grace is None else grace + 10.0)
        if self.dataplane is not None:
            self.dataplane.stop(grace)
        if self.health_server is not None:
            self.health_server.stop(0).wait(10.0)
        if self.checkpointer is not None:
            self.checkpointer.stop()

    def shutdown(self, grace: float | None = None) -> CheckpointInfo | None:
        """The SIGTERM path: NOT_SERVING, drain in-flight calls, then a final checkpoint.

        Returns:
            The final checkpoint, or None without a checkpoint directory or when nothing
            changed since the last checkpoint.
        """
        self.stop(grace)
        if self.checkpointer is None:
            return None
        return self.checkpointer.final()


def _bind(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {address}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"cannot bind {address}")
    return port


def start_shard(config: ShardConfig, shard: Shard | None = None, metrics: object | None = None) -> RunningShard:
    """Build the shard, restore its newest checkpoint, and start serving (returns once listening).

    Raises:
        RuntimeError: if a port cannot be bound.
        ValueError: unreadable TLS files.
    """
    tune_malloc()
    shard = shard or Shard(
        config.shard_index, config.num_shards, metrics, lease_s=config.lease_seconds, max_staleness=config.max_staleness
    )
    checkpointer = None
    if config.checkpoint_dir is not None:
        checkpointer = Checkpointer(shard, config.checkpoint_dir, config.checkpoint_every_s, config.checkpoint_keep, metrics)
        # Before the port opens: no call ever sees the shard half restored.
        checkpointer.restore()
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls else None
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Find dead clients' connections, and let clients ping often enough to find a dead
        # shard (or a partition) within seconds instead of TCP's minutes.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]
    interceptors = []
    if config.auth_token is not None:
        on_reject = None
        if metrics is not None:
            on_reject = lambda rpc: metrics.requests.labels(rpc=rpc, code="UNAUTHENTICATED").inc()  # noqa: E731
        interceptors.append(TokenAuthInterceptor(config.auth_token, on_reject=on_reject))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="tether-rpc"),
        options=options,
        interceptors=interceptors,
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    servicer = ShardServicer(shard, metrics, checkpointer)
    add_servicer(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _bind(server, f"{config.host}:{config.port}", credentials)
    health_server = health_port = None
    if config.health_port is not None:
        health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tether-health"))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = _bind(health_server, f"{config.host}:{config.health_port}", None)
        health_server.start()
    dataplane = None
    if config.data_port is not None:
        # TLS on the data port with the gRPC port's files. The unix socket (shared memory, same
        # machine) carries no TLS: it is offered unless clients must prove who they are by
        # certificate, which a local process could otherwise skip.
        dataplane = DataPlaneServer(
            servicer, config.host, config.data_port, token=config.auth_token,
            max_message_bytes=config.max_message_bytes, max_connections=config.max_concurrent_rpcs,
            buffer_bytes=config.data_buffer_bytes, handshake_timeout_s=config.data_handshake_timeout_s,
            idle_timeout_s=config.data_idle_timeout_s,
            ssl_context=server_ssl_context(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls else None,
            unix_socket=not config.tls_client_ca,
        )
        servicer.data_port = dataplane.port
        servicer.data_socket = dataplane.socket_name
        dataplane.start()
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if checkpointer is not None:
        checkpointer.start_periodic()
    return RunningShard(
        server=server, port=port, shard=shard, health=health_servicer, checkpointer=checkpointer,
        health_server=health_server, health_port=health_port, dataplane=dataplane,
    )
