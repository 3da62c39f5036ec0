"""CUDA paths: the worker trains on the GPU, and sync mode all-reduces with NCCL.

Skipped on machines without CUDA (CI has none); run them where there is a GPU.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tether.deploy.job import run_job
from tether.worker.config import WorkerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BASE = WorkerConfig(shards=("pending:0",), num_workers=1, steps=150, batch_size=256, vocab_size=5000, eval_samples=4000, device="cuda")


def test_worker_trains_on_cuda(tmp_path: Path) -> None:
    summary = run_job(BASE, 2, out=tmp_path, timeout_s=300, echo=False)
    record = json.loads((tmp_path / "worker-0.json").read_text())
    assert record["device"].startswith("cuda")
    assert summary["eval_loss"] < summary["baseline_loss"] - 0.02


def test_sync_mode_uses_nccl(tmp_path: Path) -> None:
    # NCCL needs one GPU per rank.
    ranks = min(torch.cuda.device_count(), 2)
    summary = run_job(replace(BASE, mode="sync", num_workers=ranks, steps=60), 1, out=tmp_path, timeout_s=300, echo=False)
    records = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(ranks)]
    assert all(r["backend"] == "nccl" for r in records)
    assert all(r["dense_digests"] == records[0]["dense_digests"] for r in records)
    assert summary["eval_loss"] < summary["baseline_loss"]
