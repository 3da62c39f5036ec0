"""A user's script that reads its data through tether's data API (a ``ParquetStream``; the public
``import tether`` surface only), for the restart tests: the row ids of every batch it trains on go
to ``OUT/rows-<worker>-<incarnation>.txt``, one line a batch (written by the loss, which runs
once per trained batch; the stream itself is read ahead of the step). With ``--die-after K`` its
first incarnation (``TETHER_RESTART_COUNT`` unset or 0) kills itself with SIGKILL right after its
step-K progress line, as a crash would, leaving ``tether launch --max-restarts`` to start it again.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn

import tether

p = argparse.ArgumentParser()
p.add_argument("--data", required=True, help="Parquet file(s): row (int id), x (float), label")
p.add_argument("--batch", type=int, default=32)
p.add_argument("--die-after", type=int, default=0, help="the first incarnation dies after this step's progress line (0: never)")
a = p.parse_args()

config = tether.TrainingConfig.from_env()
torch.manual_seed(config.seed)
incarnation = int(os.environ.get("TETHER_RESTART_COUNT") or 0)
seen = Path(config.out or ".") / f"rows-{config.worker_index}-{incarnation}.txt"


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = tether.ShardedEmbeddingBag("rows", 4)
        self.out = nn.Linear(5, 1)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.out(torch.cat([self.rows(b["row"]), b["dense"].float()], 1)).squeeze(1)


def loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    with seen.open("a") as f:
        f.write(" ".join(map(str, b["row"].tolist())) + "\n")
    return nn.functional.binary_cross_entropy_with_logits(m(b), b["label"].float())


def printer(line: str) -> None:
    print(line, flush=True)
    if a.die_after and incarnation == 0 and f" step {a.die_after}/" in line:
        os.kill(os.getpid(), signal.SIGKILL)


stream = tether.ParquetStream(a.data, a.batch, ids=["row"], dense=["x"], rank=config.worker_index, world_size=config.num_workers,
                              shuffle_rows=96, seed=config.seed)
with tether.Trainer(Model(), config, loss=loss, sparse=lambda b: {"rows": b["row"]}, printer=printer) as trainer:
    trainer.fit(stream)
