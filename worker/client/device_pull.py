"""A CUDA worker's pulled rows placed on the GPU straight from a shard's shared region (issue 41
item 4): no host copy of the rows out of the region.

Without it, an answer that arrives in a data connection's shared region (a shard on the same
host) is copied on the host into the pull's pinned buffers, and from there to the GPU. With it
(``Router.rows_to``, which ``PSModel`` uses for its training pulls on CUDA), once the region is
registered as pinned memory (``tether.worker.client.region_pins``), each shard's answer goes to
the GPU in one non-blocking copy of the bytes of its rows, straight from the region, queued on
the transfer stream; an event recorded after that copy is the region's fence, which the
connection waits for before it writes the region again. The rows are then put in place on the
GPU, on the same stream: each table's rows into its slice of one device buffer per row width
(tables back to back, in request order, as the pinned buffers hold them), scattered to their
positions where several shards share a table, and widened to float32 there when the wire
carries bfloat16 or float16.

A block that came another way (over the socket, gRPC, or from a region that cannot be
registered) is placed in the pinned buffers as before; at the end (``finish``) the blocks of a
width that has a device buffer are copied up from there too, so a width's rows are all on the
device or all in pinned memory. Dense values always go through pinned memory.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tether.protos import framing as dp
from tether.protos import tether_pb2 as pb
from tether.protos.codec import decode_tensor
from tether.worker.client import region_pins

__all__ = ["DevicePull", "DeviceRows"]

# Wire dtypes whose rows the GPU widens itself.
_WIRE = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DeviceRows:
    """Where pulled rows go: the training device and the stream their copies are queued on."""

    device: torch.device
    stream: Any


class DevicePull:
    """One pull's rows on the device, for the shards' answers that arrive in a registered region.

    Args:
        sink: the device and stream.
        sizes: table -> (row width, rows asked for), in request order.
    """

    def __init__(self, sink: DeviceRows, sizes: Mapping[str, tuple[int, int]]) -> None:
        self.sink = sink
        # table -> (width, first row in its width's buffer, rows)
        self.layout: dict[str, tuple[int, int, int]] = {}
        self._totals: dict[int, int] = {}
        for table, (dim, n) in sizes.items():
            self.layout[table] = (dim, self._totals.get(dim, 0), n)
            self._totals[dim] = self._totals.get(dim, 0) + n
        self._buffers: dict[int, torch.Tensor] = {}
        self._on_device: set[tuple[int, str]] = set()  # (shard, table): its rows were placed from a region
        self._lock = threading.Lock()
        self._rows: dict[str, torch.Tensor] | None = None

    def _buffer(self, dim: int) -> torch.Tensor:
        """The device buffer of width ``dim`` (made on the sink's stream at first need)."""
        with self._lock:
            if dim not in self._buffers:
                self._buffers[dim] = torch.empty(self._totals[dim], dim, device=self.sink.device)
            return self._buffers[dim]

    def place(self, shard: int, response: pb.PullResponse, payload: memoryview,
              positions: Mapping[tuple[int, str], np.ndarray | None]) -> frozenset[str]:
        """Put ``shard``'s rows on the device from ``payload`` when it lies in a registered region:
        one copy of their bytes, the region's fence after it, then the rows in place on the GPU.

        Returns:
            The tables whose rows were placed (the others are the caller's to place on the host).
        """
        region = region_pins.pinned(payload, self.sink.device)
        if region is None:  # the socket's buffer, or a region that cannot be registered
            return frozenset()
        blocks = []
        for block in response.sparse:
            v, table = block.values, block.table
            if not v.payload_bytes or table not in self.layout or (shard, table) not in positions:
                continue
            host = decode_tensor(v, None, payload)  # checks the block (bounds, shape) and gives its dtype
            dim, _, n = self.layout[table]
            pos = positions[(shard, table)]
            if host.dtype in _WIRE and host.dim() == 2 and host.shape[1] == dim and host.shape[0] == (n if pos is None else len(pos)):
                blocks.append((table, v.payload_offset, v.payload_bytes, host.dtype, tuple(host.shape), pos))
        if not blocks:
            return frozenset()
        lo = min(b[1] for b in blocks)
        lo -= lo % dp.ALIGN  # every block then starts at a multiple of its element size in the device copy
        hi = max(b[1] + b[2] for b in blocks)
        with torch.cuda.device(self.sink.device), torch.cuda.stream(self.sink.stream):
            staged = torch.empty(hi - lo, dtype=torch.uint8, device=self.sink.device)
            staged.copy_(torch.frombuffer(payload, dtype=torch.uint8, count=hi - lo, offset=lo), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.sink.stream)
            region_pins.fence(region, copied)
            scattered = [b[5] for b in blocks if b[5] is not None]
            index = None
            if scattered:
                host_index = torch.empty(sum(len(p) for p in scattered), dtype=torch.int64, pin_memory=True)
                np.concatenate(scattered, out=host_index.numpy())
                index = host_index.to(self.sink.device, non_blocking=True)
            at = 0
            for table, offset, nbytes, dtype, shape, pos in blocks:
                dim, start, n = self.layout[table]
                rows = staged[offset - lo : offset - lo + nbytes].view(dtype).view(shape)
                dest = self._buffer(dim)[start : start + n]
                if pos is None:
                    dest.copy_(rows)
                else:
                    assert index is not None
                    dest.index_copy_(0, index[at : at + len(pos)], rows.to(torch.float32))
                    at += len(pos)
        with self._lock:
            self._on_device.update((shard, b[0]) for b in blocks)
        return frozenset(b[0] for b in blocks)

    def placed_on_host(self, shard: int, table: str) -> None:
        """``shard``'s rows of ``table`` were placed in the pinned buffers (they win over any placed here before)."""
        with self._lock:
            self._on_device.discard((shard, table))

    def finish(self, host_rows: Mapping[str, torch.Tensor],
               positions: Mapping[tuple[int, str], np.ndarray | None]) -> dict[str, torch.Tensor]:
        """Every table of a width that has a device buffer, as its slice of it, once the blocks of
        those tables placed in pinned memory (``host_rows``) are copied up too."""
        if self._rows is not None:
            return self._rows
        rows: dict[str, torch.Tensor] = {}
        if self._buffers:
            with torch.cuda.device(self.sink.device), torch.cuda.stream(self.sink.stream):
                for (shard, table), pos in positions.items():
                    dim, start, n = self.layout.get(table, (0, 0, 0))
                    if dim not in self._buffers or (shard, table) in self._on_device:
                        continue
                    dest = self._buffers[dim][start : start + n]
                    if pos is None:
                        dest.copy_(host_rows[table], non_blocking=True)
                        continue
                    # A shard's share of the table, gathered into pinned memory and scattered on the GPU.
                    picked = torch.empty((len(pos), dim), pin_memory=True)
                    where = torch.empty(len(pos), dtype=torch.int64, pin_memory=True)
                    where.numpy()[:] = pos
                    torch.index_select(host_rows[table], 0, where, out=picked)
                    dest.index_copy_(0, where.to(self.sink.device, non_blocking=True), picked.to(self.sink.device, non_blocking=True))
            for table, (dim, start, n) in self.layout.items():
                if dim in self._buffers:
                    rows[table] = self._buffers[dim][start : start + n]
        self._rows = rows
        return rows
