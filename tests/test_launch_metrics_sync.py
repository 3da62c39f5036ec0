"""``tether launch --mode sync --metrics``: torchrun's ranks serve ``/metrics`` on one base port
plus their local rank, so every port of that run must be free (not only the base); a rank that
fails there after joining the process group ends with its one usage line, though
``torch.distributed`` wraps ``sys.excepthook`` (it collects stderr to print after the hook
returns, and ours ends the process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import urllib.request

import pytest
import torch
from torch import nn

import tether.deploy.children as children
from tether.deploy.children import free_ports
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.trainer import Trainer


def test_sync_metrics_ports_skip_a_base_whose_neighbour_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    real = children.free_port
    with socket.socket() as held:
        while True:  # a free base whose next port is taken (as a connection on a busy host may hold it)
            base = real("127.0.0.1")
            try:
                held.bind(("127.0.0.1", base + 1))
                break
            except OSError:
                continue
        held.listen()
        offered = iter([base])
        monkeypatch.setattr(children, "free_port", lambda host: next(offered, None) or real(host))
        got = free_ports("127.0.0.1", 3)
        assert got != base
        for port in range(got, got + 3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


class _Items(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = ShardedEmbeddingBag("items", 4)

    def forward(self, b: dict) -> torch.Tensor:
        return self.items(b["item"]).sum(1)


def test_a_rank_serves_the_base_port_plus_its_local_rank_with_its_own_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    base = free_ports("127.0.0.1", 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    config = TrainingConfig(local=True, steps=3, metrics_port=base, log_every=10)
    batches = [{"item": torch.arange(8) + i} for i in range(3)]
    with Trainer(_Items(), config, loss=lambda m, b: m(b).pow(2).mean(), sparse=lambda b: {"items": b["item"]}) as trainer:
        assert trainer.metrics_port == base + 1
        trainer.fit(batches)
        with urllib.request.urlopen(f"http://127.0.0.1:{base + 1}/metrics", timeout=10) as r:
            assert r.status == 200
            text = r.read().decode()
    assert "tether_worker_steps_total 3.0" in text.splitlines()
    assert "tether_worker_samples_total 24.0" in text.splitlines()


_RANK = textwrap.dedent("""
    import socket
    import torch.distributed as dist
    from tether.common.exits import end_usage_errors_in_one_line
    from tether.protos.errors import UsageError

    end_usage_errors_in_one_line()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    raise UsageError("--metrics-port 9465: Address already in use")
""")


def test_a_usage_error_after_joining_the_process_group_is_still_its_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "MASTER_"))}
    proc = subprocess.run([sys.executable, "-c", _RANK], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "tether worker: error: --metrics-port 9465: Address already in use"
