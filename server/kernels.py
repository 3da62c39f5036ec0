"""The shard's compiled hot loops (numba): the id index's probes and the optimizers' row updates.

Each is one loop over a push or pull, compiled once by LLVM and cached on disk (``cache=True``:
in ``NUMBA_CACHE_DIR`` when set, as in the container image, else next to this file or under
``~/.cache/numba``), so a restarted shard loads machine code instead of compiling it again. They
release the GIL (``nogil``), so the shard's other threads (other connections, metrics, the
checkpointer) run while a table is updated. There is no pure-Python twin: these are the code.

Row updates apply a rule to the rows ``slots`` of a table in place, reading each row once and
writing it once, instead of gathering rows, updating the copies and scattering them back. Each
row's arithmetic runs as separate simple loops over its ``dim`` elements, so that LLVM can
vectorise them (one loop that writes the weights and the state together is not vectorised: it
cannot tell that they do not overlap).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

__all__ = ["EMPTY_SLOT", "REMOVED_SLOT", "index_lookup", "index_cells", "index_place", "sgd_rows", "adagrad_rows", "adam_rows", "warm_up"]

# A cell's state is its slot, so that every int64 is a valid key: a slot >= 0 is a row,
# ``EMPTY_SLOT`` ends a probe chain, ``REMOVED_SLOT`` (a tombstone) is passed over like a row.
EMPTY_SLOT = -1
REMOVED_SLOT = -2
_EMPTY = EMPTY_SLOT
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)

log = logging.getLogger("tether.server")
_uncached: list[str] = []


def _compiled(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=True, nogil=True, **options)``; where no cache location is writable
    (a read-only package directory and no writable ``NUMBA_CACHE_DIR`` or home), the kernels
    are compiled in memory at every start instead (a few seconds), with one warning."""

    def decorate(fn: Callable[..., Any]) -> Any:
        try:
            return numba.njit(cache=True, nogil=True, **options)(fn)
        except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available"
            if not _uncached:
                log.warning("compiled kernels are not cached on disk (%s); set NUMBA_CACHE_DIR to a writable directory", exc)
            _uncached.append(fn.__name__)
            return numba.njit(cache=False, nogil=True, **options)(fn)

    return decorate


_jit = _compiled()
# Row arithmetic: the element-wise steps may be vectorised and contracted into fused multiply-adds
# ("contract"), and a division may use a reciprocal ("arcp"); no other IEEE rule is relaxed, so
# NaN and infinite gradients behave as in torch.
_jit_math = _compiled(error_model="numpy", fastmath={"contract", "arcp"})


@_compiled(inline="always")
def _home(key: np.int64, mask: np.uint64) -> np.int64:
    # splitmix64's finaliser (``tether.protos.partition.mix64``), masked to the table size.
    z = np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return np.int64(z & mask)


@_compiled(inline="always")
def _cell(cells: np.ndarray, key: np.int64, mask: np.uint64) -> np.int64:
    """The cell holding ``key``, -1 where it is absent: linear probing from its home cell.

    A cell's slot is read before its key: a writer stores them in the other order, so a slot
    that says "row" comes with its final key.
    """
    p = _home(key, mask)
    while True:
        s = cells[p, 1]
        if s == _EMPTY:
            return np.int64(-1)
        if s >= 0 and cells[p, 0] == key:
            return p
        p = (p + 1) & np.int64(mask)


@_jit
def index_cells(cells: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Cell of each id in ``cells`` ([n, 2] int64 (key, slot) pairs, n a power of two), -1 where absent."""
    mask = np.uint64(len(cells) - 1)
    out = np.empty(len(ids), np.int64)
    for i in range(len(ids)):
        out[i] = _cell(cells, ids[i], mask)
    return out


@_jit
def index_lookup(cells: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Slot of each id in ``cells`` (one snapshot of the index), -1 where absent."""
    mask = np.uint64(len(cells) - 1)
    out = np.empty(len(ids), np.int64)
    for i in range(len(ids)):
        key = ids[i]
        p = _home(key, mask)
        while True:
            # Slot before key (see ``_cell``); the slot read is also the answer, read once.
            s = cells[p, 1]
            if s == _EMPTY:
                out[i] = -1
                break
            if s >= 0 and cells[p, 0] == key:
                out[i] = s
                break
            p = (p + 1) & np.int64(mask)
    return out


@_jit
def index_place(cells: np.ndarray, ids: np.ndarray, new_slots: np.ndarray) -> None:
    """Insert absent, unique ``ids`` with their slots (each >= 0) by linear probing into empty
    cells (the caller keeps the load factor low; tombstones are not reused). Each cell's key
    is stored before its slot, so a lock-free reader that sees the slot sees the key."""
    mask = np.uint64(len(cells) - 1)
    for i in range(len(ids)):
        p = _home(ids[i], mask)
        while cells[p, 1] != _EMPTY:
            p = (p + 1) & np.int64(mask)
        cells[p, 0] = ids[i]
        cells[p, 1] = new_slots[i]


@_jit_math
def sgd_rows(w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, weight_decay: np.float32) -> None:
    """``w[slots[i]] -= lr[i] * (g[i] + weight_decay * w[slots[i]])`` for each row ``i``."""
    n, d = g.shape
    for i in range(n):
        row, grad, step = w[slots[i]], g[i], lr[i]
        if weight_decay != 0:
            for j in range(d):
                row[j] -= step * (grad[j] + weight_decay * row[j])
        else:
            for j in range(d):
                row[j] -= step * grad[j]


@_jit_math
def adagrad_rows(
    w: np.ndarray, acc: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, eps: np.float32, weight_decay: np.float32,
    scratch: np.ndarray,
) -> None:
    """Adagrad on rows ``slots``: ``acc += g * g``, ``w -= lr[i] * g / (sqrt(acc) + eps)``
    (``g`` with ``weight_decay * w`` added first; ``scratch``: ``dim`` floats)."""
    n, d = g.shape
    for i in range(n):
        s = slots[i]
        row, state, step = w[s], acc[s], lr[i]
        for j in range(d):
            scratch[j] = g[i, j] + weight_decay * row[j]
        for j in range(d):
            state[j] += scratch[j] * scratch[j]
        for j in range(d):
            row[j] -= step * scratch[j] / (np.sqrt(state[j]) + eps)


@_jit_math
def adam_rows(
    w: np.ndarray, m: np.ndarray, v: np.ndarray, t: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray,
    beta1: np.float32, beta2: np.float32, eps: np.float32, weight_decay: np.float32, scratch: np.ndarray,
) -> None:
    """Adam on rows ``slots``, with one step count per row in ``t`` (bias-corrected, as torch)."""
    n, d = g.shape
    for i in range(n):
        s = slots[i]
        row, mr, vr, step = w[s], m[s], v[s], lr[i]
        t[s] += 1
        bc1 = np.float32(1.0) - beta1 ** t[s]
        bc2 = np.float32(1.0) - beta2 ** t[s]
        for j in range(d):
            scratch[j] = g[i, j] + weight_decay * row[j]
        for j in range(d):
            mr[j] = beta1 * mr[j] + (np.float32(1.0) - beta1) * scratch[j]
        for j in range(d):
            vr[j] = beta2 * vr[j] + (np.float32(1.0) - beta2) * scratch[j] * scratch[j]
        for j in range(d):
            row[j] -= step * (mr[j] / bc1) / (np.sqrt(vr[j] / bc2) + eps)


def warm_up() -> None:
    """Load (or compile, the first time) every kernel for the types the shard uses, so that no
    request pays for it: ``tether server`` runs this in a thread while the shard starts."""
    cells = np.full((16, 2), _EMPTY, np.int64)
    ids = np.arange(2, dtype=np.int64)
    index_place(cells, ids, ids.copy())
    index_cells(cells, ids)
    index_lookup(cells, ids)
    w, g = np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32)
    lr, f = np.zeros(2, np.float32), np.float32(0.0)
    sgd_rows(w, ids, g, lr, f)
    adagrad_rows(w, np.zeros_like(w), ids, g, lr, f, f, np.zeros(4, np.float32))
    adam_rows(w, np.zeros_like(w), np.zeros_like(w), np.zeros(2, np.float32), ids, g, lr, f, f, f, f, np.zeros(4, np.float32))


def apply_rows(cfg, weights: np.ndarray, state: dict[str, np.ndarray], slots: np.ndarray, grads: np.ndarray, lr: np.ndarray) -> None:
    """Apply the rule ``cfg`` names (an ``OptimizerConfig``) to rows ``slots`` of ``weights`` and
    its ``state`` in place, row ``i`` with learning rate ``lr[i]`` (float32)."""
    wd = np.float32(cfg.weight_decay)
    scratch = np.empty(weights.shape[1], np.float32)
    if cfg.name == "sgd":
        sgd_rows(weights, slots, grads, lr, wd)
    elif cfg.name == "adagrad":
        adagrad_rows(weights, state["sum"], slots, grads, lr, np.float32(cfg.eps), wd, scratch)
    elif cfg.name == "adam":
        adam_rows(weights, state["m"], state["v"], state["t"], slots, grads, lr, np.float32(cfg.beta1), np.float32(cfg.beta2),
                  np.float32(cfg.eps), wd, scratch)
    else:
        raise ValueError(f"no row kernel for optimizer {cfg.name!r}")
