"""The push window (``--push-window K``, tether.worker.training.step): K = 1 is the pipeline as it was (a
push carries the pull of the batch after next); K = 3 keeps at most 3 pushes unsettled while a
step computes; every push reaches the shard exactly once; a shard's error on a late-settled push
surfaces; combinations where it means nothing are refused with one line."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from tether.protos.errors import InvalidArgument, TooStale, UsageError
from tether.server.serving.serve import RunningShard
from tether.worker.client.results import Handle, PullResult, PushAck
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.mode import check_window
from tether.worker.training.policies import AsyncPolicy, SSPPolicy
from tether.worker.training.step import Step, StepContext
from tether.worker.training.transfer import Prefetch, first


class _Answer:
    """One shard's answer: a value, or an error raised when it is read; counts its reads."""

    def __init__(self, value: Any, log: list[tuple], name: tuple, error: Exception | None = None) -> None:
        self.value, self.log, self.name, self.error = value, log, name, error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        self.log.append(("settled", *self.name))
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class _FakePS:
    """PSModel's calls a Step makes, logged; ``fail``: clock -> the error that push's answer raises."""

    log: list[tuple] = field(default_factory=list)
    fail: dict[int, Exception] = field(default_factory=dict)

    def _pulled(self, clock: int | None) -> PullResult:
        return PullResult({}, {}, {}, {}, PushAck(0, 0, 0) if clock is not None else None)

    def prefetch(self, sparse: dict[str, torch.Tensor]) -> Prefetch:
        b = int(sparse["t"][0])
        self.log.append(("pull", b))
        return Prefetch({"t": sparse["t"]}, Handle([_Answer(self._pulled(None), self.log, ("pull", b))], first))

    def install(self, prefetch: Prefetch, train: bool = True, timeout: float | None = None) -> PullResult:
        pulled = prefetch.handle.result(timeout)
        if prefetch.pushed:
            prefetch.ack = pulled.ack
        self.log.append(("install", int(prefetch.ids["t"][0])))
        return pulled

    def collect(self, exact: bool = False, wait: bool = True) -> None:
        pass

    def push(self, clock: int, versions: PullResult, rows: Any = None) -> Handle:
        self.log.append(("push", clock))
        return Handle([_Answer(PushAck(0, 0, 0), self.log, ("push", clock), self.fail.get(clock))], first)

    def push_pull(self, clock: int, versions: PullResult, sparse: dict[str, torch.Tensor]) -> Prefetch:
        b = int(sparse["t"][0])
        self.log.append(("push_pull", clock, b))
        answer = _Answer(self._pulled(clock), self.log, ("push_pull", clock), self.fail.get(clock))
        return Prefetch({"t": sparse["t"]}, Handle([answer], first), pushed=True)


class _FakeTrainer:
    def __init__(self, steps: int, window: int, policy: AsyncPolicy | None = None, **kw: Any) -> None:
        self.config = TrainingConfig(local=True, steps=steps, push_window=window, **kw)
        self.policy = policy or AsyncPolicy()
        self.device = torch.device("cpu")
        self.ps = _FakePS()
        self.model = nn.Linear(1, 1)
        self.name = "worker 0/1"
        self.printer = print

    def loss_fn(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["x"]).sum()

    def sparse_fn(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"t": batch["id"]}


def _context(trainer: _FakeTrainer) -> StepContext:
    """The fake trainer's parts as a step sees them (no client: these policies never wait)."""
    return StepContext(config=trainer.config, client=None, name=trainer.name, policy=trainer.policy, ps=trainer.ps,  # type: ignore[arg-type]
                       model=trainer.model, device=trainer.device, loss_fn=trainer.loss_fn, sparse_fn=trainer.sparse_fn,
                       printer=trainer.printer)


def _batches(n: int) -> Iterator[dict[str, torch.Tensor]]:
    return iter([{"id": torch.tensor([b]), "x": torch.ones(1, 1)} for b in range(n)])


def _run(trainer: _FakeTrainer, n: int) -> Step:
    step = Step(_context(trainer), _batches(n), 0)
    for i in range(n):
        step.run(i)
        assert step.in_flight <= trainer.config.push_window + 1  # K + the push just made
        if step.last:
            break
        step.advance()
    step.finish()
    return step


def test_window_one_is_the_pipeline_as_before() -> None:
    trainer = _FakeTrainer(steps=5, window=1)
    step = _run(trainer, 5)
    calls = [e for e in trainer.ps.log if e[0] != "settled"]
    # Push i carries the pull of batch i + 2; the last two pushes carry none; batch 1 is prefetched.
    assert calls == [
        ("pull", 0), ("install", 0), ("pull", 1), ("push_pull", 1, 2),
        ("install", 1), ("push_pull", 2, 3),
        ("install", 2), ("push_pull", 3, 4),
        ("install", 3), ("push", 4),
        ("install", 4), ("push", 5),
    ]
    # Each push settled once, the plain ones at the next push and the end.
    settled = [e[1:] for e in trainer.ps.log if e[0] == "settled" and e[1] != "pull"]
    assert sorted(settled) == [("push", 4), ("push", 5), ("push_pull", 1), ("push_pull", 2), ("push_pull", 3)]
    assert trainer.ps.log.index(("settled", "push", 4)) < trainer.ps.log.index(("push", 5))
    assert step.peak_in_flight == 1 and step.in_flight == 0
    assert len(step.acks.clock_staleness) == 5


def test_window_three_keeps_three_in_flight_and_settles_each_push_once() -> None:
    trainer = _FakeTrainer(steps=12, window=3)
    step = _run(trainer, 12)
    log = trainer.ps.log
    carried = {e[1]: e[2] for e in log if e[0] == "push_pull"}
    # Push at clock c (step c - 1) carries batch c + 3: the batch K + 1 steps on.
    assert carried == {c: c + 3 for c in range(1, 9)}
    assert [e for e in log if e[0] == "pull"] == [("pull", b) for b in range(4)]  # the start-up prefetches
    assert step.peak_in_flight == 3 and step.in_flight == 0
    settled = [e[1:] for e in log if e[0] == "settled" and e[1] != "pull"]
    assert len(settled) == len(set(settled)) == 12
    assert len(step.acks.clock_staleness) == 12
    # A push_pull is settled when its batch is installed, three steps after the one that made it.
    assert log.index(("settled", "push_pull", 2)) > log.index(("install", 4))


def test_worker_zero_settles_every_push_before_it_evaluates() -> None:
    trainer = _FakeTrainer(steps=12, window=3, eval_every=4)
    step = Step(_context(trainer), _batches(12), 0)
    for i in range(4):
        step.run(i)
        if i < 3:
            assert step.in_flight > 0
            step.advance()
    assert step.in_flight == 0  # after step 4 (eval_every): nothing in flight when evaluation reads
    pulls_done = [e for e in trainer.ps.log if e[:2] == ("settled", "push_pull")]
    step.advance()
    step.run(4)  # the pulls waited for early are installed from their kept answers, not read again
    assert [e for e in trainer.ps.log if e[:2] == ("settled", "push_pull")] == pulls_done


@pytest.mark.parametrize("clock", [2, 11])  # a push_pull's error (at its batch's install), a plain push's (at the end)
def test_an_error_on_a_late_settled_push_surfaces(clock: int) -> None:
    trainer = _FakeTrainer(steps=12, window=3)
    trainer.ps.fail[clock] = InvalidArgument("table 't': gradients contain NaN or Inf")
    with pytest.raises(InvalidArgument, match="NaN"):
        _run(trainer, 12)


def test_a_too_stale_push_pull_settled_early_is_counted_and_its_batch_pulled_again() -> None:
    trainer = _FakeTrainer(steps=12, window=3, eval_every=3)
    trainer.ps.fail[3] = TooStale("push from 'w': 9 updates behind (max 2)")
    step = _run(trainer, 12)
    assert step.acks.too_stale == 1 and len(step.acks.clock_staleness) == 11
    assert ("pull", 6) in trainer.ps.log and ("install", 6) in trainer.ps.log  # push at clock 3 carried batch 6


def test_windows_that_mean_nothing_are_refused() -> None:
    assert check_window(4, True, "async") == 4 and check_window(1, False, "sync") == 1
    for bad in (0, -1, 2.0, True):
        with pytest.raises(UsageError, match="int >= 1"):
            check_window(bad, True, "async")
    with pytest.raises(UsageError, match="sync pushes in lock step"):
        check_window(2, False, "sync")
    with pytest.raises(UsageError, match="ssp:2 lands every push"):
        check_window(3, False, "ssp:2")
    with pytest.raises(UsageError, match="--no-prefetch"):
        check_window(2, False, "async")
    with pytest.raises(UsageError, match="--push-window 3"):
        Step(_context(_FakeTrainer(steps=4, window=3, mode="ssp:2", policy=SSPPolicy(2))), _batches(4), 0)
    with pytest.raises(UsageError, match="--no-prefetch"):
        Step(_context(_FakeTrainer(steps=4, window=2, prefetch=False)), _batches(4), 0)
    assert TrainingConfig.from_env(local=True, push_window=3).push_window == 3


@pytest.mark.parametrize("flags, says", [
    (dict(mode="ssp:2"), "ssp:2 lands every push"),
    (dict(mode="sync"), "sync pushes in lock step"),
    (dict(mode="async", prefetch=False), "--no-prefetch"),
])
def test_a_window_that_means_nothing_is_refused_by_the_config_before_any_worker_starts(flags: dict[str, Any], says: str) -> None:
    with pytest.raises(UsageError, match=f"--push-window 3: .*{says}"):
        TrainingConfig(shards=("127.0.0.1:1",), push_window=3, **flags)
    assert TrainingConfig(shards=("127.0.0.1:1",), push_window=3, mode="async").push_window == 3


# -- against a real shard ---------------------------------------------------------------------------


class _Linear(nn.Module):
    """Row gradients that do not depend on the rows: each use of an id adds C to its gradient."""

    C = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def __init__(self) -> None:
        super().__init__()
        self.emb = ShardedEmbeddingBag("t", 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.emb(batch["id"]) * self.C).sum() * batch["scale"][0]


def _shard_job(shard: RunningShard, window: int, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    from tether.worker.training.trainer import Trainer

    config = TrainingConfig(shards=(f"127.0.0.1:{shard.port}",), optimizer="sgd", lr=0.5, init_scale=0.0, log_every=1000,
                            push_window=window, eval_every=0)
    with Trainer(_Linear(), config, loss=lambda m, b: m(b), sparse=lambda b: {"t": b["id"]},
                 printer=lambda line: None, batch_size=lambda b: len(b["id"])) as trainer:
        trainer.fit(batches, background=False)
        ids = torch.unique(torch.cat([b["id"] for b in batches]))
        return {"ids": ids, "rows": trainer.client.pull({"t": ids}).result(30).rows["t"]}


def _data(n: int, nan_at: int | None = None) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"id": torch.randint(0, 40, (16,), generator=g),
             "scale": torch.tensor([float("nan") if i == nan_at else 1.0])} for i in range(n)]


def test_every_push_reaches_the_shard_exactly_once(inproc_shard: RunningShard) -> None:
    batches = _data(20)
    got = _shard_job(inproc_shard, 3, batches)
    # SGD from zero rows: a row is -lr * C * (its uses over every batch), whatever it read when.
    uses = torch.zeros(40)
    for b in batches:
        uses.index_add_(0, b["id"], torch.ones(len(b["id"])))
    expected = -0.5 * uses[got["ids"]].unsqueeze(1) * _Linear.C
    torch.testing.assert_close(got["rows"], expected)


def test_a_shards_error_on_a_pipelined_push_ends_fit(inproc_shard: RunningShard, monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker refuses non-finite gradients before a push (check_finite); switched off here so
    # the NaN reaches the shard, whose refusal of a push in flight must end fit.
    monkeypatch.setattr("tether.worker.training.embedding.check_finite", lambda *args: None)
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        _shard_job(inproc_shard, 3, _data(12, nan_at=4))


def test_a_nan_gradient_is_refused_on_the_worker_before_any_pipelined_push(inproc_shard: RunningShard) -> None:
    with pytest.raises(UsageError, match=r"step .*NaN or Inf.*before the step's push"):
        _shard_job(inproc_shard, 3, _data(12, nan_at=4))
