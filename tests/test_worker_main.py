"""``tether worker`` (tether.worker.__main__) and the Trainer it runs: ``metrics_port`` is served
by the Trainer itself (so a user's program launched with ``--metrics`` serves one too), and the
worker leaves no process-wide warning filter behind (the codec spends torch's one read-only
warning at import)."""

from __future__ import annotations

import urllib.request
import warnings

import pytest
import torch
from torch import nn

from tether.protos.errors import UsageError
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.trainer import Trainer


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = ShardedEmbeddingBag("items", 4)
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.items(ids)).squeeze(-1)


def _trainer(config: TrainingConfig) -> Trainer[torch.Tensor]:
    torch.manual_seed(0)
    return Trainer(_Tiny(), config, loss=lambda m, b: m(b).pow(2).mean(), sparse=lambda b: {"items": b},
                   batch_size=len, printer=lambda line: None)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_the_trainer_serves_its_metrics_port_until_it_closes() -> None:
    config = TrainingConfig(local=True, steps=3, metrics_port=0, log_every=10)
    with _trainer(config) as trainer:
        assert trainer.metrics_port is not None and trainer.metrics_port > 0
        trainer.fit([torch.arange(6).view(2, 3) % 5 for _ in range(5)], background=False)
        text = _scrape(trainer.metrics_port)
        assert "tether_worker_steps_total 3.0" in text, text
        port = trainer.metrics_port
    with pytest.raises(OSError):
        _scrape(port)  # closed with the Trainer
    # No port: nothing served.
    with _trainer(TrainingConfig(local=True, steps=1)) as trainer:
        assert trainer.metrics_port is None


def test_a_taken_metrics_port_is_one_usage_error() -> None:
    config = TrainingConfig(local=True, steps=1, metrics_port=0)
    with _trainer(config) as first:
        with pytest.raises(UsageError, match=f"--metrics-port {first.metrics_port}: "):
            _trainer(TrainingConfig(local=True, steps=1, metrics_port=first.metrics_port))


def test_the_worker_leaves_no_readonly_warning_filter(tmp_path: object) -> None:
    from tether.worker.__main__ import main

    with warnings.catch_warnings():
        before = list(warnings.filters)
        argv = ["--local", "--steps", "2", "--vocab-size", "50", "--eval-samples", "16", "--batch-size", "8", "--log-every", "1"]
        assert main(argv) == 0
        added = [f for f in warnings.filters if f not in before]
    assert not [f for f in added if f[1] is not None and "not writable" in f[1].pattern], added
