"""Variable-length bags: predict a click on a candidate item from the user's recent items.

Each sample holds the ids of the items a user viewed last (1 to 30 of them, so the batch is
jagged: ids + offsets, the ``torch.nn.EmbeddingBag`` convention), recency weights for them, and
a candidate item. The history bag and the candidate share one table (``items``) on the shards.
The clicks come from a hidden model, so a learned model beats the constant click rate.

    tether launch --script examples/session_bags/train.py --num-workers 2 --mode async --steps 400
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from tether import ShardedEmbeddingBag, Trainer, TrainingConfig, auc, constant_baseline_loss, log_loss

NUM_ITEMS = 5000
MAX_HISTORY = 30


class SessionModel(nn.Module):
    """click logit = MLP([weighted history bag, candidate row, their product])."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.history = ShardedEmbeddingBag("items", dim, mode="sum")  # ids + offsets + weights
        self.candidate = ShardedEmbeddingBag("items", dim)  # the same table, one id per sample
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.history(batch["history"], batch["offsets"], per_sample_weights=batch["weights"])
        c = self.candidate(batch["candidate"])
        return self.mlp(torch.cat([h, c, h * c], dim=1)).squeeze(1)


class Sessions:
    """A stream of synthetic sessions: items belong to hidden topics, a user's history leans
    to one topic, and a candidate of that topic is clicked far more often."""

    TOPICS = 25

    def __init__(self, seed: int = 0) -> None:
        hidden = np.random.default_rng(1234)  # the hidden model: the same for every worker
        self.topic = hidden.integers(0, self.TOPICS, NUM_ITEMS)
        self.by_topic = [np.flatnonzero(self.topic == t) for t in range(self.TOPICS)]
        self.appeal = hidden.normal(0, 0.5, NUM_ITEMS)
        self.rng = np.random.default_rng(seed)

    def batch(self, size: int) -> dict[str, torch.Tensor]:
        rng = self.rng
        lengths = rng.integers(1, MAX_HISTORY + 1, size)
        taste = rng.integers(0, self.TOPICS, size)
        # 70% of a history is the user's topic, the rest random items.
        own = np.concatenate([rng.choice(self.by_topic[t], n) for t, n in zip(taste, lengths, strict=False)])
        other = rng.integers(0, NUM_ITEMS, lengths.sum())
        history = np.where(rng.random(lengths.sum()) < 0.7, own, other)
        weights = np.concatenate([0.9 ** np.arange(n)[::-1] for n in lengths]).astype(np.float32)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        # Half the candidates come from the user's topic.
        candidate = np.where(rng.random(size) < 0.5, [rng.choice(self.by_topic[t]) for t in taste], rng.integers(0, NUM_ITEMS, size))
        logit = np.where(self.topic[candidate] == taste, 1.5, -1.5) + self.appeal[candidate]
        label = (rng.random(size) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return {
            "history": torch.from_numpy(history.astype(np.int64)), "offsets": torch.from_numpy(offsets.astype(np.int64)),
            "weights": torch.from_numpy(weights), "candidate": torch.from_numpy(candidate.astype(np.int64)),
            "label": torch.from_numpy(label),
        }

    def batches(self, size: int) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.batch(size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=int(os.environ.get("TETHER_BATCH_SIZE", 256)))
    p.add_argument("--dim", type=int, default=int(os.environ.get("TETHER_EMBEDDING_DIM", 16)))
    a = p.parse_args()
    config = TrainingConfig.from_env()
    torch.manual_seed(config.seed)
    model = SessionModel(a.dim)
    held_out = [Sessions(seed=10_000).batch(4096)]
    click_rate = float(Sessions(seed=20_000).batch(20_000)["label"].mean())

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(model(batch), batch["label"])

    def metrics(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        logits = model(batch)
        return {"eval_loss": log_loss(logits, batch["label"]), "eval_auc": auc(logits, batch["label"]),
                "eval_baseline_loss": constant_baseline_loss(click_rate, batch["label"])}

    # Samples are sessions: the history tensor is jagged, so say how to count them.
    with Trainer(
        model, config, loss=loss, sparse=lambda b: {"items": [b["history"], b["candidate"]]}, batch_size=lambda b: len(b["candidate"])
    ) as trainer:
        data = Sessions(seed=config.seed * 1000 + config.worker_index + 1).batches(a.batch_size)
        record = trainer.fit(data, eval_data=held_out, evaluate=metrics)
    e = record.final_eval
    if e is not None:
        print(
            f"held-out log loss {e['eval_loss']:.4f}, AUC {e['eval_auc']:.4f} (constant click rate: {e['eval_baseline_loss']:.4f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
