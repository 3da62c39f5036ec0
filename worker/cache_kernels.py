"""Compiled pieces the worker row cache's passes share (``tether.worker.cache_batch``, which
makes one call per operation over all tables): an id's slot in a table's index (the shard's
index, ``tether.server.index_kernels``: these only read it), an id's shard, and the oldest read
version per shard. Compiled on first use and cached on disk like the shard's kernels
(``row_slots.warm_up`` loads them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from tether.server.index_kernels import EMPTY_SLOT, mix64

__all__ = ["oldest_per_shard", "warm_up"]

log = logging.getLogger(__name__)


def _compiled(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=True, nogil=True)``, in memory only (one warning) where no disk cache
    location is writable, as the shard's kernels."""

    def decorate(fn: Callable[..., Any]) -> Any:
        try:
            return numba.njit(cache=True, nogil=True, **options)(fn)
        except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available"
            log.warning("row cache kernel %s is not cached on disk (%s)", fn.__name__, exc)
            return numba.njit(cache=False, nogil=True, **options)(fn)

    return decorate


_jit = _compiled()
_NONE = np.iinfo(np.int64).max


@_compiled(inline="always")
def _slot(cells: np.ndarray, key: np.int64) -> np.int64:
    """The slot of ``key`` in the index, -1 where absent (``server.index_kernels.index_lookup``'s probe)."""
    mask = np.uint64(len(cells) - 1)
    p = np.int64(mix64(key) & mask)
    while True:
        s = cells[p, 1]
        if s == EMPTY_SLOT:
            return np.int64(-1)
        if s >= 0 and cells[p, 0] == key:
            return s
        p = (p + 1) & np.int64(mask)


@_compiled(inline="always")
def _shard(key: np.int64, num_shards: np.int64) -> np.int64:
    """``protos.partition.shard_of_ids`` for one id: ``mix64(id) % num_shards``."""
    if num_shards == 1:
        return np.int64(0)
    return np.int64(mix64(key) % np.uint64(num_shards))


@_jit
def oldest_per_shard(shards: np.ndarray, versions: np.ndarray, num_shards: np.int64) -> np.ndarray:
    """The smallest of ``versions`` per shard (int64 max where a shard has none)."""
    out = np.full(num_shards, _NONE, np.int64)
    for i in range(len(shards)):
        if versions[i] < out[shards[i]]:
            out[shards[i]] = versions[i]
    return out


def warm_up() -> None:
    """Load (or compile, the first time) every kernel here for the types the cache passes."""
    ids = np.zeros(0, np.int64)
    oldest_per_shard(ids, ids, np.int64(1))
