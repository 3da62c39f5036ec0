"""A two-tower recommender on MovieLens-format ratings, trained through tether.

Run it as the workers of a local job (any mode)::

    python examples/movielens_two_tower/train.py --generate 200000 --data ratings.dat   # once
    tether launch --script examples/movielens_two_tower/train.py --script-args "--data ratings.dat" \
        --num-workers 2 --mode ssp:2 --steps 600 --lr 0.05

Each worker finds the shards, its index and the mode in the environment tether launch (or
torchrun, or the Kubernetes manifests) gives it: ``TrainingConfig.from_env()``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from movielens import rating_batches, read_ratings, write_ratings

from tether import ShardedEmbeddingBag, Trainer, TrainingConfig


class TwoTower(nn.Module):
    """rating ~ mean + <user tower, movie tower> + user bias + movie bias."""

    def __init__(self, dim: int = 16, mean: float = 3.5) -> None:
        super().__init__()
        self.user = ShardedEmbeddingBag("user", dim)  # rows live on the shards
        self.movie = ShardedEmbeddingBag("movie", dim)
        self.user_bias = ShardedEmbeddingBag("user_bias", 1)
        self.movie_bias = ShardedEmbeddingBag("movie_bias", 1)
        self.user_tower = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))  # on the shards too (or all-reduced in sync)
        self.movie_tower = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.mean = mean

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        u = self.user_tower(self.user(batch["user"]))
        m = self.movie_tower(self.movie(batch["movie"]))
        bias = self.user_bias(batch["user"]).squeeze(1) + self.movie_bias(batch["movie"]).squeeze(1)
        return self.mean + (u * m).sum(1) + bias


def order_seed(config: TrainingConfig) -> int:
    """The seed of this worker's batch order: the data seed's (``--data-seed``, which ``tether
    compare --repeats`` and ``sweep --repeats`` step by 1 a repeat), while the initial model
    follows ``--seed`` alone, so repeats differ in their data order only. Data seed 0 keeps the
    order a seed always had."""
    return config.seed + config.worker_index + 1_000_003 * config.data_seed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="ratings file: ratings.dat (UserID::MovieID::Rating::Timestamp), u.data or ratings.csv")
    p.add_argument("--generate", type=int, default=0, help="first write this many synthetic ratings to --data, then exit")
    p.add_argument("--batch-size", type=int, default=int(os.environ.get("TETHER_BATCH_SIZE", 256)))
    p.add_argument("--dim", type=int, default=int(os.environ.get("TETHER_EMBEDDING_DIM", 16)))
    p.add_argument("--epochs", type=int, default=0,
                   help="passes over the ratings (default: as many as --steps takes; 1 where no step count is given)")
    a = p.parse_args()
    if a.epochs < 0:
        p.error(f"--epochs must be >= 0, got {a.epochs}")
    if a.generate:
        write_ratings(a.data, a.generate)
        return
    config = TrainingConfig.from_env()
    train, held_out = read_ratings(a.data, config.worker_index, config.num_workers)
    mean = float(train["rating"].mean())
    torch.manual_seed(config.seed)  # the initial model: --seed's, whatever the data order
    model = TwoTower(a.dim, mean)

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch), batch["rating"])

    def sparse(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"user": batch["user"], "movie": batch["movie"], "user_bias": batch["user"], "movie_bias": batch["movie"]}

    def metrics(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"eval_mse": float(loss(model, batch)), "eval_baseline_mse": float(((batch["rating"] - mean) ** 2).mean())}

    held = [{k: v[i:i + 4096] for k, v in held_out.items()} for i in range(0, len(held_out["rating"]), 4096)]
    with Trainer(model, config, loss=loss, sparse=sparse) as trainer:
        # With no step count the trainer runs until the data ends: one pass unless --epochs says more.
        epochs = a.epochs or (None if config.steps else 1)
        record = trainer.fit(rating_batches(train, a.batch_size, seed=order_seed(config), epochs=epochs), eval_data=held,
                             evaluate=metrics)
    e = record.final_eval
    if e is not None:
        print(f"held-out MSE {e['eval_mse']:.4f} (predicting the mean rating: {e['eval_baseline_mse']:.4f})", flush=True)


if __name__ == "__main__":
    main()
