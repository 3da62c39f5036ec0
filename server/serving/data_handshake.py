"""How a data-plane connection starts (``DataPlaneServer`` has a ``Handshakes``): TLS on a TCP
connection when the shard serves it, then the HELLO, which authenticates the connection and may
hand over a shared-memory region; and the count of open connections by how their payloads travel."""

from __future__ import annotations

import hmac
import logging
import socket
import ssl
import threading
from typing import TYPE_CHECKING

import grpc
import msgpack

from tether.protos import framing as dp
from tether.server.serving.connection import Connection, Refuse, close_all, drain, peer

if TYPE_CHECKING:
    from tether.server.serving.handler import RequestHandler

__all__ = ["Handshakes"]

log = logging.getLogger("tether.server.serving.data_port")


class Handshakes:
    """The start of every data-plane connection of one ``DataPlaneServer``.

    Args:
        handler: the shard's request handler (its metrics, its shard index).
        token: the bearer token a HELLO must carry (None: none needed).
        tls: the TLS context of the TCP port (None: plaintext).
        max_region_bytes: the largest shared-memory region a client may hand over.
        lock, conns: the server's lock and its serving thread per socket (a TLS connection
            replaces its plain socket there, so that ``stop`` shuts down the one in use).
    """

    def __init__(
        self,
        handler: RequestHandler,
        token: bytes | None,
        tls: ssl.SSLContext | None,
        max_region_bytes: int,
        lock: threading.Condition,
        conns: dict[socket.socket, threading.Thread],
    ) -> None:
        self.handler = handler
        self._token = token
        self._tls = tls
        self.max_region_bytes = max_region_bytes
        self._lock = lock
        self._conns = conns

    def count(self, state: Connection, delta: int) -> None:
        """Count ``state``'s connection in (+1) or out (-1) of the open connections by transport."""
        mode = "shm" if state.region is not None else "tcp+tls" if state.tls else "tcp"
        self.handler.metrics.connections(mode, delta)

    def start_tls(self, conn: socket.socket, deadline: float) -> ssl.SSLSocket:
        """The TLS side of a new TCP connection, its handshake done by ``deadline``.

        Raises:
            Refuse: the client spoke plaintext (answered in plaintext: UNAVAILABLE).
            ConnectionError: the handshake failed (no or an untrusted client certificate, ...).
            TimeoutError: the handshake did not finish in time.
        """
        dp.settimeout_by(conn, deadline)
        first = conn.recv(1, socket.MSG_PEEK)
        if not first:
            raise ConnectionError("closed before the TLS handshake")
        if first == dp.MAGIC[:1]:
            raise Refuse(
                grpc.StatusCode.UNAVAILABLE,
                "this shard's data port serves TLS and the client spoke plaintext: give the worker --tls-ca "
                "(and --tls-cert/--tls-key where the shard requires client certificates)",
            )
        who = peer(conn)
        ctx = self._tls
        if ctx is None:
            raise ConnectionError("this data port serves no TLS")
        with self._lock:  # the serving thread is registered under the socket stop() shuts down
            thread = self._conns.pop(conn)
            tls = ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            self._conns[tls] = thread
        try:
            dp.settimeout_by(tls, deadline)
            tls.do_handshake()
        except BaseException as exc:
            if isinstance(exc, ssl.SSLError):
                log.info("data plane: TLS handshake with %s failed: %s", who, exc.reason or exc)
                drain(tls)  # so that the alert OpenSSL sent reaches the client
            with self._lock:
                self._conns.pop(tls, None)
            tls.close()
            if isinstance(exc, ssl.SSLError):
                raise ConnectionError(f"TLS handshake failed: {exc}") from exc
            raise
        return tls

    def handshake(self, conn: socket.socket, state: Connection, deadline: float) -> None:
        """Read the first frame, which must be a small HELLO, by the handshake deadline, and answer it."""
        (method, flags, _, meta_len, payload_len, _), fds = state.read_header(conn, deadline)
        self.answer(conn, state, (method, flags, meta_len, payload_len), fds, deadline, first=True)

    def answer(
        self,
        conn: socket.socket,
        state: Connection,
        header: tuple[int, int, int, int],
        fds: list[int],
        deadline: float | None,
        first: bool,
    ) -> None:
        """Check a HELLO frame's header (``method, flags, meta_len, payload_len``; ``first``: the
        connection's first frame), read its message by ``deadline`` and answer it (``fds``: the
        descriptors that came with it, taken over)."""
        try:
            self._check_hello(*header, first=first)
            meta = memoryview(bytearray(header[2]))
            dp.recv_into(conn, meta, deadline)
            answer = self._hello(bytes(meta), state, fds)
            fds = []
        finally:
            close_all(fds)
        dp.send_frame(conn, dp.HELLO, msgpack.packb(answer))

    def _check_hello(self, method: int, flags: int, meta_len: int, payload_len: int, first: bool) -> None:
        if method != dp.HELLO:
            if first and self._token is not None:
                raise Refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token: a connection must start with HELLO")
            if first:
                raise Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"a connection must start with HELLO, not method {method}")
        if flags or payload_len or meta_len > dp.HELLO_MAX:
            raise Refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"HELLO must be at most {dp.HELLO_MAX} bytes with no payload, got {meta_len} + {payload_len} (flags {flags})",
            )

    def _hello(self, meta: bytes, state: Connection, fds: list[int]) -> dict[str, object]:
        """Authenticate and take the offered region (``fds``: the descriptors that came with it, taken over)."""
        try:
            try:
                hello = msgpack.unpackb(meta)
            except (ValueError, msgpack.UnpackException) as exc:
                raise Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"HELLO is not msgpack: {exc}") from exc
            if not isinstance(hello, dict):
                raise Refuse(grpc.StatusCode.INVALID_ARGUMENT, "HELLO must be a msgpack map")
            if self._token is not None:
                token = hello.get("token")
                if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token):
                    self.handler.metrics.refused("Hello", "UNAUTHENTICATED")
                    raise Refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
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
            close_all(fds)
        # A new HELLO replaces the connection's region (or drops it, when it offers none).
        self.count(state, -1)
        if state.region is not None:
            state.region.close()
        state.region = region
        self.count(state, +1)
        answer: dict[str, object] = {"shard": self.handler.shard.shard_index, "shm": region is not None}
        if refused is not None:
            answer["shm_error"] = refused
        return answer
