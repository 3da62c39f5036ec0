"""The data plane: Push, Pull and PushPull over a plain TCP connection, tensors out of band.

gRPC's unary path copies a message several times and hops threads on both sides; for the
megabytes a parameter server moves per step that is most of the step. So a shard also listens
on a data port (``DeclareResponse.data_port``) where a client sends the *same* protobuf
requests, framed, with every tensor's bytes outside the message (``Tensor.payload_offset`` /
``payload_bytes``):

- over the socket, right after the message, sent with scatter-gather I/O straight from the
  tensors' memory and received into one reusable buffer that the shard decodes without a copy;
- or, when the client and the shard share a machine (the shard can open the client's file in
  ``/dev/shm``), in a shared-memory region of the connection: the client writes its gradients
  there, the shard applies them from there and writes pulled values back there, and only the
  small message crosses the socket.

A frame is a 28-byte header (``HEADER``), the message (``meta_len`` bytes) and, unless
``FLAG_SHM`` says it is in the region at ``aux``, the payload (``payload_len`` bytes). A
response carries ``status`` (a ``grpc.StatusCode`` value; 0 is OK) and, on error, the message
text as its meta. A connection starts with ``HELLO`` (msgpack: the bearer token if the shard
wants one, and the shared region if the client offers one) and then carries one call at a time.
The data plane is plaintext: a shard that serves TLS offers none and clients use gRPC.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import socket
import struct
from collections.abc import Sequence

import torch

from tether.protos import tether_pb2 as pb
from tether.protos.codec import wire_dtype

__all__ = [
    "ALIGN",
    "FLAG_SHM",
    "HEADER",
    "MAGIC",
    "METHODS",
    "NONCE_BYTES",
    "REGION_START",
    "SHM_DIR",
    "FrameError",
    "PayloadWriter",
    "SharedRegion",
    "align",
    "open_region",
    "read_header",
    "recv_into",
    "send_frame",
    "shm_name_ok",
]

MAGIC = b"TDP1"
# magic, method, flags, status, meta_len, payload_len, aux (payload's offset in the region).
HEADER = struct.Struct("<4sBBHIQQ")
HELLO, PUSH, PULL, PUSH_PULL = 1, 2, 3, 4
METHODS = {HELLO: "Hello", PUSH: "Push", PULL: "Pull", PUSH_PULL: "PushPull"}
FLAG_SHM = 1
# Tensors start on cache-line boundaries, so every view of them is aligned for any dtype.
ALIGN = 64
SHM_DIR = "/dev/shm"
NONCE_BYTES = 16
# The region starts with the client's nonce; payloads go after it.
REGION_START = ALIGN
_SHM_NAME = re.compile(r"tether-[A-Za-z0-9_-]{1,100}")


class FrameError(ConnectionError):
    """The peer sent something that is not a data-plane frame (the connection is dropped)."""


def align(n: int) -> int:
    """``n`` rounded up to ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def shm_name_ok(name: object) -> bool:
    """Whether ``name`` is a region name a shard may open (``tether-...`` in ``SHM_DIR``)."""
    return isinstance(name, str) and _SHM_NAME.fullmatch(name) is not None


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

    def copy_into(self, region: memoryview) -> None:
        """Write every tensor at its offset of ``region`` (a view that starts at the payload's first byte)."""
        for offset, t, rows in self._parts:
            if rows is None:
                dest = torch.frombuffer(region, dtype=t.dtype, count=t.numel(), offset=offset)
                dest.copy_(t.reshape(-1))
            else:
                dest = torch.frombuffer(region, dtype=t.dtype, count=len(rows) * t[0].numel(), offset=offset)
                torch.index_select(t, 0, rows, out=dest.view(len(rows), *t.shape[1:]))

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
            out.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            pos = offset + t.numel() * t.element_size()
        return out


def _inline(msg: object, data: bytes) -> None:
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
    """A file in ``SHM_DIR`` mapped into this process (one per data-plane connection)."""

    def __init__(self, path: str, size: int, create: bool, nonce: bytes | None = None) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"shared region {self.name} is smaller than the {size} bytes announced")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)
        self.nonce = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        if create:
            self.view[:NONCE_BYTES] = self.nonce

    def unlink(self) -> None:
        """Remove the file; the mapping stays valid for whoever has it mapped."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap; if a tensor still views the region, the mapping goes with the last reference."""
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            pass


def open_region(name: str, size: int, nonce: bytes) -> SharedRegion:
    """Map a client's region by name, checking that it is the one the client made.

    Raises:
        ValueError: a bad name or size, a missing file, or a nonce that does not match.
    """
    if not shm_name_ok(name):
        raise ValueError(f"shared region name {name!r} is not tether-[A-Za-z0-9_-]+")
    if not isinstance(size, int) or not REGION_START < size <= 1 << 40:
        raise ValueError(f"shared region size {size!r} is out of range")
    try:
        region = SharedRegion(os.path.join(SHM_DIR, name), size, create=False, nonce=nonce)
    except OSError as exc:
        raise ValueError(f"cannot open shared region {name}: {exc.strerror}") from exc
    if bytes(region.view[:NONCE_BYTES]) != nonce:
        region.close()
        raise ValueError(f"shared region {name} does not hold the nonce it was announced with")
    return region


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``.

    Raises:
        ConnectionError: the peer closed the connection first.
    """
    got = 0
    n = len(view)
    while got < n:
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
    magic, method, flags, status, meta_len, payload_len, aux = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(f"not a tether data-plane frame (starts with {bytes(magic)!r})")
    return method, flags, status, meta_len, payload_len, aux


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
) -> None:
    """Send a header, ``meta`` and the ``payload`` buffers (their total is ``payload_len``).

    With ``FLAG_SHM`` the payload is in the shared region: pass no buffers, only ``payload_len``.
    """
    if payload:
        payload_len = sum(b.nbytes for b in payload)
    buffers = [memoryview(HEADER.pack(MAGIC, method, flags, status, len(meta), payload_len, aux)), memoryview(meta), *payload]
    while buffers:
        sent = sock.sendmsg(buffers[:512])
        while sent:
            if sent >= buffers[0].nbytes:
                sent -= buffers[0].nbytes
                buffers.pop(0)
            else:
                buffers[0] = buffers[0][sent:]
                sent = 0
        while buffers and buffers[0].nbytes == 0:
            buffers.pop(0)
