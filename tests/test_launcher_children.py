"""The launcher's children start safely while it has gRPC calls in flight (that they die with the
launcher is tests/test_integration.py::test_shards_die_with_a_killed_launcher)."""

from __future__ import annotations

import subprocess
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tether.deploy.children import child_command


def test_children_start_while_grpc_calls_are_in_flight() -> None:
    # A launcher talks to its shards while it starts workers. Started with a preexec_fn, 22 of 300
    # such children aborted before exec here (gRPC's fork handler, grpc/grpc#43055).
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    stop = threading.Event()
    calls = [0]

    def spin() -> None:
        while not stop.is_set():
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            calls[0] += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        codes = [subprocess.run(child_command(["-c", "pass"]), capture_output=True, timeout=30).returncode for _ in range(50)]
    finally:
        stop.set()
        spinner.join(timeout=15)
        channel.close()
        server.stop(None)
    assert calls[0] > 0
    assert codes == [0] * 50, [c for c in codes if c]
