"""Bounded embedding memory: capacity with batched LRU eviction, and admission by touch count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.initial import init_rows
from tether.server.metrics import ShardMetrics
from tether.server.storage.admission import CountMinSketch
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import SparseUpdate
from tether.server.storage.tables import EmbeddingTable

SGD = OptimizerConfig("sgd", 1.0)


def test_endless_new_ids_stay_within_capacity_and_hot_ids_survive() -> None:
    capacity = 2000
    table = EmbeddingTable(TableConfig("t", 16, OptimizerConfig("adagrad", 0.1), capacity=capacity))
    hot = np.arange(10**12, 10**12 + 32, dtype=np.int64)
    rng = np.random.default_rng(0)
    memory = []
    steps = 200
    for _step in range(steps):
        cold = rng.choice(2**62, 500, replace=False).astype(np.int64) + 2**40  # never the hot ids
        ids = np.concatenate([hot, cold])
        table.pull(ids)
        table.push(ids, torch.full((len(ids), 16), 0.5))
        assert table.rows <= capacity
        memory.append(table.memory_bytes)
    # 200 steps touched ~100k distinct ids; memory stopped growing once the capacity was reached.
    assert table.evicted_rows >= steps * 500 - capacity
    assert max(memory) == memory[-1] == memory[len(memory) // 2]
    raw = capacity * 16 * 4 * 2  # rows + Adagrad sums
    assert memory[-1] < 1.3 * raw + (1 << 20)
    snap = table.snapshot()
    assert np.isin(hot, snap["ids"]).all()
    # The hot rows kept their optimizer state through all of it: 200 Adagrad steps of 0.5.
    rows, _ = table.pull(hot)
    sums = snap["state"]["sum"][np.searchsorted(snap["ids"], hot)]
    assert torch.allclose(sums, torch.full((32, 16), 0.25 * steps))
    assert not torch.equal(rows, init_rows(hot, 16, 0, "t", 0.01))


def test_eviction_is_lru_and_an_evicted_row_comes_back_at_its_initial_value() -> None:
    table = EmbeddingTable(TableConfig("t", 4, SGD, init_scale=0.0, capacity=64))
    first = np.arange(64, dtype=np.int64)
    table.push(first, torch.ones(64, 4))  # every row -1
    table.pull(first[32:])  # rows 32..63 are now more recent than 0..31
    table.pull(np.arange(100, 110, dtype=np.int64))  # 10 new rows: evicts the oldest batch
    snap = table.snapshot()
    kept = set(snap["ids"].tolist())
    assert table.rows <= 64 and set(range(32, 64)) <= kept and set(range(100, 110)) <= kept
    gone = sorted(set(range(32)) - kept)
    assert len(gone) == table.evicted_rows >= 10
    back, _ = table.pull(np.array(gone[:3], dtype=np.int64))
    assert torch.equal(back, torch.zeros(3, 4))  # fresh rows again, not the evicted -1s
    # The reused slots got fresh optimizer state too: one more step gives exactly -1.
    table.push(np.array(gone[:3], dtype=np.int64), torch.ones(3, 4))
    assert torch.equal(table.pull(np.array(gone[:3], dtype=np.int64))[0], -torch.ones(3, 4))


def test_a_call_with_more_new_ids_than_capacity_keeps_what_fits() -> None:
    table = EmbeddingTable(TableConfig("t", 2, SGD, init_scale=0.0, capacity=10))
    ids = np.arange(25, dtype=np.int64)
    table.push(ids, torch.ones(25, 2))
    assert table.rows == 10 and table.dropped_rows == 15
    rows, _ = table.pull(ids)
    assert (rows == -1).all(dim=1).sum() == 10


def test_admission_after_min_count_touches() -> None:
    registry = CollectorRegistry()
    shard = Shard(metrics=ShardMetrics(registry))
    shard.declare([TableConfig("t", 4, SGD, init_scale=0.1, seed=7, min_count=3)], [])
    table = shard.tables["t"]
    ids = np.array([5, 6], dtype=np.int64)
    initial = init_rows(ids, 4, 7, "t", 0.1)
    (rows, _, _), = shard.pull([("t", ids)], [])[0]
    assert torch.equal(rows, initial) and table.rows == 0  # touch 1: not a row yet
    shard.push("w", 1, [SparseUpdate("t", ids, torch.ones(2, 4))], [], incarnation=1)  # touch 2: dropped
    assert table.rows == 0 and table.dropped_rows == 2
    assert registry.get_sample_value("tether_shard_rows_dropped_total", {"table": "t"}) == 2
    (rows, _, _), = shard.pull([("t", ids)], [])[0]
    assert torch.equal(rows, initial) and table.rows == 2  # touch 3: admitted at its initial value
    shard.push("w", 2, [SparseUpdate("t", ids, torch.ones(2, 4))], [], incarnation=1)
    (rows, _, _), = shard.pull([("t", ids)], [])[0]
    assert torch.allclose(rows, initial - 1)


def test_eviction_metric_and_info_counters() -> None:
    registry = CollectorRegistry()
    shard = Shard(metrics=ShardMetrics(registry))
    shard.declare([TableConfig("t", 4, SGD, capacity=100)], [])
    for k in range(10):
        shard.pull([("t", np.arange(k * 50, k * 50 + 50, dtype=np.int64))], [])
    evicted = shard.tables["t"].evicted_rows
    assert evicted >= 400 and shard.tables["t"].rows <= 100
    assert registry.get_sample_value("tether_shard_rows_evicted_total", {"table": "t"}) == evicted


def test_count_min_sketch_is_bounded_and_never_underestimates() -> None:
    sketch = CountMinSketch(1 << 12, seed=1)
    rng = np.random.default_rng(1)
    hot = np.arange(50, dtype=np.int64)
    for _ in range(20):
        sketch.add(hot)
    assert (sketch.estimate(hot) >= 20).all()
    # An endless stream of one-off ids: ages the counters instead of filling them up.
    for _ in range(100):
        sketch.add(rng.choice(2**62, 1000, replace=False).astype(np.int64))
    fresh = rng.choice(2**62, 5000, replace=False).astype(np.int64)
    assert (sketch.estimate(fresh) >= 3).mean() < 0.01
    assert sketch.nbytes == 4 * (1 << 12) * 2


def test_a_huge_dim_does_not_allocate_much_up_front() -> None:
    table = EmbeddingTable(TableConfig("wide", 65536, SGD))
    assert table.memory_bytes <= 8 << 20


@pytest.mark.parametrize(
    "kwargs, message", [({"capacity": -1}, "capacity"), ({"min_count": 0}, "min_count"), ({"min_count": 70000}, "min_count")]
)
def test_bounded_table_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TableConfig("t", 4, **kwargs)


def test_table_spec_round_trips_capacity_and_min_count() -> None:
    cfg = TableConfig.from_proto(TableConfig("t", 4, SGD, capacity=1000, min_count=3).to_proto())
    assert (cfg.capacity, cfg.min_count) == (1000, 3)
    assert TableConfig.from_proto(cfg.to_proto()) == cfg
    assert TableConfig.from_proto(TableConfig("t", 4).to_proto()).min_count == 1


def test_index_removal_leaves_tombstones_that_probes_pass_and_rebuilds_drop() -> None:
    from tether.server.storage.index import IdIndex

    index = IdIndex(capacity=16)
    ids = np.arange(7, dtype=np.int64)  # collide in a 16-cell table: removal must not cut probe chains
    index.insert(ids, ids * 10)
    assert index.remove(np.array([0, 2, 99], dtype=np.int64)) == 2
    assert index.lookup(ids).tolist() == [-1, 10, -1, 30, 40, 50, 60]
    assert index.size == 5 and index.tombstones == 2
    keys, slots = index.items()
    assert keys.tolist() == [1, 3, 4, 5, 6] and slots.tolist() == [10, 30, 40, 50, 60]
    # Churn: insert and remove forever; tombstones trigger rebuilds instead of filling the table.
    # A slot holds one id at a time (the index keeps the ids by slot): removed ids' slots are reused.
    rng = np.random.default_rng(0)
    live, free = np.empty(0, np.int64), np.arange(100, 300)
    for _ in range(200):
        new = rng.choice(2**62, 100, replace=False).astype(np.int64)
        new = new[index.lookup(new) < 0]
        index.insert(new, free[: len(new)])
        free = free[len(new):]
        live = np.concatenate([live, new])
        gone, live = live[:-100], live[-100:]
        free = np.concatenate([free, index.lookup(gone)])
        assert index.remove(gone) == len(gone)
    assert index.size == 5 + len(live) == 105
    assert (index.lookup(live) >= 0).all() and (index.lookup(gone) == -1).all()
    assert index.nbytes <= 16 * 4 * 256
