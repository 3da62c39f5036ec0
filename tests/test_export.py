"""``tether export``: a trained cluster's checkpoint -> safetensors -> a plain model that predicts
exactly what the cluster's model predicts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tether.deploy.export import export_checkpoint
from tether.deploy.launch import LocalCluster
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.embedding import PSModel, ShardedEmbeddingBag
from tether.worker.model import CTRModel
from tether.worker.serving import RowLookupBag, load_export

from conftest import make_client

NUM_DENSE, NUM_SPARSE, DIM = 4, 3, 8


def _model() -> CTRModel:
    torch.manual_seed(0)
    return CTRModel(NUM_DENSE, NUM_SPARSE, DIM, embedding_factory=lambda name, dim: ShardedEmbeddingBag(name, dim))


def _batch(seed: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, NUM_DENSE, generator=g), torch.randint(0, 50, (n, NUM_SPARSE), generator=g), torch.randint(0, 2, (n,), generator=g).float()


def test_export_round_trips_to_the_clusters_predictions(tmp_path: Path, cluster: LocalCluster) -> None:
    ckpt = tmp_path / "ckpt"
    addresses = cluster.start_shards(2, extra_args=["--checkpoint-dir", str(ckpt)])
    client = make_client(addresses, "trainer")
    model = _model()
    ps = PSModel(model, client, torch.device("cpu"))
    opt = OptimizerConfig("adagrad", lr=0.1)
    client.declare([TableConfig(t, DIM, opt, init_scale=0.05) for t in model.table_names()], ps.dense_tensors(), opt)
    for step in range(20):
        dense, sparse, labels = _batch(step)
        pulled = ps.install(ps.prefetch({t: sparse[:, j] for j, t in enumerate(model.table_names())}), timeout=30)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        loss.backward()
        ps.push(step + 1, pulled).result(30)
    dense, sparse, _ = _batch(1000)
    ps.install(ps.prefetch({t: sparse[:, j] for j, t in enumerate(model.table_names())}), train=False, timeout=30)
    with torch.no_grad():
        expected = model(dense, sparse)
    client.checkpoint("trained")
    client.close()

    out = tmp_path / "export"
    run = subprocess.run([sys.executable, "-m", "tether.deploy.cli", "export", "--checkpoint-dir", str(ckpt), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["checkpoint"] == "trained"
    assert set(manifest["tables"]) == {"cat_0", "cat_1", "cat_2"}
    assert all(t["dim"] == DIM for t in manifest["tables"].values())

    served = load_export(out).load_into(_model())
    assert all(isinstance(m, RowLookupBag) for m in served.embeddings)
    assert not any(isinstance(m, ShardedEmbeddingBag) for m in served.modules())
    with torch.no_grad():
        got = served(dense, sparse)
    assert torch.allclose(got, expected, atol=1e-6)
    # The export holds the trained values, not the initial ones.
    initial = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    exported = load_export(out).dense[PSModel.FLAT]
    assert exported.shape == initial.shape and not torch.allclose(exported, initial)


def test_row_lookup_bag_matches_torch_embedding_bag_and_reads_unknown_ids_as_zero() -> None:
    ids = torch.tensor([40, 3, 2**40, 7])
    rows = torch.randn(4, 5)
    bag = RowLookupBag(ids, rows, mode="sum")
    ref = torch.nn.EmbeddingBag.from_pretrained(rows, mode="sum")
    index_of = {int(i): k for k, i in enumerate(ids)}
    query = torch.tensor([7, 40, 2**40, 3, 3])
    offsets = torch.tensor([0, 2])
    weights = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])
    local = torch.tensor([index_of[int(i)] for i in query])
    assert torch.allclose(bag(query, offsets, weights), ref(local, offsets, per_sample_weights=weights))
    assert torch.allclose(bag(query), rows[local])
    assert torch.equal(bag(torch.tensor([999])), torch.zeros(1, 5))


def test_export_without_a_complete_checkpoint_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no complete checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")
    run = subprocess.run([sys.executable, "-m", "tether.deploy.cli", "export", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert "no complete checkpoint" in run.stderr
