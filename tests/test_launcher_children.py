"""The launcher's children: started safely while gRPC calls are in flight, and gone with the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tether.deploy.launch import child_command


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


def test_a_child_dies_with_its_launcher() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         "from tether.deploy.launch import child_command\n"
         "p = subprocess.Popen(child_command(['-c', 'import time; time.sleep(120)']))\n"
         "print(p.pid, flush=True)\n"
         "time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True,
    )
    child = int(launcher.stdout.readline())
    try:
        time.sleep(0.5)  # the child is past its guard and running the program
        os.kill(child, 0)
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"child {child} still runs 10 s after its launcher was killed")
    finally:
        launcher.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.stdout.close()
