"""A user's training script for the sync tests: a model none of the examples has, through the
public API only. Each rank trains the slice of the samples its ``TrainingConfig.from_env()``
names and writes which samples it trained and the final parameters to --out."""

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
p.add_argument("--out", required=True)
p.add_argument("--samples", "--n", type=int, default=480, help="--n: a prefix of torchrun's --nnodes, which torchrun must not see")
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--fail-at", type=int, default=3)
p.add_argument("--eval", action="store_true", help="evaluate held-out accuracy (a metric name without eval_)")
p.add_argument("--short-rank", type=int, default=-1, help="this rank gets half the batches of the others")
a = p.parse_args()

config = TrainingConfig.from_env()  # the rank must be right here, before the Trainer exists
torch.manual_seed(config.seed)


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = ShardedEmbeddingBag("users", 6)
        self.tags = ShardedEmbeddingBag("tags", 3, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(9, 5), nn.Tanh(), nn.Linear(5, 1))

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.mlp(torch.cat([self.users(b["user"]), self.tags(b["tags"], b["offsets"])], 1)).squeeze(1)


g = torch.Generator().manual_seed(7)
sid = torch.arange(a.samples)
user = torch.randint(-(2**40), 2**40, (a.samples,), generator=g) % 50 - 25  # negative ids too
label = (user % 3 == 0).float()
mine = sid[config.worker_index :: config.num_workers]
if config.worker_index == a.short_rank:
    mine = mine[: len(mine) // 2]
batches = []
for start in range(0, len(mine), 8):
    s = mine[start : start + 8]
    lengths = (s % 3) + 1
    tags = torch.cat([torch.arange(int(n)) + int(i) % 7 for i, n in zip(s, lengths, strict=False)])
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), lengths[:-1]]), 0)
    batches.append({"sid": s, "user": user[s], "tags": tags, "offsets": offsets, "label": label[s]})
seen: list[int] = []
steps = 0


def loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    global steps
    steps += 1
    if config.worker_index == a.fail_rank and steps == a.fail_at:
        raise RuntimeError(f"user error on purpose in rank {config.worker_index}")
    seen.extend(b["sid"].tolist())
    return nn.functional.binary_cross_entropy_with_logits(model(b), b["label"])


model = Scorer()
with Trainer(model, config, loss=loss, sparse=lambda b: {"users": b["user"], "tags": b["tags"]},
             batch_size=lambda b: len(b["sid"])) as trainer:
    if a.eval:
        accuracy = lambda m, b: {"accuracy": float(((m(b) > 0).float() == b["label"]).float().mean())}  # noqa: E731
        record = trainer.fit(batches, eval_data=batches[:2], evaluate=accuracy)
    else:
        record = trainer.fit(batches)
    rows = trainer.client.pull({"users": torch.arange(-25, 25), "tags": torch.arange(10)}).result(30).rows
out = Path(a.out)
out.mkdir(parents=True, exist_ok=True)
(out / f"rank-{config.worker_index}.json").write_text(json.dumps({
    "seen": seen,
    "steps": record["steps"],
    "dense": {k: v.tolist() for k, v in model.state_dict().items() if "mlp" in k},
    "rows": {t: r.tolist() for t, r in rows.items()},
}))
