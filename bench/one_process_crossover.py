"""When does a user's model need a parameter server? Samples/s of one model, not the CTR job, as
its compute per sample grows: in one process with plain torch (the ceiling), in tether's local
mode (the same script, no shards), and through tether (1 shard; 1 and 2 async workers), side by
side in one run, with the parameter server's share of a worker's step.

    python bench/one_process_crossover.py [--widths 32,256,1024] [--steps 300]

The model: a user table (one id per sample, 32 wide), an item table (bags of 4 ids, 32 wide), 16
dense features and an MLP of two hidden layers of WIDTH units; batch 512, Adagrad. One process
gets every core as torch threads; tether's processes get one intra-op thread each (as ``tether
launch`` gives its children), so on one host both sides use the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import markdown_table

BATCH, USERS, ITEMS, BAG, DIM, DENSE = 512, 50_000, 50_000, 4, 32, 16


def batches(steps: int, seed: int) -> list[dict]:
    """``steps`` batches of skewed ids (squared uniform: low ids are hot), dense features and labels."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        user = (torch.rand(BATCH, generator=g) ** 2 * USERS).long()
        items = (torch.rand(BATCH * BAG, generator=g) ** 2 * ITEMS).long()
        dense = torch.randn(BATCH, DENSE, generator=g)
        label = ((user % 7 < 3) ^ (dense[:, 0] > 0)).float()
        out.append({"user": user, "items": items, "offsets": torch.arange(0, BATCH * BAG, BAG), "dense": dense, "label": label})
    return out


def build(width: int, embedding):
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = embedding("users", USERS)
            self.items = embedding("items", ITEMS)
            self.mlp = nn.Sequential(nn.Linear(DENSE + 2 * DIM, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))

        def forward(self, b: dict) -> torch.Tensor:
            return self.mlp(torch.cat([b["dense"], self.user(b["user"]), self.items(b["items"], b["offsets"])], 1)).squeeze(1)

    return Model()


def loss_of(model, b):
    import torch.nn.functional as F

    return F.binary_cross_entropy_with_logits(model(b), b["label"])


def plain_torch(width: int, steps: int, warmup: int = 20) -> float:
    """Samples/s in one process: torch embedding bags with sparse gradients, torch's Adagrad."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = build(width, lambda name, rows: nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05, eps=1e-8)
    data = batches(steps + warmup, 1)
    start = 0.0
    for i, b in enumerate(data):
        if i == warmup:
            start = time.perf_counter()
        b = {**b, "user": b["user"].unsqueeze(1)}  # one id per sample: bags of one
        opt.zero_grad()
        loss_of(model, b).backward()
        opt.step()
    return steps * BATCH / (time.perf_counter() - start)


def worker(width: int, steps: int) -> None:
    """One tether worker (launched, or local with TETHER_LOCAL=1): the same model through the public API."""
    import torch

    from tether.worker.config import TrainingConfig
    from tether.worker.training.embedding_bag import ShardedEmbeddingBag
    from tether.worker.training.trainer import Trainer

    config = TrainingConfig.from_env(steps=steps, log_every=steps, device="cpu")
    torch.manual_seed(config.seed)
    model = build(width, lambda name, rows: ShardedEmbeddingBag(name, DIM))
    data = batches(steps, 1 + config.worker_index)
    with Trainer(model, config, loss=loss_of, sparse=lambda b: {"users": b["user"], "items": b["items"]},
                 batch_size=lambda b: len(b["label"]), printer=lambda line: None) as trainer:
        record = trainer.fit(data)
    print(json.dumps({"samples_per_sec": record["samples_per_sec"], "phase_seconds": record["phase_seconds"]}))


def _run(argv: list[str], env: dict[str, str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, env=env, timeout=1800).stdout


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="32,256,1024", help="hidden widths of the MLP, comma-separated")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--_plain", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_worker", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._plain is not None:
        print(plain_torch(a._plain, a.steps))
        return
    if a._worker is not None:
        worker(a._worker, a.steps)
        return
    rows = []
    for width in (int(w) for w in a.widths.split(",")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        plain = float(_run([sys.executable, __file__, "--_plain", str(width), "--steps", str(a.steps)], env).split()[-1])
        # Local mode takes one torch thread unless OMP_NUM_THREADS says otherwise (as tether launch's
        # workers do): here it gets every core, as the plain torch run does.
        local = json.loads(_run([sys.executable, __file__, "--_worker", str(width), "--steps", str(a.steps)],
                                {**env, "TETHER_LOCAL": "1", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}).splitlines()[-1])["samples_per_sec"]
        row = [width, f"{plain:,.0f}", f"{local:,.0f} ({local / plain:.2f}x)"]
        for workers in (1, 2):
            with tempfile.TemporaryDirectory() as tmp:
                _run([sys.executable, "-m", "tether.deploy.cli", "launch", "--script", __file__, "--script-args",
                      f"--_worker {width} --steps {a.steps}", "--num-shards", "1", "--num-workers", str(workers),
                      "--mode", "async", "--device", "cpu", "--out", tmp], env)
                summary = json.loads(Path(tmp, "summary.json").read_text())
            phases = summary["workers"][0]["phase_seconds"]
            share = 1 - phases["compute"] / sum(phases.values())
            rate = summary["samples_per_sec"]
            row.append(f"{rate:,.0f} ({rate / plain:.2f}x, PS {share:.0%})")
        rows.append(row)
        print(f"width {width} done", file=sys.stderr, flush=True)
    print(f"{os.cpu_count()} cores; batch {BATCH}; {a.steps} steps a worker; tether rows: samples/s (ratio to one process, "
          "parameter server's share of worker 0's step)\n")
    print(markdown_table(["MLP width", "one process (torch)", "local mode", "tether 1 worker + 1 shard", "tether 2 workers + 1 shard"], rows))


if __name__ == "__main__":
    main()
