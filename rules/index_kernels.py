"""The id index's compiled probes (numba): hashing an id (``mix64``), looking ids up in and
placing them into the shard tables' index (``slot_*``: ``tether.server.storage.index``) and the worker
row cache's (``index_*``: ``tether.worker.cache.slots``), and the update log's record and count
of each row's updates since a read (``log_record``, ``count_linked``:
``tether.server.storage.update_log``). The rules' row kernels, the gather of pulled rows and the
initialisation of new rows are in ``tether.rules.row_kernels``.

Each is one loop over a push or pull, compiled once by LLVM and cached on disk (``cache=True``:
in ``NUMBA_CACHE_DIR`` when set, as in the container image, else next to the source file or
under ``~/.cache/numba``), so a restarted shard loads machine code instead of compiling it again.
They release the GIL (``nogil``), so the shard's other threads (other connections, metrics, the
checkpointer) run while a table is updated. The decorator that compiles them so (``compiled``)
and the prefetch hint (``prefetch``) are here (``compiled`` is ``tether.rules.kernel_cache.compiled``,
whose disk cache entries are keyed by the helpers a kernel inlines too), and ``row_kernels`` uses
them as well.
"""

from __future__ import annotations

from typing import Any

import numba
import numba.extending
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba.core import cgutils

from tether.rules.kernel_cache import compiled

__all__ = [
    "EMPTY_SLOT", "REMOVED_SLOT", "cell_from", "count_linked", "index_cells", "index_lookup", "index_place", "log_record", "mix64",
    "prefetch", "shard_loads", "slot_cells", "slot_lookup", "slot_place", "slot_rebuild", "warm_up",
]

# A cell's state is its slot, so that every int64 is a valid key: a slot >= 0 is a row,
# ``EMPTY_SLOT`` ends a probe chain, ``REMOVED_SLOT`` (a tombstone) is passed over like a row.
EMPTY_SLOT = -1
REMOVED_SLOT = -2
_EMPTY = EMPTY_SLOT
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)

_jit = compiled()


@compiled(inline="always")
def mix64(key: np.int64) -> np.uint64:
    """splitmix64's finaliser (``tether.protos.partition.mix64``) of one id, compiled: the hash of
    the id indexes (the shard's and the worker row cache's) and of the shard an id lives on."""
    z = np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


@compiled(inline="always")
def _home(key: np.int64, mask: np.uint64) -> np.int64:
    """An id's home cell: its hash masked to the table size."""
    return np.int64(mix64(key) & mask)


@compiled(inline="always")
def _cell(cells: np.ndarray, key: np.int64, mask: np.uint64) -> np.int64:
    """The cell holding ``key``, -1 where it is absent: linear probing from its home cell."""
    return cell_from(cells, key, _home(key, mask), mask)


@compiled(inline="always")
def cell_from(cells: np.ndarray, key: np.int64, p: np.int64, mask: np.uint64) -> np.int64:
    """The cell holding ``key``, -1 where it is absent: linear probing from cell ``p`` (its
    home cell, taken apart where a pass computes it ahead; the worker's row cache too).

    A cell's slot is read before its key: a writer stores them in the other order, so a slot
    that says "row" comes with its final key.
    """
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


# The shard tables' id index (``tether.server.storage.index``): int32 cells over the keys, which live
# in a separate array by slot (``keys[slot]`` is the slot's id). A live cell holds its slot in
# the low ``bits`` bits and a fingerprint of its id's hash in the bits above (31 - ``bits`` of
# them, none when ``bits`` is 31), so a probe compares a key only where the fingerprint matches;
# ``EMPTY_SLOT`` and ``REMOVED_SLOT`` mark cells as in the cells above. A key's home is the high
# 32 bits of its splitmix64 hash scaled to the number of cells (any number below 2**32, not
# only powers of two); the fingerprint is taken from its low bits.




@compiled(inline="always")
def _start(h: np.uint64, n: np.uint64) -> np.int64:
    return np.int64(((h >> np.uint64(32)) * n) >> np.uint64(32))


@compiled(inline="always")
def _probe(cells: np.ndarray, keys: np.ndarray, bits: np.int64, key: np.int64, p: np.int64) -> np.int64:
    """The cell holding ``key``, -1 where it is absent, probing from cell ``p`` (its home cell,
    or one past a cell already passed). A cell is read before the key of its slot: a writer
    stores the key first, so a cell that names a slot comes with its key."""
    n = len(cells)
    h = mix64(key)
    fp = np.int64(h & np.uint64((1 << (31 - bits)) - 1))
    smask = (np.int64(1) << bits) - 1
    nkeys = len(keys)
    while True:
        c = np.int64(cells[p])
        if c == _EMPTY:
            return np.int64(-1)
        if c >= 0 and (c >> bits) == fp:
            s = c & smask
            if s < nkeys and keys[s] == key:
                return p
        p += 1
        if p == n:
            p = np.int64(0)


@numba.extending.intrinsic
def prefetch(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Hint the CPU to fetch ``arr[idx]`` into the cache (LLVM's ``prefetch``: read, high
    locality); no effect on the program's meaning."""
    sig = numba.types.void(arr, idx)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


# How many ids ahead a lookup asks for the cells (and keys) it will read.
_AHEAD = 16


@_jit
def slot_lookup(cells: np.ndarray, keys: np.ndarray, bits: int, ids: np.ndarray) -> np.ndarray:
    """Slot of each id (int64), -1 where absent, in ``cells`` (int32) over ``keys``.

    Three passes over the batch so that the reads of one id do not wait for the memory of the
    one before: every id's home cell; each id's first cell whose fingerprint matches (or an
    empty one), with the home cell ``_AHEAD`` ids on prefetched; then each candidate's key
    compared, its key prefetched ``_AHEAD`` ids on (a candidate whose key is another id, one
    in 2**(31 - bits) cells passed, goes on probing from there). Every cell is still read
    before the key of its slot."""
    m, n = len(ids), len(cells)
    out = np.empty(m, np.int64)
    where = np.empty(m, np.int64)
    fmask = np.uint64((1 << (31 - bits)) - 1)
    smask = (np.int64(1) << bits) - 1
    for i in range(m):
        where[i] = _start(mix64(ids[i]), np.uint64(n))
    for i in range(m):
        if i + _AHEAD < m:
            prefetch(cells, where[i + _AHEAD])
        p = where[i]
        fp = np.int64(mix64(ids[i]) & fmask)
        while True:
            c = np.int64(cells[p])
            if c == _EMPTY:
                out[i] = -1
                break
            if c >= 0 and (c >> bits) == fp:
                out[i] = c & smask
                break
            p += 1
            if p == n:
                p = 0
        where[i] = p
    nkeys = len(keys)
    for i in range(m):
        if i + _AHEAD < m and out[i + _AHEAD] >= 0:
            prefetch(keys, min(out[i + _AHEAD], nkeys - 1))
        s = out[i]
        if s >= 0 and (s >= nkeys or keys[s] != ids[i]):
            p = where[i] + 1
            p = _probe(cells, keys, bits, ids[i], 0 if p == n else p)
            out[i] = -1 if p < 0 else np.int64(cells[p]) & smask
    return out


@_jit
def slot_cells(cells: np.ndarray, keys: np.ndarray, bits: int, ids: np.ndarray) -> np.ndarray:
    """Cell of each id, -1 where absent."""
    out = np.empty(len(ids), np.int64)
    n = np.uint64(len(cells))
    for i in range(len(ids)):
        out[i] = _probe(cells, keys, bits, ids[i], _start(mix64(ids[i]), n))
    return out


@compiled(inline="always")
def _put(cells: np.ndarray, bits: np.int64, key: np.int64, slot: np.int64) -> None:
    n = len(cells)
    h = mix64(key)
    p = _start(h, np.uint64(n))
    fp = np.int64(h & np.uint64((1 << (31 - bits)) - 1))
    while cells[p] != _EMPTY:
        p += 1
        if p == n:
            p = 0
    cells[p] = (fp << bits) | slot


@_jit
def slot_place(cells: np.ndarray, bits: int, ids: np.ndarray, new_slots: np.ndarray) -> None:
    """Insert absent, unique ``ids`` with their slots (each in [0, 2**bits)) into empty cells;
    the caller has stored each id at ``keys[slot]`` before, and keeps the load factor below 1."""
    for i in range(len(ids)):
        _put(cells, bits, ids[i], new_slots[i])


@_jit
def slot_rebuild(old: np.ndarray, old_bits: int, cells: np.ndarray, bits: int, keys: np.ndarray) -> None:
    """Place every live cell of ``old`` (its slots' ids in ``keys``) into the empty ``cells``."""
    smask = (np.int64(1) << old_bits) - 1
    for p in range(len(old)):
        c = np.int64(old[p])
        if c >= 0:
            s = c & smask
            _put(cells, bits, keys[s], s)


_SPAN32 = np.int64(0xFFFFFFFF)  # positions kept modulo 2**32 (``RowVersions.last``)


@compiled(inline="always")
def _entries_since(ring: np.ndarray, mask: np.int64, p: np.int64, since: np.int64) -> np.int64:
    """How many entries a row has in the update log from position ``since`` on: its entry at
    ``p`` and those its links lead back to (``log_record``'s ring)."""
    c = np.int64(0)
    while p >= since:
        c += 1
        g = ring[p & mask, 1]
        if g == 0:
            break
        p -= g
    return c


@_jit
def log_record(ring: np.ndarray, rows: np.ndarray, slots: np.ndarray, at: np.int64, begin: np.int64, offset: np.int64, count: bool,
               after: np.int64, since: np.int64, whole: np.int64) -> np.int64:
    """An update's ``slots`` (int64, unique, below 2**31) into the update log from position
    ``at`` on, and each row's version set to ``offset`` (``rows[s, 0]``): ``ring`` (int32 pairs, a
    power of two of them; position p at ``p % size``; the log holds positions from ``begin``)
    gets each slot and how far back that row's entry before lies (0 where it is not in the log,
    or is not the row's: a row's last position, ``rows[s, 1]``, is modulo 2**32 and may be one it
    never had in the log), and ``rows[s, 1]`` the new entry's position.

    With ``count``, first each row's staleness as ``count_linked`` counts it (its version then
    later than ``after``: ``whole``, or its entries from ``since`` on, which must all still be
    held from ``begin`` on), walked from the entry it is linked to anyway; returns the largest
    (-1: no row updated since, or not counted)."""
    mask = np.int64(len(ring) - 1)
    largest = np.int64(-1)
    for i in range(len(slots)):
        s = slots[i]
        p = at + i
        q = p - ((p - np.int64(rows[s, 1])) & _SPAN32)
        linked = begin <= q < p and ring[q & mask, 0] == s
        if count and rows[s, 0] > after:
            c = whole
            if whole < 0:
                c = _entries_since(ring, mask, q, since) if linked else np.int64(0)
            largest = max(largest, c)
        ring[p & mask, 0] = s
        ring[p & mask, 1] = p - q if linked else 0
        rows[s, 0] = offset
        rows[s, 1] = np.int32(np.uint32(p & _SPAN32))
    return largest


@_jit
def count_linked(slots: np.ndarray, rows: np.ndarray, after: np.int64, ring: np.ndarray, since: np.int64, end: np.int64, whole: np.int64,
                 out: np.ndarray) -> np.int64:
    """A push's per-row staleness in one pass: for each of ``slots`` (int64; -1: not a row) whose
    last update (``rows[s, 0]``, int32) is later than ``after``, how many entries it has in the
    update log from position ``since`` on (``log_record``'s ring, and each row's last position
    ``rows[s, 1]``; the log's end ``end``), found by walking back its own entries from its last,
    or ``whole`` for each where ``whole`` >= 0 (a read older than the log); written to ``out``
    (0 for the others). Returns the largest, or -1 where no row was updated since. The work is
    the rows' own staleness: no entry of another row is read."""
    mask = np.int64(len(ring) - 1)
    largest = np.int64(-1)
    for i in range(len(slots)):
        out[i] = 0
        s = slots[i]
        if s < 0 or rows[s, 0] <= after:
            continue
        c = whole
        if whole < 0:
            p = end - ((end - np.int64(rows[s, 1])) & _SPAN32)
            # From the row's last entry (none in the log where that position is not its).
            c = _entries_since(ring, mask, p, since) if p < end and ring[p & mask, 0] == s else np.int64(0)
        out[i] = c
        largest = max(largest, c)
    return largest


def _load_slot_lookup() -> None:
    ids = np.arange(2, dtype=np.int64)
    wire = np.frombuffer(ids.tobytes(), np.int64)  # a request's ids: read-only, from its bytes
    slot_lookup(np.full(16, _EMPTY, np.int32), ids.copy(), 1, wire)


def _load_slot_place() -> None:
    ids = np.arange(2, dtype=np.int64)
    slot_place(np.full(16, _EMPTY, np.int32), 1, ids, ids.copy())


def _load_slot_rebuild() -> None:
    slot_rebuild(np.full(16, _EMPTY, np.int32), 1, np.full(16, _EMPTY, np.int32), 1, np.arange(2, dtype=np.int64))


def _load_update_log() -> None:
    ring, rows, slots = np.zeros((4, 2), np.int32), np.ones((2, 2), np.int32), np.arange(2, dtype=np.int64)
    log_record(ring, rows, slots, np.int64(0), np.int64(0), np.int64(1), True, np.int64(0), np.int64(0), np.int64(-1))
    count_linked(slots, rows, np.int64(0), ring, np.int64(0), np.int64(2), np.int64(-1), np.empty(2, np.int64))


def shard_loads() -> list[Any]:
    """Calls that load the kernels of the shard tables' index that a shard uses in every job,
    for the types it calls them with (lookup, insert, a growing table's rebuild, and
    the update log's record and count: a push's staleness); a removal's is loaded at its first use."""
    return [_load_slot_lookup, _load_slot_place, _load_slot_rebuild, _load_update_log]


def warm_up() -> None:
    """Load (or compile, the first time) every kernel here for the types the shard and the
    row cache use (``row_kernels.warm_up`` calls it)."""
    cells = np.full((16, 2), _EMPTY, np.int64)
    ids = np.arange(2, dtype=np.int64)
    index_place(cells, ids, ids.copy())
    index_cells(cells, ids)
    index_lookup(cells, ids)
    slots32 = np.full(16, _EMPTY, np.int32)
    keys = ids.copy()
    slot_place(slots32, 1, ids, ids.copy())
    slot_lookup(slots32, keys, 1, ids)
    slot_cells(slots32, keys, 1, ids)
    slot_rebuild(slots32, 1, np.full(16, _EMPTY, np.int32), 1, keys)
    _load_update_log()
