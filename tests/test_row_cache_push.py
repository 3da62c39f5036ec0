"""The row cache's push side (tether.worker.cache.row_cache: RowCache.accumulate): what a combined push carries per table
(the sums, and the rule's statistics with -1 in rows of one gradient), taken in the layout the
wire takes (one buffer of sums and one of statistics for all tables), and a slot's int64 columns
in one cache-line row."""

from __future__ import annotations

import numpy as np
import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.row_cache import RowCache
from tether.worker.client.results import PullResult

_DIMS = {"a": 4, "b": 2}


def _cache(rules: dict[str, str]) -> RowCache:
    cache = RowCache(RowCacheConfig(rows=50, bound=3, admission="all"), _DIMS, 1)
    cache.use_tables([TableConfig(name=t, dim=d, optimizer=OptimizerConfig(name=rules[t], lr=0.1)) for t, d in _DIMS.items()])
    return cache


def _pull(cache: RowCache, ids: dict[str, torch.Tensor]) -> PullResult:
    plan = cache.plan(ids, 0)
    rows = {t: torch.zeros(len(i), _DIMS[t]) for t, i in plan.miss.items()}
    result, lacking = cache.merge(plan, PullResult(rows, {}, {(0, t): 0 for t in ids}, {}))
    assert not lacking
    return result


def test_a_combined_push_carries_each_tables_sums_and_statistics_in_two_shared_buffers() -> None:
    cache = _cache({"a": "adam", "b": "adagrad"})
    ids = {"a": torch.tensor([3, 8, 20]), "b": torch.tensor([1, 5])}
    pulled = _pull(cache, ids)
    gen = torch.Generator().manual_seed(0)
    sent: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for clock in (1, 2, 3):
        # Row 20 of "a" and row 5 of "b" get a gradient at clock 1 only: one gradient each.
        step = {t: (i if clock == 1 else i[:-1]) for t, i in ids.items()}
        grads = {t: (i, torch.randn(len(i), _DIMS[t], generator=gen)) for t, i in step.items()}
        sent.append(grads)
        pushed, _ = cache.accumulate(grads, clock, pulled)
        assert pushed == {}  # held: the write bound is 3 clocks
    pushed, versions = cache.accumulate({}, 4, None)
    assert versions == {(0, "a"): 0, (0, "b"): 0}
    for t, i in ids.items():
        got_ids, sums, stats = pushed[t]
        assert got_ids.tolist() == i.tolist()
        for r, key in enumerate(i.tolist()):
            parts = [step[t][1][step[t][0].tolist().index(key)] for step in sent if key in step[t][0].tolist()]
            total, square = torch.zeros(_DIMS[t]), np.float32(0.0)
            for g in parts:  # summed in the order the steps came, in float32, as the cache does
                total += g
                row = np.float32(0.0)
                for x in g.numpy():
                    row = np.float32(row + x * x)
                square = np.float32(square + row / np.float32(_DIMS[t]))
            assert torch.equal(sums[r], total), (t, key)
            # adam: ("count", "square_sum"); adagrad: ("square_sum",); -1 first where one gradient.
            expected = ([float(len(parts))] if t == "a" else []) + [float(square)]
            if len(parts) == 1:
                expected[0] = -1.0
            assert stats[r].tolist() == expected, (t, key)
        assert stats.shape == (len(i), 2 if t == "a" else 1)
    # One buffer of sums and one of statistics for both tables (the layout the push takes): b's part right after a's.
    for column in (1, 2):
        a, b = pushed["a"][column], pushed["b"][column]
        assert a.is_contiguous() and b.is_contiguous() and b.data_ptr() == a.data_ptr() + a.nbytes
    assert cache.pending_rows() == 0


def test_a_push_whose_rows_hold_one_gradient_each_sends_no_statistics() -> None:
    cache = _cache({"a": "adam", "b": "sgd"})
    ids = {"a": torch.tensor([4, 9]), "b": torch.tensor([2])}
    pulled = _pull(cache, ids)
    cache.accumulate({t: (i, torch.ones(len(i), _DIMS[t])) for t, i in ids.items()}, 1, pulled)
    pushed, _ = cache.accumulate({}, 4, None)
    assert {t: len(p) for t, p in pushed.items()} == {"a": 2, "b": 2}  # ids and sums only
    assert torch.equal(pushed["a"][1], torch.ones(2, 4)) and torch.equal(pushed["b"][1], torch.ones(1, 2))


def test_a_slots_int_columns_are_one_aligned_row() -> None:
    cache = _cache({"a": "sgd", "b": "sgd"})
    _pull(cache, {"a": torch.tensor([7, 11]), "b": torch.tensor([1])})
    for tab in cache.tables.values():
        assert tab.meta.shape[1] == 8 and tab.meta.ctypes.data % 64 == 0 and tab.meta.flags.c_contiguous
        for column in (tab.ids, tab.shard, tab.read_clock, tab.read_version, tab.last_used, tab.uses, tab.pending_since,
                       tab.pending_version):
            assert np.shares_memory(column, tab.meta)
    a = cache.tables["a"]
    assert sorted(a.ids[: a.top].tolist()) == [7, 11] and a.read_clock[: a.top].tolist() == [0, 0]


def test_rows_held_at_an_earlier_clock_than_the_last_are_due_by_their_own_clock() -> None:
    """The queue of held rows stays in clock order when a push's clock is older than the last
    one held (what is due is taken from its front): each row comes due W clocks after its own."""
    cache = RowCache(RowCacheConfig(rows=50, bound=3, write_bound=3, admission="all"), {"a": 2}, 1)
    cache.use_tables([TableConfig(name="a", dim=2, optimizer=OptimizerConfig(name="sgd", lr=0.1))])
    pulled = _pull(cache, {"a": torch.tensor([1, 2, 3])})
    one = torch.ones(1, 2)
    for clock, row in ((5, 1), (2, 2), (4, 3)):  # held at 5, then at 2 and 4
        pushed, _ = cache.accumulate({"a": (torch.tensor([row]), one)}, clock, pulled)
        assert not pushed
    assert [e[0] for e in cache._queue] == [2, 4, 5]
    due = {clock: cache.accumulate({}, clock, None)[0] for clock in (5, 6, 7, 8)}
    assert {c: p["a"][0].tolist() if p else [] for c, p in due.items()} == {5: [2], 6: [], 7: [3], 8: [1]}
    assert cache.pending_rows() == 0


def test_the_other_parts_of_a_push_are_summed_per_id_in_the_order_they_came() -> None:
    # ``coalesce``'s general path (evicted rows, rows not cached, sums taken out of id order): per
    # table the sorted unique ids, each id's rows added from zero in the order they came (as
    # ``np.add.at``, bit for bit, the sign of a zero included), and per shard the oldest read version.
    from tether.worker.cache.slots import Table, coalesce

    rng = np.random.default_rng(3)
    tables = {"a": Table(4, 8)}
    for dup in (False, True):
        ids = rng.permutation(1000)[:40] if not dup else rng.integers(0, 12, 40)
        g = (rng.standard_normal((40, 6)) * rng.choice([1e-3, 1.0, 1e3], (40, 1))).astype(np.float32)
        g[:, :4][rng.random((40, 4)) < 0.1] = -0.0
        g[:, 5] = 1.0  # the held record's count column: one gradient a row
        parts = [(ids[:25], torch.from_numpy(g[:25]), np.zeros(25, np.int64), np.full(25, 7, np.int64)),
                 (ids[25:], torch.from_numpy(g[25:]), np.ones(15, np.int64), np.full(15, 4, np.int64))]
        grads, versions = coalesce({"a": parts}, None, None, ["a"], tables)
        want_ids, inverse = np.unique(ids, return_inverse=True)
        want = np.zeros((len(want_ids), 6), np.float32)
        np.add.at(want, inverse, g)
        got_ids, sums = grads["a"][0], grads["a"][1]
        assert np.array_equal(got_ids.numpy(), want_ids) and sums.numpy().tobytes() == np.ascontiguousarray(want[:, :4]).tobytes()
        assert versions == {(0, "a"): 7, (1, "a"): 4}


def test_a_rows_mean_square_is_computed_where_its_statistics_send_it_and_on_demand_elsewhere() -> None:
    """``with_unheld`` computes a row of one gradient's mean square only where its table's
    statistics carry it past the first column (Adam's count, then mean square); elsewhere
    (Adagrad's one column, -1 for such a row) it leaves -1, and ``coalesce`` computes it from the
    row when it sums that row with another of the same id: bit for bit the value it would have
    been."""
    from tether.worker.cache.batch import with_unheld
    from tether.worker.cache.kernels import mean_squares
    from tether.worker.cache.slots import Taken, coalesce

    rng = np.random.default_rng(3)
    d, n = 5, 7
    step_ids = np.sort(rng.choice(1000, n, replace=False)).astype(np.int64)
    g = rng.standard_normal(n * d).astype(np.float32)
    empty_f, empty_i = np.zeros(0, np.float32), np.zeros(0, np.int64)
    want = np.array([np.float32(sum((np.float32(x * x) for x in row), np.float32(0.0))) / np.float32(d)
                     for row in g.reshape(n, d)], np.float32)
    out = {}
    for name, kinds in (("adagrad", [[0, -1]]), ("adam", [[1, 0]])):
        out[name] = with_unheld(empty_i, empty_f, empty_f, empty_f, empty_f, empty_i, np.zeros(1, np.int64), np.ones(1, np.bool_),
                                np.full((1, 1), np.iinfo(np.int64).max, np.int64), np.array([d], np.int64), np.array(kinds, np.int64),
                                np.zeros(1, np.int64), step_ids, np.array([0, n], np.int64), g, np.array([0, n * d], np.int64),
                                np.arange(n, dtype=np.int64), np.zeros(n, np.int64), np.zeros((1, 1), np.int64))
    assert (out["adagrad"][3] == -1).all()  # not computed: Adagrad sends -1 for a row of one gradient
    assert np.array_equal(out["adam"][3], want)  # Adam sends it beside the count
    assert np.array_equal(out["adam"][2].reshape(n, 2), np.stack([np.full(n, -1, np.float32), want], 1))
    assert np.array_equal(mean_squares(g.reshape(n, d)), want)  # computed later, the same bits

    # coalesce's slow path (a table's part summed again: another part of the same table due, or
    # its ids out of order): where the square is -1 it is computed from the row. Adam's statistics
    # send it for a row of one gradient, so a wrong one shows.
    cache = _cache({"a": "adam", "b": "adam"})
    ids = {"a": torch.tensor([3, 8]), "b": torch.tensor([1])}
    pulled = _pull(cache, ids)
    gen = torch.Generator().manual_seed(5)
    cache.accumulate({t: (i, torch.randn(len(i), _DIMS[t], generator=gen)) for t, i in ids.items()}, 1, pulled)
    got, _ = cache._take(99, True)  # every held row, one gradient each
    assert got is not None and (got.counts == 1).all() and (got.square > 0).all()
    late = got.square.copy()
    late[:2] = -1.0  # as with_unheld leaves them: table a's two rows
    none = np.zeros(0, np.int64)

    def evicted() -> dict[str, list[tuple[np.ndarray, torch.Tensor, np.ndarray, np.ndarray]]]:
        # Held sums of id 3 of table a evicted and due with this push: its two parts are summed
        # into one row of two gradients, whose statistics carry the sum of their mean squares.
        return {"a": [(np.array([3]), torch.tensor([[0.5, -1.0, 2.0, 0.25, 1.578125, 1.0]]), none, none)]}

    a, _ = coalesce(evicted(), Taken(got.parts, got.ascending, late, got.counts), None, list(_DIMS), cache.tables)
    b, _ = coalesce(evicted(), Taken(got.parts, got.ascending, got.square, got.counts), None, list(_DIMS), cache.tables)
    assert len(b["a"]) == 3 and b["a"][2][0].tolist() == [2.0, float(np.float32(1.578125) + got.square[0])]
    for t in b:
        assert all(torch.equal(x, y) for x, y in zip(a[t], b[t], strict=True)), t
