"""The row cache with its rows on the training device (tether.worker.cache.device), run on CPU
tensors (CI has no GPU) and on tests/fake_cuda.py's cuda:0: it answers and pushes what the host
cache does (the shards' rows to the bit; the answers within float rounding, the local rule being
its torch form), bound 0 is exactly no cache, a restarted shard's rows are refreshed, and a step
whose rows are all cached copies no row value between host and device."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.cache.client import CachedClient
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.device import DeviceRowCache
from tether.worker.cache.row_cache import RowCache
from tether.worker.client.local import LocalClient
from tether.worker.client.results import PullResult
from tether.worker.client.traffic import TrafficMeter
from tether.worker.config import TrainingConfig

DIMS = {"a": 4, "b": 4, "c": 2}  # two widths: two banks
SPACE = 200


def _specs(optimizer: str) -> list[TableConfig]:
    return [TableConfig(name=t, dim=d, optimizer=OptimizerConfig(name=optimizer, lr=0.1, weight_decay=0.01), seed=3)
            for t, d in DIMS.items()]


def _client(on_device: bool, optimizer: str, rows: int, bound: int, write_bound: int | None,
            device: str = "cpu", admission: str = "all") -> tuple[CachedClient, LocalClient]:
    local = LocalClient()
    local.declare(_specs(optimizer))
    config = RowCacheConfig(rows, bound, write_bound, "lru", on_device, admission=admission)
    client = CachedClient(local, config, DIMS, TrafficMeter(DIMS, 4), device=torch.device(device))
    client.use_tables(_specs(optimizer))
    return client, local


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    weights = 1 / torch.arange(1, SPACE + 1, dtype=torch.float64) ** 1.1
    return [{t: torch.unique(torch.multinomial(weights, 30, True, generator=g)) for t in DIMS} for _ in range(n)]


def _run(on_device: bool, optimizer: str = "adagrad", rows: int = 50, bound: int = 3, write_bound: int | None = None,
         steps: int = 25, device: str = "cpu", admission: str = "all") -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor], dict,
                                                                              CachedClient]:
    """An async worker's calls (two pulls ahead, then a push_pull per step) through the cache;
    the answers, the shard's rows after a flush, the traffic."""
    client, local = _client(on_device, optimizer, rows, bound, write_bound, device, admission)
    batches = _batches(steps + 2)
    gen = torch.Generator().manual_seed(1)
    pending = [client.pull(batches[0]), client.pull(batches[1])]
    answers = []
    for t in range(steps):
        pulled = pending.pop(0).result()
        answers.append({k: v.cpu().clone() for k, v in pulled.rows.items()})
        grads = {k: (i, torch.randn(len(i), DIMS[k], generator=gen).to(device)) for k, i in batches[t].items()}
        pending.append(client.push_pull(grads, None, batches[t + 2], clock=t + 1, versions=pulled))
    for p in pending:
        p.result()
    client.flush()
    final = local.pull({t: torch.arange(SPACE) for t in DIMS}).result().rows
    return answers, final, client.meter.totals(), client


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"])
@pytest.mark.parametrize("rows,bound,write_bound,admission", [(50, 3, None, "all"), (12, 4, 4, "all"), (50, 5, 2, "all"),
                                                              (50, 3, None, "recurring"), (12, 4, 4, "recurring")])
def test_the_device_cache_moves_and_trains_as_the_host_cache(optimizer: str, rows: int, bound: int, write_bound: int | None,
                                                             admission: str) -> None:
    host = _run(False, optimizer, rows, bound, write_bound, admission=admission)
    dev = _run(True, optimizer, rows, bound, write_bound, admission=admission)
    assert isinstance(dev[3].cache, DeviceRowCache) and not isinstance(host[3].cache, DeviceRowCache)
    assert dev[2] == host[2]  # the same rows pulled and pushed, table by table
    for a, b in zip(host[0], dev[0], strict=False):
        for t in a:
            # The local rule's step is its torch form on the device (the compiled kernel on the host).
            assert torch.allclose(a[t], b[t], rtol=1e-5, atol=1e-6), t
    for t in DIMS:
        assert torch.allclose(host[1][t], dev[1][t], rtol=1e-5, atol=1e-6), t
    if rows == 12:
        assert sum(dev[3].cache.evictions.values()) > 0  # type: ignore[union-attr]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_bound_zero_on_the_device_is_exactly_no_cache(optimizer: str) -> None:
    plain = _run(False, optimizer, rows=0, bound=0)
    dev = _run(True, optimizer, rows=50, bound=0)
    assert isinstance(dev[3].cache, DeviceRowCache)
    for a, b in zip(plain[0], dev[0], strict=False):
        for t in a:
            assert torch.equal(a[t], b[t]), t
    for t in DIMS:
        assert torch.equal(plain[1][t], dev[1][t]), t
    assert plain[2] == dev[2]


def test_a_combined_push_carries_the_rules_statistics() -> None:
    pushed = []
    for on_device in (False, True):
        cache = (DeviceRowCache(RowCacheConfig(50, 3, admission="all"), DIMS, 1, "cpu") if on_device else RowCache(RowCacheConfig(50, 3, admission="all"), DIMS, 1))
        cache.use_tables([TableConfig(name=t, dim=d, optimizer=OptimizerConfig(name="adam" if t == "a" else "adagrad", lr=0.1))
                          for t, d in DIMS.items()])
        ids = {t: torch.tensor([3, 8, 20]) for t in DIMS}
        plan = cache.plan(ids, 0)
        cache.merge(plan, PullResult({t: torch.zeros(3, d) for t, d in DIMS.items()}, {}, {(0, t): 0 for t in DIMS}, {}))
        gen = torch.Generator().manual_seed(0)
        for clock in (1, 2, 3):
            step = {t: (i if clock == 1 else i[:-1]) for t, i in ids.items()}  # id 20 holds one gradient
            assert cache.accumulate({t: (i, torch.randn(len(i), DIMS[t], generator=gen)) for t, i in step.items()}, clock, None)[0] == {}
        pushed.append(cache.accumulate({}, 4, None)[0])
    host, dev = pushed
    for t in DIMS:
        assert len(dev[t]) == 3 and torch.equal(host[t][0], dev[t][0]) and torch.equal(host[t][1], dev[t][1])
        assert torch.allclose(host[t][2], dev[t][2], rtol=1e-6)  # mean(g * g): torch's sum order on the device
        assert dev[t][2][2, 0] == -1  # one gradient: the ordinary step


def test_a_restarted_shards_rows_are_refreshed_on_the_device() -> None:
    cache = DeviceRowCache(RowCacheConfig(rows=10, bound=5, admission="all"), {"t": 2}, 1, "cpu")
    ids = torch.tensor([1, 2])
    cache.merge(cache.plan({"t": ids}, now=0), PullResult({"t": torch.zeros(2, 2)}, {}, {(0, "t"): 7}, {}))
    assert cache.plan({"t": ids}, now=1).miss["t"].numel() == 0
    cache.merge(cache.plan({"t": torch.tensor([9])}, now=1), PullResult({"t": torch.ones(1, 2)}, {}, {(0, "t"): 3}, {}))
    plan = cache.plan({"t": ids}, now=1)
    assert torch.equal(plan.miss["t"], ids) and cache.invalidated["t"] == 2
    result, _ = cache.merge(plan, PullResult({"t": torch.full((2, 2), 5.0)}, {}, {(0, "t"): 3}, {}))
    assert torch.equal(result.rows["t"], torch.full((2, 2), 5.0))


@contextmanager
def _fake_cuda() -> Iterator[object]:
    from fake_cuda import FakeCuda

    with FakeCuda(available=True) as fake:
        yield fake


def test_the_cache_on_fake_cuda_answers_as_on_the_cpu() -> None:
    cpu = _run(True, "adagrad", 12, 4, 2)
    with _fake_cuda():
        gpu = _run(True, "adagrad", 12, 4, 2, device="cuda")
        assert all(b.values.device.type == "cuda" for b in gpu[3].cache.banks)  # type: ignore[union-attr]
    assert cpu[2] == gpu[2]
    for a, b in zip(cpu[0], gpu[0], strict=False):
        for t in a:
            assert torch.equal(a[t], b[t]), t
    for t in DIMS:
        assert torch.equal(cpu[1][t], gpu[1][t]), t


def test_a_step_of_cached_rows_copies_no_row_between_host_and_device() -> None:
    with _fake_cuda() as fake:
        client, _ = _client(True, "adagrad", rows=50, bound=5, write_bound=5, device="cuda")
        ids = {t: torch.tensor([1, 5, 9]) for t in DIMS}
        pulled = client.pull(ids).result()  # misses: the rows come to the device once
        grads = {t: (i, torch.ones(3, DIMS[t], device="cuda")) for t, i in ids.items()}
        client.push(grads, clock=1, versions=pulled).result()
        before = len(fake.copies)  # type: ignore[attr-defined]
        for clock in (2, 3):  # every row cached and read within the bound; nothing due yet
            pulled = client.pull(ids).result()
            assert all(r.device.type == "cuda" for r in pulled.rows.values())
            client.push(grads, clock=clock, versions=pulled).result()
        step = fake.copies[before:]  # type: ignore[attr-defined]
        assert step and all(c.direction == "h2d" and c.dtype == torch.int64 for c in step), step
        assert client.meter.totals()["a"]["pulled_rows"] == 3
        # The held sums go to the host once due (the write bound), as one copy per bank.
        before = len(fake.copies)  # type: ignore[attr-defined]
        client.push({}, clock=6).result()
        down = [c for c in fake.copies[before:] if c.direction == "d2h"]  # type: ignore[attr-defined]
        assert len(down) == 2 and all(c.dtype == torch.float32 for c in down)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cache_on_a_real_gpu_answers_as_on_the_cpu() -> None:
    cpu = _run(True, "adagrad", 12, 4, 2)
    gpu = _run(True, "adagrad", 12, 4, 2, device="cuda")
    assert cpu[2] == gpu[2]
    for t in DIMS:
        assert torch.allclose(cpu[1][t], gpu[1][t], rtol=1e-5, atol=1e-6), t


def test_a_cuda_worker_chooses_the_device_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--cache-rows`` on a GPU worker puts the rows on its device; on the CPU in host memory
    unless asked (``RowCacheConfig.on_device``)."""
    config = TrainingConfig(local=True, cache_rows=100, cache_bound=3)
    assert config.row_cache.on_device is None
    local = LocalClient()
    meter = TrafficMeter(DIMS, 4)
    assert type(CachedClient(local, config.row_cache, DIMS, meter, device=torch.device("cpu")).cache) is RowCache
    assert type(CachedClient(local, replace(config.row_cache, on_device=True), DIMS, meter, device=torch.device("cpu")).cache) \
        is DeviceRowCache
    with _fake_cuda():
        assert type(CachedClient(local, config.row_cache, DIMS, meter, device=torch.device("cuda", 0)).cache) is DeviceRowCache
        assert type(CachedClient(local, replace(config.row_cache, on_device=False), DIMS, meter, device=torch.device("cuda", 0)).cache) \
            is RowCache


def _trainer_run(monkeypatch: pytest.MonkeyPatch, on_device: bool | None, batches: list, fake: object = None,
                 **cache: object) -> tuple[dict[str, torch.Tensor], object]:
    """tests/test_row_cache.py's two-tower model trained through ``Trainer`` (local mode)."""
    from fake_cuda import on_fake_cuda
    from test_row_cache import TwoTower, _loss

    from tether.worker.training.trainer import Trainer

    plain = TrainingConfig.row_cache.fget  # type: ignore[attr-defined]
    monkeypatch.setattr(TrainingConfig, "row_cache", property(lambda self: replace(plain(self), on_device=on_device)))
    config = TrainingConfig(local=True, optimizer="adagrad", lr=0.05, log_every=1000, device="cuda" if fake else "cpu",
                            **cache)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = TwoTower()
    if fake is not None:
        on_fake_cuda(model)
    ids = {"users": torch.unique(torch.cat([b["user"] for b in batches])), "items": torch.unique(torch.cat([b["item"] for b in batches]))}
    with Trainer(model, config, loss=_loss, sparse=lambda b: {"users": b["user"], "items": b["item"]},
                 batch_size=lambda b: len(b["rating"]), printer=lambda line: None) as trainer:
        record = trainer.fit(batches, background=False)
        cache = trainer.ps.rows.cache
        final = trainer.client.pull(ids, ["dense"]).result(30)
    return {**final.rows, "dense": final.dense["dense"]}, (record, cache)


def test_a_trainer_with_the_device_cache_trains_as_with_the_host_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_row_cache import _batches as rating_batches

    batches = rating_batches(30)
    plain, _ = _trainer_run(monkeypatch, None, batches)
    zero, (_, cache0) = _trainer_run(monkeypatch, True, batches, cache_rows=1000, cache_bound=0)
    assert isinstance(cache0, DeviceRowCache)
    for name in plain:
        assert torch.equal(plain[name], zero[name]), name  # bound 0: exactly no cache
    host, (record_h, cache_h) = _trainer_run(monkeypatch, False, batches, cache_rows=1000, cache_bound=4)
    dev, (record_d, cache_d) = _trainer_run(monkeypatch, True, batches, cache_rows=1000, cache_bound=4)
    assert type(cache_h) is RowCache and isinstance(cache_d, DeviceRowCache)
    assert record_h.traffic == record_d.traffic  # type: ignore[attr-defined]
    for name in host:
        assert torch.allclose(host[name], dev[name], rtol=1e-5, atol=1e-6), name


def test_a_gpu_workers_steps_of_cached_rows_copy_no_row_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same batch every step: after the first pull every row is a hit, and the held sums go
    down once at the end (a flush). The model's dense part (2 floats) and the lookups' checks
    cross every step, as does the batch; no row of 8 floats does."""
    from test_row_cache import _batches as rating_batches

    batches = rating_batches(1) * 12
    with _fake_cuda() as fake:
        # Admission all: every row cached at its first miss (recurring pulls a row twice before it is cached).
        _, (record, cache) = _trainer_run(monkeypatch, None, batches, fake=fake, cache_rows=1000, cache_bound=50, cache_admission="all")
        assert isinstance(cache, DeviceRowCache)
        # Float copies other than the dense part's and each batch's 32 ratings (the main thread's, 128 bytes).
        rows = [c for c in fake.copies if c.dtype.is_floating_point and c.nbytes > 8  # type: ignore[attr-defined]
                and not (c.direction == "h2d" and c.thread == "MainThread" and c.nbytes == 4 * 32)]
    # The first pull's rows up (one copy); the flush's sums down (one bank of 8-wide rows), split
    # from their held columns on the device: the sums, then their mean squares, one float a row.
    assert [c.direction for c in rows] == ["h2d", "d2h", "d2h"], rows
    assert rows[1].nbytes == 8 * rows[2].nbytes > 0, rows
    assert record.steps == 12  # type: ignore[attr-defined]


def test_rows_cached_before_the_rules_are_known_keep_their_held_sums() -> None:
    """``use_tables`` after rows were cached and gradients held: the held sums stay, the local
    rule starts from its initial state (as on the host)."""
    pushed = []
    for on_device in (False, True):
        config = RowCacheConfig(10, 3, admission="all")
        cache = DeviceRowCache(config, {"t": 2}, 1, "cpu") if on_device else RowCache(config, {"t": 2}, 1)
        ids = torch.tensor([1, 2])
        pulled, _ = cache.merge(cache.plan({"t": ids}, 0), PullResult({"t": torch.zeros(2, 2)}, {}, {(0, "t"): 0}, {}))
        cache.accumulate({"t": (ids, torch.ones(2, 2))}, 1, pulled)
        cache.use_tables([TableConfig(name="t", dim=2, optimizer=OptimizerConfig(name="adagrad", lr=0.1))])
        cache.accumulate({"t": (ids, torch.ones(2, 2))}, 2, pulled)
        pushed.append(cache.accumulate({}, 9, None, flush=True)[0]["t"])
    assert torch.equal(pushed[0][1], pushed[1][1]) and torch.equal(pushed[1][1], torch.full((2, 2), 2.0))


def test_the_capacity_on_a_gpu_is_capped_by_its_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.worker.cache.device import FREE_SHARE, device_capacity

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10_000_000, 80_000_000))
    per_row = sum(4 * (6 * d + 3) for d in DIMS.values())  # values, held sums (+2), two local changes, Adam's state
    assert device_capacity(1_000_000, DIMS, torch.device("cuda", 0)) == int(FREE_SHARE * 10_000_000 // per_row)
    assert device_capacity(100, DIMS, torch.device("cuda", 0)) == 100
    assert device_capacity(1_000_000, DIMS, torch.device("cpu")) == 1_000_000
