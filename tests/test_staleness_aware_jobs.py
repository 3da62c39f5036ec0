"""--staleness-aware in whole jobs (issue 18): a no-op in sync mode; in async at the default
learning rate it costs at most a few percent (not "nothing beyond noise": see the test).

Not tested here: that at 3x the default rate the flag keeps async close to sync. At CI size it
does not (3 workers, 100 steps, same data order: sync 0.518 / 0.514, async 0.598 / 0.615, async with
the flag 0.584 / 0.578; the constant predictor 0.596), and at 4 workers x 300 steps it helps
but stays 14% above sync (bench/RESULTS.md, "Convergence (issue 18)"). The shard-level rule,
which does rescue a simulated Hogwild run at a high rate, is tested in test_staleness_aware.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tether.deploy.launch import LocalCluster, run_job
from tether.worker.config import WorkerConfig
from tether.worker.embedding import ShardedEmbeddingBag
from tether.worker.training import Trainer, TrainingConfig

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
    # Few rows, so every rank pushes most rows at every step: the third push of a row in a step
    # is 2 updates stale on the shard (a row overtaken once keeps its full step anyway).
    g = torch.Generator().manual_seed(100 + rank)
    return [{"item": torch.randint(0, ROWS, (16,), generator=g), "y": torch.randn(16, generator=g)} for _ in range(SYNC_STEPS)]


def _sync_rank(rank: int, addresses: list[str], tmp: str) -> None:
    """One rank of three sync jobs in a row (one shard each): the flag off, on, and forced
    through to the shard as if sync sent it (the control: what the test would see if it did)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    for variant, address in zip(VARIANTS, addresses):
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
    # The ranks' pushes of a step land in any order, so the parameters can differ by rounding
    # (SGD: a few ulps), never by a step. Measured: max |off - on| 3e-8 (rows), 2e-9 (dense).
    for key in ("rows", "dense"):
        assert torch.allclose(got["off"][key], got["on"][key], atol=1e-5, rtol=0), (key, (got["off"][key] - got["on"][key]).abs().max())
    # The pushes were stale per row (two other ranks' pushes of the same step landed first) ...
    assert max(max(torch.load(tmp_path / f"on-staleness-{rank}.pt")) for rank in range(WORLD)) >= 2
    # ... so a shard told to scale them moves the rows far beyond that tolerance (measured
    # max |off - forced| 0.0104): the comparison above can see the flag.
    assert (got["off"]["rows"] - got["forced"]["rows"]).abs().max() > 1e-3


# -- async: the flag at the default learning rate --------------------------------------------------

# Three async workers on one shard, 100 steps of 128 samples each, the default vocabulary (rows
# are rarely shared, so a row's staleness is mostly 0-1; the dense chunk is overtaken by the
# other workers' pushes, median 4-5 updates).
ASYNC = WorkerConfig(
    shards=("pending:0",), mode="async", num_workers=3, steps=100, batch_size=128, eval_samples=4000, log_every=1000
)


def test_staleness_aware_costs_at_most_a_few_percent_at_the_default_learning_rate(tmp_path: Path) -> None:
    # Noise, measured on the 2-core machine with this job (same data order every time; see
    # bench/RESULTS.md, "Convergence (issue 18)"):
    #   plain async, 7 runs: 0.4974 0.4984 0.5029 0.5035 0.5057 0.5076 0.5565, and 0.5567 in a
    #     test run (now and then a run lands ~11% worse);
    #   with the flag, 7 runs: 0.5030 0.5056 0.5104 0.5106 0.5108 0.5115 0.5122;
    #   sync, 4 runs: 0.4926 0.4927 0.4940 0.4947.
    # So the flag is steadier but not free: +0.4% to +0.9% over plain under load (6-9), +0.6% to
    # +2.7% on a quiet machine, the worst pairing of the two sets +3.0%. (Its remaining cost is
    # the dense chunk's, which every other push overtakes: its step is divided by ~4-5.) The
    # issue's 2% does not hold at this size; the tolerance is 4%, above the worst pairing. The
    # per-table rule this replaced cost 4.5% at 4 workers x 300 steps, where this one cost 0.8%.
    losses = {}
    for name, aware in (("plain", False), ("aware", True)):
        summary = run_job(replace(ASYNC, staleness_aware=aware), 1, out=tmp_path / name, timeout_s=240, echo=False)
        losses[name] = float(summary["eval_loss"])
        assert losses[name] < float(summary["baseline_loss"]) - 0.02, summary  # it learned
    assert losses["aware"] <= losses["plain"] * 1.04, losses
