"""Client side of the data plane (``tether.protos.dataplane``): connections to one shard's data port.

``DataPlane`` keeps a small pool of connections per shard (one call at a time on each, so
concurrent pushes and prefetched pulls get their own) and knows when the shard offers no data
plane, or when the data plane just failed and calls should go over gRPC for a while. Each
connection offers the shard a shared-memory region; if the shard can map it (same machine,
same ``/dev/shm``) tensors never cross the socket.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable

import grpc
import msgpack

from tether.protos import dataplane as dp

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


class DataConnection:
    """One TCP connection to a shard's data port, with its shared region when the shard maps it."""

    def __init__(self, host: str, port: int, token: str | None, timeout_s: float, shm: bool) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._token = token
        self._header = bytearray(dp.HEADER.size)
        self._buffer = bytearray(0)
        self.region: dp.SharedRegion | None = None
        self._use_region = False
        self.shm = shm and os.path.isdir(dp.SHM_DIR)
        try:
            self._hello(_MIN_REGION if self.shm else 0, timeout_s)
        except BaseException:
            self.close()
            raise

    def _hello(self, region_size: int, timeout_s: float) -> None:
        """Authenticate and offer a region of ``region_size`` bytes (0: none)."""
        region = None
        meta: dict[str, object] = {"token": self._token}
        if region_size:
            name = f"tether-{os.getpid()}-{uuid.uuid4().hex}"
            region = dp.SharedRegion(os.path.join(dp.SHM_DIR, name), region_size, create=True)
            meta.update(shm=name, shm_size=region_size, nonce=region.nonce)
        try:
            self._sock.settimeout(timeout_s)
            dp.send_frame(self._sock, dp.HELLO, msgpack.packb(meta))
            answer, _ = self._read(None)
            accepted = bool(msgpack.unpackb(answer).get("shm")) and region is not None
        finally:
            if region is not None:
                region.unlink()  # the shard has it mapped (or never will): no file to leak
        if self.region is not None:
            self.region.close()
            self.region = None
        if accepted:
            self.region = region
        else:
            if region is not None:
                region.close()
            self.shm = False

    def _read(self, region: dp.SharedRegion | None) -> tuple[bytes, memoryview | None]:
        method, flags, status, meta_len, payload_len, aux = dp.read_header(self._sock, self._header)
        meta = bytearray(meta_len)
        dp.recv_into(self._sock, memoryview(meta))
        payload = None
        if flags & dp.FLAG_SHM:
            if region is None or aux + payload_len > region.size:
                raise dp.FrameError(f"shard named shared bytes [{aux}, {aux + payload_len}) outside the region")
            payload = region.view[aux : aux + payload_len]
        elif payload_len:
            if len(self._buffer) < payload_len:
                self._buffer = bytearray(payload_len)
            payload = memoryview(self._buffer)[:payload_len]
            dp.recv_into(self._sock, payload)
        if status:
            code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
            raise DataPlaneStatus(code, bytes(meta).decode(errors="replace"), closed=method == 0)
        return bytes(meta), payload

    def send(self, method: int, request: object, out: dp.PayloadWriter, response_bytes: int, timeout_s: float) -> None:
        """Send ``request`` with its payload (through the region when both are large enough to
        be worth it and the shard maps it); ``receive`` gets the answer.

        Raises:
            OSError: the connection failed (the caller drops it).
        """
        meta = request.SerializeToString()
        self._sock.settimeout(timeout_s)
        self._use_region = self.shm and out.nbytes + response_bytes >= SHM_MIN_BYTES
        if self._use_region:
            need = dp.REGION_START + dp.align(out.nbytes) + response_bytes + dp.ALIGN
            if self.region is None or need > self.region.size:
                self._hello(max(need * 2, _MIN_REGION), timeout_s)
            self._use_region = self.region is not None
        if self._use_region:
            out.copy_into(self.region.view[dp.REGION_START :])
            dp.send_frame(self._sock, method, meta, flags=dp.FLAG_SHM, payload_len=out.nbytes, aux=dp.REGION_START)
        else:
            dp.send_frame(self._sock, method, meta, out.buffers())

    def receive(self, timeout_s: float) -> tuple[bytes, memoryview | None]:
        """The answer to the last ``send``: its message and payload (valid until the next call).

        Raises:
            DataPlaneStatus: the shard answered with an error.
            OSError: the connection failed or timed out (the caller drops it).
        """
        self._sock.settimeout(timeout_s)
        return self._read(self.region if self._use_region else None)

    def readable(self) -> bool:
        """Whether an answer has started to arrive."""
        return bool(select.select([self._sock], [], [], 0)[0])

    def close(self) -> None:
        """Close the socket and unmap the region."""
        try:
            self._sock.close()
        finally:
            if self.region is not None:
                self.region.close()
                self.region = None


class DataPlane:
    """Data-plane connections to one shard, or the knowledge that there are none to use now."""

    def __init__(self, host: str, token: str | None, timeout_s: float, shm: bool, rediscover_s: float) -> None:
        self.host = host
        self._token = token
        self._timeout_s = timeout_s
        self._shm = shm
        self._rediscover_s = rediscover_s
        self._lock = threading.Lock()
        self._idle: list[DataConnection] = []
        self.port: int | None = None  # None: not known yet; 0: the shard has no data plane
        self._retry_at = 0.0

    def set_port(self, port: int) -> None:
        """What the shard said its data port is (0: none)."""
        with self._lock:
            if port != self.port:
                self._drop_idle()
            self.port = port

    def acquire(self, discover: Callable[[], int]) -> DataConnection | None:
        """An idle or new connection, or None when calls should go over gRPC for now.

        Args:
            discover: asks the shard for its data port (over gRPC) when it is not known.
        """
        with self._lock:
            if self._idle:
                return self._idle.pop()
            port, retry_at = self.port, self._retry_at
        if port == 0 or time.monotonic() < retry_at:
            return None
        try:
            if port is None:
                port = discover()
                self.set_port(port)
                if port == 0:
                    return None
            return DataConnection(self.host, port, self._token, self._timeout_s, self._shm)
        except (OSError, DataPlaneStatus, grpc.RpcError) as exc:
            log.info("data plane of %s unreachable (%s); using gRPC for %.1fs", self.host, exc, self._rediscover_s)
            self.failed()
            return None

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
