"""A pull's plan through the worker row cache (``Plan``: how a pull's ids split between the cache
and the shards), with the small array helpers the cache's steps share
(``tether.worker.cache.row_cache``); its configuration is ``tether.worker.cache.config``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from tether.worker.client.results import PullResult

__all__ = ["NO_FLIGHTS", "NO_IDS", "NO_KEEP", "NO_ROWS", "Plan", "Pushed", "fill", "flat_rows", "joined_ids", "offsets", "read_versions"]


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


Pushed = Mapping[str, tuple[torch.Tensor, ...]]  # per table: ids, summed gradients (and a combined push's statistics)


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
    return np.ascontiguousarray(ids.numpy(), np.int64), offsets([t.shape[0] for t in tensors])


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
