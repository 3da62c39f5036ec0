"""The worker's row cache (tether.worker.cache.row_cache): bound 0 is exactly no cache; a combined push
is one update on the sum of the held gradients (checked against the update rule applied once);
read and write bounds, LRU and LFU eviction, a shard's table going back, and the flags."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.optimizers import rule
from tether.worker.cache.client import CachedClient
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.row_cache import RowCache
from tether.worker.cache.slots import NONE
from tether.worker.client.local import LocalClient
from tether.worker.client.results import PullResult
from tether.worker.client.traffic import TrafficMeter
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.run_record import RunRecord
from tether.worker.training.trainer import Trainer

USERS, ITEMS = 40, 300


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = ShardedEmbeddingBag("users", 8)
        self.item = ShardedEmbeddingBag("items", 8)
        self.bias = nn.Linear(1, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        dot = (self.user(batch["user"]) * self.item(batch["item"])).sum(1, keepdim=True)
        return self.bias(dot).squeeze(1)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch), batch["rating"])


def _batches(n: int, size: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    # Skewed item ids (many repeats from step to step), a few users.
    weights = 1.0 / torch.arange(1, ITEMS + 1, dtype=torch.float64) ** 1.1
    return [{"user": torch.randint(0, USERS, (size,), generator=g) * 31 + 7,
             "item": torch.multinomial(weights, size, replacement=True, generator=g) + 2**40,
             "rating": torch.rand(size, generator=g) * 4 + 1} for _ in range(n)]


def _train(optimizer: str, batches: list[dict[str, torch.Tensor]], **cache: object) -> tuple[dict[str, torch.Tensor], dict, dict]:
    config = TrainingConfig(local=True, optimizer=optimizer, lr=0.05, log_every=1000, **cache)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = TwoTower()
    ids = {"users": torch.unique(torch.cat([b["user"] for b in batches])),
           "items": torch.unique(torch.cat([b["item"] for b in batches]))}
    with Trainer(model, config, loss=_loss, sparse=lambda b: {"users": b["user"], "items": b["item"]},
                 batch_size=lambda b: len(b["rating"]), printer=lambda line: None) as trainer:
        record = trainer.fit(batches, background=False)
        final = trainer.client.pull(ids, ["dense"]).result(30)
        traffic = trainer.ps.meter.totals()
    return {**final.rows, "dense": final.dense["dense"]}, record, traffic


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_bound_zero_is_exactly_no_cache(optimizer: str) -> None:
    batches = _batches(30)
    plain, _, moved = _train(optimizer, batches)
    cached, _, moved_cached = _train(optimizer, batches, cache_rows=1000, cache_bound=0)
    for name in plain:
        assert torch.equal(plain[name], cached[name]), name
    assert moved == moved_cached  # every row pulled and pushed, as without a cache


def test_a_bound_moves_fewer_rows_and_still_trains() -> None:
    batches = _batches(40)
    _, plain, moved = _train("adagrad", batches)
    _, cached, moved_cached = _train("adagrad", batches, cache_rows=1000, cache_bound=4)  # admission recurring, the default
    _, _, moved_all = _train("adagrad", batches, cache_rows=1000, cache_bound=4, cache_admission="all")
    for t in ("users", "items"):
        assert moved_cached[t]["wanted_rows"] == moved_all[t]["wanted_rows"] == moved[t]["wanted_rows"]
        assert moved_all[t]["pulled_rows"] < 0.6 * moved[t]["pulled_rows"]
        assert moved_all[t]["pushed_rows"] < 0.6 * moved[t]["pushed_rows"]
        # Recurring pulls and pushes a row's first miss as no cache does: a little more than all, far less than none.
        assert moved_all[t]["pulled_rows"] < moved_cached[t]["pulled_rows"] < 0.75 * moved[t]["pulled_rows"]
        assert moved_all[t]["pushed_rows"] < moved_cached[t]["pushed_rows"] < 0.75 * moved[t]["pushed_rows"]
    # Trained alike: the last window's loss within 15% of no cache's.
    assert abs(cached["history"][-1]["train_loss"] / plain["history"][-1]["train_loss"] - 1) < 0.15
    # The run record carries the traffic (worker-<i>.json), so compare/sweep show bytes per sample.
    for record, meter in ((plain, moved), (cached, moved_cached)):
        assert record.traffic is not None
        assert {t: v["pulled_rows"] for t, v in record.traffic.items()} == {t: v["pulled_rows"] for t, v in meter.items()}
        assert RunRecord.from_json(json.loads(json.dumps(record.to_json()))).traffic == record.traffic
    assert plain.bytes_per_sample() == sum(v["pulled_bytes"] + v["pushed_bytes"] for v in moved.values()) / plain.samples
    assert cached.bytes_per_sample() < 0.6 * plain.bytes_per_sample()


def _client(rows: int, bound: int, write_bound: int | None = None, policy: str = "lru", optimizer: str = "adagrad",
            ) -> tuple[CachedClient, LocalClient]:
    local = LocalClient()
    local.declare([TableConfig(name="t", dim=4, optimizer=OptimizerConfig(name=optimizer, lr=0.1), seed=3)])
    meter = TrafficMeter({"t": 4}, 4)
    return CachedClient(local, RowCacheConfig(rows, bound, write_bound, policy, admission="all"), {"t": 4}, meter), local


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(sorted(values), dtype=torch.int64)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_combined_push_is_one_update_on_the_summed_gradients(optimizer: str) -> None:
    # Without ``use_tables`` the cache does not know the tables' rules and sends the sum alone, as
    # an older worker does (with them it sends the rules' statistics too: tests/test_rules_combined.py).
    cached, local = _client(rows=10, bound=3, optimizer=optimizer)
    ids = _ids(5, 9)
    start = local.pull({"t": ids}).result().rows["t"].clone()
    g = [torch.randn(2, 4, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    pulled = cached.pull({"t": ids}).result()
    for clock, grad in enumerate(g, start=1):
        cached.push({"t": (ids, grad)}, clock=clock, versions=pulled).result()
        # Held: the write bound is 3 clocks, and the shard still has the starting rows.
        assert torch.equal(local.pull({"t": ids}).result().rows["t"], start)
    assert cached.cache is not None and cached.cache.pending_rows() == 2
    cached.push({}, clock=4, versions=pulled).result()  # the oldest gradient (clock 1) is now 3 clocks old
    assert cached.cache.pending_rows() == 0
    # Reference: the same table, given the sum of the three gradients as one push.
    _, reference = _client(rows=0, bound=0, optimizer=optimizer)
    reference.push({"t": (ids, g[0] + g[1] + g[2])}).result()
    expected = reference.pull({"t": ids}).result().rows["t"]
    assert torch.equal(local.pull({"t": ids}).result().rows["t"], expected)
    # ... which is not three separate steps, except for SGD.
    _, separate = _client(rows=0, bound=0, optimizer=optimizer)
    for grad in g:
        separate.push({"t": (ids, grad)}).result()
    assert torch.allclose(separate.pull({"t": ids}).result().rows["t"], expected, atol=1e-6) == (optimizer == "sgd")


def test_a_combined_push_whose_ids_are_the_steps_own_carries_its_oldest_read_version() -> None:
    # SGD sends no statistics beside a sum, and here every step touches the same two rows, so the
    # sum due at clock 3 has the step's very ids: it is still three gradients read at versions
    # 10, 20 and 30, and goes with the oldest (10), not with the step's own (30).
    cached, local = _client(rows=10, bound=2, optimizer="sgd")
    sent: list[dict[tuple[int, str], int]] = []
    inner_push = local.push

    def spy(sparse=None, dense=None, clock=0, versions=None):  # type: ignore[no-untyped-def]
        if sparse:
            sent.append(dict(versions.table_versions) if versions is not None else {})
        return inner_push(sparse, dense, clock=clock, versions=versions)

    local.push = spy  # type: ignore[method-assign]
    ids = _ids(5, 9)
    cached.pull({"t": ids}).result()
    for clock in (1, 2, 3):
        read = PullResult({}, {}, {(0, "t"): 10 * clock}, {})
        cached.push({"t": (ids, torch.ones(2, 4))}, clock=clock, versions=read).result()
    assert sent == [{(0, "t"): 10}]
    # Write bound 0 pushes each gradient as made, with the step's own versions.
    cached0, local0 = _client(rows=10, bound=2, write_bound=0, optimizer="sgd")
    sent.clear()
    inner_push = local0.push
    local0.push = spy  # type: ignore[method-assign]
    cached0.pull({"t": ids}).result()
    for clock in (1, 2):
        cached0.push({"t": (ids, torch.ones(2, 4))}, clock=clock, versions=PullResult({}, {}, {(0, "t"): 10 * clock}, {})).result()
    assert sent == [{(0, "t"): 10}, {(0, "t"): 20}]


def test_read_bound_serves_cached_rows_then_refreshes() -> None:
    cached, local = _client(rows=10, bound=2)
    ids = _ids(1, 2, 3)
    first = cached.pull({"t": ids}).result().rows["t"]
    assert cached.meter.pulled_rows["t"] == 3
    # Another writer changes the shard's rows; the cache keeps answering within the bound.
    local.push({"t": (ids, torch.ones(3, 4))}).result()
    changed = local.pull({"t": ids}).result().rows["t"]
    for clock in (1, 2):
        cached.push({}, clock=clock).result()
        assert torch.equal(cached.pull({"t": ids}).result().rows["t"], first)
    assert cached.meter.pulled_rows["t"] == 3
    cached.push({}, clock=3).result()  # read at clock 0: 3 clocks old, past the bound
    assert torch.equal(cached.pull({"t": ids}).result().rows["t"], changed)
    assert cached.meter.pulled_rows["t"] == 6 and cached.cache is not None and cached.cache.refreshed["t"] == 3


def test_lru_and_lfu_evict_different_rows_and_evicted_gradients_are_pushed() -> None:
    for policy, kept in (("lru", {3, 4}), ("lfu", {1, 4})):
        cached, local = _client(rows=2, bound=10, write_bound=10, policy=policy)
        before = local.pull({"t": _ids(1)}).result().rows["t"].clone()
        p = cached.pull({"t": _ids(1)}).result()
        cached.push({"t": (_ids(1), torch.ones(1, 4))}, clock=1, versions=p).result()
        cached.pull({"t": _ids(1)}).result()  # id 1 used twice
        cached.push({}, clock=2).result()
        cached.pull({"t": _ids(3)}).result()  # id 3 once, more recently
        cached.push({}, clock=3).result()
        cached.pull({"t": _ids(4)}).result()  # full: lru drops 1, lfu drops 3
        assert cached.cache is not None
        assert cached.cache.tables["t"].cached_ids() == kept, policy
        assert cached.cache.tables["t"].held == len(kept) == int(cached.cache.tables["t"].used.sum())  # counted, not scanned
        cached.push({}, clock=4).result()
        after = local.pull({"t": _ids(1)}).result().rows["t"]
        assert torch.equal(after, before) == (policy == "lfu")  # lru evicted 1: its held gradient went out


def test_a_table_version_going_back_refreshes_that_shards_rows() -> None:
    cache = RowCache(RowCacheConfig(rows=10, bound=5, admission="all"), {"t": 2}, num_shards=1)
    ids = _ids(1, 2)
    plan = cache.plan({"t": ids}, now=0)
    cache.merge(plan, PullResult({"t": torch.zeros(2, 2)}, {}, {(0, "t"): 7}, {}))
    assert cache.plan({"t": ids}, now=1).miss["t"].numel() == 0
    # A pull of another id reports version 3 < 7: the shard came back from an older checkpoint.
    plan = cache.plan({"t": _ids(9)}, now=1)
    cache.merge(plan, PullResult({"t": torch.ones(1, 2)}, {}, {(0, "t"): 3}, {}))
    assert torch.equal(cache.plan({"t": ids}, now=1).miss["t"], ids)
    assert cache.invalidated["t"] == 2
    assert cache.tables["t"].held == 3 == int(cache.tables["t"].used.sum())  # invalidated rows stay cached, read again at their next pull


def test_flags_and_bad_values() -> None:
    config = TrainingConfig(local=True, cache_rows=100, cache_bound=3, cache_policy="lfu")
    assert config.row_cache == RowCacheConfig(100, 3, None, "lfu")
    with pytest.raises(ValueError, match="sync"):
        TrainingConfig(shards=("h:1",), mode="sync", cache_rows=5, cache_bound=2)
    with pytest.raises(ValueError, match="--cache-rows"):
        TrainingConfig(local=True, cache_rows=-1)
    with pytest.raises(ValueError, match="--cache-policy"):
        TrainingConfig(local=True, cache_policy="fifo")
    with pytest.raises(ValueError, match="--cache-write-bound"):
        TrainingConfig(local=True, cache_write_bound=-2)
    assert np.isfinite(RowCache(config.row_cache, {"t": 4}, 2).memory_bytes()["t"])


def test_the_cache_on_a_gpu_worker_trains_as_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake cuda:0 of tests/fake_cuda.py: pulls and pushes go through the transfer thread
    (plans and merges there), and the parameters end as the CPU's with the same cache. Without
    the local updates: with them a row that another pull was fetching is read when its answer
    is merged, which the transfer thread does a step earlier than the CPU's loop (so it lacks
    one more of the worker's own updates). With admission all: recurring's doorkeeper reads the clock
    of each plan, which the transfer thread's order moves too."""
    from fake_cuda import FakeCuda, on_fake_cuda

    from tether.worker.cache.device import DeviceRowCache

    monkeypatch.setattr(RowCache, "use_tables", lambda self, tables: None)
    monkeypatch.setattr(DeviceRowCache, "use_tables", lambda self, tables: None)  # the GPU worker's cache is on its device

    batches = _batches(12)

    def train(fake: FakeCuda | None) -> dict[str, torch.Tensor]:
        config = TrainingConfig(local=True, optimizer="adagrad", lr=0.05, log_every=1000, device="cuda" if fake else "cpu",
                                cache_rows=1000, cache_bound=3, cache_admission="all")
        torch.manual_seed(0)
        model = TwoTower()
        if fake is not None:
            on_fake_cuda(model)
        ids = {"users": torch.unique(torch.cat([b["user"] for b in batches])),
               "items": torch.unique(torch.cat([b["item"] for b in batches]))}
        with Trainer(model, config, loss=_loss, sparse=lambda b: {"users": b["user"], "items": b["item"]},
                     batch_size=lambda b: len(b["rating"]), printer=lambda line: None) as trainer:
            trainer.fit(batches, background=False)
            assert trainer.ps.rows.cache is not None and sum(trainer.ps.rows.cache.hits.values()) > 0
            assert isinstance(trainer.ps.rows.cache, DeviceRowCache) == (fake is not None)
            final = trainer.client.pull(ids, ["dense"]).result(30)
        return {**final.rows, "dense": final.dense["dense"]}

    cpu = train(None)
    with FakeCuda(available=True) as fake:
        gpu = train(fake)
    for name in cpu:
        assert torch.allclose(cpu[name], gpu[name], atol=1e-6), name


def _held_by_scan(cache: RowCache) -> int:
    return sum(int((tab.pending_since[: tab.top][tab.used[: tab.top]] != NONE).sum()) for tab in cache.tables.values())


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"])
def test_the_worker_reads_its_own_updates_by_the_tables_rule(optimizer: str) -> None:
    """Read-your-own-writes: held gradients are applied to the cached rows by the table's rule
    (a state of the worker's own, from the rule's start), while the shard still has the rows as
    they were; the reference is the rule's torch form applied step by step."""
    cached, local = _client(rows=10, bound=5, write_bound=5, optimizer=optimizer)
    spec = TableConfig(name="t", dim=4, optimizer=OptimizerConfig(name=optimizer, lr=0.1, weight_decay=0.01), seed=3)
    cached.use_tables([spec])
    ids = _ids(5, 9)
    start = cached.pull({"t": ids}).result().rows["t"].clone()
    r = rule(optimizer)
    w = start.clone()
    state = {k: torch.full((2, *s), r.initial_state(spec.optimizer).get(k, 0.0)) for k, s in r.state_shapes(4).items()}
    for clock in (1, 2, 3):
        g = torch.randn(2, 4, generator=torch.Generator().manual_seed(clock))
        pulled = cached.push_pull({"t": (ids, g)}, None, {"t": ids}, clock=clock).result()
        r.apply(spec.optimizer, w, g, state)
        assert torch.allclose(pulled.rows["t"], w, atol=1e-6), clock
    assert torch.equal(local.pull({"t": ids}).result().rows["t"], start)  # nothing pushed yet
    assert cached.meter.pulled_rows["t"] == 2  # every later read came from the cache


def test_tables_of_different_rules_step_by_their_own_and_a_reused_slot_starts_at_its_rules_state() -> None:
    """One hold over tables of several rules (one compiled call, ``rows_by_rule``): each table's
    cached rows step by its own rule and state (against the rule's torch form), and a slot freed
    by an eviction and given to another id starts at the rule's initial state, not the old row's."""
    specs = [TableConfig(name="a", dim=4, optimizer=OptimizerConfig(name="adam", lr=0.1), seed=3),
             TableConfig(name="b", dim=3, optimizer=OptimizerConfig(name="ftrl", lr=0.2), seed=4),
             TableConfig(name="c", dim=2, optimizer=OptimizerConfig(name="rowwise_adagrad", lr=0.3, initial_accumulator=0.5), seed=5)]
    local = LocalClient()
    local.declare(specs)
    dims = {s.name: s.dim for s in specs}
    cached = CachedClient(local, RowCacheConfig(2, 5, 5, admission="all"), dims, TrafficMeter(dims, 4))
    cached.use_tables(specs)
    ids = _ids(5, 9)
    start = cached.pull({t: ids for t in dims}).result().rows
    want = {t: start[t].clone() for t in dims}
    states = {s.name: {k: torch.full((2, *shape), rule(s.optimizer.name).initial_state(s.optimizer).get(k, 0.0))
                       for k, shape in rule(s.optimizer.name).state_shapes(s.dim).items()} for s in specs}
    for clock in (1, 2):
        grads = {t: torch.randn(2, d, generator=torch.Generator().manual_seed(10 * clock + d)) for t, d in dims.items()}
        pulled = cached.push_pull({t: (ids, grads[t]) for t in dims}, None, {t: ids for t in dims}, clock=clock).result()
        for s in specs:
            rule(s.optimizer.name).apply(s.optimizer, want[s.name], grads[s.name], states[s.name])
            assert torch.allclose(pulled.rows[s.name], want[s.name], atol=1e-6), (s.name, clock)
    assert cached.cache is not None
    tab = cached.cache.tables["b"]
    old = tab.slots_of(ids.numpy())
    assert (old >= 0).all() and np.abs(tab.state["z"][old]).sum() > 0
    cached.push({}, clock=3).result()
    cached.pull({"b": _ids(11, 12)}).result()  # full (2 rows): 5 and 9 evicted, their slots reused
    new = tab.slots_of(np.array([11, 12]))
    assert sorted(new.tolist()) == sorted(old.tolist())
    for k, a in tab.state.items():
        assert (a[new] == tab.initial.get(k, 0.0)).all(), k


def test_a_refresh_is_the_shards_value_plus_the_workers_own_held_changes() -> None:
    cached, local = _client(rows=10, bound=2, write_bound=10, optimizer="sgd")
    cached.use_tables([TableConfig(name="t", dim=4, optimizer=OptimizerConfig(name="sgd", lr=0.1), seed=3)])
    ids = _ids(1, 2, 3)
    start = cached.pull({"t": ids}).result().rows["t"].clone()
    mine, other = torch.full((3, 4), 2.0), torch.ones(3, 4)
    cached.push({"t": (ids, mine)}, clock=1).result()  # held (write bound 10), applied to the cached copy
    local.push({"t": (ids, other)}).result()  # another worker's update reaches the shard
    assert torch.allclose(cached.pull({"t": ids}).result().rows["t"], start - 0.1 * mine)  # within the read bound
    cached.push({}, clock=3).result()  # read at clock 0: refreshed by the next pull
    refreshed = cached.pull({"t": ids}).result().rows["t"]
    assert cached.meter.pulled_rows["t"] == 6
    assert torch.allclose(refreshed, start - 0.1 * (mine + other), atol=1e-6)  # the shard's value and the held update
    assert torch.equal(local.pull({"t": ids}).result().rows["t"], start - 0.1 * other)
    cached.flush()
    assert torch.allclose(local.pull({"t": ids}).result().rows["t"], refreshed, atol=1e-6)
    assert cached.cache is not None and cached.cache.pending_rows() == 0 == _held_by_scan(cached.cache)


def test_held_rows_are_counted_without_a_scan() -> None:
    cached, _ = _client(rows=3, bound=4, write_bound=2)
    assert cached.cache is not None
    for clock in range(1, 12):
        ids = _ids(*{clock % 5, (clock * 3) % 7 + 10})
        p = cached.pull({"t": ids}).result()
        cached.push({"t": (ids, torch.ones(len(ids), 4))}, clock=clock, versions=p).result()
        cache = cached.cache
        assert cache.pending_rows() == _held_by_scan(cache) + sum(len(e[1]) for e in cache._evicted), clock
    assert sum(cached.cache.evictions.values()) > 0


def test_the_trainer_hands_its_training_configs_cache_to_the_model() -> None:
    """The row cache goes from TrainingConfig.row_cache to PSModel, not through the client's config."""
    from tether import ShardedEmbeddingBag, Trainer

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = ShardedEmbeddingBag("t", 2)

        def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.t(b["t"]).sum(1)

    config = TrainingConfig(local=True, cache_rows=5, cache_bound=2)
    with Trainer(One(), config, loss=lambda m, b: m(b).sum(), sparse=lambda b: {"t": b["t"]}) as trainer:
        assert trainer.ps.rows.cache is not None and trainer.ps.rows.cache.config == config.row_cache
    with Trainer(One(), TrainingConfig(local=True), loss=lambda m, b: m(b).sum(), sparse=lambda b: {"t": b["t"]}) as trainer:
        assert trainer.ps.rows.cache is None


_EARLY_TABLE = TableConfig(name="t", dim=4, optimizer=OptimizerConfig(name="adagrad", lr=0.1), seed=3)


def _early_client(**early: object) -> tuple[CachedClient, LocalClient]:
    local = LocalClient()
    local.declare([_EARLY_TABLE])
    return CachedClient(local, RowCacheConfig(10, 10, 10, admission="all", **early), {"t": 4}, TrafficMeter({"t": 4}, 4)), local  # type: ignore[arg-type]


def test_a_hot_row_is_pushed_before_its_write_bound_as_one_combined_push() -> None:
    cached, local = _early_client(hot=2)
    assert cached.cache is not None
    hot, cold = _ids(5), _ids(7)
    g = [torch.randn(1, 4, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    start = local.pull({"t": cold}).result().rows["t"].clone()
    p = cached.pull({"t": _ids(5, 7)}).result()
    cached.push({"t": (_ids(5, 7), torch.cat([g[0], torch.ones(1, 4)]))}, clock=1, versions=p).result()
    cached.push({"t": (hot, g[1])}, clock=2, versions=p).result()
    assert cached.cache.pending_rows() == 1  # row 5 held 2 gradients: pushed at clock 2; row 7 one, still held
    assert torch.equal(local.pull({"t": cold}).result().rows["t"], start)
    _, reference = _early_client()
    reference.push({"t": (hot, g[0] + g[1])}).result()
    assert torch.equal(local.pull({"t": hot}).result().rows["t"], reference.pull({"t": hot}).result().rows["t"])
    cached.push({}, clock=11, versions=p).result()  # row 7's write bound; row 5's entry from clock 1 is no longer held
    assert cached.cache.pending_rows() == 0


@pytest.mark.parametrize(("hot", "held"), [(1, 0), (3, 2)])
def test_hot_one_pushes_every_held_row_at_once_and_a_row_never_goes_twice(hot: int, held: int) -> None:
    cached, local = _early_client(hot=hot)
    assert cached.cache is not None
    cached.cache.use_tables([_EARLY_TABLE])
    ids = _ids(5, 9)
    p = cached.pull({"t": ids}).result()
    for clock in (1, 2):
        cached.push({"t": (ids, torch.ones(2, 4))}, clock=clock, versions=p).result()
        assert cached.cache.pending_rows() == held
    cached.push({}, clock=3, versions=p).result()  # no third gradient: held until the write bound
    assert cached.cache.pending_rows() == held
    cached.push({}, clock=11, versions=p).result()  # W = 10 clocks after clock 1
    assert cached.cache.pending_rows() == 0
    # Either way the shard saw both gradients once each: every step's ones pushed (hot 1), or their sum once.
    _, reference = _early_client()
    reference.push({"t": (ids, torch.ones(2, 4))}).result()
    if hot == 1:
        reference.push({"t": (ids, torch.ones(2, 4))}).result()
        assert torch.allclose(local.pull({"t": ids}).result().rows["t"], reference.pull({"t": ids}).result().rows["t"])
    else:
        assert not torch.equal(local.pull({"t": ids}).result().rows["t"], reference.pull({"t": ids}).result().rows["t"])


def test_early_push_flags() -> None:
    config = TrainingConfig(local=True, cache_rows=100, cache_bound=3, cache_hot=4)
    assert config.row_cache == RowCacheConfig(100, 3, None, "lru", None, 4)
    with pytest.raises(ValueError, match="--cache-hot"):
        TrainingConfig(local=True, cache_rows=100, cache_hot=-1)
    with pytest.raises(ValueError, match="without --cache-rows"):
        TrainingConfig(local=True, cache_hot=2)


def test_ids_an_earlier_pull_in_flight_refreshes_are_read_later_whichever_pull_and_table() -> None:
    """A pull planned while two earlier ones are in flight (not merged yet) leaves to them the
    ids they pull (``Plan.later``), table by table, and pulls only the others; an id in flight
    for another table is not one of them. The reference is a set per pull and table."""
    rng = np.random.default_rng(4)
    cache = RowCache(RowCacheConfig(rows=1000, bound=5, admission="all"), {"a": 4, "b": 2, "c": 4}, num_shards=2)
    pulls = []
    for _ in range(2):  # two pulls in flight: their ids are misses, noted as being pulled
        sparse = {t: torch.from_numpy(np.unique(rng.integers(0, 60, 25))) for t in ("a", "b", "c")}
        pulls.append((sparse, cache.plan(sparse, now=1)))
    sparse = {t: torch.from_numpy(np.unique(rng.integers(0, 60, 30))) for t in ("c", "a", "b")}
    plan = cache.plan(sparse, now=2)
    later = set(plan.later.tolist())
    for k, t in enumerate(plan.names):
        ids = plan.ids[plan.offs[k]: plan.offs[k + 1]]
        flying = set().union(*(set(p[0][t].tolist()) for p in pulls))
        expect_later = {plan.offs[k] + i for i, x in enumerate(ids.tolist()) if x in flying}
        assert {i for i in later if plan.offs[k] <= i < plan.offs[k + 1]} == expect_later, t
        assert set(plan.miss[t].tolist()) == {x for x in ids.tolist() if x not in flying}, t
        assert expect_later and len(expect_later) < len(ids), t  # both kinds present: the check can fail
