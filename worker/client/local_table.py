"""Local mode's storage (``tether.worker.client.local``): a table's rows and a dense parameter in this
process, created and updated with the shards' rules and initial values."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from tether.protos.errors import UsageError
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.initial import init_rows
from tether.rules.optimizers import rule
from tether.rules.push_hooks import combine_rows
from tether.rules.update_rules import UpdateRule

__all__ = ["LocalDense", "LocalTable"]

# Rows of an empty table (grows by half as needed).
_INITIAL_ROWS = 1024
_GROWTH = 1.5
# The last updates of a table whose rows are remembered, to count a push's staleness as a shard does.
_LOG_UPDATES = 16


class _Index:
    """Id -> slot: a sorted array of ids and their slots, plus a small sorted one of recent
    inserts merged into it once it outgrows a sixteenth of it (lookups are two vectorised binary
    searches; an insert moves the small array, and the large one only at a merge)."""

    def __init__(self) -> None:
        self._keys = np.empty(0, np.int64)
        self._slots = np.empty(0, np.int64)
        self._new_keys = np.empty(0, np.int64)
        self._new_slots = np.empty(0, np.int64)

    @staticmethod
    def _find(keys: np.ndarray, slots: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
        if not len(keys):
            return
        pos = np.searchsorted(keys, ids).clip(max=len(keys) - 1)
        hit = keys[pos] == ids
        out[hit] = slots[pos[hit]]

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where absent."""
        out = np.full(len(ids), -1, np.int64)
        self._find(self._keys, self._slots, ids, out)
        self._find(self._new_keys, self._new_slots, ids, out)
        return out

    @staticmethod
    def _merge(keys: np.ndarray, slots: np.ndarray, ids: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.searchsorted(keys, ids)
        return np.insert(keys, at, ids), np.insert(slots, at, new)

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Add absent ids (sorted, unique) with their slots."""
        self._new_keys, self._new_slots = self._merge(self._new_keys, self._new_slots, ids, slots)
        if len(self._new_keys) > max(4096, len(self._keys) >> 4):
            self._keys, self._slots = self._merge(self._keys, self._slots, self._new_keys, self._new_slots)
            self._new_keys, self._new_slots = self._new_keys[:0], self._new_slots[:0]


class LocalTable:
    """One embedding table in this process: rows keyed by int64 id, created on first touch with
    the shards' initial values and updated with the table's rule, as a shard's table is."""

    def __init__(self, config: TableConfig) -> None:
        if config.capacity or config.min_count > 1:
            raise UsageError(
                f"table {config.name!r}: local mode keeps every row, so capacity={config.capacity} and "
                f"min_count={config.min_count} need shards; leave them at 0 and 1 to train in this process"
            )
        self.config = config
        self.dim = config.dim
        self.version = 0
        self._rule = rule(config.optimizer.name)
        self._state_shapes = self._rule.state_shapes(config.dim)
        self._initial_state = self._rule.initial_state(config.optimizer)
        self._index = _Index()
        self._used = 0
        self._weights = torch.empty(_INITIAL_ROWS, config.dim)
        self._state = {k: torch.zeros(_INITIAL_ROWS, *s) for k, s in self._state_shapes.items()}
        # Per-row staleness as a shard counts it: the version of each row's last update, and
        # the rows of the last updates.
        self._row_version = np.zeros(_INITIAL_ROWS, np.int64)
        self._log: deque[tuple[int, np.ndarray]] = deque(maxlen=_LOG_UPDATES)

    @property
    def rows(self) -> int:
        """Number of rows created so far."""
        return self._used

    def _grow(self, need: int) -> None:
        cap = self._weights.shape[0]
        if need <= cap:
            return
        cap = max(need, int(cap * _GROWTH) + 1)
        n = self._used
        weights = torch.empty(cap, self.dim)
        weights[:n] = self._weights[:n]
        self._weights = weights
        for k, s in self._state_shapes.items():
            t = torch.zeros(cap, *s)
            t[:n] = self._state[k][:n]
            self._state[k] = t
        row_version = np.zeros(cap, np.int64)
        row_version[:n] = self._row_version[:n]
        self._row_version = row_version

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """Row slot of each id (repeats allowed), creating the missing rows."""
        slots = self._index.lookup(ids)
        missing = slots < 0
        if missing.any():
            fresh, where = np.unique(ids[missing], return_inverse=True)
            start, k = self._used, len(fresh)
            self._grow(start + k)
            cfg = self.config
            init_rows(fresh, self.dim, cfg.seed, cfg.name, cfg.init_scale, out=self._weights.numpy()[start:start + k])
            for name, t in self._state.items():
                t[start:start + k] = self._initial_state.get(name, 0.0)
            new = np.arange(start, start + k, dtype=np.int64)
            self._index.insert(fresh, new)
            self._used += k
            slots[missing] = new[where.reshape(-1)]
        return slots

    def pull(self, ids: np.ndarray) -> torch.Tensor:
        """The rows of ``ids`` (a copy)."""
        slots = torch.from_numpy(self.slots(ids))  # first: creating rows may replace the storage
        return self._weights.index_select(0, slots)

    def staleness(self, ids: np.ndarray, read_version: int) -> int:
        """The most updates any row of ``ids`` received since a read at ``read_version``."""
        if self.version <= read_version:
            return 0
        slots = self._index.lookup(ids)
        slots = slots[slots >= 0]
        newer = slots[self._row_version[slots] > read_version]
        if not len(newer):
            return 0
        since = [updated for version, updated in self._log if version > read_version]
        if len(since) < self.version - read_version:  # the log does not reach back that far
            return self.version - read_version
        hits = np.zeros(len(newer), np.int64)
        for updated in since:
            hits += np.isin(newer, updated)
        return int(hits.max())

    def _step(self, slots: np.ndarray, grads: torch.Tensor, factor: float) -> None:
        """Rows ``slots`` (unique) stepped by the rule's torch form, one gradient each."""
        if not len(slots):
            return
        index = torch.from_numpy(slots)
        w = self._weights.index_select(0, index)
        state = {k: t.index_select(0, index) for k, t in self._state.items()}
        self._rule.apply(self.config.optimizer, w, grads, state, factor)
        self._weights.index_copy_(0, index, w)
        for k, t in self._state.items():
            t.index_copy_(0, index, state[k])

    @property
    def rule(self) -> UpdateRule:
        return self._rule

    def push(self, ids: np.ndarray, grads: torch.Tensor, clock: int = 0, combined: torch.Tensor | None = None) -> int:
        """Apply one gradient per id (unique ids) with the table's rule, at its schedule's rate
        for ``clock`` as a shard does; returns the new version. ``combined``: a combined push's
        statistics per row: its rows of one gradient take the ordinary step, the others the
        rule's combine by the function a shard applies them with (``push_hooks.combine_rows``)."""
        slots = self.slots(ids)
        opt = self.config.optimizer
        factor = opt.schedule.factor(opt.lr, clock)
        if combined is None:
            self._step(slots, grads, factor)
        else:
            one = combined[:, 0] == -1
            many = ~one
            if bool(many.any()):
                lr = np.full(int(many.sum()), opt.lr * factor, np.float32)
                combine_rows(self._rule, opt, self._weights, self._state, slots[many.numpy()], grads.detach()[many].numpy(), lr,
                             combined[many])
            self._step(slots[one.numpy()], grads[one], factor)
        self.version += 1
        self._row_version[slots] = self.version
        self._log.append((self.version, slots))
        return self.version


class LocalDense:
    """One dense parameter in this process: its flat value, the rule's state and a version."""

    def __init__(self, init: torch.Tensor, optimizer: OptimizerConfig) -> None:
        self.shape = tuple(init.shape)
        self.optimizer = optimizer
        self.value = init.detach().reshape(-1).to("cpu", torch.float32).clone()
        self._rule = rule(optimizer.name).dense_rule()  # as a shard's DenseChunk steps it
        initial = self._rule.initial_state(optimizer)
        self.state = {k: torch.full(s, initial.get(k, 0.0)) for k, s in self._rule.state_shapes(self.value.numel()).items()}
        self.version = 0

    def push(self, grad: torch.Tensor, clock: int = 0) -> None:
        opt = self.optimizer
        self._rule.apply(opt, self.value, grad, self.state, opt.schedule.factor(opt.lr, clock))
        self.version += 1
