"""Parameter storage of one shard: embedding tables and dense chunks.

Embedding rows live in one contiguous tensor per table (plus one per optimizer state), and
ids map to row slots through a vectorised hash index (``tether.server.index``): no Python
object per row and no Python loop over ids. Updates to one table are applied in a
short vectorised critical section (gather, update, scatter) under that table's own lock, so
concurrent pushes never lose an update while pushes to other tables and dense chunks, and all
pulls, go on in parallel (pulls read without a lock, Hogwild-style).
"""

from __future__ import annotations

import threading
import zlib
import numpy as np
import torch

from tether.protos.errors import InvalidArgument
from tether.protos.partition import mix64
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.index import IdIndex
from tether.server.optimizers import state_shapes, step

__all__ = ["DenseChunk", "EmbeddingTable", "TableConfig", "init_rows"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_GROWTH = 1.5


def init_rows(ids: np.ndarray, dim: int, seed: int, table: str, scale: float) -> torch.Tensor:
    """Deterministic initial rows, uniform in [-scale, scale), from (seed, table, id) alone."""
    salt = np.uint64((zlib.crc32(table.encode()) << 32) ^ (seed & 0xFFFFFFFF))
    base = mix64(ids.astype(np.int64).view(np.uint64) ^ salt)
    with np.errstate(over="ignore"):
        h = mix64(base[:, None] + np.arange(1, dim + 1, dtype=np.uint64)[None, :] * _GOLDEN)
    u = (h >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))
    return torch.from_numpy(u).mul_(2 * scale).sub_(scale)


class EmbeddingTable:
    """Rows of one table owned by this shard, created on first touch."""

    def __init__(self, config: TableConfig, initial_capacity: int = 1024) -> None:
        self.config = config
        self.dim = config.dim
        self.version = 0
        self._lock = threading.Lock()
        self._state_shapes = state_shapes(config.optimizer, config.dim)
        self._rows = 0
        self._index = IdIndex(initial_capacity)
        self._weights = torch.empty(initial_capacity, config.dim)
        self._state = {k: torch.zeros(initial_capacity, *s) for k, s in self._state_shapes.items()}

    @property
    def rows(self) -> int:
        """Number of rows created."""
        return self._rows

    @property
    def memory_bytes(self) -> int:
        """Bytes held by rows, optimizer state and the id index (allocated capacity)."""
        total = self._weights.nbytes + self._index.nbytes
        return total + sum(t.nbytes for t in self._state.values())

    def _grow(self, need: int) -> None:
        cap = self._weights.shape[0]
        if need <= cap:
            return
        new_cap = max(need, int(cap * _GROWTH) + 1)
        w = torch.empty(new_cap, self.dim)
        w[: self._rows] = self._weights[: self._rows]
        state = {}
        for k, s in self._state_shapes.items():
            t = torch.zeros(new_cap, *s)
            t[: self._rows] = self._state[k][: self._rows]
            state[k] = t
        self._weights, self._state = w, state

    def _insert(self, new_ids: np.ndarray) -> None:
        """Create rows for sorted, unique ids that are not present. Caller holds the lock."""
        n, k = self._rows, len(new_ids)
        self._grow(n + k)
        cfg = self.config
        self._weights[n : n + k] = init_rows(new_ids, self.dim, cfg.seed, cfg.name, cfg.init_scale)
        if "sum" in self._state and cfg.optimizer.initial_accumulator:
            self._state["sum"][n : n + k] = cfg.optimizer.initial_accumulator
        self._rows = n + k
        self._index.insert(new_ids, np.arange(n, n + k, dtype=np.int64))

    def slots(self, ids: np.ndarray) -> torch.Tensor:
        """Row slots of ``ids`` (unique, non-negative int64), creating missing rows."""
        slots = self._index.lookup(ids)
        missing = slots < 0
        if missing.any():
            with self._lock:
                # Another writer may have created some of them meanwhile.
                want = ids[missing]
                again = self._index.lookup(want)
                new = again < 0
                if new.any():
                    fresh, inverse = np.unique(want[new], return_inverse=True)
                    first = self._rows
                    self._insert(fresh)
                    again[new] = first + inverse
                slots[missing] = again
        return torch.from_numpy(slots)

    def pull(self, ids: np.ndarray) -> tuple[torch.Tensor, int]:
        """Rows of ``ids`` (a copy) and the table version they were read at."""
        version = self.version
        idx = self.slots(ids)
        return self._weights.index_select(0, idx), version

    def push(self, ids: np.ndarray, grads: torch.Tensor, lr_scale: float = 1.0) -> int:
        """Apply row gradients with the table's optimizer; returns the new version."""
        idx = self.slots(ids)
        opt = self.config.optimizer
        with self._lock:
            if opt.name == "sgd" and not opt.weight_decay:
                self._weights.index_add_(0, idx, grads, alpha=-opt.lr * lr_scale)
            else:
                w = self._weights.index_select(0, idx)
                state = {k: t.index_select(0, idx) for k, t in self._state.items()}
                step(opt, w, grads, state, lr_scale)
                self._weights.index_copy_(0, idx, w)
                for k, t in state.items():
                    self._state[k].index_copy_(0, idx, t)
            self.version += 1
            return self.version

    def snapshot(self) -> dict[str, object]:
        """Ids, rows, optimizer state and version, sorted by id (for checkpoints and tests)."""
        with self._lock:
            keys, slots = self._index.items()
            idx = torch.from_numpy(slots)
            return {
                "ids": keys,
                "weights": self._weights.index_select(0, idx),
                "state": {k: t.index_select(0, idx) for k, t in self._state.items()},
                "version": self.version,
            }


class DenseChunk:
    """One chunk of a dense parameter (flat float32) and its optimizer state."""

    def __init__(self, name: str, index: int, init: torch.Tensor, optimizer: OptimizerConfig) -> None:
        if init.dim() != 1 or init.numel() == 0:
            raise InvalidArgument(f"dense chunk {name}[{index}] must be a non-empty 1-D tensor, got shape {tuple(init.shape)}")
        self.name = name
        self.index = index
        self.optimizer = optimizer
        self.value = init.to(torch.float32).clone()
        self.version = 0
        self._lock = threading.Lock()
        # Per-element state; Adam's step count is one scalar for the whole chunk.
        self._state = {k: torch.zeros(() if k == "t" else init.numel()) for k in state_shapes(optimizer, 1)}

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.value.numel()

    def pull(self) -> tuple[torch.Tensor, int]:
        """The chunk's values (read without a lock) and their version."""
        return self.value, self.version

    def push(self, grad: torch.Tensor, lr_scale: float = 1.0) -> int:
        """Apply a gradient with the chunk's optimizer; returns the new version."""
        with self._lock:
            step(self.optimizer, self.value, grad, self._state, lr_scale)
            self.version += 1
            return self.version
