"""The row cache's admission (``--cache-admission recurring``; tether.worker.cache.row_cache): a missed
id is cached only once it is missed again within max(R, W) clocks; the others are pulled, answered
and pushed in their step, as with no cache, merged into the step's push (``batch.with_unheld``)."""

from __future__ import annotations

import pytest
import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.cache.client import CachedClient
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.device import DeviceRowCache
from tether.worker.cache.row_cache import DOOR_MIN, RowCache
from tether.worker.client.local import LocalClient
from tether.worker.client.results import PullResult
from tether.worker.client.traffic import TrafficMeter
from tether.worker.config import TrainingConfig

SPEC = TableConfig(name="t", dim=4, optimizer=OptimizerConfig(name="adagrad", lr=0.1), seed=3)


def _client(cache: RowCacheConfig | None, device: str | None = None) -> tuple[CachedClient, LocalClient]:
    local = LocalClient()
    local.declare([SPEC])
    client = CachedClient(local, cache or RowCacheConfig(), {"t": 4}, TrafficMeter({"t": 4}, 4),
                          device=None if device is None else torch.device(device))
    client.use_tables([SPEC])
    return client, local


def _recurring(rows: int = 100, bound: int = 3, write_bound: int | None = None) -> RowCacheConfig:
    return RowCacheConfig(rows, bound, write_bound, admission="recurring")


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(sorted(values), dtype=torch.int64)


def _grad(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def _spy(local: LocalClient) -> list[dict[str, tuple[torch.Tensor, ...]]]:
    """What ``local`` is pushed, per call, sparse part only (copied)."""
    sent: list[dict[str, tuple[torch.Tensor, ...]]] = []
    inner = local.push

    def push(sparse=None, dense=None, clock=0, versions=None):  # type: ignore[no-untyped-def]
        if sparse:
            sent.append({t: tuple(x.clone() for x in part) for t, part in sparse.items()})
        return inner(sparse, dense, clock=clock, versions=versions)

    local.push = push  # type: ignore[method-assign]
    return sent


def test_ids_that_never_recur_are_not_cached_and_train_exactly_as_with_no_cache() -> None:
    plain, plain_local = _client(None)
    cached, cached_local = _client(_recurring())
    sent = _spy(cached_local)
    for clock in range(6):
        ids = _ids(*(10 * clock + k for k in range(5)))  # new ids every step
        for client in (plain, cached):
            read = client.pull({"t": ids}).result()
            client.push({"t": (ids, _grad(5, clock))}, clock=clock + 1, versions=read).result()
        assert torch.equal(sent[-1]["t"][0], ids) and torch.equal(sent[-1]["t"][1], _grad(5, clock))
        assert len(sent[-1]["t"]) == 2  # no row combines: no statistics, as with no cache
    every = _ids(*range(60))
    assert torch.equal(plain_local.pull({"t": every}).result().rows["t"], cached_local.pull({"t": every}).result().rows["t"])
    cache = cached.cache
    assert isinstance(cache, RowCache)
    assert cache.tables["t"].cached_ids() == set() and cache.pending_rows() == 0
    assert cache.passed["t"] == 30 and cache.hits["t"] == 0
    assert cached.meter.totals()["t"]["pulled_rows"] == plain.meter.totals()["t"]["pulled_rows"] == 30
    assert cached.meter.totals()["t"]["pushed_rows"] == plain.meter.totals()["t"]["pushed_rows"] == 30


def test_an_id_missed_again_within_the_window_is_cached_then_answered_from_the_cache() -> None:
    cached, _ = _client(_recurring(bound=3))
    cache = cached.cache
    assert isinstance(cache, RowCache)
    ids = _ids(7)
    cached.pull({"t": ids}).result()  # first miss: passed, not cached
    assert cache.tables["t"].cached_ids() == set() and cache.passed["t"] == 1
    cached.push({}, clock=2).result()
    cached.pull({"t": ids}).result()  # missed again 2 clocks later (window 3): cached
    assert cache.tables["t"].cached_ids() == {7} and cache.passed["t"] == 1
    cached.push({}, clock=3).result()
    cached.pull({"t": ids}).result()
    assert cache.hits["t"] == 1 and cached.meter.totals()["t"]["pulled_rows"] == 2
    # Past the window a second miss is a first miss again.
    cached.pull({"t": _ids(9)}).result()
    cached.push({}, clock=10).result()
    cached.pull({"t": _ids(9)}).result()
    assert 9 not in cache.tables["t"].cached_ids() and cache.passed["t"] == 3


def test_a_push_merges_the_held_sums_with_the_steps_rows_not_cached_in_id_order() -> None:
    cached, local = _client(_recurring(bound=2))
    sent = _spy(local)
    hot = _ids(4, 20)
    for clock in (0, 1):  # 4 and 20 missed twice: cached at clock 1
        cached.pull({"t": hot}).result()
        cached.push({}, clock=clock + 1).result()
    both = _ids(4, 20, 11, 30)  # 11 and 30 never seen: not cached
    read = cached.pull({"t": both}).result()
    assert cached.cache is not None and cached.cache.tables["t"].cached_ids() == {4, 20}
    g1 = _grad(4, 1)
    cached.push({"t": (both, g1)}, clock=3, versions=read).result()
    assert [list(p["t"][0].tolist()) for p in sent] == [[11, 30]]  # 4 and 20 held (write bound 2)
    assert torch.equal(sent[0]["t"][1], g1[[1, 3]])
    read = cached.pull({"t": hot}).result()
    g2 = _grad(2, 2)
    cached.push({"t": (hot, g2)}, clock=4, versions=read).result()
    cached.push({"t": (_ids(11), _grad(1, 3))}, clock=5, versions=read).result()  # 4 and 20 due (held since 3), with 11
    ids, sums, stats = sent[-1]["t"]
    assert ids.tolist() == [4, 11, 20]  # one push, in id order
    assert torch.allclose(sums[[0, 2]], g1[[0, 2]] + g2)
    assert torch.equal(sums[1], _grad(1, 3)[0])
    # Adagrad's statistic: the sum of mean(g * g) for the combined rows, -1 for the row of one gradient.
    expect = (g1[[0, 2]] ** 2).mean(1) + (g2 ** 2).mean(1)
    assert torch.allclose(stats[[0, 2], 0], expect) and stats[1, 0].item() == -1.0
    assert cached.cache.pending_rows() == 0


def test_a_pull_in_flight_of_an_id_not_admitted_is_not_waited_on() -> None:
    cached, local = _client(_recurring(bound=5))
    ids = _ids(3)
    first = cached.pull({"t": ids})
    second = cached.pull({"t": ids})  # planned before the first is stored: the id is admitted now, pulled by this pull itself
    want = local.pull({"t": ids}).result().rows["t"]
    assert torch.equal(first.result().rows["t"], want) and torch.equal(second.result().rows["t"], want)
    assert cached.meter.totals()["t"]["pulled_rows"] == 2
    assert cached.cache is not None and cached.cache.tables["t"].cached_ids() == {3}


def test_the_doorkeeper_grows_with_the_misses_a_step() -> None:
    cache = RowCache(_recurring(rows=10_000, bound=4), {"t": 4}, 1)
    ids = torch.arange(5_000, dtype=torch.int64)
    plan = cache.plan({"t": ids}, 0)
    # A doorkeeper of DOOR_MIN entries: colliding ids are admitted early (never one missed again left out).
    first = cache.passed["t"]
    assert len(plan.miss["t"]) == 5_000 and DOOR_MIN // 2 < first < 5_000
    assert cache._door.shape[1] >= 8 * 5_000 * 4
    assert cache.memory_bytes()["t"] >= cache._door.shape[1] * 8  # counted with the cache's memory
    cache.merge(plan, PullResult({"t": torch.zeros(5_000, 4)}, {}, {(0, "t"): 0}, {}))
    assert len(cache.tables["t"].cached_ids()) == 5_000 - first
    cache.plan({"t": ids + 10_000}, 1)  # grown: new ids collide rarely
    assert cache.passed["t"] - first > 0.95 * 5_000


def test_bound_zero_with_admission_is_exactly_no_cache() -> None:
    plain, plain_local = _client(None)
    cached, cached_local = _client(RowCacheConfig(100, 0, admission="recurring"))
    ids = _ids(1, 2, 3)
    for clock in range(4):
        for client in (plain, cached):
            read = client.pull({"t": ids}).result()
            client.push({"t": (ids, _grad(3, clock))}, clock=clock + 1, versions=read).result()
    assert torch.equal(plain_local.pull({"t": ids}).result().rows["t"], cached_local.pull({"t": ids}).result().rows["t"])
    assert cached.meter.totals() == plain.meter.totals()


def test_bad_admission_values_and_where_it_does_not_apply() -> None:
    with pytest.raises(ValueError, match=r"cache_admission.*recurring, all"):
        RowCacheConfig(10, 2, admission="some")
    with pytest.raises(ValueError, match="--cache-admission without --cache-rows"):
        TrainingConfig(local=True, cache_admission="all")
    assert TrainingConfig(local=True).cache_admission == RowCacheConfig().admission == "recurring"  # the default
    assert RowCache(RowCacheConfig(10, 2), {"t": 4}, 1)._door.shape == (1, DOOR_MIN)
    assert RowCache(RowCacheConfig(10, 2, admission="all"), {"t": 4}, 1)._door.shape == (1, 1)  # all: no doorkeeper


def test_a_full_tables_rows_not_cached_go_in_their_step_with_the_held_sums() -> None:
    # Admission all, 2 rows a table: a pull of 4 new ids caches 2; the other 2 take the same merge
    # as rows not admitted (their gradients in this step's push, the cached ones held).
    cached, local = _client(RowCacheConfig(2, 3, admission="all"))
    sent = _spy(local)
    ids = _ids(1, 2, 3, 4)
    read = cached.pull({"t": ids}).result()
    assert cached.cache is not None and len(cached.cache.tables["t"].cached_ids()) == 2
    kept = sorted(cached.cache.tables["t"].cached_ids())
    g = _grad(4, 7)
    cached.push({"t": (ids, g)}, clock=1, versions=read).result()
    out = [i for i in (1, 2, 3, 4) if i not in kept]
    assert sent[-1]["t"][0].tolist() == out and torch.equal(sent[-1]["t"][1], g[[i - 1 for i in out]])
    assert cached.cache.pending_rows() == 2
    cached.flush(clock=1)
    assert sorted(sent[-1]["t"][0].tolist()) == kept and cached.cache.pending_rows() == 0


def test_the_device_cache_admits_alike() -> None:
    # The cache a GPU worker uses (rows in device tensors), here on the CPU's: the same admission,
    # and rows never missed again train exactly as with no cache.
    plain, plain_local = _client(None)
    cached, cached_local = _client(RowCacheConfig(100, 3, on_device=True, admission="recurring"), device="cpu")
    assert isinstance(cached.cache, DeviceRowCache)
    for clock in range(4):
        ids = _ids(*(10 * clock + k for k in range(5)))
        for client in (plain, cached):
            read = client.pull({"t": ids}).result()
            client.push({"t": (ids, _grad(5, clock))}, clock=clock + 1, versions=read).result()
    every = _ids(*range(40))
    assert torch.equal(plain_local.pull({"t": every}).result().rows["t"], cached_local.pull({"t": every}).result().rows["t"])
    assert cached.cache.tables["t"].cached_ids() == set() and cached.cache.passed["t"] == 20
    again = _ids(2, 13)  # missed at clocks 0 and 1; now, at clock 4, 13 is within the window (3) again, 2 is not
    want = cached_local.pull({"t": again}).result().rows["t"]
    assert torch.equal(cached.pull({"t": again}).result().rows["t"], want)
    assert cached.cache.tables["t"].cached_ids() == {13} and cached.cache.passed["t"] == 21
    cached.push({}, clock=5).result()
    assert torch.equal(cached.pull({"t": again}).result().rows["t"], want)  # 13 a hit, 2 missed again within 1: cached
    assert cached.cache.tables["t"].cached_ids() == {2, 13} and cached.cache.hits["t"] == 1
    cached.push({}, clock=6).result()
    assert torch.equal(cached.pull({"t": again}).result().rows["t"], want) and cached.cache.hits["t"] == 3
