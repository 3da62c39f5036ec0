"""The shard's compiled hot loops (numba): the id index's probes, and the machinery that
compiles each update rule's row kernel.

Each is one loop over a push or pull, compiled once by LLVM and cached on disk (``cache=True``:
in ``NUMBA_CACHE_DIR`` when set, as in the container image, else next to the source file or
under ``~/.cache/numba``), so a restarted shard loads machine code instead of compiling it again.
They release the GIL (``nogil``), so the shard's other threads (other connections, metrics, the
checkpointer) run while a table is updated.

The row updates are not written here: each update rule (``tether.protos.optimizers``) holds its
own kernel (``UpdateRule.rows``) beside its torch form, and this module compiles whichever rule
a table names (``row_kernel``) and binds it to the table's state and constants
(``row_update``): a kernel applies the rule to the rows ``slots`` of a table in place, reading
each row once and writing it once, instead of gathering rows, updating the copies and
scattering them back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numba
import numpy as np

from tether.protos.optimizers import OPTIMIZERS, OptimizerConfig, UpdateRule, rule

__all__ = ["EMPTY_SLOT", "REMOVED_SLOT", "index_cells", "index_lookup", "index_place", "row_kernel", "row_update", "warm_up"]

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


# Each rule's compiled row kernel, created on first use (and compiled, or loaded from the disk
# cache, on its first call), keyed by the rule's kernel function.
_row_kernels: dict[Callable[..., None], Any] = {}
_row_kernels_lock = threading.Lock()


def row_kernel(update_rule: UpdateRule) -> Any:
    """The compiled form of ``update_rule.rows`` (one per rule for the process)."""
    fn = update_rule.rows
    with _row_kernels_lock:
        kernel = _row_kernels.get(fn)
        if kernel is None:
            kernel = _row_kernels[fn] = _jit_math(fn)
        return kernel


# A rule's row update bound to a table's constants: (weights, state, slots, grads, lr) -> None.
RowUpdate = Callable[[np.ndarray, Mapping[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray], None]


def row_update(update_rule: UpdateRule, cfg: OptimizerConfig, dim: int) -> RowUpdate:
    """``update_rule``'s compiled row update with the constants of ``cfg``, for rows of ``dim``
    floats: ``update(weights, state, slots, grads, lr)`` updates rows ``slots`` (unique, int64)
    of ``weights`` and of the ``state`` arrays (by name) in place, row ``i`` from ``grads[i]``
    with learning rate ``lr[i]`` (float32, contiguous). Binding compiles nothing: the kernel is
    compiled, or loaded from the disk cache, on its first call (or by ``warm_up``)."""
    kernel = row_kernel(update_rule)
    names = tuple(update_rule.state_shapes(dim))
    constants = update_rule.kernel_constants(cfg)

    def update(weights: np.ndarray, state: Mapping[str, np.ndarray], slots: np.ndarray, grads: np.ndarray, lr: np.ndarray) -> None:
        scratch = np.empty(dim, np.float32)
        kernel(weights, slots, grads, lr, scratch, *[state[k] for k in names], *constants)

    return update


def warm_up() -> None:
    """Load (or compile, the first time) every kernel for the types the shard uses, so that no
    request pays for it: ``tether server`` runs this in a thread while the shard starts."""
    cells = np.full((16, 2), _EMPTY, np.int64)
    ids = np.arange(2, dtype=np.int64)
    index_place(cells, ids, ids.copy())
    index_cells(cells, ids)
    index_lookup(cells, ids)
    for name in OPTIMIZERS:
        r = rule(name)
        w, g, lr = np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32), np.zeros(2, np.float32)
        state = {k: np.zeros((2, *s), np.float32) for k, s in r.state_shapes(4).items()}
        row_update(r, OptimizerConfig(name), 4)(w, state, ids, g, lr)
