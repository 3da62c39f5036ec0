"""A combined push (issue 29's row cache: a row's gradients of several steps summed into one) with
the statistics each rule takes beside the sum (``UpdateRule.combined_stats``): checked against the
rule's k separate steps in its torch form, within the tolerances stated per rule; rows of one
gradient take the ordinary step; the shard, local mode and a client over the wire apply it alike
(with the rule's compiled combine where it has one, bit for bit);
a push without the statistics is what it always was; bad statistics are refused with nothing
applied; and the row cache sends them, counted in the bytes pushed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_client

from tether.protos.errors import InvalidArgument
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.optimizers import rule
from tether.rules.row_kernels import combined_update
from tether.rules.update_rules import spread_squares
from tether.server.serving.serve import RunningShard
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import SparseUpdate
from tether.server.storage.tables import EmbeddingTable
from tether.worker.cache.client import CachedClient
from tether.worker.cache.config import RowCacheConfig
from tether.worker.client.local import LocalClient
from tether.worker.client.local_table import LocalTable
from tether.worker.client.traffic import TrafficMeter

DIM, ROWS, K = 8, 6, 5
# Relative error of a combined push's weight change against the k separate steps', for k = 5
# gradients that are parallel (each a positive multiple of one vector, as a hot row's gradients
# over a few steps roughly are), on rows with 20 steps of history. The state the statistics
# determine is checked exactly (float rounding): Adagrad's and FTRL's sums of squares, Adam's
# count (its moments weight the k gradients by their order, which the sum does not keep).
TOLERANCE = {"adagrad": 0.06, "rowwise_adagrad": 0.04, "adam": 0.05, "ftrl": 0.15}
EXACT_STATE = {"adagrad": ("sum",), "rowwise_adagrad": ("sum",), "adam": ("t",), "ftrl": ("n",)}


def _warm(name: str, seed: int = 1) -> tuple[OptimizerConfig, torch.Tensor, dict[str, torch.Tensor], torch.Generator]:
    cfg = OptimizerConfig(name, lr=0.05)
    r = rule(name)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(ROWS, DIM, generator=gen)
    state = {k: torch.full((ROWS, *s), r.initial_state(cfg).get(k, 0.0)) for k, s in r.state_shapes(DIM).items()}
    for _ in range(20):
        r.apply(cfg, w, torch.randn(ROWS, DIM, generator=gen), state)
    return cfg, w, state, gen


def _stats(name: str, grads: list[torch.Tensor]) -> torch.Tensor:
    """What the row cache sends for these gradients summed (``row_slots.Table.combined``)."""
    square = sum((g * g).mean(1) for g in grads)
    columns = {"count": torch.full((ROWS,), float(len(grads))), "square_sum": square}
    return torch.stack([columns[c] for c in rule(name).combined_stats], 1)


def _copy(w: torch.Tensor, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return w.clone(), {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("name", sorted(TOLERANCE))
def test_a_combined_push_is_close_to_the_k_separate_steps(name: str) -> None:
    r = rule(name)
    cfg, w, state, gen = _warm(name)
    v = torch.randn(ROWS, DIM, generator=gen)
    grads = [v * (0.5 + torch.rand(ROWS, 1, generator=gen)) for _ in range(K)]
    total = torch.stack(grads).sum(0)
    separate_w, separate = _copy(w, state)
    for g in grads:
        r.apply(cfg, separate_w, g, separate)
    combined_w, combined = _copy(w, state)
    r.apply_combined(cfg, combined_w, total, _stats(name, grads), combined)
    sum_w, summed = _copy(w, state)  # before this change: the sum as one gradient
    r.apply(cfg, sum_w, total, summed)
    change = (separate_w - w).norm()
    error, before = float((combined_w - separate_w).norm() / change), float((sum_w - separate_w).norm() / change)
    assert error < TOLERANCE[name], (error, before)
    assert error < before / 3, (error, before)
    for key in EXACT_STATE[name]:
        torch.testing.assert_close(combined[key], separate[key], rtol=1e-5, atol=1e-6)


def test_adam_is_exact_for_equal_gradients_and_sgd_needs_no_statistics() -> None:
    r = rule("adam")
    cfg, w, state, gen = _warm("adam")
    g = torch.randn(ROWS, DIM, generator=gen)
    separate_w, separate = _copy(w, state)
    for _ in range(K):
        r.apply(cfg, separate_w, g, separate)
    combined_w, combined = _copy(w, state)
    r.apply_combined(cfg, combined_w, g * K, _stats("adam", [g] * K), combined)
    torch.testing.assert_close(combined_w, separate_w, rtol=0, atol=1e-5)
    for key in ("m", "v", "t"):
        torch.testing.assert_close(combined[key], separate[key], rtol=1e-5, atol=1e-7)
    assert rule("sgd").combined_stats == ()


def test_spread_squares_is_exact_for_parallel_gradients() -> None:
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(ROWS, DIM, generator=gen)
    grads = [v * (0.2 + torch.rand(ROWS, 1, generator=gen)) for _ in range(4)]
    want = sum(g * g for g in grads)
    torch.testing.assert_close(spread_squares(sum(grads), sum((g * g).mean(1) for g in grads)), want, rtol=1e-5, atol=1e-7)
    # Gradients that cancel: their squares spread evenly.
    assert torch.equal(spread_squares(torch.zeros(1, 4), torch.tensor([2.0])), torch.full((1, 4), 2.0))


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_rows_of_one_gradient_take_the_ordinary_step(name: str) -> None:
    r = rule(name)
    cfg, w, state, gen = _warm(name)
    g = torch.randn(ROWS, DIM, generator=gen)
    stats = _stats(name, [g, g])
    stats[::2, 0] = -1  # even rows: one gradient
    a_w, a = _copy(w, state)
    r.apply_combined(cfg, a_w, g, stats, a)
    b_w, b = _copy(w, state)
    r.apply(cfg, b_w, g, b)
    assert torch.equal(a_w[::2], b_w[::2]) and not torch.allclose(a_w[1::2], b_w[1::2], atol=1e-4)


def shard_of(name: str) -> Shard:
    shard = Shard()
    shard.declare([TableConfig("t", DIM, optimizer=OptimizerConfig(name, lr=0.05), init_scale=0.5, seed=4)], [])
    return shard


def _table_rows(shard: Shard, ids: np.ndarray) -> torch.Tensor:
    return shard.tables["t"].pull(ids)[0].clone()


@pytest.mark.parametrize("name", ["adagrad", "rowwise_adagrad", "adam", "ftrl"])
def test_the_shard_and_local_mode_apply_a_combined_push_as_the_torch_form(name: str) -> None:
    ids = np.array([3, 9, 12, 40, 41, 77])
    gen = torch.Generator().manual_seed(7)
    warm = torch.randn(ROWS, DIM, generator=gen)
    total = torch.randn(ROWS, DIM, generator=gen)
    stats = _stats(name, [total / 3] * 3)
    stats[0, 0] = -1  # row 0: one gradient
    shard, plain = shard_of(name), shard_of(name)
    local = LocalClient()
    local.declare([TableConfig("t", DIM, optimizer=OptimizerConfig(name, lr=0.05), init_scale=0.5, seed=4)])
    for s in (shard, plain):
        s.push("w", 1, [SparseUpdate("t", ids, warm)], [], incarnation=1)
    local.push({"t": (torch.from_numpy(ids), warm)}).result(5)
    before, state = _table_rows(shard, ids), shard.export_state().tables[0].state
    shard.push("w", 2, [SparseUpdate("t", ids, total, combined=stats)], [], incarnation=1)
    local.push({"t": (torch.from_numpy(ids), total, stats)}).result(5)
    want_w, want_state = before.clone(), {k: v.clone() for k, v in state.items()}
    rule(name).apply_combined(OptimizerConfig(name, lr=0.05), want_w, total, stats, want_state)
    torch.testing.assert_close(_table_rows(shard, ids), want_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(local.pull({"t": torch.from_numpy(ids)}).result(5).rows["t"], want_w, rtol=0, atol=1e-5)
    # Row 0 (one gradient) took the kernel's ordinary step, as a push without statistics does.
    plain.push("w", 2, [SparseUpdate("t", ids, total)], [], incarnation=1)
    assert torch.equal(_table_rows(shard, ids)[0], _table_rows(plain, ids)[0])
    assert not torch.allclose(_table_rows(shard, ids)[1:], _table_rows(plain, ids)[1:], atol=1e-5)


def test_bad_statistics_are_refused_and_change_nothing() -> None:
    shard, sgd = shard_of("adagrad"), shard_of("sgd")
    ids = np.array([1, 2])
    g = torch.ones(2, DIM)
    before = _table_rows(shard, ids)
    for stats, match in ((torch.ones(2, 2), "expected \\(2, 1\\)"), (torch.tensor([[float("nan")], [1.0]]), "finite"),
                         (torch.tensor([[-0.5], [1.0]]), "out of range")):
        with pytest.raises(InvalidArgument, match=match):
            shard.push("w", 1, [SparseUpdate("t", ids, g, combined=stats)], [], incarnation=1)
    with pytest.raises(InvalidArgument, match="takes no combined statistics"):
        sgd.push("w", 1, [SparseUpdate("t", ids, g, combined=torch.ones(2, 1))], [], incarnation=1)
    # Gradients not finite beside good statistics (checked in the statistics' pass where float32, by torch else).
    for bad in (float("nan"), float("inf")):
        for dtype in (torch.float32, torch.float64):
            grads = torch.ones(2, DIM, dtype=dtype)
            grads[1, 3] = bad
            with pytest.raises(InvalidArgument, match="table 't': gradients contain NaN or Inf"):
                shard.push("w", 1, [SparseUpdate("t", ids, grads, combined=torch.tensor([[3.0], [-1.0]]))], [], incarnation=1)
    assert torch.equal(_table_rows(shard, ids), before) and shard.rejected_pushes == 7
    local = LocalClient()
    local.declare([TableConfig("t", 2, optimizer=OptimizerConfig("adagrad", lr=0.1))])
    with pytest.raises(InvalidArgument, match="gradients contain NaN or Inf"):
        local.push({"t": (torch.tensor([1]), torch.tensor([[1.0, float("nan")]]), torch.tensor([[2.0]]))}).result(5)
    with pytest.raises(InvalidArgument, match="out of range"):
        LocalClient_push_bad()


def LocalClient_push_bad() -> None:
    local = LocalClient()
    local.declare([TableConfig("t", 2, optimizer=OptimizerConfig("adam", lr=0.1))])
    local.push({"t": (torch.tensor([1]), torch.ones(1, 2), torch.tensor([[0.5, 1.0]]))}).result(5)


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_a_client_sends_the_statistics_over_the_wire(inproc_shard: RunningShard, transport: str) -> None:
    client = make_client([f"127.0.0.1:{inproc_shard.port}"], "a", transport=transport)
    try:
        client.declare([TableConfig("t", DIM, optimizer=OptimizerConfig("adagrad", lr=0.05), init_scale=0.5, seed=4)], {})
        ids = torch.tensor([5, 6, 7, 8, 9, 10])
        gen = torch.Generator().manual_seed(2)
        total = torch.randn(ROWS, DIM, generator=gen)
        stats = _stats("adagrad", [total / 2, total / 2])
        start = client.pull({"t": ids}).result(10).rows["t"]
        client.push({"t": (ids, total, stats)}).result(10)
        got = client.pull({"t": ids}).result(10).rows["t"]
    finally:
        client.close()
    want, state = start.clone(), {"sum": torch.zeros(ROWS, DIM)}
    rule("adagrad").apply_combined(OptimizerConfig("adagrad", lr=0.05), want, total, stats, state)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_row_cache_sends_the_statistics_and_counts_their_bytes() -> None:
    local = LocalClient()
    spec = TableConfig(name="t", dim=4, optimizer=OptimizerConfig(name="adagrad", lr=0.1), seed=3)
    local.declare([spec])
    meter = TrafficMeter({"t": 4}, 4)
    cached = CachedClient(local, RowCacheConfig(10, 3, admission="all"), {"t": 4}, meter)
    cached.use_tables([spec])
    ids = torch.tensor([5, 9])
    start = local.pull({"t": ids}).result().rows["t"].clone()
    pulled = cached.pull({"t": ids}).result()
    grads = [torch.randn(2, 4, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    for clock, g in enumerate(grads, start=1):
        cached.push({"t": (ids, g)}, clock=clock, versions=pulled).result()
    cached.push({}, clock=4, versions=pulled).result()  # the held gradients (clocks 1-3) go as one push
    total, square = sum(grads), sum((g * g).mean(1) for g in grads)
    want, state = start.clone(), {"sum": torch.zeros(2, 4)}
    rule("adagrad").apply_combined(spec.optimizer, want, total, square.unsqueeze(1), state)
    torch.testing.assert_close(local.pull({"t": ids}).result().rows["t"], want, rtol=0, atol=1e-6)
    moved = meter.totals()["t"]
    assert moved["pushed_rows"] == 2 and moved["pushed_bytes"] == 2 * (8 + 4 * 4) + 2 * 4  # one float a row more


def _rows_and_state(table: EmbeddingTable | LocalTable, ids: np.ndarray) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if isinstance(table, EmbeddingTable):
        snap = table.snapshot()  # sorted by id, as ``ids`` are
        return snap["weights"].clone(), {k: v.clone() for k, v in snap["state"].items()}
    idx = torch.from_numpy(table.slots(ids))
    return table.pull(ids), {k: v.index_select(0, idx) for k, v in table._state.items()}


@pytest.mark.parametrize("table_type", [EmbeddingTable, LocalTable])
@pytest.mark.parametrize("name", ["adagrad", "adam", "rowwise_adagrad", "ftrl"])
def test_a_shards_table_and_local_mode_combine_with_the_rules_compiled_kernel(name: str, table_type: type) -> None:
    """Where the rule has a compiled combine (``row_kernels.combined_update``), a shard's table and
    local mode apply a combined push's summed rows with it, bit for bit; the row of one
    gradient takes the ordinary step."""
    cfg = TableConfig("t", DIM, optimizer=OptimizerConfig(name, lr=0.05, weight_decay=0.01), init_scale=0.5, seed=4)
    ids = np.array([3, 9, 12, 40, 41, 77])
    gen = torch.Generator().manual_seed(7)
    warm, total = torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, DIM, generator=gen)
    stats = _stats(name, [total / 3] * 3)
    stats[0, 0] = -1
    table = table_type(cfg)
    table.push(ids, warm)
    w, state = _rows_and_state(table, ids)
    combine = combined_update(rule(name), cfg.optimizer, DIM)
    assert combine is not None
    combine(w.numpy(), {k: v.numpy() for k, v in state.items()}, np.arange(1, ROWS), total[1:].numpy(),
            np.full(ROWS - 1, 0.05, np.float32), stats[1:].numpy())
    table.push(ids, total, combined=stats)
    got_w, got_state = _rows_and_state(table, ids)
    assert torch.equal(got_w[1:], w[1:])
    for k in state:
        assert torch.equal(got_state[k][1:], state[k][1:]), k
    assert not torch.equal(got_w[0], w[0])  # row 0 took its ordinary step (not the kernel's call above)
