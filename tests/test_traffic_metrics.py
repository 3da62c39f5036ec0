"""What a worker moves (tether.worker.client.traffic): the reuse measure, and the Prometheus counters a
training run leaves (rows and bytes pulled and pushed per table, rows wanted, recent rows, the
cache's outcomes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from test_row_cache import TwoTower, _batches, _loss

from tether.worker.client.reuse import ReuseTracker
from tether.worker.client.traffic import TrafficMeter
from tether.worker.config import TrainingConfig
from tether.worker.metrics import WorkerMetrics
from tether.worker.training.trainer import Trainer


def _ids(*v: int) -> torch.Tensor:
    return torch.tensor(sorted(v), dtype=torch.int64)


def test_reuse_counts_ids_seen_within_each_window() -> None:
    tracker = ReuseTracker(windows=(1, 2, 3))
    assert tracker.observe({"t": _ids(1, 2, 3)}) == {"t": {1: 0, 2: 0, 3: 0}}
    assert tracker.observe({"t": _ids(2, 3, 4)}) == {"t": {1: 2, 2: 2, 3: 2}}
    assert tracker.observe({"t": _ids(9)}) == {"t": {1: 0, 2: 0, 3: 0}}
    # 1 was last seen 3 steps ago, 4 two steps ago, 9 one step ago.
    assert tracker.observe({"t": _ids(1, 4, 9, 10)}) == {"t": {1: 1, 2: 2, 3: 3}}
    for _ in range(3):
        tracker.observe({"t": _ids(20)})
    # Forgotten past the largest window (kept: only what a window can still count).
    assert tracker.observe({"t": _ids(1, 4, 9, 20)}) == {"t": {1: 1, 2: 1, 3: 1}}
    with pytest.raises(ValueError, match="windows"):
        ReuseTracker(windows=(0, 5))


def test_reuse_counts_as_a_dict_of_last_steps_counts_over_many_steps() -> None:
    """The hash tables (rebuilt as they fill, dropping ids past the window) count what a plain
    dict of each id's last step counts, ids of any int64 value, tables of any size."""
    rng = np.random.default_rng(3)
    windows = (1, 5, 20, 100)
    tracker, last = ReuseTracker(windows), {"a": {}, "b": {}}
    for step in range(1, 401):
        sparse = {"a": np.unique(rng.integers(-(1 << 63), (1 << 63) - 1, 50) if step % 7 == 0 else rng.zipf(1.2, 300) - 2),
                  "b": np.unique(rng.integers(0, 50 + 20 * step, rng.integers(1, 2000)))}
        got = tracker.observe({t: torch.from_numpy(ids.astype(np.int64)) for t, ids in sparse.items()})
        for t, ids in sparse.items():
            ages = [step - last[t][i] for i in ids.tolist() if i in last[t]]
            assert got[t] == {w: sum(a <= w for a in ages) for w in windows}, (step, t)
            last[t].update(dict.fromkeys(ids.tolist(), step))


def test_meter_bytes_are_ids_and_wire_values() -> None:
    meter = TrafficMeter({"a": 16, "b": 4}, wire_itemsize=2, reuse=False)
    meter.wanted({"a": _ids(1, 2, 3)})
    meter.pulled({"a": _ids(1, 2, 3)})
    meter.pushed({"a": (_ids(1, 2), torch.zeros(2, 16)), "b": (_ids(7), torch.zeros(1, 4))})
    totals = meter.totals()
    assert totals["a"]["pulled_bytes"] == 3 * (8 + 16 * 2) and totals["a"]["pushed_bytes"] == 2 * (8 + 16 * 2)
    assert totals["b"]["pushed_rows"] == 1 and totals["b"]["pulled_rows"] == 0 and totals["a"]["wanted_rows"] == 3


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.mark.parametrize("cache", [{}, {"cache_rows": 500, "cache_bound": 3, "cache_admission": "all"}, {"cache_rows": 500, "cache_bound": 3}])
def test_a_run_exports_its_traffic(cache: dict) -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    config = TrainingConfig(local=True, optimizer="adagrad", lr=0.05, log_every=1000, **cache)
    torch.manual_seed(0)
    batches = _batches(25)
    with Trainer(TwoTower(), config, loss=_loss, sparse=lambda b: {"users": b["user"], "items": b["item"]},
                 batch_size=lambda b: len(b["rating"]), metrics=metrics, printer=lambda line: None) as trainer:
        trainer.fit(batches, background=False)
        totals = trainer.ps.meter.totals()
    for table in ("users", "items"):
        t = totals[table]
        pulled = _sample(registry, "tether_worker_rows_moved_total", table=table, direction="pull")
        pushed = _sample(registry, "tether_worker_rows_moved_total", table=table, direction="push")
        assert pulled == t["pulled_rows"] > 0 and pushed == t["pushed_rows"] > 0
        assert _sample(registry, "tether_worker_row_bytes_moved_total", table=table, direction="pull") == pulled * (8 + 8 * 4)
        wanted = _sample(registry, "tether_worker_rows_wanted_total", table=table)
        assert wanted == t["wanted_rows"] == sum(len(torch.unique(b["user" if table == "users" else "item"])) for b in batches)
        recent = [_sample(registry, "tether_worker_rows_recent_total", table=table, within=w) for w in ("1", "5", "20", "100")]
        assert 0 < recent[0] <= recent[1] <= recent[2] <= recent[3] <= wanted
        hits = _sample(registry, "tether_worker_cache_rows_total", table=table, outcome="hits")
        passed = _sample(registry, "tether_worker_cache_rows_total", table=table, outcome="passed")
        # Admission (recurring, the default): the misses of ids not seen within the bound pass the
        # cache (the first miss of every id at least); with all, none.
        assert (passed > 0) == (bool(cache) and "cache_admission" not in cache)
        if cache:
            assert hits > 0 and pulled < wanted
            assert _sample(registry, "tether_worker_cache_held_rows", table=table) > 0
            assert _sample(registry, "tether_worker_cache_bytes", table=table) > 0
        else:
            assert hits == 0 and pulled == wanted == pushed
    assert _sample(registry, "tether_worker_cache_pending_rows") >= 0
