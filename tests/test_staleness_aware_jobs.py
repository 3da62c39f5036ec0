"""--staleness-aware in whole jobs (issue 18): a no-op in sync mode; in async at the default
learning rate it costs nothing beyond noise (it damps only rows and chunks staler than usual).

Not tested here: that at 3x the default rate the flag keeps async close to sync. At CI size no
rule measured does so robustly (3 workers, 100 steps: sync 0.514-0.518; async 0.560-0.616; with
the flag 0.529-0.594, the constant predictor 0.596), so the figures, and the margin at 4
workers x 300 steps, live in bench/RESULTS.md ("Convergence (issue 18)"). The shard-level rule,
which does rescue a simulated Hogwild run with a straggler, is tested in test_staleness_aware.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tether.deploy.job import run_job
from tether.deploy.launch import LocalCluster
from tether.rules.initial import init_rows
from tether.worker.config import TrainingConfig, WorkerConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.trainer import Trainer

# -- sync: the flag changes nothing ----------------------------------------------------------------

ROWS, DIM, SYNC_STEPS, WORLD = 12, 4, 8, 3
VARIANTS = ("off", "on", "forced")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = ShardedEmbeddingBag("items", DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.emb(batch["item"])).squeeze(1)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch), batch["y"])


def _batches(rank: int) -> list[dict[str, torch.Tensor]]:
    # Few rows, so every rank looks up most rows at every step.
    g = torch.Generator().manual_seed(100 + rank)
    return [{"item": torch.randint(0, ROWS, (16,), generator=g), "y": torch.randn(16, generator=g)} for _ in range(SYNC_STEPS)]


def _sync_rank(rank: int, addresses: list[str], tmp: str) -> None:
    """One rank of three sync jobs in a row (one shard each): the flag off, on, and forced
    through to the shard as if sync sent it (the control: what the test would see if it did)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    for variant, address in zip(VARIANTS, addresses, strict=False):
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init-{variant}", rank=rank, world_size=WORLD)
        torch.manual_seed(0)
        model = _Model()
        config = TrainingConfig(
            shards=(address,), mode="sync", optimizer="sgd", lr=0.3, init_scale=0.3, staleness_aware=variant != "off",
            log_every=1000, device="cpu",
        )
        with Trainer(model, config, loss=_loss, sparse=lambda b: {"items": b["item"]}, printer=lambda line: None) as trainer:
            if variant == "forced":
                trainer.client.config = replace(trainer.client.config, staleness_aware=True)
            assert trainer.client.config.staleness_aware == (variant == "forced")
            record = trainer.fit(_batches(rank), background=False)
            torch.save(record["update_staleness"], f"{tmp}/{variant}-staleness-{rank}.pt")
            if rank == 0:
                rows = trainer.client.pull({"items": torch.arange(ROWS)}).result(30).rows["items"]
                dense = torch.cat([p.detach().reshape(-1) for p in trainer.ps.parameters()])
                torch.save({"rows": rows, "dense": dense}, f"{tmp}/{variant}.pt")
        # Trainer.close left the process group: the next variant makes its own.


def test_sync_with_and_without_staleness_aware_gives_the_same_parameters(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    addresses = [cluster.start_shards(1)[0] for _ in VARIANTS]  # a one-shard job each
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # three ranks on a 2-core machine
    mp.start_processes(_sync_rank, args=(addresses, str(tmp_path)), nprocs=WORLD, start_method="spawn", join=True)
    got = {v: torch.load(tmp_path / f"{v}.pt") for v in VARIANTS}
    # Sync sums the ranks' row gradients before they reach the shard and pushes each row once a
    # step, so no push is stale (before, the ranks' pushes of a step overtook each other: 2
    # updates stale) ...
    for variant in VARIANTS:
        assert max(max(torch.load(tmp_path / f"{variant}-staleness-{rank}.pt")) for rank in range(WORLD)) == 0, variant
    # ... and the flag changes nothing, even forced through to the shard.
    for variant in ("on", "forced"):
        for key in ("rows", "dense"):
            assert torch.equal(got["off"][key], got[variant][key]), (variant, key, (got["off"][key] - got[variant][key]).abs().max())
    # The rows moved: the comparison is not between untouched starts.
    start = init_rows(np.arange(ROWS, dtype=np.int64), DIM, 0, "items", 0.3)
    assert (got["off"]["rows"] - start).abs().max() > 0.01


# -- async: the flag at the default learning rate --------------------------------------------------

# Three async workers on one shard, 100 steps of 128 samples each, the default vocabulary (rows
# are rarely shared, so a row's staleness is mostly 0-1; the dense chunk is overtaken by the
# other workers' pushes, median 4-5 updates, which is its typical staleness).
ASYNC = WorkerConfig(
    shards=("pending:0",), mode="async", num_workers=3, steps=100, batch_size=128, eval_samples=4000, log_every=1000
)


# Plain async's usual worst final loss with this job (its runs without the outliers below).
PLAIN_USUAL_WORST = 0.5100


def test_staleness_aware_costs_nothing_beyond_noise_at_the_default_learning_rate(tmp_path: Path) -> None:
    # Noise, measured on the 2-core machine with this job (same data order every time, load
    # 2-10; see bench/RESULTS.md, "Convergence (issue 18)"):
    #   plain async, 16 runs: 13 at 0.4950-0.5100, three ~11% worse (0.5565, 0.5566, 0.5567);
    #   with the flag (typical-staleness rule), 9 runs: 0.4947-0.5056 (mean 0.5004; plain's 7
    #     runs alongside them, outlier left out, mean 0.5039);
    #   with the flag under the rule this replaced (1/staleness, which cut the dense chunk's
    #     step by ~4-5 on every push), 11 runs: 0.5030-0.5122, +0.6% to +2.7% over plain.
    # The flag now damps only rows and chunks staler than their running mean, so at the default
    # rate it is within the spread of plain async. The tolerance is the 2%, over the
    # worse of this run's plain loss and plain's usual worst (a lucky plain run, 0.4950, is not
    # what "noise" means). Plain async lands ~11% worse in about one run of six; the flag did not
    # in 20 runs (both rules; why is not established), but so that one such run cannot block
    # CI, a flagged run over the bound is run once more.
    def loss(name: str, aware: bool) -> float:
        summary = run_job(replace(ASYNC, staleness_aware=aware), 1, out=tmp_path / name, timeout_s=240, echo=False)
        assert float(summary["eval_loss"]) < float(summary["baseline_loss"]) - 0.02, summary  # it learned
        return float(summary["eval_loss"])

    plain = loss("plain", False)
    bound = max(plain, PLAIN_USUAL_WORST) * 1.02
    aware = [loss("aware", True)]
    if aware[0] > bound:
        aware.append(loss("aware-again", True))
    assert min(aware) <= bound, (plain, aware)
