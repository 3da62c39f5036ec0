"""Client side of the data plane (``tether.protos.framing``): connections to one shard's data port.

``DataPlane`` keeps a small pool of connections per shard (one call at a time on each, so
prefetched pulls and a push in flight get their own; the shard serves connections in parallel,
so ``ShardChannel.push_in_order`` sends a client's next push only once its last is answered) and knows when the shard offers no data
plane, or when the data plane just failed and calls should go over gRPC for a while. With
shared memory allowed, a connection first tries the shard's abstract unix socket (which only a
process on the same machine and network namespace reaches) and sends it a sealed memfd region
with its HELLO; then tensors never cross the socket. When that fails (another machine, no
memory for the region, a shard that refuses it) the connection is TCP, said once in the log.
With TLS (``ClientSecurity.ssl_context``) a TCP connection is wrapped in TLS, checking the
shard's certificate and host name as the gRPC channel does; the unix socket never is.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import msgpack

from tether.protos import framing as dp
from tether.worker.client import region_pins

__all__ = ["SHM_MIN_BYTES", "DataConnection", "DataPlane", "DataPlaneStatus"]

log = logging.getLogger(__name__)

_MIN_REGION = 1 << 20
# Below this many bytes (request plus answer) a payload goes through the socket: copying it
# there costs less than the region's bookkeeping.
SHM_MIN_BYTES = 64 * 1024


class DataPlaneStatus(Exception):
    """A shard answered a data-plane call with an error status."""

    def __init__(self, code: grpc.StatusCode, details: str, closed: bool) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        # The shard refused the connection itself (auth, load, draining) and closed it.
        self.closed = closed


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _tls_reason(exc: OSError) -> str:
    """OpenSSL's reason in words ("tlsv13 alert certificate required", "Hostname mismatch, ...")."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    if not isinstance(exc, ssl.SSLError) or isinstance(exc, ssl.SSLEOFError):
        return "the shard closed the connection during the TLS handshake"
    return (exc.reason or str(exc)).replace("_", " ").lower()


class DataConnection:
    """One connection to a shard's data plane, with its shared region when the shard maps it.

    Args:
        socket_name: the shard's abstract unix socket ("" or None: none); tried first when ``shm``.
        shm: whether to offer a shared region (over the unix socket only).
        on_fallback: told why, when a region this connection had or wanted cannot be had later.
        ssl_context: wrap the TCP connection in TLS with this context (verifying ``host``).

    Raises:
        OSError, DataPlaneStatus: neither the unix socket with a region nor TCP works.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        timeout_s: float,
        shm: bool,
        socket_name: str | None = None,
        on_fallback: Callable[[str], None] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._token = token
        self._on_fallback = on_fallback
        self._header = bytearray(dp.HEADER.size)
        self._buffer = bytearray(0)
        self.region: dp.SharedRegion | None = None
        self._use_region = False
        # Why shared memory is not used on this connection (None: it is, or it was not asked for).
        self.fallback: str | None = None
        self.shm = False
        # Whether this connection runs inside TLS (TCP only).
        self.tls = False
        self._sock: socket.socket | None = None
        if shm:
            self._try_unix(socket_name, timeout_s)
        if self._sock is None:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                if ssl_context is not None:
                    self._start_tls(ssl_context, host, port)
                self._hello(0, timeout_s)
            except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as exc:
                if not isinstance(exc, ssl.SSLError) and not self.tls:
                    self.close()
                    raise
                self.close()
                # Under TLS 1.3 a shard refuses a client certificate after the client's side of
                # the handshake is done: that alert comes with the first answer, here.
                raise DataPlaneStatus(
                    grpc.StatusCode.UNAVAILABLE,
                    f"TLS with the data plane of {host}:{port} failed: {_tls_reason(exc)} (check the TLS CA, "
                    f"and the client certificate where the shard requires one)",
                    closed=True,
                ) from exc
            except BaseException:
                self.close()
                raise

    @property
    def _live(self) -> socket.socket:
        """The socket of this open connection.

        Raises:
            ConnectionError: the connection was closed.
        """
        if self._sock is None:
            raise ConnectionError("the data connection is closed")
        return self._sock

    def _start_tls(self, ctx: ssl.SSLContext, host: str, port: int) -> None:
        """Wrap the TCP socket in TLS, checking the shard's certificate for ``host``."""
        self._sock = ctx.wrap_socket(self._live, server_hostname=host)
        self.tls = True

    def _try_unix(self, name: str | None, timeout_s: float) -> None:
        """Connect to the shard's unix socket with a region; on any failure, note why and leave no socket."""
        if not name or not name.startswith("\0"):
            self.fallback = f"the shard offers no abstract unix socket ({name!r})"
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(name)
        except OSError as exc:
            sock.close()
            self.fallback = f"cannot reach the shard's unix socket ({exc.strerror or exc}): another machine or network namespace"
            return
        self._sock = sock
        self.shm = True
        try:
            self._hello(_MIN_REGION, timeout_s)
        except BaseException:
            self.close()
            self._sock = None
            raise
        if self.region is None:
            self.close()
            self._sock = None

    def _hello(self, region_size: int, timeout_s: float) -> None:
        """Authenticate and offer a new region of ``region_size`` bytes (0: none, and drop the old one)."""
        region = None
        fds: list[int] = []
        meta: dict[str, object] = {"token": self._token}
        if region_size and self.shm:
            try:
                region, fd = dp.SharedRegion.create(region_size)
            except OSError as exc:
                self.fallback = f"no shared region of {region_size} bytes ({exc.strerror or exc})"
                self.shm = False
            else:
                fds.append(fd)
                meta["shm_size"] = region_size
        try:
            self._live.settimeout(timeout_s)
            dp.send_frame(self._live, dp.HELLO, msgpack.packb(meta), fds=fds)
        except BaseException:
            if region is not None:
                region.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)  # the shard has its own descriptor now (or never will)
        try:
            answer, _ = self._read(None)
            hello = msgpack.unpackb(answer)
        except BaseException:
            if region is not None:
                region.close()
            raise
        self._drop_region()
        if region is not None and isinstance(hello, dict) and hello.get("shm"):
            self.region = region
        elif region is not None:
            region.close()
            self.shm = False
            self.fallback = f"the shard refused the shared region: {hello.get('shm_error', '?') if isinstance(hello, dict) else '?'}"

    def _read(
        self, region: dp.SharedRegion | None, place: Callable[[bytes, int], list[tuple[int, memoryview]]] | None = None
    ) -> tuple[bytes, memoryview | None]:
        method, flags, status, meta_len, payload_len, aux = dp.read_header(self._live, self._header)
        meta = bytearray(meta_len)
        dp.recv_into(self._live, memoryview(meta))
        payload = None
        if flags & dp.FLAG_SHM:
            if region is None or aux + payload_len > region.size:
                raise dp.FrameError(f"shard named shared bytes [{aux}, {aux + payload_len}) outside the region")
            payload = region.view[aux : aux + payload_len]
        elif payload_len:
            if len(self._buffer) < payload_len:
                self._buffer = bytearray(payload_len)
            payload = memoryview(self._buffer)[:payload_len]
            pos = 0
            # Blocks the caller names go straight from the socket to where they belong (no
            # staging copy); the rest to the buffer.
            for offset, dest in (place(bytes(meta), payload_len) if place is not None and not status else ()):
                if offset < pos or offset + dest.nbytes > payload_len:
                    raise dp.FrameError(f"bytes [{offset}, {offset + dest.nbytes}) to place are not in order inside the payload")
                if offset > pos:
                    dp.recv_into(self._live, payload[pos:offset])
                dp.recv_into(self._live, dest)
                pos = offset + dest.nbytes
            dp.recv_into(self._live, payload[pos:])
        if status:
            code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
            raise DataPlaneStatus(code, bytes(meta).decode(errors="replace"), closed=method == 0)
        return bytes(meta), payload

    def send(self, method: int, request: Any, out: dp.PayloadWriter, response_bytes: int, timeout_s: float) -> None:
        """Send ``request`` with its payload (through the region when both are large enough to
        be worth it and the shard maps it); ``receive`` gets the answer.

        Raises:
            DataPlaneStatus: the shard refused the frame and hung up before taking all of it.
            OSError: the connection failed (the caller drops it).
        """
        try:
            self._send(method, request, out, response_bytes, timeout_s)
        except (BrokenPipeError, ConnectionResetError) as exc:
            # A shard that refuses a frame (too large, over its buffers) answers and closes
            # before reading the rest: its answer says why, and is waiting to be read.
            try:
                self._live.settimeout(1.0)
                self._read(None)
            except DataPlaneStatus as status:
                raise status from exc
            except (OSError, dp.FrameError):
                pass
            raise

    def _send(self, method: int, request: Any, out: dp.PayloadWriter, response_bytes: int, timeout_s: float) -> None:
        meta = request.SerializeToString()
        self._live.settimeout(timeout_s)
        self._use_region = self.shm and out.nbytes + response_bytes >= SHM_MIN_BYTES
        if self._use_region:
            if self.region is not None:
                # A GPU copy may still be reading the last answer from it (tether.worker.client.region_pins).
                region_pins.settle(self.region.view)
            need = dp.align(out.nbytes) + response_bytes + dp.ALIGN
            if self.region is None or need > self.region.size:
                self._hello(max(need * 2, _MIN_REGION), timeout_s)
                if self.region is None and self._on_fallback is not None:
                    self._on_fallback(f"{self.fallback}; this connection sends through its socket from now on")
            self._use_region = self.region is not None
        if self._use_region and self.region is not None:
            out.copy_into(self.region.view)
            dp.send_frame(self._live, method, meta, flags=dp.FLAG_SHM, payload_len=out.nbytes, aux=0)
        else:
            dp.send_frame(self._live, method, meta, out.buffers())

    def receive(
        self, timeout_s: float, place: Callable[[bytes, int], list[tuple[int, memoryview]]] | None = None
    ) -> tuple[bytes, memoryview | None]:
        """The answer to the last ``send``: its message and payload (valid until the next call).

        ``place``, given the answer's message and payload size, may name (payload offset,
        destination) pairs, ascending, disjoint and inside the payload: over the socket those bytes
        are received there directly (the returned payload holds stale bytes in their place);
        through a region it is not called.

        Raises:
            DataPlaneStatus: the shard answered with an error.
            OSError: the connection failed or timed out (the caller drops it).
        """
        self._live.settimeout(timeout_s)
        return self._read(self.region if self._use_region else None, place)

    def readable(self) -> bool:
        """Whether an answer has started to arrive (on an idle connection: the shard closed it)."""
        poller = select.poll()
        poller.register(self._live, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))

    def _drop_region(self) -> None:
        """Unmap the region, once no GPU copy reads it any more (unregistering its pinned pages first)."""
        if self.region is not None:
            try:
                region_pins.release(self.region.view)
            finally:
                self.region.close()
                self.region = None

    def close(self) -> None:
        """Close the socket and unmap the region."""
        try:
            if self._sock is not None:
                self._sock.close()
        finally:
            self._drop_region()


class DataPlane:
    """Data-plane connections to one shard, or the knowledge that there are none to use now."""

    def __init__(
        self, host: str, token: str | None, timeout_s: float, shm: bool, rediscover_s: float, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.host = host
        self._ssl = ssl_context
        self._token = token
        self._timeout_s = timeout_s
        self._shm = shm
        self._rediscover_s = rediscover_s
        self._lock = threading.Lock()
        self._idle: list[DataConnection] = []
        self.port: int | None = None  # None: not known yet; 0: the shard has no data plane
        self.socket_name = ""  # the shard's abstract unix socket ("": none)
        self._retry_at = 0.0
        self._told_fallback = False

    def set_port(self, port: int, socket_name: str = "") -> None:
        """What the shard said its data port (0: none) and unix socket ("": none) are."""
        with self._lock:
            if port != self.port or socket_name != self.socket_name:
                self._drop_idle()
            self.port = port
            self.socket_name = socket_name

    def acquire(self, discover: Callable[[], tuple[int, str]], timeout_s: float | None = None) -> DataConnection | None:
        """An idle or new connection, or None when calls should go over gRPC for now.

        An idle connection the shard has closed meanwhile (idle timeout, restart) is dropped.

        Args:
            discover: asks the shard for its data port and unix socket (over gRPC) when not known.
            timeout_s: limit of discovery and a new connection's handshake together, when less
                than the plane's own.
        """
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
                port, socket_name, retry_at = self.port, self.socket_name, self._retry_at
            if conn is None:
                break
            if not conn.readable():
                return conn
            conn.close()  # readable while idle: the shard hung up
        if port == 0 or time.monotonic() < retry_at:
            return None
        try:
            if port is None:
                port, socket_name = discover()
                self.set_port(port, socket_name)
                if port == 0:
                    return None
            limit = self._timeout_s if end is None else min(self._timeout_s, max(end - time.monotonic(), 0.001))
            conn = DataConnection(self.host, port, self._token, limit, self._shm, socket_name, self._fallback, self._ssl)
        except (OSError, DataPlaneStatus, grpc.RpcError) as exc:
            log.info("data plane of %s unreachable (%s); using gRPC for %.1fs", self.host, exc, self._rediscover_s)
            self.failed()
            return None
        if conn.fallback is not None:
            self._fallback(f"{conn.fallback}; using TCP")
        return conn

    def _fallback(self, why: str) -> None:
        """Say once (per shard) that shared memory is not used, and why."""
        with self._lock:
            told, self._told_fallback = self._told_fallback, True
        if not told:
            log.info("data plane of %s: %s", self.host, why)

    def release(self, conn: DataConnection) -> None:
        """Return a healthy connection to the pool."""
        with self._lock:
            self._idle.append(conn)

    def failed(self, conn: DataConnection | None = None) -> None:
        """Drop ``conn`` and every idle connection; ask for the port again after a pause."""
        if conn is not None:
            conn.close()
        with self._lock:
            self._drop_idle()
            self.port = None
            self._retry_at = time.monotonic() + self._rediscover_s

    def _drop_idle(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            self._drop_idle()
