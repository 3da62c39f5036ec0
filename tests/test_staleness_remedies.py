"""DC-ASGD-a and gap-aware (issue 42 item 2): the maths on hand-computed numbers, for a table's
rows (running means per row) and a dense chunk (per element), on a shard; bad values refused
with nothing changed; the flags parsed, refused in sync and local mode, and carried to workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tether.protos.errors import InvalidArgument
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.push_hooks import dc_adaptive_compensated, gap_penalized, running_mean
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import DenseDecl, DenseUpdate, SparseUpdate
from tether.worker.config import TrainingConfig

LR = 0.5


def test_running_mean_starts_at_the_first_value() -> None:
    first = running_mean(np.array([-1.0, -1.0], np.float32), np.array([4.0, 1.0]), 0.5)
    np.testing.assert_allclose(first, [4.0, 1.0])
    np.testing.assert_allclose(running_mean(first, np.array([1.0, 1.0]), 0.5), [2.5, 1.0])
    np.testing.assert_allclose(running_mean(np.array([2.0], np.float32), np.array([0.0]), 0.95), [1.9], rtol=1e-6)


def test_dc_adaptive_by_hand() -> None:
    # Per element, first push (the mean square is g * g): g + lam0 * |g| * (w_now - w_read).
    g, now, read = torch.tensor([2.0, -1.0]), torch.tensor([0.5, -0.25]), torch.zeros(2)
    out = dc_adaptive_compensated(g, now, read, 0.5, torch.tensor([4.0, 1.0]))
    torch.testing.assert_close(out, torch.tensor([2.0 + 0.5 * 2 * 0.5, -1.0 + 0.5 * 1 * -0.25]))  # 2.5, -1.125
    # A per-row mean square (a column): row [1, 3] has mean(1, 9) = 5; 1/sqrt(5) * [1 * 0.2, 9 * -0.1].
    out = dc_adaptive_compensated(torch.tensor([[1.0, 3.0]]), torch.tensor([[0.2, -0.1]]), torch.zeros(1, 2), 1.0, torch.tensor([[5.0]]))
    torch.testing.assert_close(out, torch.tensor([[1.0894427, 2.5975078]]))
    # The term does not shrink with the gradient's scale: a gradient 1000x smaller is corrected by
    # the same share of itself (DC-ASGD's lam * g * g would be 1000x smaller a share).
    small = dc_adaptive_compensated(g / 1000, now, read, 0.5, torch.tensor([4.0, 1.0]) / 1e6)
    torch.testing.assert_close(small * 1000, torch.tensor([2.5, -1.125]))


def test_gap_penalty_by_hand() -> None:
    g = torch.tensor([4.0, 1.0, 3.0])
    now, read = torch.tensor([-1.0, 2.0, 0.1]), torch.zeros(3)
    # gap / C = [2, 2, 0.2]: the first two halved, the third (moved less than one update) kept.
    out = gap_penalized(g, now, read, torch.tensor([0.5, 1.0, 0.5]))
    torch.testing.assert_close(out, torch.tensor([2.0, 0.5, 3.0]))
    # C not known yet (-1): no penalty.
    torch.testing.assert_close(gap_penalized(g, now, read, torch.full((3,), -1.0)), g)


def _shard() -> Shard:
    shard = Shard()
    opt = OptimizerConfig("sgd", LR)
    shard.declare([TableConfig("t", 2, optimizer=opt, init_scale=0.0, seed=1)], [DenseDecl("d", 0, torch.zeros(2), opt)])
    return shard


def _push(shard: Shard, worker: str, seq: int, g: list[float], read: tuple[torch.Tensor, torch.Tensor], **kw: object) -> None:
    ids = np.array([5])
    shard.push(worker, seq, [SparseUpdate("t", ids, torch.tensor([g]), 0, read[0])], [DenseUpdate("d", 0, torch.tensor(g), 0, read[1])],
               incarnation=1 if worker == "a" else 2, **kw)  # type: ignore[arg-type]


def _read(shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    return shard.tables["t"].pull(np.array([5]))[0].clone(), shard.dense[("d", 0)].value.clone()


def test_gap_aware_on_a_shard_by_hand() -> None:
    """SGD at 0.5, decay 0.5, the row and the chunk at [0, 0]. b pushes [1, -2] twice, reading
    fresh each time (no gap; each step [0.5, 1.0] in size: C is 0.75 for the row, the mean of its
    elements, and [0.5, 1.0] for the chunk); then a pushes [4, 1] read at the start, gap [1, 2]:
    the row's step is divided by its mean gap over C, 1.5 / 0.75 = 2 -> [2, 0.5] (one penalty per
    row, as C is one per row), the chunk's per element by [2, 2] -> [2, 0.5]."""
    shard = _shard()
    kw = {"gap_aware": True, "remedy_decay": 0.5}
    start = _read(shard)
    _push(shard, "b", 1, [1.0, -2.0], start, **kw)
    _push(shard, "b", 2, [1.0, -2.0], _read(shard), **kw)
    row, chunk = _read(shard)
    assert row.tolist() == [[-1.0, 2.0]] and chunk.tolist() == [-1.0, 2.0]
    _push(shard, "a", 1, [4.0, 1.0], start, **kw)
    row, chunk = _read(shard)
    torch.testing.assert_close(row, torch.tensor([[-1.0 - LR * 2.0, 2.0 - LR * 0.5]]))
    torch.testing.assert_close(chunk, torch.tensor([-1.0 - LR * 2.0, 2.0 - LR * 0.5]))
    # The update sizes went into the means: row mean(|[-1.0, -0.25]|) = 0.625, 0.5 * 0.75 + 0.5 * 0.625.
    np.testing.assert_allclose(shard.tables["t"].running_means("gap_step", np.array([5])), [0.6875])
    torch.testing.assert_close(shard.dense[("d", 0)].running_means("gap_step"), torch.tensor([0.75, 0.625]))


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_gap_aware_divides_the_step_whatever_the_rule(rule: str) -> None:
    """The penalty divides the step the rule takes, not the gradient: under Adagrad (the default)
    or Adam a divided gradient is mostly undone by the rule's normalisation (a fresh row's first
    Adagrad step is lr * sign(g) at any scale), and gap-aware changed nothing on the built-in job
    (bench/RESULTS.md, issue 42). The same pushes on a gap-aware shard and a plain one: b's two
    fresh pushes (no gap, the same steps on both), then a's push read at the start, whose step on
    the gap-aware shard is the plain one divided by the penalty (the row's mean gap over its C; the
    chunk's per element)."""
    def shard() -> Shard:
        s = Shard()
        opt = OptimizerConfig(rule, LR)
        s.declare([TableConfig("t", 2, optimizer=opt, init_scale=0.0, seed=1)], [DenseDecl("d", 0, torch.zeros(2), opt)])
        return s

    gap, plain = shard(), shard()
    kw = {"gap_aware": True, "remedy_decay": 0.5}
    start = _read(gap)
    for seq in (1, 2):
        _push(gap, "b", seq, [1.0, -2.0], _read(gap), **kw)
        _push(plain, "b", seq, [1.0, -2.0], _read(plain))
    now = _read(gap)
    torch.testing.assert_close(now, _read(plain))
    c_row = float(gap.tables["t"].running_means("gap_step", np.array([5]))[0])
    c_chunk = gap.dense[("d", 0)].running_means("gap_step")
    p_row = max(1.0, float((now[0] - start[0]).abs().mean()) / c_row)
    p_chunk = ((now[1] - start[1]).abs() / c_chunk).clamp(min=1.0)
    assert p_row > 1.5 and bool((p_chunk > 1.5).all())
    _push(gap, "a", 1, [4.0, 1.0], start, **kw)
    _push(plain, "a", 1, [4.0, 1.0], start)
    (row, chunk), (plain_row, plain_chunk) = _read(gap), _read(plain)
    torch.testing.assert_close(row - now[0], (plain_row - now[0]) / p_row)
    torch.testing.assert_close(chunk - now[1], (plain_chunk - now[1]) / p_chunk)


def test_dc_adaptive_on_a_shard_by_hand() -> None:
    """b moves the parameters to [-0.5, 1.0]; a's gradient [2, 2] read at [0, 0] with lambda0 1 and
    decay 0.5. The row's mean square: b's mean(1, 4) = 2.5, then 0.5 * 2.5 + 0.5 * 4 = 3.25; the
    chunk's: [1, 4], then [2.5, 4]. Compensated: g + 1 / sqrt(ms) * g * g * (w_now - w_read)."""
    shard = _shard()
    kw = {"delay_compensation": 1.0, "dc_adaptive": True, "remedy_decay": 0.5}
    start = _read(shard)
    _push(shard, "b", 1, [1.0, -2.0], start, **kw)
    _push(shard, "a", 1, [2.0, 2.0], start, **kw)
    row, chunk = _read(shard)
    delta = np.array([-0.5, 1.0])
    g_row = 2.0 + 4.0 / np.sqrt(3.25) * delta          # [0.8906, 4.2188]
    g_chunk = 2.0 + 4.0 / np.sqrt([2.5, 4.0]) * delta  # [0.7351, 4.0]
    np.testing.assert_allclose(row.numpy()[0], delta - LR * g_row, rtol=1e-5)
    np.testing.assert_allclose(chunk.numpy(), delta - LR * g_chunk, rtol=1e-5)
    # Plain SGD would have ended elsewhere.
    assert np.abs(row.numpy()[0] - (delta - LR * 2.0)).max() > 0.2


def test_no_read_values_is_plain() -> None:
    shard, plain = _shard(), _shard()
    ids = np.array([5])
    for s in (shard, plain):
        s.push("b", 1, [SparseUpdate("t", ids, torch.tensor([[1.0, -2.0]]))], [], incarnation=2)
    shard.push("a", 1, [SparseUpdate("t", ids, torch.tensor([[4.0, 1.0]]))], [], incarnation=1, gap_aware=True, delay_compensation=1.0,
               dc_adaptive=True)
    plain.push("a", 1, [SparseUpdate("t", ids, torch.tensor([[4.0, 1.0]]))], [], incarnation=1)
    assert torch.equal(shard.tables["t"].pull(ids)[0], plain.tables["t"].pull(ids)[0])


@pytest.mark.parametrize("kw, match", [
    ({"delay_compensation": float("nan"), "dc_adaptive": True}, "delay_compensation must be a finite number >= 0, got nan"),
    ({"dc_adaptive": True}, r"--dc-adaptive needs --delay-compensation LAMBDA0 > 0"),
    ({"gap_aware": True, "remedy_decay": 1.0}, r"--remedy-decay must be a number in \(0, 1\), got 1.0"),
    ({"gap_aware": True, "remedy_decay": 0.0}, r"--remedy-decay must be a number in \(0, 1\)"),
])
def test_bad_values_are_refused_and_change_nothing(kw: dict, match: str) -> None:
    shard = _shard()
    start = _read(shard)
    before = shard.export_state()
    with pytest.raises(InvalidArgument, match=match) as err:
        _push(shard, "a", 1, [1.0, 1.0], start, **kw)
    assert "\n" not in str(err.value) and shard.rejected_pushes == 1
    after = shard.export_state()
    assert torch.equal(before.tables[0].weights, after.tables[0].weights)
    assert torch.equal(before.dense[0].value, after.dense[0].value)


def test_the_flags_are_checked_and_refused_where_nothing_is_stale() -> None:
    shards = ("127.0.0.1:1",)
    for kw, where in [({"local": True}, "local mode"), ({"shards": shards, "mode": "sync"}, "sync")]:
        for flag, value in (("--delay-compensation", {"delay_compensation": 1.0, "dc_adaptive": True}),
                            ("--gap-aware", {"gap_aware": True})):
            with pytest.raises(ValueError, match=f"{flag} is for async and ssp:S: {where} has no stale gradient") as err:
                TrainingConfig(**value, **kw)  # type: ignore[arg-type]
            assert "\n" not in str(err.value)
    for kw, match in [({"dc_adaptive": True}, "--dc-adaptive needs --delay-compensation LAMBDA0 > 0"),
                      ({"remedy_decay": 1.5}, r"--remedy-decay must be a number in \(0, 1\), got 1.5")]:
        with pytest.raises(ValueError, match=match):
            TrainingConfig(shards=shards, **kw)  # type: ignore[arg-type]
    cfg = TrainingConfig(shards=shards, mode="ssp:2", delay_compensation=2.0, dc_adaptive=True, gap_aware=True, remedy_decay=0.9)
    client = cfg.client_config()
    assert (client.delay_compensation, client.dc_adaptive, client.gap_aware, client.remedy_decay) == (2.0, True, True, 0.9)
    assert client.sends_read_values and TrainingConfig(shards=shards, gap_aware=True).client_config().sends_read_values


def test_the_flags_reach_workers_and_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.common.settings import to_argv as worker_argv
    from tether.common.settings import to_env as job_env
    from tether.worker import flags as worker_flags

    argv = ["--shards", "127.0.0.1:1", "--delay-compensation", "2", "--dc-adaptive", "--gap-aware", "--remedy-decay", "0.9"]
    cfg = worker_flags.load_config(argv)
    want = (2.0, True, True, 0.9)
    assert (cfg.delay_compensation, cfg.dc_adaptive, cfg.gap_aware, cfg.remedy_decay) == want
    child = worker_flags.config_from_args(worker_flags.build_parser().parse_args(worker_argv(cfg)))
    assert (child.delay_compensation, child.dc_adaptive, child.gap_aware, child.remedy_decay) == want
    for name, value in job_env(cfg).items():
        monkeypatch.setenv(name, value)
    script = TrainingConfig.from_env()
    assert (script.delay_compensation, script.dc_adaptive, script.gap_aware, script.remedy_decay) == want


def _remedied(registry: object) -> dict[tuple[str | None, str], float]:
    """Every remedied series of a shard's registry: (table, remedy) -> count, table None for
    the dense elements."""
    from tether.server.metrics import ShardMetrics

    assert isinstance(registry, ShardMetrics)
    got: dict[tuple[str | None, str], float] = {}
    for family in registry.registry.collect():
        for sample in family.samples:
            if sample.name == "tether_shard_remedied_rows_total":
                got[(sample.labels["table"], sample.labels["remedy"])] = sample.value
            elif sample.name == "tether_shard_remedied_dense_elements_total":
                got[(None, sample.labels["remedy"])] = sample.value
    return got


def _counted_shard() -> tuple[Shard, object]:
    from prometheus_client import CollectorRegistry

    from tether.server.metrics import ShardMetrics

    metrics = ShardMetrics(CollectorRegistry())
    shard = Shard(metrics=metrics)
    opt = OptimizerConfig("sgd", LR)
    shard.declare([TableConfig("t", 2, optimizer=opt, init_scale=0.0, seed=1)], [DenseDecl("d", 0, torch.zeros(2), opt)])
    return shard, metrics


@pytest.mark.parametrize("remedy, kw", [
    ("gap_aware", {"gap_aware": True, "remedy_decay": 0.5}),
    ("dc", {"delay_compensation": 1.0}),
    ("dc_adaptive", {"delay_compensation": 1.0, "dc_adaptive": True, "remedy_decay": 0.5}),
    ("staleness_aware", {"staleness_aware": True}),
])
def test_the_shard_counts_the_rows_and_elements_a_remedy_changed(remedy: str, kw: dict) -> None:
    """b pushes [1, -2] three times, each read fresh: no remedy changes anything (no gap; no
    staleness; gap-aware's C unknown at first). Then a pushes [4, 1] read at the start, three
    updates ago: the row's update and both of the chunk's elements change under every remedy
    (gap-aware: the row's mean gap is 3 updates, each element's 3 of its own; staleness-aware: 3
    updates stale where the table's usual is 0). The counter says so per table and remedy, and
    the other remedies' series stay at 0."""
    shard, metrics = _counted_shard()

    def read() -> tuple[int, int, torch.Tensor, torch.Tensor]:
        return (shard.tables["t"].version, shard.dense[("d", 0)].version, *_read(shard))

    def push(worker: str, seq: int, g: list[float], at: tuple[int, int, torch.Tensor, torch.Tensor]) -> None:
        shard.push(worker, seq, [SparseUpdate("t", np.array([5]), torch.tensor([g]), at[0], at[2])],
                   [DenseUpdate("d", 0, torch.tensor(g), at[1], at[3])], incarnation=1 if worker == "a" else 2, **kw)

    start = read()
    for seq in (1, 2, 3):
        push("b", seq, [1.0, -2.0], read())
    assert set(_remedied(metrics).values()) <= {0.0}
    push("a", 1, [4.0, 1.0], start)
    got = {k: v for k, v in _remedied(metrics).items() if v}
    assert got == {("t", remedy): 1.0, (None, remedy): 2.0}


def test_nothing_is_counted_without_a_remedy_or_without_read_values() -> None:
    shard, metrics = _counted_shard()
    start = _read(shard)
    _push(shard, "b", 1, [1.0, -2.0], start)
    _push(shard, "a", 1, [4.0, 1.0], start)  # stale by one, but no remedy asked for
    ids = np.array([5])
    shard.push("a", 2, [SparseUpdate("t", ids, torch.tensor([[4.0, 1.0]]))], [], incarnation=1, gap_aware=True,
               delay_compensation=1.0, dc_adaptive=True)  # remedies asked for, but no read values
    assert set(_remedied(metrics).values()) == {0.0}  # the dense series, exported at 0 from the start
    assert {k for k, _ in _remedied(metrics)} == {None}


def test_the_flags_reach_the_shard_in_a_real_job_and_the_shard_counts_what_they_change(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One async worker and one shard (separate processes): its prefetched reads miss its own last
    update, so pushes are stale and carry their read values. What each run's shard counted (its
    metrics endpoint, read once the worker is done) shows which remedy reached it: 0 everywhere
    without a flag, > 0 for the remedy asked for and 0 for the others. (Final losses are no test
    of it: a 1-worker async job is not deterministic under load, where a step's prefetch can land
    after its push.)"""
    import contextlib
    import urllib.request
    from collections.abc import Iterator
    from dataclasses import replace

    from tether.deploy.job import run_job
    from tether.deploy.launch import LocalCluster
    from tether.worker.config import WorkerConfig

    base = WorkerConfig(shards=("pending:0",), mode="async", num_workers=1, steps=10, batch_size=128, eval_samples=1000,
                        log_every=1000, lr=0.15)

    def counted(name: str, **kw: object) -> dict[str, float]:
        scraped: dict[str, float] = {}

        @contextlib.contextmanager
        def scrape(cluster: LocalCluster) -> Iterator[None]:
            yield  # the workers are done; the shard still serves
            url = f"http://127.0.0.1:{cluster.metrics_ports['shard-0']}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            for line in text.splitlines():
                if line.startswith(("tether_shard_remedied_rows_total{", "tether_shard_remedied_dense_elements_total{")):
                    remedy = line.split('remedy="')[1].split('"')[0]
                    scraped[remedy] = scraped.get(remedy, 0.0) + float(line.split()[-1])
            assert scraped, "the shard exported no remedied series"

        run_job(replace(base, **kw), 1, out=tmp_path / name, timeout_s=120, echo=False, metrics=True, during=scrape)  # type: ignore[arg-type]
        return scraped

    assert set(counted("plain").values()) == {0.0}
    for name, kw in [("gap_aware", {"gap_aware": True}), ("dc_adaptive", {"delay_compensation": 1.0, "dc_adaptive": True})]:
        got = counted(name, **kw)
        assert got[name] > 0, (name, got)
        assert {r: v for r, v in got.items() if r != name and v} == {}, (name, got)


def test_a_cached_workers_combined_push_carries_the_dense_values_read_and_no_rows() -> None:
    """With a write bound the row cache pushes sums of several steps' row gradients: no read values
    for them (the remedies leave those rows as they are), but the step's own dense gradient still
    goes with the values it was computed on."""
    from tether.worker.cache.client import CachedClient
    from tether.worker.cache.config import RowCacheConfig
    from tether.worker.client.results import PullResult
    from tether.worker.client.traffic import TrafficMeter

    class Inner:
        num_shards = 1
        config = None

        def __init__(self) -> None:
            self.versions: list[PullResult | None] = []

        def push(self, grads: object, dense: object, clock: int = 0, versions: PullResult | None = None) -> None:
            self.versions.append(versions)

    inner = Inner()
    client = CachedClient(inner, RowCacheConfig(rows=8, bound=2), {"t": 2}, TrafficMeter({"t": 2}, 4, None))  # type: ignore[arg-type]
    client.use_tables([TableConfig("t", 2, optimizer=OptimizerConfig("sgd", LR))])
    ids, dense = torch.tensor([1, 2]), torch.ones(3)
    read = PullResult({"t": torch.zeros(2, 2)}, {"d": dense}, {(0, "t"): 3}, {("d", 0): 5})
    client.push({"t": (ids, torch.ones(2, 2))}, {"d": torch.ones(3)}, clock=1, versions=read)
    sent = inner.versions[-1]
    assert sent is not None and sent.rows == {} and torch.equal(sent.dense["d"], dense) and sent.dense_versions == {("d", 0): 5}
