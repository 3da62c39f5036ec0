"""Exactly once across client restarts: a worker process that comes back under the same worker
id is a new incarnation, and its pushes are never taken for duplicates of the old one's."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import make_client
from prometheus_client import CollectorRegistry

from tether.deploy.launch import LocalCluster
from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.codec import encode_ids, encode_tensor
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import SparseUpdate
from tether.worker.metrics import WorkerMetrics

TABLE = TableConfig("emb", 4, OptimizerConfig("sgd", 1.0), init_scale=0.5)
ROW = 7

# One worker process: declares the table, pushes a gradient of ones on row ROW `n` times under
# the same worker id every run, and reports how many pushes were acknowledged as applied.
_WORKER = """
import json, sys, torch
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.client.ps_client import PSClient
from tether.worker.client.config import ClientConfig
address, n = sys.argv[1], int(sys.argv[2])
client = PSClient(ClientConfig(addresses=(address,), worker_id="worker-0", timeout_s=10.0, retries=20, backoff_s=0.05, max_backoff_s=0.5))
client.declare([TableConfig("emb", 4, OptimizerConfig("sgd", 1.0), init_scale=0.5)])
ids = torch.tensor([ROW])
applied = duplicates = 0
for _ in range(n):
    ack = client.push({"emb": (ids, torch.ones(1, 4))}).result(60)
    duplicates += ack.duplicates
    applied += 1 - ack.duplicates
client.close()
print(json.dumps({"applied": applied, "duplicates": duplicates, "incarnation": client.incarnation}))
""".replace("ROW", str(ROW))


def _run_worker(address: str, n: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _WORKER, address, str(n)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _row(address: str) -> torch.Tensor:
    client = make_client([address], "reader")
    try:
        client.declare([TABLE])
        return client.pull({"emb": torch.tensor([ROW])}).result(30).rows["emb"][0].clone()
    finally:
        client.close()


def test_a_worker_restarted_twice_under_the_same_id_has_every_push_applied(cluster: LocalCluster) -> None:
    (address,) = cluster.start_shards(1)
    initial = _row(address)
    runs = [_run_worker(address, n) for n in (5, 7, 9)]
    assert [r["duplicates"] for r in runs] == [0, 0, 0]
    assert len({r["incarnation"] for r in runs}) == 3
    acknowledged = sum(r["applied"] for r in runs)
    assert acknowledged == 21
    # SGD with lr 1 and a gradient of ones: the row drops by exactly one per applied push.
    assert torch.allclose(_row(address), initial - acknowledged, atol=1e-5)
    client = make_client([address], "reader")
    assert client.info()[0].applied_pushes == 21
    assert client.info()[0].duplicate_pushes == 0
    client.close()


def test_pushes_of_a_new_incarnation_survive_a_shard_kill_and_restore(tmp_path: Path) -> None:
    cluster = LocalCluster(log_dir=tmp_path / "logs", grace_s=5, restart=True)
    try:
        (address,) = cluster.start_shards(1, extra_args=["--checkpoint-dir", str(tmp_path / "ckpt")])
        initial = _row(address)
        first = _run_worker(address, 6)
        client = make_client([address], "operator", timeout_s=5.0, retries=30, backoff_s=0.05, max_backoff_s=0.5)
        client.checkpoint("after-first")
        cluster.signal_shard(0, signal.SIGKILL)
        address = cluster.wait_shard(0, timeout_s=60)
        deadline = time.monotonic() + 30
        while client.info()[0].restored_checkpoint != "after-first":
            assert time.monotonic() < deadline, "the restarted shard did not restore the checkpoint"
            time.sleep(0.1)
        client.close()
        # The restored dedup window holds the first process's sequence numbers 1..6; a second
        # process numbers its pushes from 1 again and every one of them must still apply.
        second = _run_worker(address, 8)
        third = _run_worker(address, 3)
        assert (first["duplicates"], second["duplicates"], third["duplicates"]) == (0, 0, 0)
        acknowledged = first["applied"] + second["applied"] + third["applied"]
        assert acknowledged == 17
        assert torch.allclose(_row(address), initial - acknowledged, atol=1e-5)
    finally:
        cluster.stop()


def test_a_retried_push_of_one_incarnation_is_still_applied_once() -> None:
    shard = Shard(0, 1)
    shard.declare([TABLE], [])
    ids = np.array([ROW], dtype=np.int64)
    shard.pull([("emb", ids)], [])
    before = shard.tables["emb"].snapshot()["weights"].clone()
    update = [SparseUpdate("emb", ids, torch.ones(1, 4))]
    assert shard.push("w", 1, update, [], incarnation=11).applied
    assert not shard.push("w", 1, update, [], incarnation=11).applied  # a retry of the same push
    assert shard.push("w", 1, update, [], incarnation=12).applied  # a new process, numbering from 1
    assert torch.allclose(shard.tables["emb"].snapshot()["weights"], before - 2)
    # The windows survive a checkpoint's export and import, one per incarnation.
    restored = Shard(0, 1)
    restored.import_state(shard.export_state())
    assert not restored.push("w", 1, update, [], incarnation=11).applied
    assert not restored.push("w", 1, update, [], incarnation=12).applied
    assert restored.push("w", 2, update, [], incarnation=12).applied


def test_a_duplicate_the_client_never_resent_is_logged_and_counted(inproc_shard, caplog: pytest.LogCaptureFixture) -> None:
    address = f"127.0.0.1:{inproc_shard.port}"
    metrics = WorkerMetrics(CollectorRegistry())
    client = make_client([address], "w", transport="grpc")
    client.metrics = metrics
    try:
        client.declare([TABLE])
        # Someone else pushes under this client's incarnation and its next sequence number.
        stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(address))
        block = pb.SparseBlock(table="emb", ids=encode_ids(np.array([ROW])), values=encode_tensor(torch.ones(1, 4)))
        assert stub.Push(pb.PushRequest(worker_id="w", incarnation=client.incarnation, seq=1, sparse=[block]), timeout=10).applied
        with caplog.at_level(logging.WARNING, logger="tether.worker.client.ps_client"):
            ack = client.push({"emb": (torch.tensor([ROW]), torch.ones(1, 4))}).result(30)
        assert ack.duplicates == 1
        assert "a duplicate, but it was sent once" in caplog.text
        assert metrics.unexpected_duplicates._value.get() == 1
        # An ordinary push afterwards is applied and not counted.
        assert client.push({"emb": (torch.tensor([ROW]), torch.ones(1, 4))}).result(30).duplicates == 0
        assert metrics.unexpected_duplicates._value.get() == 1
    finally:
        client.close()
