"""Transport ceilings on loopback: raw Python sockets and raw grpc with identity serializers.

Every figure is an echo (payload out, same payload back), so it is comparable to a push
followed by a pull; MB/s counts bytes sent plus bytes received, in MiB/s (2**20).

Run: ``python bench/ceilings.py [--quick]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    MIB,
    QUICK_SIZES,
    SIZES,
    ChildProcess,
    call_stats,
    fmt_size,
    markdown_table,
    mib_per_s,
    start_process,
    time_op,
)

__all__ = [
    "GrpcEchoPeer",
    "SocketEchoPeer",
    "grpc_echo_mbps",
    "grpc_small_calls",
    "main",
    "socket_roundtrip_mbps",
]

GRPC_MAX_MESSAGE = 256 * MIB
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
]
_ECHO_METHOD = "/bench.Echo/Echo"
_STARTUP_TIMEOUT = 30.0
_IO_TIMEOUT = 60.0


# --------------------------------------------------------------------------- sockets


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on a clean EOF before the first byte."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n
    return True


def _socket_echo_serve(port_queue: Any, max_size: int, timeout: float) -> None:
    """Child: accept one connection, echo length-prefixed messages until EOF."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(timeout)
        port_queue.put(listener.getsockname()[1])
        conn, _ = listener.accept()
    with conn:
        conn.settimeout(timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = memoryview(bytearray(8))
        buf = memoryview(bytearray(max_size))
        while _recv_exact(conn, header):
            n = int.from_bytes(header, "little")
            _recv_exact(conn, buf[:n])
            conn.sendall(buf[:n])


class SocketEchoPeer:
    """An echo server in a child process and one connected client socket."""

    def __init__(self, max_size: int = 64 * MIB, timeout: float = _IO_TIMEOUT) -> None:
        self._max_size = max_size
        self._timeout = timeout
        self._child: ChildProcess | None = None
        self._sock: socket.socket | None = None
        self._send = memoryview(bytearray(max_size))
        self._recv = memoryview(bytearray(max_size))

    def __enter__(self) -> SocketEchoPeer:
        ctx = mp.get_context("spawn")
        ports = ctx.Queue()
        self._child = start_process(
            _socket_echo_serve, (ports, self._max_size, self._timeout), "socket-echo", ctx
        )
        try:
            port = ports.get(timeout=_STARTUP_TIMEOUT)
            self._sock = socket.create_connection(("127.0.0.1", port), timeout=self._timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._child is not None:
            self._child.stop()
            self._child = None

    def roundtrip(self, size: int) -> None:
        """Send ``size`` bytes and receive them back."""
        if self._sock is None:
            raise RuntimeError("SocketEchoPeer used outside its with-block")
        if not 0 < size <= self._max_size:
            raise ValueError(f"size must be in 1..{self._max_size}, got {size}")
        self._sock.sendall(size.to_bytes(8, "little"))
        self._sock.sendall(self._send[:size])
        if not _recv_exact(self._sock, self._recv[:size]):
            raise ConnectionError("echo server closed the connection")

    def roundtrip_mbps(self, size: int, seconds: float) -> float:
        """MiB/s (sent + received) of back-to-back round trips of ``size`` bytes."""
        lat = time_op(
            lambda: self.roundtrip(size), seconds, min_iters=3, warmup_seconds=seconds / 2
        )
        return mib_per_s(2 * size, lat)


def socket_roundtrip_mbps(size: int, seconds: float) -> float:
    """Loopback socket echo throughput for one size (starts and stops its own server)."""
    with SocketEchoPeer(max_size=size) as peer:
        return peer.roundtrip_mbps(size, seconds)


# --------------------------------------------------------------------------- grpc


def _echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _grpc_echo_serve(port_queue: Any, stop: Any, max_workers: int, lifetime: float) -> None:
    """Child: serve the identity echo method until ``stop`` is set (or ``lifetime`` s)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_queue.put(port)
    stop.wait(lifetime)
    server.stop(grace=1.0).wait(5.0)


class GrpcEchoPeer:
    """A grpc identity-echo server in a child process and a channel to it."""

    def __init__(self, max_workers: int = 8, lifetime: float = 3600.0) -> None:
        self._max_workers = max_workers
        self._lifetime = lifetime
        self._child: ChildProcess | None = None
        self._stop: Any = None
        self._channel: grpc.Channel | None = None
        self._call: grpc.UnaryUnaryMultiCallable | None = None

    def __enter__(self) -> GrpcEchoPeer:
        ctx = mp.get_context("spawn")
        ports, self._stop = ctx.Queue(), ctx.Event()
        self._child = start_process(
            _grpc_echo_serve,
            (ports, self._stop, self._max_workers, self._lifetime),
            "grpc-echo",
            ctx,
        )
        try:
            port = ports.get(timeout=_STARTUP_TIMEOUT)
            self._channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
            grpc.channel_ready_future(self._channel).result(timeout=_STARTUP_TIMEOUT)
            self._call = self._channel.unary_unary(_ECHO_METHOD)  # no serializers: bytes
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._call = None
        if self._child is not None:
            self._stop.set()
            self._child.stop()
            self._child = None

    def echo(self, payload: bytes) -> bytes:
        """One unary call; returns the echoed payload."""
        if self._call is None:
            raise RuntimeError("GrpcEchoPeer used outside its with-block")
        return self._call(payload, timeout=_IO_TIMEOUT)

    def echo_mbps(self, size: int, seconds: float) -> float:
        """MiB/s (request + response bytes) of back-to-back echo calls of ``size`` bytes."""
        payload = bytes(size)
        lat = time_op(lambda: self.echo(payload), seconds, min_iters=3, warmup_seconds=seconds / 2)
        return mib_per_s(2 * size, lat)

    def small_calls(self, seconds: float, size: int = 8) -> dict[str, float]:
        """Sequential calls of ``size`` bytes: calls_per_s, p50_us, p99_us."""
        payload = bytes(size)
        lat = time_op(lambda: self.echo(payload), min_seconds=seconds, min_iters=100, warmup=20)
        return call_stats(lat)


def grpc_echo_mbps(size: int, seconds: float) -> float:
    """Raw grpc identity-echo throughput for one size (starts and stops its own server)."""
    with GrpcEchoPeer() as peer:
        return peer.echo_mbps(size, seconds)


def grpc_small_calls(seconds: float) -> dict[str, float]:
    """Raw grpc rate and p50/p99 latency of 8-byte unary echo calls."""
    with GrpcEchoPeer() as peer:
        return peer.small_calls(seconds)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """Print the ceilings as Markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run (~30 s)")
    parser.add_argument("--seconds", type=float, help="time per size (default 1.0, quick 0.3)")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 1.0)

    with SocketEchoPeer(max_size=max(sizes)) as sock_peer:
        sock = {s: sock_peer.roundtrip_mbps(s, seconds) for s in sizes}
    with GrpcEchoPeer() as grpc_peer:
        rpc = {s: grpc_peer.echo_mbps(s, seconds) for s in sizes}
        small = grpc_peer.small_calls(2 * seconds)

    print("## Echo throughput, loopback (MiB/s, sent + received)\n")
    rows = [[fmt_size(s), sock[s], rpc[s], rpc[s] / sock[s]] for s in sizes]
    print(markdown_table(["size", "socket MiB/s", "grpc MiB/s", "grpc / socket"], rows))
    print("\n## grpc small calls (8-byte identity echo, sequential)\n")
    print(
        markdown_table(
            ["calls/s", "p50 us", "p99 us"],
            [[small["calls_per_s"], small["p50_us"], small["p99_us"]]],
        )
    )


if __name__ == "__main__":
    main()
