"""A worker-side cache of embedding rows with per-row staleness bounds (HET's two bounds).

``RowCache`` keeps up to ``rows`` rows per table. Each cached row remembers the worker clock it
was read at and the table version the shard read it at. With read bound R > 0 a pull at clock
``now`` is answered from the cache for every row read at a clock >= ``now - R``; the others are
pulled (refreshed). A step's row gradients are added to the rows' pending sums; a row's sum is
pushed once its oldest gradient is W (the write bound) clocks old, when the row is evicted, or
at a flush (evaluation, the end of training). R = W = 0 sends exactly what no cache sends (every
row pulled, every gradient pushed in the step it was made).

Read-your-own-writes (once ``use_tables`` names the tables' rules, as ``Trainer`` does after it
declares them; read bound > 0): each step's gradients are applied to the cached rows as they are
held, by the table's rule with its learning rate, schedule and weight decay, and with a rule state
of the worker's own per cached row (Adagrad's sum, Adam's moments and count, FTRL's z and n),
started at the rule's initial state when the row is cached and kept while it stays (the shard's
state is never pulled). For SGD that is the shard's step exactly; for the others an estimate
from this worker's gradients alone (with one worker the shard's own state, the row never evicted;
with several, short of the other workers' gradients). A refresh stores the shard's answer plus the worker's own
changes that answer lacks: those of the gradients still held when the refresh was planned and
of every step since (so with SGD a refreshed row is the shard's value once the held gradients
land).

A combined push is the **sum** of the row's pending gradients, sent as one gradient, and, once
``use_tables`` named the rules, what the table's rule needs to update its state as if it had taken
the k steps (``UpdateRule.combined_stats``, ``SparseBlock.combined``): for Adagrad, row-wise
Adagrad and FTRL one float per row, the sum over the k gradients of mean(g * g); for Adam that
and the count k; nothing for SGD, whose step on the sum is the k steps. A row that holds one
gradient sends -1 there and takes the ordinary step; a push none of whose rows combine (write
bound 0) sends nothing, so it is exactly what no cache sends. The shard applies the rule's
``combine`` (``protos.update_rules``, ``protos.ctr_rules``). The sum is what the shard's state
stays authoritative on; the local copy's own steps are never pushed. Its read version is the
oldest read version of the rows it combines, so shards count its staleness from the oldest read
(conservative).

Admission (``RowCacheConfig.admission``, ``--cache-admission``): ``all`` caches every missed row;
``recurring`` caches a missed row only when it was missed before within max(R, W) clocks (a
doorkeeper of the clock each id's hash was last missed at, ``plan_all``). A row not cached is
answered from the pull and its gradient pushed in its own step, merged into the held sums due
(``batch.with_unheld``): exactly what no cache does with it.

A pull whose table version for a shard went back (a restarted shard, a reset table) marks every
cached row of that shard and table stale: they are refreshed by the next pull that wants them.

``CachedClient`` (``tether.worker.cache.client``) puts the cache in front of a client (pull, push,
push_pull, flush) and counts the traffic (``tether.worker.client.traffic``); with no cache it
passes calls through unchanged.
Each table's slots and id index (a compiled hash table) are ``tether.worker.cache.slots.Table``;
each step's passes (plan, store, hold with the local rule's changes, take) are compiled loops
over all tables at once, one call each (``tether.worker.cache.batch``); the push side (hold,
take) is the second half of ``RowCache``. ``take_all`` writes a push's sums and its combined
statistics in the layout the wire takes (one buffer each; a table's part is a view of them).
The local rule's step is taken inside ``hold_all``, table by table while its rows are in the CPU's
caches, by each rule's own compiled kernel (``tether.rules.rows_by_rule``); a new row's rule state
is set as ``store_all`` places it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tether.protos.framing import ALIGN
from tether.protos.specs import TableConfig
from tether.rules.optimizers import rule
from tether.rules.rows_by_rule import MAX_CONSTANTS, rule_code, rule_constants, rule_states
from tether.worker.cache.batch import hold_all, later_all, plan_all, store_all, take_all, with_unheld
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.kernels import HELD, PS, VALS, Columns, columns, set_cells, typed_list
from tether.worker.cache.parts import (
    NO_FLIGHTS,
    NO_IDS,
    NO_KEEP,
    Plan,
    Pushed,
    flat_rows,
    joined_ids,
    offsets,
    read_versions,
)
from tether.worker.cache.slots import NONE, STALE, Due, Table, Taken, coalesce, start_warm_up, wait_warm_up
from tether.worker.cache.split import group_ids, pack_push
from tether.worker.client.results import PullResult
from tether.worker.client.router import PackedParts, PackedPush

__all__ = ["RowCache"]

# The admission doorkeeper's entries per table (``RowCache._door``, 8 bytes each): at least, and at
# most (8 MiB a table: at --preset gpu's ~2,650 new ids a table and step over a window of 20, a
# collision admits ~1 id in 3 early, and 26 tables hold 208 MiB, counted in ``memory_bytes``).
DOOR_MIN, DOOR_MAX = 1 << 12, 1 << 20

class RowCache:
    """Cached rows of every table with their read clocks, versions and pending gradients
    (see the module docstring). Thread-safe: on CUDA the transfer thread calls it too."""

    def __init__(self, config: RowCacheConfig, dims: Mapping[str, int], num_shards: int) -> None:
        self.config = config
        self.num_shards = max(num_shards, 1)
        self.tables = {t: Table(d, config.rows) for t, d in dims.items()}
        self._tabs, self._names = list(self.tables.values()), list(self.tables)
        self._index = {t: g for g, t in enumerate(self.tables)}
        self._cols: Columns | None = None  # made at the first step (``_columns``), once the passes are loaded
        self._dims = np.array(list(dims.values()), np.int64)
        # Per table and shard: the largest table version seen (-1: none yet).
        self._max_version = [[-1] * self.num_shards for _ in dims]
        self._holding = np.zeros(len(dims), np.int64)  # per table: slots whose gradients are held
        # Per table: its rule's code (``row_kernels.rows_of_rule``) where it is applied to the
        # cached rows, else -1; where its state arrays start in ``_states`` and its constants.
        self._rules = np.full(len(dims), -1, np.int64)
        self._sbase = np.zeros(len(dims), np.int64)
        self._scount = np.zeros(len(dims), np.int64)
        self._sinit = np.zeros(1, np.float32)  # per state array of ``_states``: a new row's value
        self._consts = np.zeros((len(dims), MAX_CONSTANTS))
        # Every local rule's state arrays (one unused first), and in the typed list the passes take
        # (built anew from the Python list: indexing a typed list from Python compiles numba's list
        # methods in every process, ~2 s a worker).
        self._state_arrays = [np.zeros((1, 1), np.float32)]
        self._states = typed_list(self._state_arrays)
        self._dim_list = [int(d) for d in dims.values()]
        # Per table: what its rule takes beside a combined sum (``take_all``'s kinds: 0 the sum of
        # mean(g * g), 1 the count, -1 none), and how many.
        self._kinds, self._nstats = np.full((len(dims), 1), -1, np.int64), [0] * len(dims)
        # Admission (``config.admission``): a missed id is cached once it is missed again within
        # ``_window`` clocks (0: every missed id cached). ``_door``: per table, the clock each hash
        # of a missed id was last missed at (``plan_all``), grown with the misses a step.
        self._window = max(config.bound, config.writes) if config.admission == "recurring" else 0
        self._door = np.full((len(dims), DOOR_MIN if self._window else 1), -(2 ** 62), np.int64)
        # The last step's gradients of rows not cached, pushed with the next take (``with_unheld``).
        self._unheld_now: tuple[np.ndarray, ...] | None = None
        start_warm_up()  # the compiled index and passes loaded while the worker starts; use_tables or the first step waits
        self._lock = threading.Lock()
        self._evicted: list[tuple[str, np.ndarray, torch.Tensor, np.ndarray, np.ndarray]] = []
        # The pulls in flight: their plans' ids, clocks, and the ids they refresh (all tables' one
        # after another, and per table where they start).
        self._inflight: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        # Rows first held at a clock: (clock, their slots, their tables), in clock order
        # (``_queued``), so what is due is a prefix of it, found without a scan.
        self._queue: list[tuple[int, np.ndarray, np.ndarray]] = []
        # Held rows due at the next take before their write bound (``_early``): (their first held clocks, slots, tables).
        self._early: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._parts: dict[tuple[str, ...], tuple[list[str], np.ndarray]] = {}
        self.hits = dict.fromkeys(dims, 0)
        self.refreshed = dict.fromkeys(dims, 0)
        self.evictions = dict.fromkeys(dims, 0)
        self.invalidated = dict.fromkeys(dims, 0)
        self.passed = dict.fromkeys(dims, 0)  # misses not admitted: pulled and pushed as with no cache

    def use_tables(self, tables: Sequence[TableConfig]) -> None:
        """The rules the shards apply to the tables (the specs the worker declared): from now on
        the worker's own gradients are applied to its cached rows (read-your-own-writes). Not
        with read bound 0, whose every pull answers with the shards' rows as they are."""
        self._columns()  # the compiled passes' load (started when the cache was made) waited for here, before the steps' clock
        with self._lock:
            for spec in tables:
                if spec.name in self.tables:
                    self.tables[spec.name].combined_stats = rule(spec.optimizer.name).combined_stats
                    if self.config.bound > 0:
                        self._local_rule(spec)
            stats = [tab.combined_stats for tab in self._tabs]
            self._kinds = np.full((len(stats), max([1, *map(len, stats)])), -1, np.int64)
            for g, names in enumerate(stats):
                self._kinds[g, : len(names)] = [1 if n == "count" else 0 for n in names]
            self._nstats = [len(names) for names in stats]

    def _local_rule(self, spec: TableConfig) -> None:
        """Table ``spec``'s rule applied to its cached rows from now on (``hold_all`` takes its step)."""
        g, tab = self._index[spec.name], self.tables[spec.name]
        tab.local_rule(spec.optimizer)
        r = rule(spec.optimizer.name)
        states = rule_states(r, tab.state)
        self._sbase[g], self._scount[g] = len(self._state_arrays), len(states)
        self._state_arrays += states
        self._states = typed_list(self._state_arrays)
        self._sinit = np.concatenate([self._sinit, np.array([tab.initial.get(k, 0.0) for k in tab.state], np.float32)])
        self._consts[g] = rule_constants(r, spec.optimizer)
        self._rules[g] = rule_code(spec.optimizer.name)

    def _columns(self) -> Columns:
        """The tables' columns for the compiled passes, made once those are loaded (waits for
        ``start_warm_up``'s load the first time; its error raised here)."""
        if self._cols is None:
            wait_warm_up()
            self._cols = columns(self._tabs)
        return self._cols

    def _split(self, names: Sequence[str]) -> tuple[list[str], np.ndarray]:
        """``names`` in table order, and their table indexes."""
        key = tuple(names)
        got = self._parts.get(key)
        if got is None:
            ordered = sorted(names, key=self._index.__getitem__)
            got = self._parts[key] = (ordered, np.array([self._index[t] for t in ordered], np.int64))
        return got

    def _flights(self, now: int) -> tuple[np.ndarray, np.ndarray]:
        """The ids the pulls in flight (planned within the read bound) refresh, and per pull and table where they start."""
        self._inflight[:] = [e for e in self._inflight if now - e[1] <= self.config.bound]
        if not self._inflight:
            return NO_IDS, NO_FLIGHTS
        if len(self._inflight) == 1:
            return self._inflight[0][2], self._inflight[0][3].reshape(1, -1)
        base = np.cumsum([0] + [len(e[2]) for e in self._inflight[:-1]])
        return np.concatenate([e[2] for e in self._inflight]), np.stack([e[3] + b for e, b in zip(self._inflight, base, strict=False)])

    def plan(self, sparse: Mapping[str, torch.Tensor], now: int) -> Plan:
        """Split a pull of ``sparse`` (table -> sorted unique ids) at clock ``now``."""
        names, parts, ids, counts, offs = self._pull_ids(sparse)
        row_offs = offsets(counts * self._dims[parts])
        out = torch.empty(int(row_offs[-1]))
        oldest = np.full((len(names), self.num_shards), NONE, np.int64)
        with self._lock:
            _, miss, later, miss_offs, miss_ids, _, keep = self._plan_ids(names, parts, ids, offs, now, out.numpy(), row_offs, oldest,
                                                                          id(out))
        plan = Plan(now, names, parts, ids, offs, out, row_offs, oldest, later, miss, miss_offs, keep)
        plan.miss = {t: torch.from_numpy(miss_ids[miss_offs[k]: miss_offs[k + 1]]) for k, t in enumerate(names)}
        plan.splits = self._miss_splits(names, miss_ids, miss_offs)
        return plan

    def _miss_splits(self, names: Sequence[str], miss_ids: np.ndarray,
                     miss_offs: np.ndarray) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
        """Each table's missed ids (``miss_ids[miss_offs[k]:miss_offs[k + 1]]``) split by shard as
        ``split_ids`` splits them (``split.group_ids``, one compiled pass for all tables), so that the
        router hashes none of them (``Plan.splits``)."""
        order, bounds, grouped = group_ids(miss_ids, miss_offs, self.num_shards)
        out: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        offs, b = miss_offs.tolist(), bounds.tolist()
        for k, t in enumerate(names):
            a = offs[k]
            if offs[k + 1] > a:
                row = b[k]
                out[t] = [(order[a + row[s]: a + row[s + 1]], grouped[a + row[s]: a + row[s + 1]]) for s in range(self.num_shards)]
        return out

    def _pull_ids(self, sparse: Mapping[str, torch.Tensor]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A pull's tables (names, their parts), all its ids in one array, each table's count and
        where each table's ids start."""
        names, parts = self._split(list(sparse))
        ids, offs = joined_ids([sparse[t] for t in names])
        return names, parts, ids, np.diff(offs), offs

    def _plan_ids(
        self, names: list[str], parts: np.ndarray, ids: np.ndarray, offs: np.ndarray, now: int, out: np.ndarray, row_offs: np.ndarray,
        oldest: np.ndarray, key: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``plan_all`` over a pull's ids (under the lock): each id's code, the positions of the
        misses and of the ``later`` rows, where each table's misses start, the missed ids, each
        id's slot (-1: not cached) and whether each miss is to be cached (admitted; ``NO_KEEP``:
        all); the admitted misses are noted as in flight under ``key`` (within the read bound) and
        the hits, refreshes and misses not admitted counted per table. Cached rows go into ``out``
        at ``row_offs`` (the host cache; the device cache passes no floats)."""
        bound = self.config.bound
        flights, foffs = self._flights(now) if bound > 0 else (NO_IDS, NO_FLIGHTS)
        code, done, found, miss, later, miss_offs, keep = plan_all(*self._columns(), parts, ids, offs, now, bound, flights, foffs, out,
                                                                   row_offs, oldest, self._door, self._window)
        miss_ids = ids[miss]
        passed = done[:, 2]
        some_passed = bool(passed.any())
        if bound > 0:  # only the admitted are stored: a later pull wanting the others pulls them itself
            table_offs = np.zeros(len(self._tabs) + 1, np.int64)
            table_offs[parts + 1] = np.diff(miss_offs) - passed
            self._inflight.append((key, now, miss_ids[keep] if some_passed else miss_ids, np.cumsum(table_offs)))
        for t, (hit, refreshed, n) in zip(names, done.tolist(), strict=True):
            self.hits[t] += hit
            self.refreshed[t] += refreshed
            self.passed[t] += n
        if self._window and len(miss):
            self._door_room(int((np.diff(miss_offs) - done[:, 1]).max()))  # the ids not cached a part missed
        return code, miss, later, miss_offs, miss_ids, found, keep if some_passed else NO_KEEP

    def _door_room(self, new: int) -> None:
        """The doorkeeper grown (and cleared: an id seen before is admitted a miss later) where a
        table's misses of ids not cached this step (``new``), over the window, would fill an
        eighth of it."""
        size = self._door.shape[1]
        if 8 * new * self._window > size and size < DOOR_MAX:
            size = min(DOOR_MAX, 1 << int(8 * new * self._window).bit_length())
            self._door = np.full((len(self._tabs), size), -(2 ** 62), np.int64)

    def merge(self, plan: Plan, pulled: PullResult) -> tuple[PullResult, dict[str, torch.Tensor]]:
        """The pull's answer for every id of the plan (cached rows and pulled ones), and the
        pulled rows stored. Its table versions are, per shard and table, the oldest of any row's.
        Also returns, per table, the ids of ``later`` rows the cache still lacks (an earlier pull
        that never came back): the caller pulls those and ``fill``s them in."""
        versions = dict(pulled.table_versions)
        lacking: dict[str, torch.Tensor] = {}
        names = plan.names
        with self._lock:
            if len(plan.miss_pos):
                self._store(plan, pulled)
            if self.config.bound > 0:
                flight = self._flight_key(plan)
                self._inflight[:] = [e for e in self._inflight if e[0] != flight]
            if len(plan.later):
                loffs = np.searchsorted(plan.later, plan.offs)
                gone = self._later(plan, loffs)
                if len(gone):
                    at = np.searchsorted(loffs, gone, side="right") - 1
                    for k in np.unique(at).tolist():
                        lacking[names[k]] = torch.from_numpy(plan.ids[plan.later[gone[at == k]]])
        rows = self._answer_rows(plan, pulled)
        for k, row in enumerate(plan.oldest.tolist()):
            for sh, v in enumerate(row):
                if v != NONE:
                    key = (sh, names[k])
                    versions[key] = min(v, versions.get(key, v))
        return PullResult(rows, pulled.dense, versions, pulled.dense_versions, pulled.ack), lacking

    # ``merge``'s parts that depend on where the answer's rows are (the device cache's differ).

    def _flight_key(self, plan: Plan) -> int:
        """The key ``plan``'s pull was noted in flight under (``_plan_ids``): its answer buffer's id."""
        return id(plan.out)

    def _later(self, plan: Plan, loffs: np.ndarray) -> np.ndarray:
        """The ``later`` rows (part k's ``loffs[k]:loffs[k + 1]``) into the answer from the cache
        where it holds them recently enough (``later_all``); the indexes in ``plan.later`` of the others."""
        return later_all(*self._columns(), plan.parts, plan.ids, plan.offs, plan.later, loffs, plan.now - self.config.bound,
                         plan.out.numpy(), plan.row_offs, plan.oldest)

    def _answer_rows(self, plan: Plan, pulled: PullResult) -> dict[str, torch.Tensor]:
        """The answer's rows per table (views of the plan's buffer), in the pulled rows' dtype."""
        rows: dict[str, torch.Tensor] = {}
        out, offs, row_offs = plan.out.numpy(), plan.offs.tolist(), plan.row_offs.tolist()
        for k, (t, g) in enumerate(zip(plan.names, plan.parts.tolist(), strict=False)):
            got = pulled.rows.get(t)
            part = torch.from_numpy(out[row_offs[k]: row_offs[k + 1]].reshape(offs[k + 1] - offs[k], self._dim_list[g]))
            rows[t] = part if got is None or got.dtype == torch.float32 else part.to(got.dtype)
        return rows

    def _read_versions(self, pulled: PullResult, names: Sequence[str]) -> np.ndarray:
        """``read_versions(pulled, names, num_shards)``, noting each table version seen: where a
        shard's went back (restarted from a checkpoint, or reset), the rows read from it before
        are refreshed on their next pull."""
        out = [[0] * self.num_shards for _ in names]
        where = {t: k for k, t in enumerate(names)}
        seen = self._max_version  # per table, per shard (Python lists: read and set per entry, a step)
        for (s, t), v in pulled.table_versions.items():
            k = where.get(t)
            if k is None or s >= self.num_shards:
                continue
            out[k][s] = v
            g = self._index[t]
            last = seen[g][s]
            if v < last:
                tab = self._tabs[g]
                stale = np.flatnonzero(tab.used[: tab.top] & (tab.shard[: tab.top] == s))
                tab.read_clock[stale] = STALE
                self.invalidated[t] += len(stale)
            seen[g][s] = v
        return np.array(out, np.int64).reshape(len(names), self.num_shards)

    def _store(self, plan: Plan, pulled: PullResult) -> None:
        """The pulled rows into the cache: refreshed where cached, placed (evicting where the
        table is full) where not; the answer's rows of them as stored (with the worker's own
        changes the shard's answer lacks)."""
        names, parts, moffs = plan.names, plan.parts, plan.miss_offs
        versions = self._read_versions(pulled, names)
        # The parts something was pulled for, joined (one cat while their widths agree: a part with
        # nothing pulled adds nothing, and no empty tensor of another shape breaks the fast path).
        got = [pulled.rows[t] if w else None for t, w in zip(names, (moffs[1:] > moffs[:-1]).tolist(), strict=True)]
        flat, got_offs = flat_rows([r for r in got if r is not None]), offsets([0 if r is None else r.numel() for r in got])
        keys, pos = plan.ids[plan.miss_pos], plan.miss_pos
        got_row = NO_IDS  # key i is row i - moffs[k] of its part's pulled rows (store_all)
        koffs = moffs
        for attempt in range(2):
            for g, n in zip(parts.tolist(), np.diff(koffs).tolist(), strict=False):
                if self._tabs[g].room(n):
                    set_cells(self._columns().cells, g, self._tabs[g].cells)
            top = np.array([tab.top for tab in self._tabs], np.int64)
            nfree = np.array([tab.nfree for tab in self._tabs], np.int64)
            unplaced, _, nplaced, _ = store_all(*self._columns(), parts, keys, koffs, pos, flat, got_offs, got_row, versions, plan.now,
                                                  self.num_shards, top, nfree, plan.out.numpy(), plan.row_offs, plan.offs, self._states,
                                                  self._sbase, self._scount, self._sinit, plan.keep if not attempt else NO_KEEP)
            self._placed(parts, top, nfree, nplaced)
            if not len(unplaced) or attempt:
                return
            # Full tables: evict rows the current pull does not want, then place the rest.
            at = np.searchsorted(koffs, unplaced, side="right") - 1
            for k in np.unique(at).tolist():
                g = int(parts[k])
                self._evict(names[k], self._tabs[g], int((at == k).sum()), plan.ids[plan.offs[k]: plan.offs[k + 1]])
            got_row = (np.arange(len(keys), dtype=np.int64) - np.repeat(moffs[:-1], np.diff(moffs)))[unplaced]
            keys, pos, koffs = keys[unplaced], pos[unplaced], np.searchsorted(unplaced, koffs)

    def _placed(self, parts: np.ndarray, top: np.ndarray, nfree: np.ndarray, nplaced: np.ndarray) -> None:
        """After ``store_all``: the tables' slot counters and index fill (``store_all`` set the
        new rows' local rule state)."""
        for k, n in enumerate(nplaced.tolist()):
            if n:
                tab = self._tabs[int(parts[k])]
                tab.top, tab.nfree = int(top[parts[k]]), int(nfree[parts[k]])
                tab.filled += n

    def _evict(self, t: str, tab: Table, n: int, protected: np.ndarray) -> None:
        victims = tab.victims(n, protected, self.config.policy)
        if not len(victims):
            return
        held = victims[tab.pending_since[victims] != NONE]
        if len(held):
            self._evicted.append((t, tab.ids[held].copy(), tab.pending[torch.from_numpy(held)].clone(),
                                  tab.shard[held].copy(), tab.pending_version[held].copy()))
            self._holding[self._index[t]] -= len(held)
        tab.remove(victims)
        self.evictions[t] += len(victims)

    def pending_rows(self) -> int:
        """Rows whose gradients are held (counted as they are held and pushed: no scan)."""
        with self._lock:
            return int(self._holding.sum()) + sum(len(e[1]) for e in self._evicted)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes each table's cache holds (the slots used: values, pending sums, the local
        changes held and in flight, the local rule's state, their columns; the id index; the
        admission's doorkeeper)."""
        door = self._door.shape[1] * 8 if self._window else 0
        return {t: tab.size * ((tab.dim * 4 + 2) * 4 + sum(a[0].nbytes for a in tab.state.values()) + 8 * 9) + tab.index_entries() * 16
                + door for t, tab in self.tables.items()}

    # -- the push side: a step's gradients held, the due sums taken ---------------------------------

    def accumulate(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], clock: int,
                   versions: PullResult | None, flush: bool = False) -> tuple[Pushed, dict[tuple[int, str], int]]:
        """Add a step's row gradients (pushed at ``clock``) to the pending sums and return what
        is due now (``flush``: everything held), with the read version per shard and table: per
        table ``(ids, sums)``, or ``(ids, sums, stats)`` where rows combine several gradients
        (``Table.combined``)."""
        due: Due = {}
        with self._lock:
            if grads:
                self._hold(grads, clock, versions, due)
            for t, e_ids, e_grads, e_shards, e_read in self._evicted:
                due.setdefault(t, []).append((e_ids, e_grads, e_shards, e_read))
            self._evicted.clear()
            taken, oldest = self._take(clock, flush)
        return coalesce(due, taken, oldest, self._names, self.tables)

    def _take(self, clock: int, flush: bool) -> tuple[Taken | None, np.ndarray | None]:
        """The held sums due at ``clock`` (``flush``: every one; ``Taken``: the push's parts, per
        table whether its ids ascend, each row's two statistics columns; None: nothing due), and
        the oldest read version per table and shard."""
        due = self._ready(clock, flush)
        unheld, self._unheld_now = self._unheld_now, None
        if due is None and unheld is None:
            return None, None
        tables, slots, since = (NO_IDS, NO_IDS, NO_IDS) if due is None else due
        ids, sums, stats, square, grads, shards, count, ascending, many, oldest, taken = take_all(*self._columns(), tables, slots, since,
                                                                                               self.num_shards, self._kinds)
        self._holding -= count
        sums, stats, square = self._held_sums(sums, stats, square, grads, count, taken)
        if unheld is not None:  # this step's gradients of rows not cached, each one gradient (``many`` unchanged)
            ids, sums, stats, square, grads, shards, count, ascending, oldest = with_unheld(ids, sums, stats, square, grads, shards, count,
                                                                                            ascending, oldest, self._dims, self._kinds,
                                                                                            *unheld)
        return self._taken(ids, sums, stats, square, grads, shards, count, ascending, many), oldest

    def _held_sums(self, sums: np.ndarray, stats: np.ndarray, square: np.ndarray, grads: np.ndarray, count: np.ndarray,
                   slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The taken rows' sums, statistics and sums of mean(g * g), as ``take_all`` read them from
        their ``slots`` (``count`` per table, ``grads`` each row's count of gradients); the device
        cache's are on the device."""
        return sums, stats, square

    def _ready(self, clock: int, flush: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The held rows due at ``clock`` (``flush``: every one), out of the queue: their tables,
        slots and first held clocks (``take_all`` takes those still held since then); None if none."""
        queue, due = self._queue, len(self._queue)
        if not flush:
            last = clock - self.config.writes  # due: first held at this clock or before
            due = 0
            while due < len(queue) and queue[due][0] <= last:
                due += 1
        ready = queue[:due]
        early, self._early = self._early, []  # never also due by the bound (``_due_early``)
        if not ready and not early:
            return None
        del queue[:due]
        if flush:  # every held row is in ``ready``
            early = []
        if len(ready) == 1 and not early:  # the usual step: one clock's rows come due
            clock0, slots, tables = ready[0]
            return tables, slots, np.full(len(slots), clock0, np.int64)
        slots = np.concatenate([*(e[1] for e in ready), *(e[1] for e in early)])
        tables = np.concatenate([*(e[2] for e in ready), *(e[2] for e in early)])
        since = np.concatenate([*(np.full(len(e[1]), e[0], np.int64) for e in ready), *(e[0] for e in early)])
        return tables, slots, since

    def _taken(self, ids: np.ndarray, sums: np.ndarray, stats: np.ndarray, square: np.ndarray, grads: np.ndarray, shards: np.ndarray,
               count: np.ndarray, ascending: np.ndarray, many: np.ndarray) -> Taken:
        """``take_all``'s rows as a push's parts split by their known shards and laid out as each
        shard's payload (``PackedParts``: a table's part is made only where something reads it)."""
        combined = (self._kinds >= 0).any(1) & many
        order, bounds, gids, payload, starts, voff, soff = pack_push(shards, count, self.num_shards, ids, sums, stats, self._dims,
                                                                     self._kinds, combined, ALIGN // 4)
        counts = count.tolist()
        groups = [g for g, n in enumerate(counts) if n]
        packed = PackedPush(payload, starts, voff, soff, gids, offsets(counts), combined, tuple(self._names[g] for g in groups))
        return Taken(PackedParts(packed, ids, sums, stats, self._dim_list, self._nstats, order, bounds, groups), ascending, square, grads)

    def _hold(self, grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]], clock: int, versions: PullResult | None, due: Due) -> None:
        """Add the step's gradients to their rows' pending sums and apply them to the cached rows
        by the tables' rules (rows not cached: due at once)."""
        names, parts = self._split(list(grads))
        ids, offs = joined_ids([grads[t][0] for t in names])
        rows = [grads[t][1] for t in names]
        flat, g_offs = flat_rows(rows), offsets([r.numel() for r in rows])
        read = read_versions(versions, names, self.num_shards)
        rules = self._rules[parts]
        lrs = np.array([self._tabs[g].rate(clock) if r >= 0 else 0.0 for g, r in zip(parts.tolist(), rules.tolist(), strict=True)],
                       np.float32)
        held, _, first, missing, missing_shards, counts = hold_all(*self._columns(), parts, ids, offs, flat, g_offs, read, clock,
                                                                self.num_shards, rules, lrs, self._states, self._sbase[parts],
                                                                self._consts[parts])
        if len(first):
            self._holding[parts] += counts[:, 1]
            self._queued(clock, first, np.repeat(parts, counts[:, 1]))
        if self.config.hot and len(held):
            self._due_early(held, parts, counts[:, 0], clock)
        if len(missing):  # not cached (not admitted, or the table was full): pushed with this step's take, each row one gradient
            self._unheld_now = (parts, ids, offs, flat, g_offs, missing, missing_shards, read)

    def _queued(self, clock: int, slots: np.ndarray, tables: np.ndarray) -> None:
        """Rows first held at ``clock`` into the queue, kept in clock order (a push's clock is
        usually the latest: appended)."""
        at = len(self._queue)
        while at and self._queue[at - 1][0] > clock:
            at -= 1
        self._queue.insert(at, (clock, slots, tables))

    def _due_early(self, held: np.ndarray, parts: np.ndarray, counts: np.ndarray, clock: int) -> None:
        """Of the rows this step's gradients were held for (``held``: part k's ``counts[k]`` slots
        one after another), queue for this clock's push those that hold ``config.hot`` gradients
        or more (``--cache-hot``: the rows trained on every step reach the other workers within K
        clocks, not W); the write bound stays everyone's ceiling. (A significance filter, Gaia's
        ||held change|| > X ||row||, was measured and not kept: bench/RESULTS.md.)"""
        cells_l, meta_l, floats = self._columns()[:3]
        nt, writes, at = len(cells_l), self.config.writes, 0
        for k, n in enumerate(counts.tolist()):
            s, at = held[at: at + n], at + n
            if not n:
                continue
            t = int(parts[k])
            since = meta_l[t][s, PS]
            due = clock - since < writes  # those due by the bound now are taken anyway
            dim = floats[VALS * nt + t].shape[1]
            due &= floats[HELD * nt + t][s, dim + 1] >= self.config.hot  # the held gradients' count, past the sum and mean square
            if due.any():
                self._early.append((since[due], s[due], np.full(int(due.sum()), t, np.int64)))
