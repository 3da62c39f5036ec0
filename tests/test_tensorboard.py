"""``--tensorboard DIR``: a real run writes event files whose scalars are the worker's logged
records; ``tether compare`` puts each mode under OUT/tensorboard/<mode>; without the package the
flag is one error line before training starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tether.deploy import cli
from tether.deploy.launch import LocalCluster
from tether.protos.errors import UsageError
from tether.worker.config import TrainingConfig
from tether.worker.training import tensorboard_writer
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.tensorboard_writer import MISSING, TensorBoardRecorder
from tether.worker.training.trainer import Trainer

SKIP = "the tensorboard package is not installed (pip install 'tether[tensorboard]'; the test extra has it)"


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    pytest.importorskip("tensorboard", reason=SKIP)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class _Dot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = ShardedEmbeddingBag("users", 4)
        self.item = ShardedEmbeddingBag("items", 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.user(batch["user"]) * self.item(batch["item"])).sum(1)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch), batch["rating"])


def _ids(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"users": batch["user"], "items": batch["item"]}


def _batches(n: int, size: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"user": torch.randint(0, 20, (size,), generator=g), "item": torch.randint(0, 30, (size,), generator=g),
         "rating": torch.randn(size, generator=g)}
        for _ in range(n)
    ]


def test_a_real_run_writes_the_logged_scalars(cluster: LocalCluster, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason=SKIP)
    addresses = cluster.start_shards(1)
    board = tmp_path / "tb"
    config = TrainingConfig(shards=tuple(addresses), steps=12, log_every=4, eval_every=6, device="cpu", lr=0.1, tensorboard=str(board))
    torch.manual_seed(0)
    with Trainer(_Dot(), config, loss=_loss, sparse=_ids, printer=lambda line: None) as trainer:
        record = trainer.fit(_batches(20), eval_data=_batches(2, size=64))
    history = [h for h in record.history if "train_loss" in h]  # (not the initial model's evaluation)
    assert [h["step"] for h in history] == [4, 6, 8, 12]
    scalars = _scalars(board / "worker-0")
    loss = scalars["train/loss"]
    assert [step for step, _ in loss] == [4, 6, 8, 12]
    for (_, value), h in zip(loss, history, strict=False):
        assert value == pytest.approx(h["train_loss"], rel=1e-5)
    history = record.history
    assert scalars["eval/loss"] == [(h["step"], pytest.approx(h["eval_loss"], rel=1e-5)) for h in history if "eval_loss" in h]
    assert [step for step, _ in scalars["train/samples_per_sec"]] == [4, 6, 8, 12]
    assert all(value > 0 for _, value in scalars["train/samples_per_sec"])
    staleness = scalars["staleness/clock"]
    assert [step for step, _ in staleness] == [4, 6, 8, 12] and all(value >= 0 for _, value in staleness)


def test_missing_package_is_one_line_before_training(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tensorboard_writer, "tensorboard_available", lambda: False)
    assert MISSING == "--tensorboard needs the tensorboard package: pip install 'tether[tensorboard]'"
    with pytest.raises(UsageError, match=r"^--tensorboard needs the tensorboard package: pip install 'tether\[tensorboard\]'$"):
        TensorBoardRecorder(tmp_path / "tb")
    # The Trainer fails before it connects (no shard listens at this address) and writes nothing.
    config = TrainingConfig(shards=("127.0.0.1:1",), device="cpu", tensorboard=str(tmp_path / "tb"))
    with pytest.raises(UsageError, match="needs the tensorboard package"):
        Trainer(_Dot(), config, loss=_loss, sparse=_ids, printer=lambda line: None)
    assert not (tmp_path / "tb").exists()
    # tether launch checks it with every other flag, before any process starts.
    assert cli.main(["launch", "--tensorboard", str(tmp_path / "tb"), "--steps", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"tether launch: error: {MISSING}"]
    assert not (tmp_path / "out").exists()


def test_config_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.worker.flags import load_config

    assert load_config(["--shards", "127.0.0.1:1"]).tensorboard is None
    assert load_config(["--shards", "127.0.0.1:1", "--tensorboard", "runs/tb"]).tensorboard == "runs/tb"
    monkeypatch.setenv("TETHER_TENSORBOARD", "from-env")
    assert TrainingConfig.from_env(shards=("127.0.0.1:1",)).tensorboard == "from-env"
    with pytest.raises(ValueError, match="tensorboard must name a directory"):
        TrainingConfig(shards=("127.0.0.1:1",), tensorboard="")


def test_compare_overlays_modes_under_out_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason=SKIP)
    out = tmp_path / "cmp"
    argv = ["compare", "--modes", "async,ssp:1", "--num-shards", "1", "--num-workers", "1", "--steps", "20", "--batch-size", "64",
            "--vocab-size", "500", "--eval-samples", "500", "--log-every", "10", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "tether.deploy.cli", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"tensorboard --logdir {out / 'tensorboard'}" in proc.stdout
    for mode in ("async", "ssp-1"):
        history = json.loads((out / mode / "worker-0.json").read_text())["history"]
        scalars = _scalars(out / "tensorboard" / mode / "worker-0")
        assert [step for step, _ in scalars["train/loss"]] == [h["step"] for h in history if "train_loss" in h]
        assert "eval/loss" in scalars and "eval/auc" in scalars
