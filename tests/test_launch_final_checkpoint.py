"""``tether launch`` ends a job with one checkpoint id on every shard (outsider trial 2): the
shards' own shutdown checkpoints each got a ``final-<ms>`` of their own, so no complete
checkpoint was left and a relaunch onto another shard count was refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_client

from tether.deploy.job import _final_checkpoint
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig
from tether.server.serving.serve import start_shard
from tether.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
TABLES = [TableConfig("t", 4, OptimizerConfig("sgd", 0.5), init_scale=0.1)]


def test_every_shard_writes_the_final_checkpoint_under_one_id_and_another_count_restores_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process: the launcher's last call, then each shard's shutdown (which finds nothing new
    to write), then three shards on the same folder."""
    root = tmp_path / "checkpoints"
    shards = [start_shard(ShardConfig(port=0, shard_index=i, num_shards=2, checkpoint_dir=str(root))) for i in range(2)]
    addresses = [f"127.0.0.1:{s.port}" for s in shards]
    ids = torch.arange(0, 600, 3)
    client = make_client(addresses)
    try:
        client.declare(TABLES)
        client.push({"t": (ids, torch.ones(len(ids), 4))}).result(10)
        trained = client.wait(client.pull({"t": ids})).rows["t"]
    finally:
        client.close()
    _final_checkpoint(WorkerConfig(shards=("pending:0",)), addresses, root)
    assert [s.shutdown(0) for s in shards] == [None, None]  # nothing changed since: no checkpoint of each shard's own
    (final_id, written), = _parts(root).items()
    assert final_id.startswith("final-") and written == {(0, 2), (1, 2)}
    assert f"final checkpoint {final_id} of all 2 shard(s) in {root}" in capsys.readouterr().out

    again = [start_shard(ShardConfig(port=0, shard_index=i, num_shards=3, checkpoint_dir=str(root))) for i in range(3)]
    client = make_client([f"127.0.0.1:{s.port}" for s in again])
    try:
        assert [s.shard.restored_checkpoint for s in again] == [final_id] * 3
        client.declare(TABLES)
        assert torch.equal(client.wait(client.pull({"t": ids})).rows["t"], trained)
    finally:
        client.close()
        for s in again:
            s.stop(0)


def _launch(out: Path, shards: int, steps: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tether.deploy.cli", "launch", "--num-workers", "1", "--num-shards", str(shards),
         "--steps", str(steps), "--checkpoint-every-steps", "1000", "--eval-samples", "200", "--vocab-size", "2000",
         "--out", str(out)],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )


def _parts(root: Path) -> dict[str, set[tuple[int, int]]]:
    parts: dict[str, set[tuple[int, int]]] = {}
    for manifest in root.glob("*/shard-*.manifest.json"):
        doc = json.loads(manifest.read_text())
        parts.setdefault(manifest.parent.name, set()).add((doc["shard_index"], doc["num_shards"]))
    return parts


@pytest.mark.slow
def test_the_end_of_job_checkpoint_is_one_id_and_restores_onto_another_shard_count(tmp_path: Path) -> None:
    out = tmp_path / "job"
    first = _launch(out, shards=2, steps=6)
    assert first.returncode == 0, first.stderr[-3000:]
    parts = _parts(out / "checkpoints")
    # No step checkpoint (every 1000 steps): the end of the job's alone, every shard's part under one id.
    assert len(parts) == 1, parts
    (final_id, written), = parts.items()
    assert final_id.startswith("final-") and written == {(0, 2), (1, 2)}
    assert f"final checkpoint {final_id} of all 2 shard(s)" in first.stdout

    second = _launch(out, shards=3, steps=2)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    logs = [(out / "logs" / f"shard-{i}.log").read_text() for i in range(3)]
    for i, log in enumerate(logs):
        assert f"restored checkpoint {final_id} (complete, 2 part(s) of 2 shards, onto 3)" in log, (i, log[-2000:])
    # The relaunch ends with its own complete checkpoint, of 3 shards.
    newest = {k: v for k, v in _parts(out / "checkpoints").items() if k != final_id}
    assert list(newest.values()) == [{(0, 3), (1, 3), (2, 3)}], newest


@pytest.mark.slow
def test_launch_checkpoint_every_steps_alone_writes_checkpoints_or_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "job"
    proc = subprocess.run(
        [sys.executable, "-m", "tether.deploy.cli", "launch", "--num-workers", "1", "--num-shards", "1", "--steps", "20",
         "--checkpoint-every-steps", "10", "--eval-samples", "500", "--out", str(out)],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )
    if proc.returncode == 2:  # refused up front: one line naming what to add
        assert len(proc.stderr.strip().splitlines()) == 1 and "--checkpoint-every" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "checkpoints" / "step-10").is_dir(), proc.stdout[-2000:] + proc.stderr[-2000:]
