"""CUDA paths: workers train on GPUs (one per GPU, several per host), sync mode all-reduces with
NCCL over several ranks, variable-length bags, a bf16 wire and the ``--preset gpu`` model.

Skipped on machines without CUDA (CI has none); run them where there is a GPU:
``python -m pytest -q tests/test_gpu.py``. What CPU-only CI can check of the same code (device
placement of metrics, exports and lookups) is in test_evaluation.py and test_export.py, on a
fake ``cuda:0`` (tests/fake_cuda.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tether.deploy.job import run_job
from tether.protos.errors import UsageError
from tether.worker.config import MODEL_PRESETS, WorkerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[1]
BASE = WorkerConfig(shards=("pending:0",), num_workers=1, steps=150, batch_size=256, vocab_size=5000, eval_samples=4000, device="cuda")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _records(out: Path, workers: int) -> list[dict]:
    return [json.loads((out / f"worker-{i}.json").read_text()) for i in range(workers)]


def _tether(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tether.deploy.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_worker_trains_on_cuda(tmp_path: Path) -> None:
    summary = run_job(BASE, 2, out=tmp_path, timeout_s=300, echo=False)
    record = json.loads((tmp_path / "worker-0.json").read_text())
    assert record["device"].startswith("cuda")
    # Worker 0's held-out evaluation ran on the GPU at its last step (a crash before issue 26 B1).
    assert "eval_loss" in record["final_eval"]
    assert summary["eval_loss"] < summary["baseline_loss"] - 0.02


@pytest.mark.parametrize("mode", ["async", "ssp:1"])
def test_several_workers_are_dealt_the_gpus_round_robin(tmp_path: Path, mode: str) -> None:
    # More workers than GPUs on a 1- or 2-GPU host, so some GPUs take two workers.
    workers = _gpus() + 1
    summary = run_job(replace(BASE, mode=mode, num_workers=workers, steps=80), 2, out=tmp_path, timeout_s=400, echo=False)
    records = _records(tmp_path, workers)
    assert [r["device"] for r in records] == [f"cuda:{i % _gpus()}" for i in range(workers)]
    assert all(r["samples"] == 80 * BASE.batch_size for r in records)
    assert summary["eval_loss"] < summary["baseline_loss"] - 0.02


def test_sync_mode_uses_nccl(tmp_path: Path) -> None:
    # NCCL needs one GPU per rank.
    ranks = min(_gpus(), 2)
    summary = run_job(replace(BASE, mode="sync", num_workers=ranks, steps=60), 1, out=tmp_path, timeout_s=300, echo=False)
    records = _records(tmp_path, ranks)
    assert all(r["backend"] == "nccl" for r in records)
    assert all(r["dense_digests"] == records[0]["dense_digests"] for r in records)
    assert summary["eval_loss"] < summary["baseline_loss"]


@pytest.mark.skipif(_gpus() < 2, reason="sync with several ranks needs a GPU per rank")
def test_sync_with_several_ranks_gives_each_its_own_gpu(tmp_path: Path) -> None:
    ranks = min(_gpus(), 4)
    summary = run_job(replace(BASE, mode="sync", num_workers=ranks, steps=60), 2, out=tmp_path, timeout_s=400, echo=False)
    records = _records(tmp_path, ranks)
    assert sorted(r["device"] for r in records) == [f"cuda:{i}" for i in range(ranks)]
    assert all(r["backend"] == "nccl" for r in records)
    assert all(r["dense_digests"] == records[0]["dense_digests"] for r in records)
    assert summary["staleness_max"] == 0
    assert summary["eval_loss"] < summary["baseline_loss"]


def test_sync_with_more_ranks_than_gpus_is_one_line_before_nccl(tmp_path: Path) -> None:
    # Two ranks on one GPU would fail in NCCL's first all-reduce, after every rank started.
    with pytest.raises(UsageError, match="GPUs"):
        run_job(replace(BASE, mode="sync", num_workers=_gpus() + 1, steps=5), 1, out=tmp_path, timeout_s=300, echo=False)


def test_variable_length_bags_train_on_cuda(tmp_path: Path) -> None:
    # examples/session_bags: ids + offsets + per-sample weights, a table shared by two bags,
    # and metrics (log loss, AUC) computed from logits and labels on the GPU.
    out = tmp_path / "bags"
    proc = _tether(["launch", "--script", str(ROOT / "examples" / "session_bags" / "train.py"), "--num-shards", "2", "--num-workers", "2",
                    "--steps", "200", "--log-every", "200", "--device", "cuda", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert all(r["device"].startswith("cuda") for r in _records(out, 2))
    assert summary["eval_loss"] < summary["eval_baseline_loss"] - 0.03, summary
    assert summary["eval_auc"] > 0.65, summary


def test_bf16_wire_trains_on_cuda(tmp_path: Path) -> None:
    summary = run_job(replace(BASE, num_workers=2, wire_dtype="bfloat16"), 2, out=tmp_path, timeout_s=300, echo=False)
    records = _records(tmp_path, 2)
    assert all(r["device"].startswith("cuda") and r["config"]["wire_dtype"] == "bfloat16" for r in records)
    assert summary["eval_loss"] < summary["baseline_loss"] - 0.02


def test_gpu_preset_trains_through_the_cli(tmp_path: Path) -> None:
    # batch 8,192, 26 fields, 128-wide rows: ~33 MiB of rows pulled and of gradients pushed a step;
    # no --num-shards: the launcher gives the shards the cores the GPU worker leaves, and the
    # preset keeps 2 pushes in flight.
    from tether.deploy.shard_count import choose_shards, host_cores

    out = tmp_path / "gpu"
    proc = _tether(["launch", "--preset", "gpu", "--device", "cuda", "--num-workers", "1", "--steps", "30",
                    "--log-every", "10", "--vocab-size", "20000", "--eval-samples", "8000", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = _records(out, 1)
    preset = MODEL_PRESETS["gpu"]
    assert record["device"].startswith("cuda")
    assert {k: record["config"][k] for k in preset} == preset
    assert record["config"]["push_window"] == 2
    chosen = choose_shards(None, gpus=_gpus(), cores=host_cores(), num_workers=1, device="cuda").num_shards
    assert json.loads((out / "summary.json").read_text())["num_shards"] == chosen
    assert f"tether: {chosen} shard(s) (one per core that 1 GPU worker(s) leave" in proc.stdout, proc.stdout[:2000]
    assert record["samples"] == 30 * preset["batch_size"]
    assert set(record["phase_seconds"]) >= {"pull_wait", "compute", "push"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss"] < summary["baseline_loss"], summary
