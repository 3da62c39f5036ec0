"""Start-up of one shard: restore its checkpoint, then serve gRPC (with TLS, token checks and
health) and the data plane, and stop them again in order."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tether.common.security import server_credentials, server_ssl_context
from tether.server.checkpoints.checkpoint import Checkpointer
from tether.server.checkpoints.checkpoint_files import CheckpointInfo
from tether.server.config import ShardConfig
from tether.server.metrics import NullShardMetrics, ShardRecorder
from tether.server.serving.auth import TokenAuthInterceptor
from tether.server.serving.data_port import DataPlaneServer
from tether.server.serving.handler import RequestHandler
from tether.server.serving.service import SERVICE_NAME, ShardServicer, add_servicer
from tether.server.storage.shard import Shard

__all__ = ["RunningShard", "start_shard"]


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


def start_shard(config: ShardConfig, shard: Shard | None = None, metrics: ShardRecorder | None = None) -> RunningShard:
    """Build the shard, restore its newest checkpoint, and start serving (returns once listening).

    Raises:
        RuntimeError: if a port cannot be bound.
        ValueError: unreadable TLS files.
    """
    metrics = metrics if metrics is not None else NullShardMetrics()
    shard = shard or Shard(
        config.shard_index, config.num_shards, metrics, lease_s=config.lease_seconds, max_staleness=config.max_staleness
    )
    checkpointer = None
    if config.checkpoint_dir is not None:
        checkpointer = Checkpointer(
            shard, config.checkpoint_dir, config.checkpoint_every_s, config.checkpoint_keep, metrics, config.crash_before_manifest
        )
        # Before the port opens: no call ever sees the shard half restored.
        checkpointer.restore()
    # Certificate and key go together (ShardConfig checks it): TLS when they are given.
    tls = (config.tls_cert, config.tls_key) if config.tls_cert is not None and config.tls_key is not None else None
    credentials = server_credentials(*tls, config.tls_client_ca) if tls else None
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
        recorder = metrics
        interceptors.append(TokenAuthInterceptor(config.auth_token, on_reject=lambda rpc: recorder.refused(rpc, "UNAUTHENTICATED")))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="tether-rpc"),
        options=options,
        interceptors=interceptors,
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    handler = RequestHandler(shard, metrics, checkpointer)
    add_servicer(ShardServicer(handler), server)
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
            handler, config.host, config.data_port, token=config.auth_token,
            max_message_bytes=config.max_message_bytes, max_connections=config.max_concurrent_rpcs,
            buffer_bytes=config.data_buffer_bytes, handshake_timeout_s=config.data_handshake_timeout_s,
            idle_timeout_s=config.data_idle_timeout_s,
            ssl_context=server_ssl_context(*tls, config.tls_client_ca) if tls else None,
            unix_socket=not config.tls_client_ca,
        )
        handler.data_port = dataplane.port
        handler.data_socket = dataplane.socket_name
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
