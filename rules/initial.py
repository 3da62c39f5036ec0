"""Initial rows of embedding tables: deterministic, from (seed, table, id) alone.

Part of the contract: a shard creates a row with these values on its first touch, and local mode
(``tether.worker.client.local``) creates its in-process rows with the very same ones, so a model trained
either way starts from the same point.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch

from tether.protos.partition import mix64_

__all__ = ["column_steps", "init_rows", "salt"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def init_rows(ids: np.ndarray, dim: int, seed: int, table: str, scale: float, out: np.ndarray | None = None) -> torch.Tensor:
    """Deterministic initial rows, uniform in [-scale, scale), from (seed, table, id) alone.

    Any int64 id (negative ones too: the hash reads its 64 bits) gets its own row, whatever
    the other ids of the call and whichever process creates it.

    ``out``: a float32 ``[len(ids), dim]`` array to write them into (returned as a tensor view).
    """
    base = mix64_(ids.astype(np.int64, copy=False).view(np.uint64) ^ salt(seed, table))
    h = mix64_(base[:, None] + column_steps(dim))
    h >>= np.uint64(40)
    # h < 2**24, exactly representable: u = h * 2 * scale / 2**24 - scale.
    u = np.multiply(h, np.float32(2 * scale / (1 << 24)), out=out, dtype=np.float32, casting="unsafe")
    u -= np.float32(scale)
    return torch.from_numpy(u)


@functools.lru_cache(maxsize=256)
def salt(seed: int, table: str) -> np.uint64:
    return np.uint64((zlib.crc32(table.encode()) << 32) ^ (seed & 0xFFFFFFFF))


@functools.lru_cache(maxsize=64)
def column_steps(dim: int) -> np.ndarray:
    steps = np.arange(1, dim + 1, dtype=np.uint64)[None, :] * _GOLDEN
    steps.flags.writeable = False
    return steps