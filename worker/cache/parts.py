"""The worker row cache's configuration (``RowCacheConfig``) and a pull's plan (``Plan``: how a
pull's ids split between the cache and the shards), with the small array helpers the cache's
steps share (``tether.worker.cache.row_cache``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from tether.common.choices import CACHE_ADMISSIONS, CACHE_POLICIES
from tether.worker.client.results import PullResult

__all__ = ["NO_FLIGHTS", "NO_IDS", "NO_KEEP", "NO_ROWS",
           "POLICIES", "Plan", "Pushed", "RowCacheConfig", "fill", "flat_rows", "joined_ids", "offsets", "read_versions"]

POLICIES = CACHE_POLICIES  # eviction policies, declared once in tether.common.choices


@dataclass(frozen=True)
class RowCacheConfig:
    """``rows``: rows cached per table (0: no cache); ``bound``: read bound R in this worker's
    clocks (0: every pull reads the shards); ``write_bound``: W, clocks a row's gradients may be
    held before they are pushed (None: the same as ``bound``); ``policy``: eviction, lru or lfu;
    ``on_device``: where the cached rows live (``tether.worker.cache.device``): None, on the
    training device when it is a GPU (else in host memory); True, on the training device
    whatever it is (the CPU too: how CI tests the device cache); False, in host memory.
    ``hot``: a held row with K gradients is pushed with this step (0: off). ``admission``: which
    missed rows are cached: ``all``, or ``recurring``, those missed again within max(R, W) clocks
    (the others are pulled and pushed in their step, as with no cache)."""

    rows: int = 0
    bound: int = 0
    write_bound: int | None = None
    policy: str = CACHE_POLICIES[0]
    on_device: bool | None = None
    hot: int = 0
    admission: str = CACHE_ADMISSIONS[0]

    def __post_init__(self) -> None:
        for name in ("rows", "bound"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"cache_{name} (--cache-{name}) must be an int >= 0, got {value!r}")
        if self.write_bound is not None and (not isinstance(self.write_bound, int) or self.write_bound < 0):
            raise ValueError(f"cache_write_bound (--cache-write-bound) must be empty or an int >= 0, got {self.write_bound!r}")
        if isinstance(self.hot, bool) or not isinstance(self.hot, int) or self.hot < 0:
            raise ValueError(f"cache_hot (--cache-hot) must be an int >= 0, got {self.hot!r}")
        if self.admission not in CACHE_ADMISSIONS:
            raise ValueError(f"cache_admission (--cache-admission) must be one of {', '.join(CACHE_ADMISSIONS)}, got {self.admission!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"cache_policy (--cache-policy) must be one of {', '.join(POLICIES)}, got {self.policy!r}")

    @property
    def active(self) -> bool:
        return self.rows > 0

    @property
    def writes(self) -> int:
        return self.bound if self.write_bound is None else self.write_bound


NO_IDS = np.zeros(0, np.int64)
NO_ROWS = np.zeros(0, np.float32)
NO_FLIGHTS = np.zeros((0, 2), np.int64)
NO_KEEP = np.zeros(0, np.bool_)


@dataclass
class Plan:
    """A pull's split, over its tables (``parts``: global table indexes, in table order) with
    their sorted ids one after another (``ids``, part k's at ``offs[k]:offs[k + 1]``): the
    answer (``out``, flat: part k's rows at ``row_offs[k]``; the hits' rows copied at plan time),
    the positions an earlier pull in flight is refreshing (``later``: read from the cache once
    that pull is stored), those that go to the shards (``miss_pos``, part k's at ``miss_offs[k]:
    miss_offs[k + 1]``; their ids ``miss`` per table) and the oldest read version of the rows answered, per part and shard."""

    now: int
    names: list[str]
    parts: np.ndarray
    ids: np.ndarray
    offs: np.ndarray
    out: torch.Tensor
    row_offs: np.ndarray
    oldest: np.ndarray
    later: np.ndarray
    miss_pos: np.ndarray
    miss_offs: np.ndarray
    keep: np.ndarray = field(default_factory=lambda: NO_KEEP)  # per miss: cached (admitted) or only answered; empty: all cached
    miss: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per table, ``miss`` split by shard as ``protos.partition.split_ids`` splits it (positions,
    # ids per shard): the pull's split, which ``Router.pull_requests`` takes as it is.
    splits: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)


Pushed = dict[str, tuple[torch.Tensor, ...]]  # per table: ids, summed gradients (and a combined push's statistics)


def offsets(counts: Sequence[int] | np.ndarray) -> np.ndarray:
    """Where each of ``counts``' runs starts, and their total last (from a list, a fifth of
    ``np.cumsum``'s cost: it converts the list first)."""
    return np.fromiter(accumulate(counts, initial=0), np.int64, len(counts) + 1)


def joined_ids(tensors: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Tables' ids one after another and where each table's ids start (one ``torch.cat``: a quarter
    of the cost of a conversion per table and ``np.concatenate``)."""
    if not tensors:
        return NO_IDS, np.zeros(1, np.int64)
    ids = tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))
    return np.ascontiguousarray(ids.numpy(), np.int64), offsets([len(t) for t in tensors])


def flat_rows(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """Tables' rows one after another, flat, as float32 (one ``torch.cat`` where the widths agree)."""
    if not tensors:
        return NO_ROWS
    if len(tensors) == 1:
        rows = tensors[0]
    elif all(t.dim() == 2 and t.shape[1] == tensors[0].shape[1] for t in tensors):
        rows = torch.cat(list(tensors))
    else:
        rows = torch.cat([t.reshape(-1) for t in tensors])
    return np.ascontiguousarray(rows.detach().float().numpy()).reshape(-1)


def fill(result: PullResult, plan: Plan, lacking: Mapping[str, torch.Tensor], pulled: PullResult) -> None:
    """Put the rows of ``lacking`` (pulled on their own) into ``result``."""
    for t, ids in lacking.items():
        k = plan.names.index(t)
        pos = np.searchsorted(plan.ids[plan.offs[k]: plan.offs[k + 1]], ids.numpy())
        into = result.rows[t]  # on the training device with a device cache (tether.worker.cache.device)
        into[torch.from_numpy(pos).to(into.device)] = pulled.rows[t].to(into.device, into.dtype)
        for key, v in pulled.table_versions.items():
            if key[1] == t:
                result.table_versions[key] = min(v, result.table_versions.get(key, v))


def read_versions(pulled: PullResult | None, names: Sequence[str], num_shards: int) -> np.ndarray:
    """The table versions of ``pulled`` per table of ``names`` and shard (0 where none)."""
    if pulled is None:
        return np.zeros((len(names), num_shards), np.int64)
    out = [[0] * num_shards for _ in names]  # filled as lists: a numpy item set costs several times more
    where = {t: k for k, t in enumerate(names)}
    for (s, t), v in pulled.table_versions.items():
        k = where.get(t)
        if k is not None and s < num_shards:
            out[k][s] = v
    return np.array(out, np.int64).reshape(len(names), num_shards)
