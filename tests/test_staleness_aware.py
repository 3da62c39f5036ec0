"""Staleness-aware learning rates (Zhang et al. 2016) on the shard itself.

Simulated Hogwild: W workers take turns; each reads the dense parameters, and its gradient
is pushed only after the other W-1 workers have pushed theirs, so every push is W-1 updates
stale. With a step size that is stable without staleness, plain SGD then oscillates and
diverges on a stiff quadratic; dividing by the staleness converges.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.shard import DenseDecl, DenseUpdate, Shard, SparseUpdate
from tether.server.tables import EmbeddingTable

DIM = 20
STALENESS_WORKERS = 16
STEPS = 600


def _run(staleness_aware: bool) -> tuple[float, int]:
    torch.manual_seed(0)
    curvature = torch.linspace(0.5, 3.0, DIM)  # f(w) = 0.5 * sum(c * w^2)
    shard = Shard()
    shard.declare([], [DenseDecl("w", 0, torch.ones(DIM), OptimizerConfig("sgd", lr=0.3))])
    chunk = shard.dense[("w", 0)]
    in_flight: deque[tuple[torch.Tensor, int]] = deque()
    max_seen = 0
    for seq in range(1, STEPS + 1):
        w, version = chunk.pull()
        in_flight.append((curvature * w.clone(), version))
        if len(in_flight) == STALENESS_WORKERS:
            grad, read_version = in_flight.popleft()
            result = shard.push("w", seq, [], [DenseUpdate("w", 0, grad, read_version)], staleness_aware=staleness_aware, incarnation=1)
            max_seen = max(max_seen, result.max_staleness)
        value = float(0.5 * (curvature * chunk.pull()[0] ** 2).sum())
        if not value < 1e6:
            return float("inf"), max_seen
    return value, max_seen


def test_staleness_aware_lr_converges_where_plain_does_worse() -> None:
    plain, plain_staleness = _run(staleness_aware=False)
    aware, aware_staleness = _run(staleness_aware=True)
    start = float(0.5 * torch.linspace(0.5, 3.0, DIM).sum())
    assert plain_staleness == aware_staleness == STALENESS_WORKERS - 1
    assert aware < 1e-3 * start, aware
    assert plain > 10 * start, plain  # diverged (or blew up to inf)


def test_without_staleness_both_rules_are_the_same() -> None:
    shard = Shard()
    shard.declare([], [DenseDecl("w", 0, torch.ones(4), OptimizerConfig("sgd", lr=0.5))])
    chunk = shard.dense[("w", 0)]
    for seq in range(1, 4):
        _, version = chunk.pull()
        shard.push("w", seq, [], [DenseUpdate("w", 0, torch.ones(4), version)], staleness_aware=True, incarnation=1)
    assert chunk.pull()[0].tolist() == [-0.5] * 4


# -- staleness per row (issue 18): only updates of the rows a push names count -----------------------


def _table_shard(lr: float = 0.5) -> Shard:
    shard = Shard()
    shard.declare([TableConfig(name="t", dim=2, optimizer=OptimizerConfig("sgd", lr=lr), init_scale=0.0)], [])
    return shard


def _read(shard: Shard, ids: list[int]) -> tuple[np.ndarray, int]:
    rows, _ = shard.pull([("t", np.array(ids, np.int64))], [])
    source, index, version = rows[0]
    return (source if index is None else source.index_select(0, index)).numpy().copy(), version


def _push(shard: Shard, worker: str, seq: int, ids: list[int], version: int, aware: bool) -> int:
    update = SparseUpdate("t", np.array(ids, np.int64), torch.ones(len(ids), 2), version)
    return shard.push(worker, seq, [update], [], staleness_aware=aware, incarnation=1).max_staleness


def test_staleness_counts_only_the_updates_of_the_pushed_rows() -> None:
    shard = _table_shard()
    _, read_a = _read(shard, [1, 2, 3])
    for seq in range(1, 4):  # three pushes by B to rows A did not read
        _, v = _read(shard, [7, 8])
        assert _push(shard, "b", seq, [7, 8], v, False) == 0
    for seq in range(4, 6):  # two to row 3, which A read
        _, v = _read(shard, [3])
        _push(shard, "b", seq, [3], v, False)
    table = shard.tables["t"]
    assert table.staleness(np.array([1, 2, 3], np.int64), read_a).tolist() == [0, 0, 2]
    assert table.staleness(np.array([7, 8], np.int64), read_a).tolist() == [3, 3]
    assert table.staleness(np.array([1, 2], np.int64), read_a) is None
    assert _push(shard, "a", 1, [1, 2, 3], read_a, True) == 2  # the table moved 5 times
    rows, _ = _read(shard, [1, 2, 3])
    # Rows 1 and 2 were overtaken by nothing: the full step; row 3 by two updates: half of it.
    assert rows.tolist() == [[-0.5, -0.5], [-0.5, -0.5], [-1.0 - 0.25, -1.0 - 0.25]]


def test_staleness_aware_changes_nothing_when_no_update_overtook_the_read() -> None:
    results = []
    for aware in (False, True):
        shard = _table_shard()
        reads = {w: _read(shard, ids)[1] for w, ids in (("a", [1, 2]), ("b", [3, 4]), ("c", [5]))}
        for seq, (w, ids) in enumerate((("a", [1, 2]), ("b", [3, 4]), ("c", [5])), start=1):
            assert _push(shard, w, seq, ids, reads[w], aware) == 0
        results.append(_read(shard, [1, 2, 3, 4, 5])[0])
    assert np.array_equal(results[0], results[1])


def test_per_row_staleness_scales_adagrad_rows_like_a_smaller_learning_rate() -> None:
    opt = OptimizerConfig("adagrad", lr=0.1)
    a = EmbeddingTable(TableConfig(name="t", dim=3, optimizer=opt, init_scale=0.1, seed=3))
    b = EmbeddingTable(TableConfig(name="t", dim=3, optimizer=opt, init_scale=0.1, seed=3))
    ids = np.array([2, 5, 9], np.int64)
    grads = torch.randn(3, 3)
    a.push(ids, grads, np.array([1.0, 0.25, 1.0]))
    b.push(ids[[0, 2]], grads[[0, 2]], 1.0)
    b.push(ids[[1]], grads[[1]], 0.25)
    assert torch.allclose(a.pull(ids)[0], b.pull(ids)[0], atol=1e-7)


def test_a_read_older_than_the_update_log_counts_the_table_updates() -> None:
    shard = _table_shard()
    _, read = _read(shard, [1])
    table = shard.tables["t"]
    for seq in range(1, 300):  # more updates than the log keeps
        _push(shard, "b", seq, [1] if seq == 1 else [2], table.version, False)
    assert table.staleness(np.array([1], np.int64), read).tolist() == [299]


def test_rows_overtaken_at_most_once_keep_the_full_step() -> None:
    # Several rows, each overtaken by at most one update: the per-row staleness is [1, 1, 0]
    # (an array with nothing above 1), which once made an aware push fail ("truth value of an
    # array ... is ambiguous") instead of applying it unscaled.
    shard = _table_shard()
    _, read = _read(shard, [1, 2, 3])
    _, v = _read(shard, [1, 2])
    _push(shard, "b", 1, [1, 2], v, False)
    assert shard.tables["t"].staleness(np.array([1, 2, 3], np.int64), read).tolist() == [1, 1, 0]
    assert _push(shard, "a", 1, [1, 2, 3], read, True) == 1
    rows, _ = _read(shard, [1, 2, 3])
    assert rows.tolist() == [[-1.0, -1.0], [-1.0, -1.0], [-0.5, -0.5]]
