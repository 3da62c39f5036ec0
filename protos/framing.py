"""The data plane: Push, Pull and PushPull over a plain TCP connection, tensors out of band.

gRPC's unary path copies a message several times and hops threads on both sides; for the
megabytes a parameter server moves per step that is most of the step. So a shard also listens
on a data port (``DeclareResponse.data_port``) where a client sends the *same* protobuf
requests, framed, with every tensor's bytes outside the message (``Tensor.payload_offset`` /
``payload_bytes``):

- over the socket, right after the message, sent with scatter-gather I/O straight from the
  tensors' memory and received into one reusable buffer that the shard decodes without a copy;
- or, when the client and the shard share a machine (the client reached the shard's abstract
  unix socket, ``DeclareResponse.data_socket``), in a shared-memory region of the connection:
  an anonymous ``memfd`` the client made, reserved and sealed against shrinking and growing,
  whose descriptor travels with the HELLO (``SCM_RIGHTS``). The client writes its gradients
  there, the shard applies them from there and writes pulled values back there, and only the
  small message crosses the socket. Nobody opens a path, nothing can be truncated under a
  mapping, and the memory goes with the last process that holds it.

A frame is a 28-byte header (``HEADER``), the message (``meta_len`` bytes) and, unless
``FLAG_SHM`` says it is in the region at ``aux``, the payload (``payload_len`` bytes). A
response carries ``status`` (a ``grpc.StatusCode`` value; 0 is OK) and, on error, the message
text as its meta. A connection starts with ``HELLO`` (msgpack, at most ``HELLO_MAX`` bytes, no
payload: the bearer token if the shard wants one and ``shm_size`` when the region's descriptor
rides with it) and then carries one call at a time.

A shard that serves TLS serves it on the data port too (the same certificates and client CA as
its gRPC port; ``tether.common.security``): frames then travel inside TLS, sent with one
``sendall`` per large buffer (small ones joined) since an SSL socket has no scatter-gather
``sendmsg``, and received with ``recv_into`` as before. The abstract unix socket never carries
TLS: its bytes never leave the machine (see ``tether.server.serving.data_port`` for when it is offered).
"""

from __future__ import annotations

import array
import fcntl
import math
import mmap
import os
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tether.protos import tether_pb2 as pb
from tether.protos.codec import wire_dtype

__all__ = [
    "ALIGN",
    "FLAG_SHM",
    "HEADER",
    "HELLO_MAX",
    "MAGIC",
    "METHODS",
    "SEALS",
    "FrameError",
    "PayloadWriter",
    "SharedRegion",
    "align",
    "read_header",
    "recv_header_fds",
    "recv_into",
    "send_frame",
    "settimeout_by",
    "unpack_header",
]

MAGIC = b"TDP1"
# magic, method, flags, status, meta_len, payload_len, aux (payload's offset in the region).
HEADER = struct.Struct("<4sBBHIQQ")
HELLO, PUSH, PULL, PUSH_PULL = 1, 2, 3, 4
METHODS = {HELLO: "Hello", PUSH: "Push", PULL: "Pull", PUSH_PULL: "PushPull"}
# How a client's Push/Pull/PushPull may travel (TRANSPORTS, declared in tether.protos.names):
# "auto" (the data plane, in shared memory when the shard is on the same machine), "tcp" (the
# data plane, never shared memory), "grpc".
FLAG_SHM = 1
# Tensors start on cache-line boundaries, so every view of them is aligned for any dtype.
ALIGN = 64
# Largest HELLO message: the only bytes a shard reads before it has checked the token.
HELLO_MAX = 4096
# Seals on every region: it can neither shrink (no SIGBUS under a mapping) nor grow, and they stay.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Descriptors a header read accepts at once (more are closed by the kernel: MSG_CTRUNC).
_MAX_FDS = 4


class FrameError(ConnectionError):
    """The peer sent something that is not a data-plane frame (the connection is dropped)."""


def align(n: int) -> int:
    """``n`` rounded up to ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class PayloadWriter:
    """Lays tensors out in a payload and points ``Tensor`` messages at them (no copy yet).

    Offsets count from the payload's first byte, wherever it ends up (socket or region). A part
    added with ``rows`` is gathered from its source only when the payload is written, straight
    into the shared region where it goes there (no temporary tensor).
    """

    def __init__(self) -> None:
        self.nbytes = 0
        self._parts: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []

    def add(self, t: torch.Tensor, msg: pb.Tensor, dtype: torch.dtype | None = None, rows: torch.Tensor | None = None) -> None:
        """Describe ``t`` (or its ``rows``, an int64 index, if given; cast to ``dtype``) in ``msg``
        and place its bytes after the last tensor."""
        t = t.detach()
        if rows is not None and ((dtype is not None and t.dtype != dtype) or t.device.type != "cpu" or not t.is_contiguous()):
            t, rows = t.index_select(0, rows.to(t.device)), None
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        shape = t.shape if rows is None else (len(rows), *t.shape[1:])
        msg.dtype = wire_dtype(t.dtype)
        msg.shape[:] = shape
        n = math.prod(shape) * t.element_size()
        if n == 0:
            return
        offset = align(self.nbytes)
        msg.payload_offset = offset
        msg.payload_bytes = n
        self._parts.append((offset, t, rows))
        self.nbytes = offset + n

    def add_run(self, run: np.ndarray) -> int:
        """Place the bytes of ``run`` (1-D, contiguous: several tensors laid out already, each
        described by a ``Tensor`` message of the caller's) after the last tensor; their offset."""
        t = torch.from_numpy(run)
        offset = align(self.nbytes)
        self._parts.append((offset, t, None))
        self.nbytes = offset + t.numel() * t.element_size()
        return offset

    def copy_into(self, region: memoryview, gather: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """Write every tensor at its offset of ``region`` (a view that starts at the payload's
        first byte). ``gather(source, rows, dest)`` writes ``source[rows]`` into ``dest`` for the
        parts added with ``rows`` (default: ``torch.index_select``)."""
        for offset, t, rows in self._parts:
            if rows is None:
                dest = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=offset)
                dest.copy_(t.reshape(-1))
            else:
                dest = torch.frombuffer(region, dtype=t.dtype, count=len(rows) * t[0].numel(), offset=offset)
                out = dest.view(len(rows), *t.shape[1:])
                if gather is None:
                    torch.index_select(t, 0, rows, out=out)
                else:
                    gather(t, rows, out)

    def inline(self, request: object) -> None:
        """Move the payload into ``request``'s ``Tensor.data`` fields, for a call over gRPC."""
        if not self._parts:
            return
        data = b"".join(self.buffers())
        _inline(request, data)
        self._parts.clear()
        self.nbytes = 0

    def buffers(self) -> list[memoryview]:
        """The payload as a list of buffers for ``sendmsg``, padding included."""
        out: list[memoryview] = []
        pos = 0
        for offset, t, rows in self._parts:
            if rows is not None:
                t = t.index_select(0, rows)
            if offset > pos:
                out.append(memoryview(bytes(offset - pos)))
            out.append(t.reshape(-1).view(torch.uint8).numpy().data)
            pos = offset + t.numel() * t.element_size()
        return out


def _inline(msg: Any, data: bytes) -> None:
    if isinstance(msg, pb.Tensor):
        if msg.payload_bytes:
            msg.data = data[msg.payload_offset : msg.payload_offset + msg.payload_bytes]
            msg.payload_offset = msg.payload_bytes = 0
        return
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        for sub in value if field.is_repeated else (value,):
            _inline(sub, data)


class SharedRegion:
    """An anonymous, sealed ``memfd`` mapped into this process (one per data-plane connection).

    The client makes one with ``create`` and sends ``fd`` along with its HELLO; the shard maps
    the descriptor it received with ``adopt``. Neither side ever opens a path.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._mmap = mmap.mmap(fd, size)
        self.view = memoryview(self._mmap)

    @classmethod
    def create(cls, size: int) -> tuple[SharedRegion, int]:
        """A new region of ``size`` bytes, reserved and sealed, and its descriptor (the caller closes it).

        Raises:
            OSError: no memfd, or not ``size`` bytes of memory to reserve (ENOSPC/ENOMEM): use TCP.
        """
        fd = os.memfd_create("tether-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # Every page now, so that lack of memory is this error and never a SIGBUS later.
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            return cls(fd, size), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int, size: object, max_size: int) -> SharedRegion:
        """Map a region whose descriptor a client sent, after checking it is one; closes ``fd``.

        Args:
            fd: the received descriptor; closed whatever happens.
            size: the size the client announced.
            max_size: the largest region this side maps.

        Raises:
            ValueError: not a memfd sealed against shrinking, smaller than announced, not fully
                reserved, or a size out of range.
        """
        try:
            if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= max_size:
                raise ValueError(f"shared region size {size!r} is not in (0, {max_size}]")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError as exc:
                raise ValueError(f"the descriptor sent as a region is not a memfd ({exc.strerror})") from exc
            if not seals & fcntl.F_SEAL_SHRINK:
                raise ValueError(f"the region is not sealed against shrinking (seals {seals:#x})")
            st = os.fstat(fd)
            if st.st_size < size:
                raise ValueError(f"the region holds {st.st_size} bytes, less than the {size} announced")
            if st.st_blocks * 512 < size:
                raise ValueError(f"the region's {size} bytes are not all reserved ({st.st_blocks * 512} are)")
            try:
                return cls(fd, size)
            except OSError as exc:
                raise ValueError(f"cannot map the region: {exc.strerror}") from exc
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap; if a tensor still views the region, the mapping goes with the last reference."""
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            pass


def settimeout_by(sock: socket.socket, deadline: float | None) -> None:
    """Give ``sock`` the time left until ``deadline`` (a ``time.monotonic()`` value; None: leave it).

    Raises:
        TimeoutError: the deadline has passed.
    """
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the frame did not arrive in time")
        sock.settimeout(left)


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock`` (by ``deadline``, a ``time.monotonic()`` value, if given).

    Raises:
        ConnectionError: the peer closed the connection first.
        TimeoutError: the socket's timeout or the deadline passed.
    """
    got = 0
    n = len(view)
    while got < n:
        settimeout_by(sock, deadline)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k


def read_header(sock: socket.socket, buf: bytearray) -> tuple[int, int, int, int, int, int]:
    """Read one header into ``buf`` (``HEADER.size`` bytes): (method, flags, status, meta_len, payload_len, aux).

    Raises:
        FrameError: a header without the magic.
        ConnectionError: the peer closed the connection.
    """
    recv_into(sock, memoryview(buf)[: HEADER.size])
    return unpack_header(buf)


def unpack_header(buf: bytearray) -> tuple[int, int, int, int, int, int]:
    """Decode a header already in ``buf``: (method, flags, status, meta_len, payload_len, aux).

    Raises:
        FrameError: a header without the magic.
    """
    magic, method, flags, status, meta_len, payload_len, aux = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(f"not a tether data-plane frame (starts with {bytes(magic)!r})")
    return method, flags, status, meta_len, payload_len, aux


def recv_header_fds(
    sock: socket.socket, buf: bytearray, deadline: float | None = None
) -> tuple[tuple[int, int, int, int, int, int], list[int]]:
    """``read_header`` on a unix socket: also the descriptors that came with the header's bytes.

    The caller owns (and must close) every descriptor returned; on an exception none is left open.

    Raises:
        FrameError: a header without the magic, or descriptors the kernel had to drop (MSG_CTRUNC).
        ConnectionError: the peer closed the connection.
        TimeoutError: the socket's timeout or the deadline passed.
    """
    view = memoryview(buf)[: HEADER.size]
    fds: list[int] = []
    truncated = False
    got = 0
    try:
        while got < HEADER.size:
            settimeout_by(sock, deadline)
            k, ancillary, msg_flags, _ = sock.recvmsg_into([view[got:]], socket.CMSG_SPACE(_MAX_FDS * 4))
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(data[: len(data) - len(data) % a.itemsize])
                    fds.extend(a)
            truncated |= bool(msg_flags & socket.MSG_CTRUNC)
            if k == 0:
                raise ConnectionError("connection closed by the peer")
            got += k
        if truncated:
            raise FrameError(f"more than {_MAX_FDS} descriptors came with one frame")
        return unpack_header(buf), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def send_frame(
    sock: socket.socket,
    method: int,
    meta: bytes,
    payload: Sequence[memoryview] = (),
    *,
    flags: int = 0,
    status: int = 0,
    payload_len: int = 0,
    aux: int = 0,
    fds: Sequence[int] = (),
) -> None:
    """Send a header, ``meta`` and the ``payload`` buffers (their total is ``payload_len``).

    With ``FLAG_SHM`` the payload is in the shared region: pass no buffers, only ``payload_len``.
    ``fds`` (a unix socket only) ride with the header's bytes.
    """
    if payload:
        payload_len = sum(b.nbytes for b in payload)
    buffers = [memoryview(HEADER.pack(MAGIC, method, flags, status, len(meta), payload_len, aux)), memoryview(meta), *payload]
    if isinstance(sock, ssl.SSLSocket):
        if fds:
            raise ValueError("descriptors cannot travel over TLS")
        _send_tls(sock, buffers)
        return
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while buffers:
        sent = sock.sendmsg(buffers[:512], ancillary)
        ancillary = []
        while sent:
            if sent >= buffers[0].nbytes:
                sent -= buffers[0].nbytes
                buffers.pop(0)
            else:
                buffers[0] = buffers[0][sent:]
                sent = 0
        while buffers and buffers[0].nbytes == 0:
            buffers.pop(0)


# Buffers below this size are joined before they go into TLS (each ``sendall`` on an SSL
# socket makes at least one record and one system call); larger ones are encrypted in place.
_TLS_JOIN = 64 * 1024


def _send_tls(sock: ssl.SSLSocket, buffers: list[memoryview]) -> None:
    """Send ``buffers`` in order over TLS: small neighbours joined, large ones as they are."""
    pending = bytearray()
    for b in buffers:
        if b.nbytes < _TLS_JOIN:
            pending += b
            continue
        if pending:
            sock.sendall(pending)
            pending = bytearray()
        sock.sendall(b)
    if pending:
        sock.sendall(pending)
