"""A user's training script for ``tether compare --script`` / ``sweep --script``: a small
regression through the public API only. Each worker trains its slice of the samples
(``TrainingConfig.from_env()`` names it) in the order of its data seed (``config.data_seed``) and
writes the ids it trained, in the order it trained them, to
``<TETHER_OUT>/seen-<i>.json`` (each run of a comparison has its own TETHER_OUT).

Worker 0 evaluates held-out samples as ``eval_loss``, ``mae`` and ``within_half`` (the
fraction predicted within 0.5); ``--no-eval`` gives ``fit`` no held-out data, so the records carry no
eval loss.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.trainer import Trainer

p = argparse.ArgumentParser()
p.add_argument("--samples", type=int, default=384)
p.add_argument("--no-eval", action="store_true")
a = p.parse_args()

config = TrainingConfig.from_env()
torch.manual_seed(config.seed)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = ShardedEmbeddingBag("items", 4)
        self.head = nn.Linear(4, 1)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.items(b["item"])).squeeze(1)


def batches_of(ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    item = ids % 40
    target = (item % 5).float() - 2.0
    return [{"sid": ids[i : i + 16], "item": item[i : i + 16], "target": target[i : i + 16]} for i in range(0, len(ids), 16)]


# Its slice in the order of the data seed (compare --repeats steps it); the model is --seed's.
slice_ids = torch.arange(a.samples)[config.worker_index :: config.num_workers]
mine = batches_of(slice_ids[torch.randperm(len(slice_ids), generator=torch.Generator().manual_seed(config.data_seed))])
held_out = batches_of(torch.arange(a.samples, a.samples + 64))
seen: list[int] = []


def loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    if model.training:
        seen.extend(b["sid"].tolist())
    return nn.functional.mse_loss(model(b), b["target"])


def evaluate(model: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, float]:
    y = model(b)
    err = (y - b["target"]).abs()
    return {"eval_loss": float(nn.functional.mse_loss(y, b["target"])), "mae": float(err.mean()), "within_half": float((err < 0.5).float().mean())}


with Trainer(Regressor(), config, loss=loss, sparse=lambda b: {"items": b["item"]}, batch_size=lambda b: len(b["sid"])) as trainer:
    if a.no_eval:
        trainer.fit(mine)
    else:
        trainer.fit(mine, eval_data=held_out, evaluate=evaluate)
Path(config.out or ".", f"seen-{config.worker_index}.json").write_text(json.dumps(seen))
