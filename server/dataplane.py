"""The shard's data plane: Push, Pull and PushPull over framed TCP (see ``tether.protos.dataplane``).

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

import ctypes
import hmac
import logging
import mmap
import os
import select
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING

import grpc
import msgpack
from google.protobuf.message import DecodeError

from tether.protos import dataplane as dp
from tether.protos import tether_pb2 as pb
from tether.protos.errors import OVERLOADED

if TYPE_CHECKING:
    from tether.server.handler import RequestHandler

__all__ = ["RELEASE_IDLE_S", "DataPlaneServer"]

log = logging.getLogger(__name__)

_REQUESTS = {dp.PUSH: pb.PushRequest, dp.PULL: pb.PullRequest, dp.PUSH_PULL: pb.PushPullRequest}
# A connection's receive buffer is given back after this many seconds without a frame, so
# back-to-back calls reuse it and an idle connection holds nothing.
RELEASE_IDLE_S = 1.0
# Bytes read and thrown away after a refusal, so the answer is not lost to a reset.
_DRAIN_BYTES = 256 * 1024
# Buffers from this size on ask for transparent huge pages.
_HUGE = 2 << 20
_DRAIN_S = 0.5


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
        _drain(conn)

    def _serve(self, conn: socket.socket, unix: bool) -> None:
        state = _Connection(self, unix, authenticated=self._token is None, tls=self._tls is not None and not unix)
        self._count(state, +1)
        deadline = time.monotonic() + self.handshake_timeout_s
        try:
            if state.tls:
                conn = self._start_tls(conn, deadline)
            self._handshake(conn, state, deadline)
            while self._one_call(conn, state):
                pass
        except _Refuse as exc:
            self._refuse(conn, exc.code, str(exc))
        except dp.FrameError as exc:
            self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TimeoutError as exc:
            log.debug("data connection timed out: %s", exc)
        except (ConnectionError, OSError) as exc:
            log.debug("data connection closed: %s", exc)
        finally:
            self._count(state, -1)
            state.release()
            if state.region is not None:
                state.region.close()
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _count(self, state: _Connection, delta: int) -> None:
        mode = "shm" if state.region is not None else "tcp+tls" if state.tls else "tcp"
        self.handler.metrics.connections(mode, delta)

    def _start_tls(self, conn: socket.socket, deadline: float) -> ssl.SSLSocket:
        """The TLS side of a new TCP connection, its handshake done by ``deadline``.

        Raises:
            _Refuse: the client spoke plaintext (answered in plaintext: UNAVAILABLE).
            ConnectionError: the handshake failed (no or an untrusted client certificate, ...).
            TimeoutError: the handshake did not finish in time.
        """
        dp._until(conn, deadline)
        first = conn.recv(1, socket.MSG_PEEK)
        if not first:
            raise ConnectionError("closed before the TLS handshake")
        if first == dp.MAGIC[:1]:
            raise _Refuse(
                grpc.StatusCode.UNAVAILABLE,
                "this shard's data port serves TLS and the client spoke plaintext: give the worker --tls-ca "
                "(and --tls-cert/--tls-key where the shard requires client certificates)",
            )
        peer = _peer(conn)
        with self._lock:  # the serving thread is registered under the socket stop() shuts down
            thread = self._conns.pop(conn)
            tls = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            self._conns[tls] = thread
        try:
            dp._until(tls, deadline)
            tls.do_handshake()
        except BaseException as exc:
            if isinstance(exc, ssl.SSLError):
                log.info("data plane: TLS handshake with %s failed: %s", peer, exc.reason or exc)
                _drain(tls)  # so that the alert OpenSSL sent reaches the client
            with self._lock:
                self._conns.pop(tls, None)
            tls.close()
            if isinstance(exc, ssl.SSLError):
                raise ConnectionError(f"TLS handshake failed: {exc}") from exc
            raise
        return tls

    def _handshake(self, conn: socket.socket, state: _Connection, deadline: float) -> None:
        """Read the first frame, which must be a small HELLO, by the handshake deadline, and answer it."""
        (method, flags, _, meta_len, payload_len, _), fds = state.read_header(conn, deadline)
        try:
            self._check_hello(method, flags, meta_len, payload_len, first=True)
            meta = memoryview(bytearray(meta_len))
            dp.recv_into(conn, meta, deadline)
            answer = self._hello(bytes(meta), state, fds)
            fds = []
        finally:
            _close_all(fds)
        dp.send_frame(conn, dp.HELLO, msgpack.packb(answer))

    def _check_hello(self, method: int, flags: int, meta_len: int, payload_len: int, first: bool) -> None:
        if method != dp.HELLO:
            if first and self._token is not None:
                raise _Refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token: a connection must start with HELLO")
            if first:
                raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"a connection must start with HELLO, not method {method}")
        if flags or payload_len or meta_len > dp.HELLO_MAX:
            raise _Refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"HELLO must be at most {dp.HELLO_MAX} bytes with no payload, got {meta_len} + {payload_len} (flags {flags})",
            )

    def _wait_for_frame(self, conn: socket.socket, state: _Connection) -> bool:
        """Wait for the next frame: release the buffer after a short pause, give up at the idle timeout."""
        if not _readable(conn, min(RELEASE_IDLE_S, self.idle_timeout_s)):
            state.release()
            if not _readable(conn, max(self.idle_timeout_s - RELEASE_IDLE_S, 0.0)):
                log.debug("data connection idle for %.1fs: closed", self.idle_timeout_s)
                return False
        return True

    def _one_call(self, conn: socket.socket, state: _Connection) -> bool:
        if not self._wait_for_frame(conn, state):
            return False
        conn.settimeout(self.idle_timeout_s)  # a frame that stalls half-way counts as idle too
        (method, flags, _, meta_len, payload_len, aux), fds = state.read_header(conn, None)
        if method == dp.HELLO:
            try:
                self._check_hello(method, flags, meta_len, payload_len, first=False)
                meta = memoryview(bytearray(meta_len))
                dp.recv_into(conn, meta)
                answer = self._hello(bytes(meta), state, fds)
                fds = []
            finally:
                _close_all(fds)
            dp.send_frame(conn, dp.HELLO, msgpack.packb(answer))
            return True
        _close_all(fds)  # descriptors ride only with a HELLO
        if method not in dp.METHODS:
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"unknown data-plane method {method}")
        shared = bool(flags & dp.FLAG_SHM)
        too_big = meta_len + payload_len > self.max_message_bytes
        if too_big and not (shared and meta_len <= self.max_message_bytes):
            # Bytes we will not read are still on the socket: answer, then hang up.
            raise _Refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, _over_limit(meta_len + payload_len, self.max_message_bytes))
        meta, payload = state.receive(conn, meta_len, 0 if shared else payload_len)
        if too_big:  # a shared payload: refuse the call, keep the connection
            dp.send_frame(conn, method, _over_limit(meta_len + payload_len, self.max_message_bytes).encode(),
                          status=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
            return True
        with self._lock:
            if self._draining:
                raise _Refuse(grpc.StatusCode.UNAVAILABLE, "shard is draining")
            self._busy += 1
        try:
            if not state.authenticated:
                raise _Refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
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
            _Refuse: RESOURCE_EXHAUSTED, they do not fit.
        """
        with self._lock:
            if self._buffered + n > self.buffer_bytes:
                raise _Refuse(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{OVERLOADED}: a frame needs {n} more bytes of receive buffer, and the data plane's buffers "
                    f"already hold {self._buffered} of their limit of {self.buffer_bytes} bytes (--data-buffer-mb)",
                )
            self._buffered += n

    def _unreserve(self, n: int) -> None:
        with self._lock:
            self._buffered -= n

    def _hello(self, meta: bytes, state: _Connection, fds: list[int]) -> dict[str, object]:
        """Authenticate and take the offered region (``fds``: the descriptors that came with it, taken over)."""
        try:
            try:
                hello = msgpack.unpackb(meta)
            except (ValueError, msgpack.UnpackException) as exc:
                raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"HELLO is not msgpack: {exc}") from exc
            if not isinstance(hello, dict):
                raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, "HELLO must be a msgpack map")
            if self._token is not None:
                token = hello.get("token")
                if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token):
                    self.handler.metrics.refused("Hello", "UNAUTHENTICATED")
                    raise _Refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
                state.authenticated = True
            region, refused = None, None
            if hello.get("shm_size") is not None:
                if len(fds) != 1:
                    refused = f"a region comes as one descriptor over the unix socket, got {len(fds)}"
                else:
                    try:
                        region = dp.SharedRegion.adopt(fds.pop(), hello["shm_size"], self.max_region_bytes)
                    except ValueError as exc:
                        refused = str(exc)
                if refused is not None:
                    log.info("shared region refused: %s", refused)
        finally:
            _close_all(fds)
        # A new HELLO replaces the connection's region (or drops it, when it offers none).
        self._count(state, -1)
        if state.region is not None:
            state.region.close()
        state.region = region
        self._count(state, +1)
        answer: dict[str, object] = {"shard": self.handler.shard.shard_index, "shm": region is not None}
        if refused is not None:
            answer["shm_error"] = refused
        return answer

    def _answer(
        self, conn: socket.socket, method: int, meta: memoryview, payload: memoryview | None, state: _Connection, shm_end: int | None
    ) -> None:
        rpc = dp.METHODS[method]
        try:
            request = _REQUESTS[method].FromString(meta)
        except DecodeError as exc:
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {rpc}: {exc}") from exc
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
        if shm_end is not None and out.nbytes:
            start = dp.align(shm_end)
            if start + out.nbytes <= state.region.size:
                out.copy_into(state.region.view[start:])
                dp.send_frame(conn, method, body, flags=dp.FLAG_SHM, payload_len=out.nbytes, aux=start)
                return
        dp.send_frame(conn, method, body, out.buffers())


def _drain(conn: socket.socket) -> None:
    """End the connection after what was sent: shut down writing, then read and drop what the
    peer still sends (bounded in bytes and time) so that no reset destroys our last bytes.
    Below TLS on an SSL socket (its records are dropped undecrypted)."""
    try:
        socket.socket.shutdown(conn, socket.SHUT_WR)
        scratch = bytearray(16 * 1024)
        deadline = time.monotonic() + _DRAIN_S
        left = _DRAIN_BYTES
        while left > 0:
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            socket.socket.settimeout(conn, wait)
            n = socket.socket.recv_into(conn, scratch)
            if n == 0:
                break
            left -= n
    except OSError:
        pass


def _peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


def _readable(conn: socket.socket, timeout_s: float) -> bool:
    """Whether ``conn`` has bytes (or EOF) to read within ``timeout_s``."""
    if isinstance(conn, ssl.SSLSocket) and conn.pending():
        return True  # decrypted already, in TLS's buffer: the socket itself may have nothing
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(timeout_s * 1000))


def _anonymous(n: int) -> tuple[mmap.mmap, int]:
    """``n`` bytes of anonymous memory, in transparent huge pages where the system allows them:
    the mapping and the offset in it where the ``n`` bytes start.

    A buffer of megabytes is then faulted in a few 2 MiB pages instead of 4 KiB at a time (a
    4 MiB frame after an idle release: 1,025 page faults before, 3 with THP on ``madvise``)
    and costs fewer TLB misses while the frame is received and applied.
    """
    if n < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return mmap.mmap(-1, n), 0
    # Private (shared anonymous memory is shmem: no huge pages unless shmem THP is on), one huge
    # page longer so that the bytes used can start on a huge-page boundary (only touched pages
    # cost memory).
    buf = mmap.mmap(-1, n + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return buf, 0  # no THP here: 4 KiB pages, as before
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return buf, -address % _HUGE


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class _Connection:
    """Per-connection state: authentication, the shared region, the reusable receive buffer."""

    def __init__(self, server: DataPlaneServer, unix: bool, authenticated: bool, tls: bool = False) -> None:
        self.server = server
        self.unix = unix
        self.tls = tls
        self.authenticated = authenticated
        self.region: dp.SharedRegion | None = None
        self.header = bytearray(dp.HEADER.size)
        # Anonymous memory (returned to the system on release, whatever malloc's thresholds).
        self._buffer: mmap.mmap | None = None
        self._base = 0  # where the buffer starts in its mapping (a huge-page boundary)
        self._reserved = 0

    def read_header(self, conn: socket.socket, deadline: float | None) -> tuple[tuple[int, int, int, int, int, int], list[int]]:
        """The next header, and the descriptors that came with it (unix connections only)."""
        if self.unix:
            return dp.recv_header_fds(conn, self.header, deadline)
        dp.recv_into(conn, memoryview(self.header), deadline)
        return dp.unpack_header(self.header), []

    def receive(self, conn: socket.socket, meta_len: int, payload_len: int) -> tuple[memoryview, memoryview | None]:
        """Read a frame's message and ``payload_len`` payload bytes into the reusable buffer.

        Raises:
            _Refuse: RESOURCE_EXHAUSTED, the buffer would go over the shard's budget.
        """
        start = dp.align(meta_len)
        need = start + payload_len
        if need > self._reserved:
            self.release()
            self.server._reserve(need)
            self._reserved = need
            try:
                self._buffer, self._base = _anonymous(max(need, 1))
            except BaseException:
                self.release()
                raise
        view = memoryview(self._buffer)[self._base :]
        dp.recv_into(conn, view[:meta_len])
        if payload_len == 0:
            return view[:meta_len], None
        dp.recv_into(conn, view[start:need])
        return view[:meta_len], view[start:need]

    def release(self) -> None:
        """Give the receive buffer back (to the system and to the budget)."""
        if self._buffer is not None:
            try:
                self._buffer.close()
            except BufferError:
                pass  # a view still lives: the mapping goes with it
            self._buffer = None
        if self._reserved:
            self.server._unreserve(self._reserved)
            self._reserved = 0

    def shared_payload(self, offset: int, n: int) -> memoryview:
        """The request's payload in the shared region."""
        if self.region is None:
            raise _Refuse(grpc.StatusCode.INVALID_ARGUMENT, "payload flagged as shared but no region was announced")
        if offset % dp.ALIGN or offset < 0 or offset + n > self.region.size:
            raise _Refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"shared payload [{offset}, {offset + n}) is not an aligned range of the {self.region.size}-byte region",
            )
        return self.region.view[offset : offset + n]
