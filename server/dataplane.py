"""The shard's data plane: Push, Pull and PushPull over framed TCP (see ``tether.protos.dataplane``).

One thread per connection reads a frame into a buffer it reuses, hands the request to the same
``ShardServicer`` the gRPC server uses (so validation, errors, deduplication and metrics are
one code path) and writes the answer back, with pulled values either after the message or in
the connection's shared-memory region. Torch releases the GIL while it applies or gathers rows,
so connections of different workers run in parallel.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

import grpc
import msgpack
from google.protobuf.message import DecodeError

from tether.protos import dataplane as dp
from tether.protos import tether_pb2 as pb

if TYPE_CHECKING:
    from tether.server.service import ShardServicer

__all__ = ["DataPlaneServer"]

log = logging.getLogger(__name__)

_REQUESTS = {dp.PUSH: pb.PushRequest, dp.PULL: pb.PullRequest, dp.PUSH_PULL: pb.PushPullRequest}
# What a client sees when the shard sheds a connection (the same words grpc uses, so the
# client treats it as load and retries).
OVERLOADED = "Concurrent RPC limit exceeded"


def _over_limit(size: int, limit: int) -> str:
    return f"message of {size} bytes is over the shard's limit of {limit}"


class _Refuse(Exception):
    """Answer with this status and close the connection."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DataPlaneServer:
    """Serves one shard's data port until ``stop``."""

    def __init__(
        self,
        servicer: ShardServicer,
        host: str,
        port: int,
        *,
        token: str | None = None,
        max_message_bytes: int = 256 * 1024 * 1024,
        max_connections: int = 64,
    ) -> None:
        self.servicer = servicer
        self._token = token.encode() if token is not None else None
        self.max_message_bytes = max_message_bytes
        self.max_connections = max_connections
        try:
            self._listener = socket.create_server((host, port), backlog=128)
        except OSError as exc:
            raise RuntimeError(f"cannot bind data port {host}:{port}: {exc.strerror}") from exc
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Condition()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._busy = 0
        self._draining = False
        self._accept_thread = threading.Thread(target=self._accept_loop, name="tether-data-accept", daemon=True)

    @property
    def connections(self) -> int:
        """Open client connections."""
        with self._lock:
            return len(self._conns)

    def start(self) -> None:
        """Start accepting connections."""
        self._accept_thread.start()

    def drain(self) -> None:
        """Stop accepting; calls after this one get UNAVAILABLE (clients retry elsewhere or later)."""
        with self._lock:
            self._draining = True
        try:
            self._listener.close()
        except OSError:
            pass

    def stop(self, grace: float | None = None) -> None:
        """Drain, wait up to ``grace`` seconds for calls in flight, then close every connection."""
        self.drain()
        deadline = None if grace is None else time.monotonic() + grace
        with self._lock:
            while self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._lock.wait(left)
            conns = list(self._conns.items())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _, thread in conns:
            thread.join(5.0)
        self._accept_thread.join(5.0)

    # -- connections -------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by drain()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                refuse = self._draining or len(self._conns) >= self.max_connections
                if not refuse:
                    thread = threading.Thread(target=self._serve, args=(conn,), name="tether-data", daemon=True)
                    self._conns[conn] = thread
            if refuse:
                code = grpc.StatusCode.UNAVAILABLE if self._draining else grpc.StatusCode.RESOURCE_EXHAUSTED
                self._refuse(conn, code, "shard is draining" if self._draining else OVERLOADED)
                conn.close()
            else:
                thread.start()

    @staticmethod
    def _refuse(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
        try:
            dp.send_frame(conn, 0, message.encode(), status=code.value[0])
        except OSError:
            pass

    def _serve(self, conn: socket.socket) -> None:
        state = _Connection(authenticated=self._token is None)
        self._count(state, +1)
        try:
            while self._one_call(conn, state):
                pass
        except _Refuse as exc:
            self._refuse(conn, exc.code, str(exc))
        except (ConnectionError, OSError) as exc:
            log.debug("data connection closed: %s", exc)
        finally:
            self._count(state, -1)
            if state.region is not None:
                state.region.close()
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _count(self, state: _Connection, delta: int) -> None:
        if self.servicer.metrics is not None:
            self.servicer.metrics.data_connections.labels(mode="tcp" if state.region is None else "shm").inc(delta)

    def _one_call(self, conn: socket.socket, state: _Connection) -> bool:
        method, flags, _, meta_len, payload_len, aux = dp.read_header(conn, state.header)
        shared = bool(flags & dp.FLAG_SHM)
        too_big = meta_len + payload_len > self.max_message_bytes
        if method not in dp.METHODS:
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"unknown data-plane method {method}")
        if too_big and not (shared and meta_len <= self.max_message_bytes):
            # Bytes we will not read are still on the socket: answer, then hang up.
            raise _Refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, _over_limit(meta_len + payload_len, self.max_message_bytes))
        meta = bytearray(meta_len)
        dp.recv_into(conn, memoryview(meta))
        if too_big:  # a shared payload: refuse the call, keep the connection
            dp.send_frame(conn, method, _over_limit(meta_len + payload_len, self.max_message_bytes).encode(),
                          status=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
            return True
        payload = state.receive(conn, 0 if shared else payload_len)
        with self._lock:
            if self._draining:
                raise _Refuse(grpc.StatusCode.UNAVAILABLE, "shard is draining")
            self._busy += 1
        try:
            if method == dp.HELLO:
                dp.send_frame(conn, dp.HELLO, msgpack.packb(self._hello(bytes(meta), state)))
                return True
            if not state.authenticated:
                raise _Refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            if flags & dp.FLAG_SHM:
                payload = state.shared_payload(aux, payload_len)
            self._answer(conn, method, bytes(meta), payload, state, aux + payload_len if flags & dp.FLAG_SHM else None)
            return True
        finally:
            with self._lock:
                self._busy -= 1
                self._lock.notify_all()

    def _hello(self, meta: bytes, state: _Connection) -> dict[str, object]:
        try:
            hello = msgpack.unpackb(meta)
        except (ValueError, msgpack.UnpackException) as exc:
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"HELLO is not msgpack: {exc}") from exc
        if not isinstance(hello, dict):
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, "HELLO must be a msgpack map")
        if self._token is not None:
            token = hello.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token):
                if self.servicer.metrics is not None:
                    self.servicer.metrics.requests.labels(rpc="Hello", code="UNAUTHENTICATED").inc()
                raise _Refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            state.authenticated = True
        shm = False
        if hello.get("shm") is not None:
            try:
                region = dp.open_region(hello["shm"], hello.get("shm_size"), hello.get("nonce", b""))
            except ValueError as exc:
                # Not on this machine, or not visible to this process: the client sends inline.
                log.debug("shared region refused: %s", exc)
            else:
                self._count(state, -1)
                if state.region is not None:
                    state.region.close()
                state.region = region
                self._count(state, +1)
                shm = True
        return {"shard": self.servicer.shard.shard_index, "shm": shm}

    def _answer(
        self, conn: socket.socket, method: int, meta: bytes, payload: memoryview | None, state: _Connection, shm_end: int | None
    ) -> None:
        rpc = dp.METHODS[method]
        try:
            request = _REQUESTS[method].FromString(meta)
        except DecodeError as exc:
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {rpc}: {exc}") from exc
        out = dp.PayloadWriter()
        response, code, message = self.servicer.data_call(rpc, request, payload, out)
        if code != grpc.StatusCode.OK:
            dp.send_frame(conn, method, message.encode(), status=code.value[0])
            return
        body = response.SerializeToString()
        if len(body) + out.nbytes > self.max_message_bytes:
            # gRPC refuses such an answer too; the request itself was applied (a PushPull's push).
            message = "answer: " + _over_limit(len(body) + out.nbytes, self.max_message_bytes)
            dp.send_frame(conn, method, message.encode(), status=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
            return
        if shm_end is not None and out.nbytes:
            start = dp.align(shm_end)
            if start + out.nbytes <= state.region.size:
                out.copy_into(state.region.view[start:])
                dp.send_frame(conn, method, body, flags=dp.FLAG_SHM, payload_len=out.nbytes, aux=start)
                return
        dp.send_frame(conn, method, body, out.buffers())


class _Connection:
    """Per-connection state: authentication, the shared region, the reusable receive buffer."""

    def __init__(self, authenticated: bool) -> None:
        self.authenticated = authenticated
        self.region: dp.SharedRegion | None = None
        self.header = bytearray(dp.HEADER.size)
        self._buffer = bytearray(0)

    def receive(self, conn: socket.socket, n: int) -> memoryview | None:
        """Read ``n`` payload bytes into the reusable buffer."""
        if n == 0:
            return None
        if len(self._buffer) < n:
            self._buffer = bytearray(n)
        view = memoryview(self._buffer)[:n]
        dp.recv_into(conn, view)
        return view

    def shared_payload(self, offset: int, n: int) -> memoryview:
        """The request's payload in the shared region."""
        if self.region is None:
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, "payload flagged as shared but no region was announced")
        if offset % dp.ALIGN or offset < dp.REGION_START or offset + n > self.region.size:
            raise _Refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"shared payload [{offset}, {offset + n}) is not an aligned range of the {self.region.size}-byte region",
            )
        return self.region.view[offset : offset + n]
