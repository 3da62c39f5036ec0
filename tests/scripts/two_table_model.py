"""An outsider's model for the per-table rule tests: a two-task regression with two tables of
different widths (``items``: bags of 3 negative 64-bit ids, dim 6; ``ctx``: one id a sample,
dim 2), a dense tower with two heads, float targets, and batches as a dataclass. Only the
public API: ``TrainingConfig.from_env()``, ``Trainer``, ``ShardedEmbeddingBag``.

Each worker writes ``worker-<i>.json`` under ``--out``: its steps, its first and last losses,
what every shard's ``Info`` says each table and dense chunk is stepped with, the rows of a few
probe ids of both tables after training, and the dense parameters (as ``fit`` left them in the
model, and the shards' current ones, installed by ``trainer.evaluate``). ``--code-rules`` sets the
per-table rules in code (``TrainingConfig(table_optimizers=...)``) instead of flags or files;
``--items-capacity N`` declares the tables in code (``Trainer(tables=...)``) with items bounded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.trainer import Trainer

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--batches", type=int, default=40, help="batches per worker")
p.add_argument("--batch", type=int, default=16)
p.add_argument("--code-rules", default="", help="per-table entries set in code, separated by ';'")
p.add_argument("--items-capacity", type=int, default=0, help="Trainer(tables=...): items' rows per shard (0: unbounded)")
a = p.parse_args()

config = TrainingConfig.from_env()
if a.code_rules:
    config = dataclasses.replace(config, table_optimizers=tuple(e for e in a.code_rules.split(";") if e))
torch.manual_seed(config.seed)

ITEMS = -(2**62) + torch.arange(12) * 977_131  # negative 64-bit ids
CTX = torch.arange(4)


@dataclass
class Batch:
    items: torch.Tensor  # [B, 3] ids, one bag of 3 per sample
    ctx: torch.Tensor  # [B]
    x: torch.Tensor  # [B, 2] float features
    y: torch.Tensor  # [B, 2] two float targets


class TwoTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = ShardedEmbeddingBag("items", 6, mode="mean")
        self.ctx = ShardedEmbeddingBag("ctx", 2)
        self.tower = nn.Sequential(nn.Linear(10, 8), nn.Tanh())
        self.heads = nn.Linear(8, 2)

    def forward(self, b: Batch) -> torch.Tensor:
        return self.heads(self.tower(torch.cat([self.items(b.items), self.ctx(b.ctx), b.x], 1)))


def data(worker: int, workers: int) -> list[Batch]:
    g = torch.Generator().manual_seed(11)
    effect = torch.randn(len(ITEMS), generator=g)
    n = a.batches * a.batch * workers
    pick = torch.randint(0, len(ITEMS), (n, 3), generator=g)
    ctx = torch.randint(0, len(CTX), (n,), generator=g)
    x = torch.randn(n, 2, generator=g)
    y = torch.stack([effect[pick].mean(1) + 0.5 * x[:, 0], (ctx.float() - 1.5) * 0.8 - 0.3 * x[:, 1]], 1)
    mine = torch.arange(n)[worker::workers]
    return [Batch(ITEMS[pick[s]], CTX[ctx[s]], x[s], y[s]) for s in mine.split(a.batch) if len(s) == a.batch]


losses: list[float] = []


def loss(model: nn.Module, b: Batch) -> torch.Tensor:
    value = nn.functional.mse_loss(model(b), b.y)
    losses.append(float(value.detach()))
    return value


tables = None
if a.items_capacity:
    tables = [TableConfig("items", 6, OptimizerConfig(config.optimizer, lr=config.lr), capacity=a.items_capacity, seed=config.seed),
              TableConfig("ctx", 2, OptimizerConfig(config.optimizer, lr=config.lr), seed=config.seed)]
with Trainer(TwoTask(), config, loss=loss, sparse=lambda b: {"items": b.items, "ctx": b.ctx}, tables=tables,
             batch_size=lambda b: len(b.y)) as trainer:
    batches = data(config.worker_index, config.num_workers)
    record = trainer.fit(batches)
    after_fit = {k: v.tolist() for k, v in trainer.model.state_dict().items() if k.startswith(("tower", "heads"))}
    trainer.evaluate(batches[:1])  # installs the shards' current parameters in the model
    info = [{"tables": {t.name: t.optimizer for t in s.tables}, "dense": sorted({d.optimizer for d in s.dense})}
            for s in trainer.client.info()]
    rows = trainer.client.wait(trainer.client.pull({"items": ITEMS, "ctx": CTX})).rows
    dense = {k: v.tolist() for k, v in trainer.model.state_dict().items() if k.startswith(("tower", "heads"))}
out = Path(a.out)
out.mkdir(parents=True, exist_ok=True)
k = max(1, len(losses) // 5)
(out / f"worker-{config.worker_index}.json").write_text(json.dumps({
    "steps": record.steps,
    "first_loss": sum(losses[:k]) / k,
    "last_loss": sum(losses[-k:]) / k,
    "info": info,
    "rows": {t: r.tolist() for t, r in rows.items()},
    "dense": dense,
    "dense_after_fit": after_fit,
}))
