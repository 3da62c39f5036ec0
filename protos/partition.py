"""The one key -> shard partition function, shared by workers and shards."""

from __future__ import annotations

import zlib

import numpy as np

__all__ = ["dense_shard", "mix64", "shard_of_ids", "split_ids"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)
# Up to this many shards, ids are grouped by one pass per shard instead of a sort.
_PASS_PER_SHARD_MAX = 8


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijective scramble of uint64 keys (vectorised)."""
    return mix64_(x.astype(np.uint64, copy=True))


def mix64_(z: np.ndarray) -> np.ndarray:
    """``mix64`` in place on a uint64 array (returned)."""
    # Array arithmetic on uint64 wraps silently (only NumPy scalars warn), so no errstate.
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def shard_of_ids(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """Shard index (int64) of each id: ``mix64(id) % num_shards``.

    Hashing first spreads ids that share low bits (for example hashed features of one field).
    An id is hashed as its 64 bits, so every int64 (negative ones too) has an owner in
    ``[0, num_shards)``.

    Raises:
        ValueError: if ``num_shards`` < 1.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards == 1:
        return np.zeros(len(ids), dtype=np.int64)
    arr = np.asarray(ids, dtype=np.int64)
    h = mix64(arr.view(np.uint64))
    if num_shards & (num_shards - 1):
        h %= np.uint64(num_shards)
    else:  # the same value as %, without a division per id
        h &= np.uint64(num_shards - 1)
    return h.view(np.int64)


def split_ids(ids: np.ndarray, num_shards: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Group ``ids`` by shard.

    Returns:
        For each shard, ``(positions, ids)``: where in ``ids`` its ids sit, and the ids.
    """
    if num_shards == 1:
        return [(np.arange(len(ids)), ids)]
    owner = shard_of_ids(ids, num_shards)
    if num_shards <= _PASS_PER_SHARD_MAX:
        # One comparison pass per shard beats sorting the owners.
        groups = [np.flatnonzero(owner == s) for s in range(num_shards)]
    else:
        # A stable sort of 16-bit keys is a radix sort.
        key = owner.astype(np.uint16) if num_shards <= 1 << 16 else owner
        order = np.argsort(key, kind="stable")
        bounds = np.concatenate(([0], np.cumsum(np.bincount(owner, minlength=num_shards))))
        groups = [order[bounds[s] : bounds[s + 1]] for s in range(num_shards)]
    return [(pos, ids[pos]) for pos in groups]


def dense_shard(name: str, index: int, num_shards: int) -> int:
    """Shard that owns chunk ``index`` of dense parameter ``name``.

    Chunks of one parameter go round-robin from a start chosen by a stable hash of the name,
    so both a tensor's chunks and different small tensors spread over the shards.

    Raises:
        ValueError: if ``num_shards`` < 1 or ``index`` < 0.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if index < 0:
        raise ValueError(f"chunk index must be >= 0, got {index}")
    return (zlib.crc32(name.encode()) + index) % num_shards
