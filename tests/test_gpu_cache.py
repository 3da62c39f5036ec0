"""The worker's row cache on a CUDA worker against real shards: it trains as no cache does and
moves fewer rows (issue 29 on the GPU path: the plans, merges and held gradients of a CUDA
worker's steps go through its transfer thread).

On CUDA the cache keeps its rows on the GPU (tether.worker.cache.device, issue 41). Skipped on
machines without CUDA (CI has none); what CPU-only CI can check of the same code is
tests/test_device_cache.py (CPU tensors and the fake ``cuda:0``) and tests/test_row_cache.py's
fake ``cuda:0`` run."""

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


def _pulled_rows(out: Path) -> int:
    record = json.loads((out / "worker-0.json").read_text())
    assert record["device"].startswith("cuda")
    return sum(t["pulled_rows"] for t in record["traffic"].values())


@pytest.mark.parametrize("mode", ["async", "ssp:2"])
def test_the_row_cache_on_a_cuda_worker_trains_and_moves_fewer_rows(tmp_path: Path, mode: str) -> None:
    plain = run_job(replace(BASE, mode=mode), 2, out=tmp_path / "plain", timeout_s=300, echo=False)
    cached = run_job(replace(BASE, mode=mode, cache_rows=100_000, cache_bound=5), 2, out=tmp_path / "cached", timeout_s=300,
                     echo=False)
    assert _pulled_rows(tmp_path / "cached") < 0.8 * _pulled_rows(tmp_path / "plain")
    assert cached["eval_loss"] < cached["baseline_loss"] - 0.02
    assert abs(cached["eval_loss"] / plain["eval_loss"] - 1) < 0.05
