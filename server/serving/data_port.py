"""The shard's data plane: Push, Pull and PushPull over framed TCP (see ``tether.protos.framing``).

One thread per connection reads a frame into a buffer it reuses, hands the request to the same
``RequestHandler`` the gRPC server uses (so validation, errors, deduplication and metrics are
one code path) and writes the answer back, with pulled values either after the message or in
the connection's shared-memory region. Torch releases the GIL while it applies or gathers rows,
so connections of different workers run in parallel.

Beside the TCP port the shard listens on an abstract unix socket (no path: nothing to leak or
to point elsewhere); a client on the same machine connects there and sends its sealed memfd
region with its HELLO. The shard maps only descriptors it received, after checking their seals.

A shard that serves TLS wraps every TCP connection in TLS (the gRPC port's certificate, key and
client CA), the handshake bounded by the handshake timeout; a client that speaks plaintext to it
gets one plaintext error frame saying so. The unix socket stays plaintext (its bytes never leave
the machine) and is offered under TLS only when the shard requires no client certificate:
under mutual TLS a local process could otherwise skip the certificate check.

What a connection can make the shard hold: before the token is checked, one HELLO of at most
``HELLO_MAX`` bytes (anything else is refused having read only its header), which must arrive
within the handshake timeout; after, one receive buffer, released when the connection is idle
for ``RELEASE_IDLE_S`` and counted against a budget for all connections together
(RESOURCE_EXHAUSTED beyond it); a connection silent for the idle timeout is closed.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING

import grpc
import torch
from google.protobuf.message import DecodeError

from tether.protos import framing as dp
from tether.protos import tether_pb2 as pb
from tether.protos.errors import OVERLOADED
from tether.rules import row_kernels
from tether.rules.kernel_threads import in_parts
from tether.server.serving.connection import Connection, Refuse, close_all, drain, readable
from tether.server.serving.data_handshake import Handshakes

if TYPE_CHECKING:
    from tether.server.serving.handler import RequestHandler

__all__ = ["RELEASE_IDLE_S", "DataPlaneServer"]

log = logging.getLogger(__name__)

_REQUESTS = {dp.PUSH: pb.PushRequest, dp.PULL: pb.PullRequest, dp.PUSH_PULL: pb.PushPullRequest}
# A connection's receive buffer is given back after this many seconds without a frame, so
# back-to-back calls reuse it and an idle connection holds nothing.
RELEASE_IDLE_S = 1.0


def _over_limit(size: int, limit: int) -> str:
    return f"message of {size} bytes is over the shard's limit of {limit}"


class DataPlaneServer:
    """Serves one shard's data port until ``stop`` (how connections start: its ``handshakes``)."""

    def __init__(
        self,
        handler: RequestHandler,
        host: str,
        port: int,
        *,
        token: str | None = None,
        max_message_bytes: int = 256 * 1024 * 1024,
        max_connections: int = 64,
        buffer_bytes: int = 1024 * 1024 * 1024,
        handshake_timeout_s: float = 10.0,
        idle_timeout_s: float = 120.0,
        unix_socket: bool = True,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """Bind the TCP port (and the abstract unix socket); ``start`` serves them.

        Args:
            buffer_bytes: receive buffers of all connections together (at least one largest frame).
            handshake_timeout_s: a connection's HELLO must be complete this soon after it opens.
            idle_timeout_s: a connection without a frame for this long is closed.
            unix_socket: also listen on an abstract unix socket (shared-memory regions).
            ssl_context: serve TLS on the TCP port with this context (``server_ssl_context``).

        Raises:
            RuntimeError: the port cannot be bound.
        """
        self.handler = handler
        self._token = token.encode() if token is not None else None
        self._tls = ssl_context
        self.max_message_bytes = max_message_bytes
        self.max_connections = max_connections
        # One largest frame (its message aligned, then its payload) always fits.
        self.buffer_bytes = max(buffer_bytes, max_message_bytes + dp.ALIGN)
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        # Regions: a request's payload and its answer, each up to the message limit, with room to grow.
        self.max_region_bytes = 4 * max_message_bytes + (4 << 20)
        try:
            self._listener = socket.create_server((host, port), backlog=128)
        except OSError as exc:
            raise RuntimeError(f"cannot bind data port {host}:{port}: {exc.strerror}") from exc
        self.port = self._listener.getsockname()[1]
        self.socket_name = ""
        self._unix: socket.socket | None = None
        if unix_socket:
            name = f"\0tether-{os.getpid()}-{os.urandom(8).hex()}"
            try:
                self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._unix.bind(name)
                self._unix.listen(128)
                self.socket_name = name
            except OSError as exc:
                log.info("no unix socket for shared memory (%s); the data plane is TCP only", exc)
                if self._unix is not None:
                    self._unix.close()
                self._unix = None
        self._lock = threading.Condition()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self.handshakes = Handshakes(handler, self._token, self._tls, self.max_region_bytes, self._lock, self._conns)
        self._busy = 0
        self._buffered = 0
        self._draining = False
        self._accept_threads = [threading.Thread(target=self._accept_loop, args=(self._listener,), name="tether-data-accept", daemon=True)]
        if self._unix is not None:
            self._accept_threads.append(
                threading.Thread(target=self._accept_loop, args=(self._unix,), name="tether-data-accept-unix", daemon=True)
            )

    @property
    def connections(self) -> int:
        """Open client connections."""
        with self._lock:
            return len(self._conns)

    @property
    def buffered(self) -> int:
        """Bytes of receive buffers held by all connections now."""
        with self._lock:
            return self._buffered

    def start(self) -> None:
        """Start accepting connections."""
        for thread in self._accept_threads:
            thread.start()

    def drain(self) -> None:
        """Stop accepting; calls after this one get UNAVAILABLE (clients retry elsewhere or later)."""
        with self._lock:
            self._draining = True
        for listener in (self._listener, self._unix):
            if listener is None:
                continue
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                listener.close()
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
                # socket's own shutdown: an SSL socket's would drop its TLS state under the serving thread.
                socket.socket.shutdown(conn, socket.SHUT_RDWR)
            except OSError:
                pass
        for _, thread in conns:
            thread.join(5.0)
        for thread in self._accept_threads:
            thread.join(5.0)

    # -- connections -------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        unix = listener.family == socket.AF_UNIX
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                if self._draining:
                    return  # closed by drain()
                log.warning("data plane: accept failed; retrying", exc_info=True)
                time.sleep(0.1)
                continue
            if not unix:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                refuse = self._draining or len(self._conns) >= self.max_connections
                if not refuse:
                    thread = threading.Thread(target=self._serve, args=(conn, unix), name="tether-data", daemon=True)
                    self._conns[conn] = thread
            if refuse:
                code = grpc.StatusCode.UNAVAILABLE if self._draining else grpc.StatusCode.RESOURCE_EXHAUSTED
                self._refuse(conn, code, "shard is draining" if self._draining else OVERLOADED)
                conn.close()
            else:
                thread.start()

    @staticmethod
    def _refuse(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
        """Answer with an error frame and end the connection so that the answer arrives.

        Whatever the peer still sends is read into a small scratch buffer and dropped (bounded
        in bytes and time): closing with unread bytes would reset the connection, and the reset
        can destroy the answer before the peer reads it.
        """
        try:
            dp.send_frame(conn, 0, message.encode(), status=code.value[0])
        except OSError:
            return
        drain(conn)

    def _serve(self, conn: socket.socket, unix: bool) -> None:
        state = Connection(self._reserve, self._unreserve, unix, authenticated=self._token is None, tls=self._tls is not None and not unix)
        self.handshakes.count(state, +1)
        deadline = time.monotonic() + self.handshake_timeout_s
        try:
            if state.tls:
                conn = self.handshakes.start_tls(conn, deadline)
            self.handshakes.handshake(conn, state, deadline)
            # Once, not per call (each settimeout is a syscall): a frame that stalls half-way
            # counts as idle too. Nothing after the handshake sets another timeout.
            conn.settimeout(self.idle_timeout_s)
            while self._one_call(conn, state):
                pass
        except Refuse as exc:
            self._refuse(conn, exc.code, str(exc))
        except dp.FrameError as exc:
            self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TimeoutError as exc:
            log.debug("data connection timed out: %s", exc)
        except (ConnectionError, OSError) as exc:
            log.debug("data connection closed: %s", exc)
        finally:
            self.handshakes.count(state, -1)
            state.release()
            if state.region is not None:
                state.region.close()
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _wait_for_frame(self, conn: socket.socket, state: Connection) -> bool:
        """Wait for the next frame: release the buffer after a short pause, give up at the idle timeout."""
        if not readable(conn, min(RELEASE_IDLE_S, self.idle_timeout_s)):
            state.release()
            if not readable(conn, max(self.idle_timeout_s - RELEASE_IDLE_S, 0.0)):
                log.debug("data connection idle for %.1fs: closed", self.idle_timeout_s)
                return False
        return True

    def _one_call(self, conn: socket.socket, state: Connection) -> bool:
        if not self._wait_for_frame(conn, state):
            return False
        (method, flags, _, meta_len, payload_len, aux), fds = state.read_header(conn, None)
        if method == dp.HELLO:
            self.handshakes.answer(conn, state, (method, flags, meta_len, payload_len), fds, None, first=False)
            return True
        close_all(fds)  # descriptors ride only with a HELLO
        if method not in dp.METHODS:
            raise Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"unknown data-plane method {method}")
        shared = bool(flags & dp.FLAG_SHM)
        too_big = meta_len + payload_len > self.max_message_bytes
        if too_big and not (shared and meta_len <= self.max_message_bytes):
            # Bytes we will not read are still on the socket: answer, then hang up.
            raise Refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, _over_limit(meta_len + payload_len, self.max_message_bytes))
        meta, payload = state.receive(conn, meta_len, 0 if shared else payload_len)
        if too_big:  # a shared payload: refuse the call, keep the connection
            dp.send_frame(conn, method, _over_limit(meta_len + payload_len, self.max_message_bytes).encode(),
                          status=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
            return True
        with self._lock:
            if self._draining:
                raise Refuse(grpc.StatusCode.UNAVAILABLE, "shard is draining")
            self._busy += 1
        try:
            if not state.authenticated:
                raise Refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            if shared:
                payload = state.shared_payload(aux, payload_len)
            self._answer(conn, method, meta, payload, state, aux + payload_len if shared else None)
            return True
        finally:
            with self._lock:
                self._busy -= 1
                self._lock.notify_all()

    def _reserve(self, n: int) -> None:
        """Count ``n`` more bytes of receive buffers against the budget.

        Raises:
            Refuse: RESOURCE_EXHAUSTED, they do not fit.
        """
        with self._lock:
            if self._buffered + n > self.buffer_bytes:
                raise Refuse(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{OVERLOADED}: a frame needs {n} more bytes of receive buffer, and the data plane's buffers "
                    f"already hold {self._buffered} of their limit of {self.buffer_bytes} bytes (--data-buffer-mb)",
                )
            self._buffered += n

    def _unreserve(self, n: int) -> None:
        with self._lock:
            self._buffered -= n

    def _answer(
        self, conn: socket.socket, method: int, meta: memoryview, payload: memoryview | None, state: Connection, shm_end: int | None
    ) -> None:
        rpc = dp.METHODS[method]
        try:
            request = _REQUESTS[method].FromString(meta)
        except DecodeError as exc:
            raise Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {rpc}: {exc}") from exc
        out = dp.PayloadWriter()
        response, code, message = self.handler.data_call(rpc, request, payload, out)
        if code != grpc.StatusCode.OK:
            dp.send_frame(conn, method, message.encode(), status=code.value[0])
            return
        body = response.SerializeToString()
        if len(body) + out.nbytes > self.max_message_bytes:
            # gRPC refuses such an answer too; the request itself was applied (a PushPull's push).
            message = "answer: " + _over_limit(len(body) + out.nbytes, self.max_message_bytes)
            dp.send_frame(conn, method, message.encode(), status=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
            return
        if shm_end is not None and out.nbytes and state.region is not None:
            start = dp.align(shm_end)
            if start + out.nbytes <= state.region.size:
                out.copy_into(state.region.view[start:], gather_rows)
                dp.send_frame(conn, method, body, flags=dp.FLAG_SHM, payload_len=out.nbytes, aux=start)
                return
        dp.send_frame(conn, method, body, out.buffers())


# Pulls of at least this many floats per table (256 KiB) are gathered by the compiled gather.
GATHER_ELEMENTS = 1 << 16


def gather_rows(source: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``source[rows]`` written into ``out`` (a pulled table's rows, straight into the shared
    region): a large pull's float32 rows (``GATHER_ELEMENTS`` floats or more) by the compiled
    gather (``row_kernels.gather_rows``), in runs of rows on several threads
    (``tether.rules.kernel_threads``); anything else (a small pull, where calling a kernel costs
    more than the copy), or a row outside ``source``, by ``torch.index_select`` (which says so)."""
    if (len(rows) * source.shape[-1] < GATHER_ELEMENTS or source.dim() != 2 or source.dtype != torch.float32
            or rows.dtype != torch.int64 or not source.is_contiguous()):
        torch.index_select(source, 0, rows, out=out)
        return
    index = rows.numpy()
    if int(index.min()) < 0 or int(index.max()) >= len(source):
        torch.index_select(source, 0, rows, out=out)
        return
    src, dest = source.numpy(), out.numpy()
    in_parts(lambda a, b: row_kernels.gather_rows(src, index[a:b], dest[a:b]), len(index), src.shape[1])
