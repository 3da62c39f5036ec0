"""One data-plane connection as the shard holds it: authentication, the shared region, the
reusable receive buffer (counted against the shard's budget), and the socket helpers the
data-plane server uses."""

from __future__ import annotations

import mmap
import os
import select
import socket
import ssl
import time
from collections.abc import Callable

import grpc

from tether.common.pages import anonymous
from tether.protos import framing as dp

__all__ = ["Connection", "Refuse", "close_all", "drain", "peer", "readable"]

# Bytes read and thrown away after a refusal, so the answer is not lost to a reset.
_DRAIN_BYTES = 256 * 1024
_DRAIN_S = 0.5
# Buffers from this size on ask for transparent huge pages.


class Refuse(Exception):
    """Answer with this status and close the connection."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def drain(conn: socket.socket) -> None:
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


def peer(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


def readable(conn: socket.socket, timeout_s: float) -> bool:
    """Whether ``conn`` has bytes (or EOF) to read within ``timeout_s``."""
    if isinstance(conn, ssl.SSLSocket) and conn.pending():
        return True  # decrypted already, in TLS's buffer: the socket itself may have nothing
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(timeout_s * 1000))


def close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class Connection:
    """Per-connection state: authentication, the shared region, the reusable receive buffer."""

    def __init__(
        self, reserve: Callable[[int], None], unreserve: Callable[[int], None], unix: bool, authenticated: bool, tls: bool = False
    ) -> None:
        # Count bytes of receive buffer against the shard's budget (``reserve`` raises
        # ``Refuse`` when they do not fit) and give them back.
        self._reserve_bytes = reserve
        self._unreserve_bytes = unreserve
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
            Refuse: RESOURCE_EXHAUSTED, the buffer would go over the shard's budget.
        """
        start = dp.align(meta_len)
        need = start + payload_len
        if need > self._reserved:
            self.release()
            self._reserve_bytes(need)
            self._reserved = need
            try:
                self._buffer, self._base = anonymous(max(need, 1))
            except BaseException:
                self.release()
                raise
        # No buffer only for a frame of no bytes at all (nothing was reserved for it).
        view = memoryview(self._buffer if self._buffer is not None else b"")[self._base :]
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
            self._unreserve_bytes(self._reserved)
            self._reserved = 0

    def shared_payload(self, offset: int, n: int) -> memoryview:
        """The request's payload in the shared region."""
        if self.region is None:
            raise Refuse(grpc.StatusCode.INVALID_ARGUMENT, "payload flagged as shared but no region was announced")
        if offset % dp.ALIGN or offset < 0 or offset + n > self.region.size:
            raise Refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"shared payload [{offset}, {offset + n}) is not an aligned range of the {self.region.size}-byte region",
            )
        return self.region.view[offset : offset + n]
