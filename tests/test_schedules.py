"""Learning-rate schedules (issue 28 item 3): the rate at each step equals torch.optim.lr_scheduler's,
the shard and local mode step each push at its clock's rate, sync's worker-side optimizer follows
it too, and a real one-worker run (a shard process; local mode) ends where one process with the
torch scheduler does, to 1e-6."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as S

from tether.deploy.launch import LocalCluster
from tether.protos.schedules import Schedule, step_of_clock
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.optimizers import rule
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import DenseDecl, DenseUpdate, SparseUpdate
from tether.worker.client.local import LocalClient
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.table_rules import dense_torch_optimizer
from tether.worker.training.trainer import Trainer

LR = 0.5


def _torch_rates(make: object, steps: int) -> list[float]:
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=LR)
    sched = make(opt)  # type: ignore[operator]
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


CASES = [
    ("warm-up then constant", Schedule(warmup_steps=5, warmup_factor=0.1),
     lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.1, total_iters=5), S.ConstantLR(o, factor=1.0, total_iters=1)], milestones=[5]), 20),
    ("step", Schedule(decay="step", decay_steps=4, gamma=0.5), lambda o: S.StepLR(o, step_size=4, gamma=0.5), 20),
    ("cosine", Schedule(decay="cosine", decay_steps=12, min_lr=0.01), lambda o: S.CosineAnnealingLR(o, T_max=12, eta_min=0.01), 13),
    ("warm-up then step", Schedule(warmup_steps=3, decay="step", decay_steps=5, gamma=0.3),
     lambda o: S.SequentialLR(o, [S.LinearLR(o, 1 / 3, total_iters=3), S.StepLR(o, step_size=5, gamma=0.3)], milestones=[3]), 25),
    ("warm-up then cosine", Schedule(warmup_steps=4, warmup_factor=0.25, decay="cosine", decay_steps=10, min_lr=0.05),
     lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.25, total_iters=4), S.CosineAnnealingLR(o, T_max=10, eta_min=0.05)], milestones=[4]), 15),
]


@pytest.mark.parametrize(("name", "schedule", "make", "steps"), CASES, ids=[c[0] for c in CASES])
def test_the_rate_at_each_step_is_torchs(name: str, schedule: Schedule, make: object, steps: int) -> None:
    want = _torch_rates(make, steps)
    got = [schedule.lr_at(LR, k) for k in range(steps)]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12), name
    # The push after step k carries clock k + 1.
    assert [LR * schedule.factor(LR, k + 1) for k in range(steps)] == pytest.approx(want, rel=1e-9)


def test_cosine_holds_its_floor_and_bad_schedules_are_one_line() -> None:
    s = Schedule(decay="cosine", decay_steps=10, min_lr=0.01)
    assert s.lr_at(LR, 10) == s.lr_at(LR, 11) == s.lr_at(LR, 1000) == 0.01
    assert step_of_clock(0) == step_of_clock(1) == 0 and step_of_clock(7) == 6
    for bad, match in [({"decay": "linear"}, "decay must be one of constant, step, cosine"),
                       ({"decay": "step"}, "needs decay_steps >= 1"), ({"warmup_factor": 0.0}, "warmup_factor"),
                       ({"gamma": 1.5}, "gamma"), ({"warmup_steps": -1}, "warmup_steps")]:
        with pytest.raises(ValueError, match=match):
            Schedule(**bad)
    # A checkpoint's JSON (asdict) reads back; an old one without a schedule is constant.
    cfg = OptimizerConfig("sgd", 0.1, schedule=s)
    assert OptimizerConfig(**asdict(cfg)) == cfg
    old = {k: v for k, v in asdict(cfg).items() if k != "schedule"}
    assert OptimizerConfig(**old).schedule.constant
    assert OptimizerConfig.from_proto(cfg.to_proto()).schedule == Schedule.from_proto(s.to_proto())


def _shard_with(schedule: Schedule) -> Shard:
    shard = Shard()
    opt = OptimizerConfig("sgd", LR, schedule=schedule)
    shard.declare([TableConfig("t", 3, optimizer=opt, init_scale=0.0)], [DenseDecl("d", 0, torch.zeros(2), opt)])
    return shard


def test_the_shard_steps_each_push_at_its_clocks_rate() -> None:
    schedule = Schedule(warmup_steps=2, warmup_factor=0.5, decay="step", decay_steps=2, gamma=0.5)
    shard = _shard_with(schedule)
    ids, g = np.array([4, 9]), torch.ones(2, 3)
    expect_rows, expect_dense = np.zeros((2, 3)), np.zeros(2)
    for seq, clock in enumerate([1, 2, 3, 5, 8, 0], start=1):
        shard.push("w", seq, [SparseUpdate("t", ids, g)], [DenseUpdate("d", 0, torch.ones(2))], clock=clock, incarnation=1)
        rate = schedule.lr_at(LR, max(clock - 1, 0))
        expect_rows -= rate
        expect_dense -= rate
    rows, _ = shard.tables["t"].pull(ids)
    np.testing.assert_allclose(rows.numpy(), expect_rows, rtol=0, atol=1e-6)
    np.testing.assert_allclose(shard.dense[("d", 0)].value.numpy(), expect_dense, rtol=0, atol=1e-6)


def test_local_mode_steps_as_the_shard_does() -> None:
    schedule = Schedule(decay="cosine", decay_steps=4, min_lr=0.1)
    client = LocalClient()
    opt = OptimizerConfig("adagrad", LR, schedule=schedule)
    client.declare([TableConfig("t", 3, optimizer=opt, init_scale=0.0)], {"d": torch.zeros(2)}, opt)
    shard = Shard()
    shard.declare([TableConfig("t", 3, optimizer=opt, init_scale=0.0)], [DenseDecl("d", 0, torch.zeros(2), opt)])
    ids = torch.tensor([1, 5])
    for step in range(6):
        g = torch.full((2, 3), 0.1 * (step + 1))
        client.push({"t": (ids, g)}, {"d": g[0, :2]}, clock=step + 1).result()
        shard.push("w", step + 1, [SparseUpdate("t", ids.numpy(), g)], [DenseUpdate("d", 0, g[0, :2])], clock=step + 1, incarnation=1)
    local = client.pull({"t": ids}, ["d"]).result()
    assert torch.allclose(local.rows["t"], shard.tables["t"].pull(ids.numpy())[0], atol=1e-6)
    assert torch.allclose(local.dense["d"], shard.dense[("d", 0)].value, atol=1e-6)
    assert local.rows["t"].abs().max() > 0.1  # it moved


@pytest.mark.parametrize("rule_name", ["sgd", "adam"])
def test_syncs_dense_optimizer_follows_the_schedule_as_torchs_scheduler(rule_name: str) -> None:
    schedule = Schedule(warmup_steps=3, warmup_factor=0.5, decay="cosine", decay_steps=5)
    opt = OptimizerConfig(rule_name, LR, schedule=schedule)
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    ours = dense_torch_optimizer(opt, [a])
    assert type(ours) is type(rule(rule_name).torch_optimizer(opt, [nn.Parameter(torch.ones(1))]))  # torch's own, hooked
    inner = torch.optim.SGD([b], lr=LR) if rule_name == "sgd" else torch.optim.Adam([b], lr=LR, eps=1e-8)
    ref = S.SequentialLR(inner, [S.LinearLR(inner, 0.5, total_iters=3), S.CosineAnnealingLR(inner, T_max=5)], milestones=[3])
    for k in range(8):
        for p in (a, b):
            p.grad = torch.full((4,), 0.3 + k)
        ours.step()
        inner.step()
        ref.step()
    assert torch.allclose(a, b, atol=1e-6) and not torch.equal(a, torch.ones(4))
    assert isinstance(dense_torch_optimizer(OptimizerConfig("sgd", LR), [a]), torch.optim.SGD)  # constant: torch's own


# -- a real run against one process with the torch scheduler ----------------------------------------

DIM, USERS, ITEMS, STEPS = 4, 20, 30, 12
# Warm-up 4 + cosine 8 = STEPS: past T_max torch's cosine rises again where ours holds its floor.
USER_RULE = "users=sgd:lr=0.25,warmup_steps=4,warmup_factor=0.25,decay=cosine,decay_steps=8,min_lr=0.0625"
ITEM_RULE = "items=sgd:lr=0.5,decay=step,decay_steps=3,gamma=0.5"
DENSE_RULE = "dense=sgd:lr=0.125,warmup_steps=5,warmup_factor=0.5"


class _MF(nn.Module):
    def __init__(self, embedding: object) -> None:
        super().__init__()
        self.user = embedding("users")  # type: ignore[operator]
        self.item = embedding("items")  # type: ignore[operator]
        self.scale = nn.Linear(1, 1)
        nn.init.constant_(self.scale.weight, 2.0)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.scale((self.user(batch["user"]) * self.item(batch["item"])).sum(1, keepdim=True)).squeeze(1)


class _Rows(nn.Module):
    def __init__(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        super().__init__()
        self.ids, self.weight = ids, nn.Parameter(rows.clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[torch.searchsorted(self.ids, ids)]


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch), batch["rating"])


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"user": torch.randint(0, USERS, (16,), generator=g), "item": torch.randint(0, ITEMS, (16,), generator=g) + 1000,
             "rating": 2 * torch.randn(16, generator=g)} for _ in range(STEPS)]


def _reference(start: dict[str, torch.Tensor], ids: dict[str, torch.Tensor], dense0: list[torch.Tensor],
               batches: list[dict[str, torch.Tensor]], scheduled: bool = True) -> nn.Module:
    torch.manual_seed(0)
    ref = _MF(lambda name: _Rows(ids[name], start[name]))
    with torch.no_grad():
        for p, v in zip(ref.scale.parameters(), dense0, strict=False):
            p.copy_(v)
    groups = [
        (torch.optim.SGD([ref.user.weight], lr=0.25), lambda o: S.SequentialLR(
            o, [S.LinearLR(o, 0.25, total_iters=4), S.CosineAnnealingLR(o, T_max=8, eta_min=0.0625)], milestones=[4])),
        (torch.optim.SGD([ref.item.weight], lr=0.5), lambda o: S.StepLR(o, step_size=3, gamma=0.5)),
        (torch.optim.SGD(list(ref.scale.parameters()), lr=0.125), lambda o: S.LinearLR(o, 0.5, total_iters=5)),
    ]
    opts = [(o, make(o)) for o, make in groups]
    for b in batches:
        for o, _ in opts:
            o.zero_grad()
        _loss(ref, b).backward()
        for o, sched in opts:
            o.step()
            if scheduled:
                sched.step()
    return ref


@pytest.mark.parametrize("mode", ["async", "ssp:1", "local"])
def test_a_real_run_with_schedules_ends_where_torch_with_its_schedulers_does(cluster: LocalCluster, mode: str) -> None:
    batches = _batches()
    place = {"local": True} if mode == "local" else {"shards": tuple(cluster.start_shards(1)), "mode": mode}
    config = TrainingConfig(**place, optimizer="adagrad", lr=0.01, prefetch=False, log_every=100, init_scale=0.3, device="cpu",
                            table_optimizers=(USER_RULE, ITEM_RULE, DENSE_RULE))
    torch.manual_seed(0)
    model = _MF(lambda name: ShardedEmbeddingBag(name, DIM))
    ids = {"users": torch.unique(torch.cat([b["user"] for b in batches])),
           "items": torch.unique(torch.cat([b["item"] for b in batches]))}
    with Trainer(model, config, loss=_loss, sparse=lambda b: {"users": b["user"], "items": b["item"]},
                 printer=lambda line: None) as trainer:
        start = trainer.client.pull(ids).result(30).rows
        dense0 = [p.detach().clone() for p in model.scale.parameters()]
        trainer.fit(batches)
        final = trainer.client.pull(ids, ["dense"]).result(30)
    ref = _reference(start, ids, dense0, batches)
    assert torch.allclose(final.rows["users"], ref.user.weight.detach(), rtol=0, atol=1e-6)
    assert torch.allclose(final.rows["items"], ref.item.weight.detach(), rtol=0, atol=1e-6)
    dense_ref = torch.cat([p.detach().reshape(-1) for p in ref.scale.parameters()])
    assert torch.allclose(final.dense["dense"], dense_ref, rtol=0, atol=1e-6)
    assert (final.rows["users"] - start["users"]).abs().max() > 0.05
    # Without the schedules (each table at its first step's rate) the run would end elsewhere.
    unscheduled = _reference(start, ids, dense0, batches, scheduled=False)
    assert (final.rows["items"] - unscheduled.item.weight.detach()).abs().max() > 0.01
