"""Config drift (issue 30 item 5): a shard restarted with another table spec, update rule or shard
count than its checkpoint was written with refuses it with one line naming both, unless it is
restoring a complete checkpoint onto the new shard count (the way to change it)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tether.protos.errors import FailedPrecondition
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.checkpoints.checkpoint import Checkpointer, RestoreError
from tether.server.config import ShardConfig
from tether.server.serving.serve import RunningShard, start_shard
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import SparseUpdate
from tether.worker.client.config import ClientConfig
from tether.worker.client.ps_client import PSClient

ADAGRAD = OptimizerConfig("adagrad", 0.1)
TABLE = TableConfig("user", 8, ADAGRAD, init_scale=0.0)
IDS = torch.arange(0, 300, 3, dtype=torch.int64)


# -- table spec and update rule ---------------------------------------------------------------


def _serve(root: Path) -> tuple[RunningShard, PSClient]:
    running = start_shard(ShardConfig(host="127.0.0.1", port=0, checkpoint_dir=str(root)))
    client = PSClient(ClientConfig(addresses=(f"127.0.0.1:{running.port}",), worker_id="w", timeout_s=5.0, call_deadline_s=20.0))
    return running, client


@pytest.fixture
def restored(tmp_path: Path):
    """A shard restarted from a checkpoint of TABLE (2 pushes) and dense "w" (Adagrad, 10 values)."""
    running, client = _serve(tmp_path)
    client.declare([TABLE], {"w": torch.zeros(10)}, ADAGRAD)
    for _ in range(2):
        client.push({"user": (IDS, torch.ones(len(IDS), 8))}, {"w": torch.ones(10)}).result(10)
    client.checkpoint("c1")
    client.close()
    running.stop(0)
    running, client = _serve(tmp_path)
    assert client.info()[0].restored_checkpoint == "c1"
    yield running, client
    client.close()
    running.stop(0)


DRIFTS = {
    "dim": (lambda: ([TableConfig("user", 16, ADAGRAD, init_scale=0.0)], {}), ("'user'", "8", "16")),
    "rule": (lambda: ([TableConfig("user", 8, OptimizerConfig("adam", 0.1), init_scale=0.0)], {}), ("'user'", "adagrad", "adam")),
    "hyper-parameter": (lambda: ([TableConfig("user", 8, OptimizerConfig("adagrad", 0.5), init_scale=0.0)], {}), ("'user'", "0.1", "0.5")),
    "capacity": (lambda: ([TableConfig("user", 8, ADAGRAD, init_scale=0.0, capacity=50)], {}), ("'user'", "0", "50")),
    # (a dense chunk's message names the chunk; its sizes or rules come with the shard's
    # conflict messages, protos/specs.py)
    "dense size": (lambda: ([TABLE], {"w": torch.zeros(12)}), ("dense chunk w[0]",)),
    "dense rule": (lambda: ([TABLE], {"w": torch.zeros(10)}), ("dense chunk w[0]",)),
}


@pytest.mark.parametrize("drift", list(DRIFTS))
def test_a_restored_table_or_chunk_refuses_a_drifted_spec_with_one_line(restored, drift: str) -> None:
    running, client = restored
    make, words = DRIFTS[drift]
    tables, dense = make()
    start = time.monotonic()
    with pytest.raises(FailedPrecondition) as err:
        client.declare(tables, dense, OptimizerConfig("sgd", 0.1) if drift == "dense rule" else ADAGRAD)
    elapsed = time.monotonic() - start
    message = str(err.value)
    print(f"{drift}: {message}")
    assert "\n" not in message and elapsed < 5.0  # the shard's answer: not retried
    for word in words:
        assert word in message, (word, message)
    # Nothing changed: the restored spec is still what the shard serves, with its rows.
    table = running.shard.tables["user"]
    assert (table.config.dim, table.config.optimizer.name, table.config.capacity, table.rows) == (8, "adagrad", 0, len(IDS))
    client.declare([TABLE], {"w": torch.zeros(10)}, ADAGRAD)  # the checkpoint's spec: accepted
    rows = client.pull({"user": IDS}).result(10).rows["user"]
    assert rows.shape == (len(IDS), 8) and bool((rows < 0).all())


# -- shard count ------------------------------------------------------------------------------


def _part(root: Path, ckpt_id: str, shard_index: int, num_shards: int, rows: int = 40) -> None:
    """Shard ``shard_index`` of ``num_shards`` writes its part of ``ckpt_id`` (its rows of 0..rows)."""
    from tether.protos.partition import shard_of_ids

    shard = Shard(shard_index, num_shards)
    shard.declare([TableConfig("t", 4, OptimizerConfig("sgd", 1.0), init_scale=0.0)], [])
    ids = np.arange(rows, dtype=np.int64)
    ids = ids[shard_of_ids(ids, num_shards) == shard_index]
    shard.push("w", 1, [SparseUpdate("t", ids, torch.ones(len(ids), 4))], [], incarnation=1)
    Checkpointer(shard, root).checkpoint(ckpt_id)
    time.sleep(0.01)  # manifests are ordered by their time


def test_a_shard_count_whose_checkpoint_is_not_complete_here_is_refused_with_one_line(tmp_path: Path) -> None:
    """A StatefulSet scaled from 2 to 3: shard 0's volume holds its part of a 2-shard job only.
    It used to start empty and serve that."""
    _part(tmp_path, "auto-1", 0, 2)
    with pytest.raises(RestoreError) as err:
        Checkpointer(Shard(0, 3), tmp_path).restore()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"shard 0 of 3: the newest checkpoint under {tmp_path}, auto-1, was written by 2 shards, not 3")
    assert "--num-shards 2" in message
    with pytest.raises(RuntimeError, match="written by 2 shards, not 3"):
        start_shard(ShardConfig(host="127.0.0.1", port=0, shard_index=0, num_shards=3, checkpoint_dir=str(tmp_path)))
    # Its own shard count restores it.
    fresh = Shard(0, 2)
    assert Checkpointer(fresh, tmp_path).restore().id == "auto-1" and fresh.tables["t"].rows > 0


def test_an_older_part_of_its_own_count_under_newer_parts_of_another_is_refused(tmp_path: Path) -> None:
    """Started again with the shard count it had before a reshard: its own part is older than
    what the other layout wrote since, which it cannot use."""
    _part(tmp_path, "old", 0, 2)
    _part(tmp_path, "new", 0, 3)
    with pytest.raises(RestoreError, match=r"shard 0 of 2: .* new, was written by 3 shards, not 2, .*its own newest, old, is older"):
        Checkpointer(Shard(0, 2), tmp_path).restore()


def test_a_complete_checkpoint_of_another_count_is_restored_onto_the_new_one(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Changing the shard count (kept): every part of one checkpoint in the directory. Newer
    parts that are no complete checkpoint are named in a warning."""
    for i in range(2):
        _part(tmp_path, "both", i, 2)
    _part(tmp_path, "final-1", 0, 2)  # shard 0's own shutdown checkpoint, after
    caplog.set_level(logging.INFO, logger="tether.server.checkpoints.checkpoint")
    shards = [Shard(i, 3) for i in range(3)]
    for s in shards:
        assert Checkpointer(s, tmp_path).restore().id == "both"
    assert sum(s.tables["t"].rows for s in shards) == 40
    messages = [r.getMessage() for r in caplog.records]
    assert any("restored checkpoint both (complete, 2 part(s) of 2 shards, onto 3)" in m for m in messages), messages
    assert any("are left out" in m and "final-1 (shard 0 of 2)" in m for m in messages), messages


def test_a_shard_missing_its_own_part_of_the_same_count_starts_empty_as_before(tmp_path: Path) -> None:
    """Same shard count, another shard's parts only (a shard that crashed before its first
    checkpoint): not drift, it comes back empty as documented."""
    _part(tmp_path, "auto-1", 0, 2)
    fresh = Shard(1, 2)
    assert Checkpointer(fresh, tmp_path).restore() is None and fresh.tables == {}


def test_tether_server_refuses_another_shard_count_and_exits_1_with_one_line(tmp_path: Path) -> None:
    _part(tmp_path, "auto-1", 0, 2)
    proc = subprocess.run(
        [sys.executable, "-m", "tether.deploy.cli", "server", "--port", "0", "--shard-index", "0", "--num-shards", "3",
         "--checkpoint-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "cannot start" in line]
    assert len(lines) == 1 and "written by 2 shards, not 3" in lines[0], proc.stderr[-2000:]
