"""Staleness-aware learning rates on the shard itself (issue 18): Zhang et al. 2016's 1/staleness,
relative to the typical staleness of the table or chunk (``staleness_scale``).

Simulated Hogwild: fast workers take turns, each gradient pushed after the next FAST reads
(FAST updates stale, the staleness the learning rate was tuned for), and a straggler whose
gradient, read every SLOW_EVERY steps, lands SLOW_DELAY steps later. With a step size that is
stable without the straggler, plain SGD on a stiff quadratic diverges; damping the straggler's
unusually stale gradients converges. Without the straggler the rule changes nothing.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.storage import shard as shard_module
from tether.server.storage.shard import Shard, staleness_scale
from tether.server.storage.shard_records import DenseDecl, DenseUpdate, SparseUpdate
from tether.server.storage.tables import EmbeddingTable

DIM = 20
FAST, SLOW_EVERY, SLOW_DELAY, LR = 2, 4, 30, 0.2
STEPS = 800


def _run(staleness_aware: bool, straggler: bool = True) -> tuple[torch.Tensor, int]:
    curvature = torch.linspace(0.5, 3.0, DIM)  # f(w) = 0.5 * sum(c * w^2)
    shard = Shard()
    shard.declare([], [DenseDecl("w", 0, torch.ones(DIM), OptimizerConfig("sgd", lr=LR))])
    chunk = shard.dense[("w", 0)]
    fast: deque[tuple[torch.Tensor, int]] = deque()
    slow: deque[tuple[int, torch.Tensor, int]] = deque()
    seq = max_seen = 0

    def push(worker: str, grad: torch.Tensor, read_version: int) -> None:
        nonlocal seq, max_seen
        seq += 1
        update = DenseUpdate("w", 0, grad, read_version)
        max_seen = max(max_seen, shard.push(worker, seq, [], [update], staleness_aware=staleness_aware, incarnation=1).staleness)

    for step in range(STEPS):
        w, version = chunk.pull()
        fast.append((curvature * w.clone(), version))
        if straggler and step % SLOW_EVERY == 0:
            slow.append((step + SLOW_DELAY, curvature * w.clone(), version))
        if len(fast) > FAST:
            push("fast", *fast.popleft())
        while slow and slow[0][0] <= step:
            push("slow", *slow.popleft()[1:])
        if not float(chunk.pull()[0].abs().max()) < 1e6:
            break
    return chunk.pull()[0].clone(), max_seen


def _loss(w: torch.Tensor) -> float:
    return float(0.5 * (torch.linspace(0.5, 3.0, DIM) * w**2).sum())


def test_staleness_aware_lr_converges_where_a_straggler_makes_plain_diverge() -> None:
    plain, plain_staleness = _run(staleness_aware=False)
    aware, aware_staleness = _run(staleness_aware=True)
    start = _loss(torch.ones(DIM))
    assert plain_staleness == aware_staleness > 4 * FAST  # the straggler's pushes
    assert _loss(aware) < 1e-3 * start, _loss(aware)
    assert not _loss(plain) < 10 * start, _loss(plain)  # diverged (or blew up to inf)


def test_staleness_aware_changes_nothing_at_the_typical_staleness(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every push FAST updates stale, as the other workers' pushes make it in any async job: the
    # learning rate was tuned for this, so the rule keeps the full step (Zhang et al.'s plain
    # 1/s would cut every step to 1/FAST). Only while the running mean warms up from the first
    # pushes (nothing overtook those) are the first few steps damped, less and less.
    scales: list[float] = []

    def record(stale: int | np.ndarray | None, typical: float) -> float | np.ndarray:
        scales.append(float(np.min(got := staleness_scale(stale, typical))))
        return got

    monkeypatch.setattr(shard_module, "staleness_scale", record)
    plain, staleness = _run(staleness_aware=False, straggler=False)
    aware, _ = _run(staleness_aware=True, straggler=False)
    assert staleness == FAST
    assert len(scales) == STEPS - FAST
    assert min(scales[30:]) > 0.95 and min(scales[100:]) > 0.9999, (scales[:40], min(scales[100:]))
    assert _loss(plain) < 1e-3 * _loss(torch.ones(DIM))
    assert _loss(aware) < 1e-3 * _loss(torch.ones(DIM))


@pytest.mark.parametrize(
    ("stale", "typical", "want"),
    [
        (None, 4.0, 1.0),  # nothing overtook the read
        (0, 4.0, 1.0),
        (1, 0.0, 1.0),  # overtaken once keeps the full step even where nothing usually is
        (4, 4.5, 1.0),  # as stale as usual
        (9, 4.5, 0.5),  # twice as stale as usual: half the step
        (3, 0.2, 1 / 3),  # the floor of the reference is one update
    ],
)
def test_staleness_scale(stale: int | None, typical: float, want: float) -> None:
    assert staleness_scale(stale, typical) == pytest.approx(want)


def test_staleness_scale_per_row() -> None:
    assert staleness_scale(np.array([0, 2, 3], np.int64), 3.0) == 1.0
    np.testing.assert_allclose(staleness_scale(np.array([0, 3, 6, 12], np.int64), 3.0), [1.0, 1.0, 0.5, 0.25])


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
    return shard.push(worker, seq, [update], [], staleness_aware=aware, incarnation=1).staleness


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


# -- the push's largest staleness without per-row counts (issue 17) ---------------------------------


def test_a_push_reports_its_largest_staleness_without_counting_rows_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    shard = Shard()
    shard.declare(
        [TableConfig(name="t", dim=2, optimizer=OptimizerConfig("sgd", lr=0.5), init_scale=0.0)],
        [DenseDecl("d", 0, torch.zeros(2), OptimizerConfig("sgd", lr=0.5))],
    )
    table, chunk = shard.tables["t"], shard.dense[("d", 0)]

    def push(worker: str, seq: int, ids: list[int], version: int, chunk_version: int | None = None) -> int:
        sparse = [SparseUpdate("t", np.array(ids, np.int64), torch.ones(len(ids), 2), version)]
        dense = [] if chunk_version is None else [DenseUpdate("d", 0, torch.ones(2), chunk_version)]
        return shard.push(worker, seq, sparse, dense, incarnation=1).staleness

    def per_row(*args: object) -> None:
        raise AssertionError("per-row staleness computed for a push that needs only its largest")

    monkeypatch.setattr(table, "staleness", per_row)
    read, chunk_read = table.version, chunk.version
    # B: row 3 twice and 7 once, each with the chunk (the table and the chunk move 3 times).
    for seq, ids in enumerate(([3], [3], [7]), start=1):
        push("b", seq, ids, table.version, chunk.version)
    # The chunk's 3 bound every row's: no count needed, and 3 is the push's largest.
    assert push("a", 1, [1, 3], read, chunk_read) == 3
    # Without a chunk, the table's count (4 since the read) is only a bound: rows are counted.
    assert push("a", 2, [2, 9], read) == 0  # rows nobody updated since the read
    assert push("a", 3, [1, 3], read) == 3  # row 3: B's two pushes and a's first
    assert shard.tables["t"].largest_staleness(np.array([3, 9], np.int64), read) == 4
