"""``tether export``: a trained cluster's checkpoint -> safetensors -> a plain model that predicts
exactly what the cluster's model predicts."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import make_client
from fake_cuda import FakeCuda, on_fake_cuda
from safetensors import safe_open
from torch import nn

from tether.deploy.export import export_checkpoint, load_model
from tether.deploy.launch import LocalCluster
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig
from tether.server.serving.serve import start_shard
from tether.worker.ctr.model import CTRModel
from tether.worker.serving import RowLookupBag, load_export
from tether.worker.training.embedding import PSModel
from tether.worker.training.embedding_bag import ShardedEmbeddingBag

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
    # Narrower integer ids are widened (as ShardedEmbeddingBag does); float ids are refused.
    assert torch.equal(bag(torch.tensor([7, 3], dtype=torch.int32)), rows[[3, 1]])
    with pytest.raises(ValueError, match=r"ids must be integers, got torch.float32"):
        bag(torch.tensor([7.0]))


def test_export_without_a_complete_checkpoint_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no complete checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")
    run = subprocess.run([sys.executable, "-m", "tether.deploy.cli", "export", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert "no complete checkpoint" in run.stderr


# A checkpoint folder, a held-out batch (dense, user, items) and the trained model's logits for it.
Wide = tuple[Path, tuple[torch.Tensor, ...], torch.Tensor]


class WideDeep(nn.Module):
    """An outsider's model: a single-id table, a padded variable-length bag (mean), and two
    Linear layers and a bias-free one over the dense features and both embeddings."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.user = ShardedEmbeddingBag("user", 4)
        self.items = ShardedEmbeddingBag("items", 3, mode="mean", padding_id=0)
        self.hidden = nn.Linear(2 + 4 + 3, 6)
        self.mid = nn.Linear(6, 5)
        self.out = nn.Linear(5, 1, bias=False)

    def forward(self, dense: torch.Tensor, user: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        x = torch.cat([dense, self.user(user), self.items(items)], dim=1)
        return self.out(torch.relu(self.mid(torch.relu(self.hidden(x))))).squeeze(1)


def _wide_batch(seed: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    items = torch.randint(1, 40, (n, 5), generator=g)
    items[:, 3:] *= torch.randint(0, 2, (n, 2), generator=g)  # id 0 pads the shorter bags
    return torch.randn(n, 2, generator=g), torch.randint(0, 30, (n,), generator=g), items, torch.randint(0, 2, (n,), generator=g).float()


@pytest.fixture(scope="module")
def wide_export(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wide]:
    """A checkpoint of ``WideDeep`` trained 10 steps on an in-process shard; a held-out batch
    and the trained model's logits for it."""
    ckpt = tmp_path_factory.mktemp("wide") / "ckpt"
    shard = start_shard(ShardConfig(host="127.0.0.1", port=0, checkpoint_dir=str(ckpt)))
    try:
        client = make_client([f"127.0.0.1:{shard.port}"], "wide")
        model = WideDeep()
        ps = PSModel(model, client, torch.device("cpu"))
        opt = OptimizerConfig("adagrad", lr=0.1)
        client.declare([TableConfig("user", 4, opt, init_scale=0.1), TableConfig("items", 3, opt, init_scale=0.1)], ps.dense_tensors(), opt)
        for step in range(10):
            dense, user, items, labels = _wide_batch(step)
            pulled = ps.install(ps.prefetch({"user": user, "items": items}), timeout=30)
            torch.nn.functional.binary_cross_entropy_with_logits(model(dense, user, items), labels).backward()
            ps.push(step + 1, pulled).result(30)
        dense, user, items, _ = _wide_batch(1000)
        ps.install(ps.prefetch({"user": user, "items": items}), train=False, timeout=30)
        with torch.no_grad():
            expected = model(dense, user, items)
        client.checkpoint("wide")
        client.close()
    finally:
        shard.stop(0)
    yield ckpt, (dense, user, items), expected


def test_export_names_each_dense_parameter_and_round_trips_exactly(tmp_path: Path, wide_export: Wide) -> None:
    ckpt, inputs, expected = wide_export
    out = tmp_path / "export"
    manifest = export_checkpoint(ckpt, out, model=WideDeep())
    params = dict(WideDeep().named_parameters())
    assert manifest["dense_layout"] == "parameters"
    assert manifest["dense_shapes"] == {name: list(p.shape) for name, p in params.items()}
    assert manifest["dense"] == {name: p.numel() for name, p in params.items()}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {k: v for k, v in shapes.items() if k.startswith("dense.")} == {f"dense.{n}": tuple(p.shape) for n, p in params.items()}
    assert shapes["user.rows"][1] == 4 and shapes["items.rows"][1] == 3

    served = load_export(out).load_into(WideDeep())
    assert isinstance(served.user, RowLookupBag) and isinstance(served.items, RowLookupBag)
    with torch.no_grad():
        assert torch.equal(served(*inputs), expected)


def test_export_without_the_model_is_the_flat_vector_and_still_loads(tmp_path: Path, wide_export: Wide) -> None:
    ckpt, inputs, expected = wide_export
    manifest = export_checkpoint(ckpt, tmp_path / "flat")
    total = sum(p.numel() for p in WideDeep().parameters())
    assert manifest["dense_layout"] == "flat" and manifest["dense"] == {PSModel.FLAT: total}
    with torch.no_grad():
        assert torch.equal(load_export(tmp_path / "flat").load_into(WideDeep())(*inputs), expected)


def test_export_refuses_a_model_built_another_way(tmp_path: Path, wide_export: Wide) -> None:
    ckpt, _, _ = wide_export
    other = WideDeep()
    other.out = nn.Linear(5, 1)  # a bias the trained model did not have
    with pytest.raises(ValueError, match=r"the model has 101 dense parameter values in 6 parameters, the flat dense vector 100 "):
        export_checkpoint(ckpt, tmp_path / "x", model=other)
    export_checkpoint(ckpt, tmp_path / "named", model=WideDeep())
    with pytest.raises(ValueError, match=r"missing from the export \['out.bias'\]"):
        load_export(tmp_path / "named").load_into(other)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_export_files_get_the_mode_the_umask_gives(tmp_path: Path, wide_export: Wide, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        export_checkpoint(wide_export[0], tmp_path / "out", model=WideDeep())
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()} == {"model.safetensors": mode, "manifest.json": mode}


def test_load_into_a_model_already_on_the_gpu_puts_the_tables_there(tmp_path: Path, wide_export: Wide) -> None:
    ckpt, inputs, expected = wide_export
    export_checkpoint(ckpt, tmp_path / "out", model=WideDeep())
    export = load_export(tmp_path / "out")
    with FakeCuda():
        served = export.load_into(on_fake_cuda(WideDeep()))
        assert all(b.device.type == "cuda" for b in served.buffers())
        with torch.no_grad():
            got = served(*(t.cuda() for t in inputs)).cpu()
    assert torch.equal(got, expected)


def test_row_lookup_bag_leaves_padding_out_of_means_and_maxima() -> None:
    rows = torch.tensor([[1.0, -4.0], [3.0, -2.0]])
    for mode, want in (("mean", [[2.0, -3.0], [1.0, -4.0], [0.0, 0.0]]), ("max", [[3.0, -2.0], [1.0, -4.0], [0.0, 0.0]])):
        bag = RowLookupBag(torch.tensor([10, 11]), rows, mode=mode, padding_id=-1)
        assert bag(torch.tensor([[10, 11, -1], [10, -1, -1], [-1, -1, -1]])).tolist() == want


def test_load_model_takes_a_module_or_a_file_and_names_a_bad_spec(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text("from torch import nn\n\ndef build():\n    return nn.Linear(2, 1)\n\ndef nothing():\n    return 3\n")
    assert isinstance(load_model(f"{tmp_path / 'mine.py'}:build"), nn.Linear)
    assert isinstance(load_model("torch.nn:Identity"), nn.Identity)
    for spec, message in (("mine", "must be module:function or file.py:function, got 'mine'"),
                          (f"{tmp_path / 'missing.py'}:build", "no file"),
                          ("no_such_module_here:build", "cannot import no_such_module_here"),
                          (f"{tmp_path / 'mine.py'}:absent", "has no function 'absent'"),
                          (f"{tmp_path / 'mine.py'}:nothing", "returned int, not a torch.nn.Module")):
        with pytest.raises(ValueError, match=message):
            load_model(spec)


def test_the_export_command_names_dense_parameters_with_model(tmp_path: Path, wide_export: Wide) -> None:
    ckpt, _, _ = wide_export
    run = subprocess.run([sys.executable, "-m", "tether.deploy.cli", "export", "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "o"),
                          "--model", f"{Path(__file__)}:WideDeep"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["dense_layout"] == "parameters" and "hidden.weight" in manifest["dense_shapes"]
    bad = subprocess.run([sys.executable, "-m", "tether.deploy.cli", "export", "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "b"),
                          "--model", "no_such_module_here:build"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "no_such_module_here" in bad.stderr


def test_a_tables_only_export_loads_with_dense_false_and_keeps_the_models_dense(tmp_path: Path, wide_export: Wide) -> None:
    ckpt, inputs, expected = wide_export
    export_checkpoint(ckpt, tmp_path / "flat")
    full = load_export(tmp_path / "flat")
    tables_only = dataclasses.replace(full, dense={})  # what a sync job's export holds
    with pytest.raises(ValueError, match=r"the export none .*load_into\(model, dense=False\)"):
        tables_only.load_into(WideDeep())
    trained = WideDeep()
    full.load_into(trained)  # the dense values a sync rank would have saved itself
    model = WideDeep()
    saved = dict(trained.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(saved[name])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    served = tables_only.load_into(model, dense=False)
    assert isinstance(served.user, RowLookupBag) and isinstance(served.items, RowLookupBag)
    assert all(torch.equal(p, before[n]) for n, p in served.named_parameters())
    with torch.no_grad():
        assert torch.equal(served(*inputs), expected)
