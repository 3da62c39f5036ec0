"""ShardedEmbeddingBag and PSModel against a real in-process shard."""

import pytest
import torch

from tether.protos.errors import InvalidArgument
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.embedding import PSModel, ShardedEmbeddingBag

from conftest import make_client

SGD = OptimizerConfig("sgd", 1.0)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = ShardedEmbeddingBag("e", 2, mode="sum")
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.bag(ids) * self.scale).sum()


def test_backward_collects_row_gradients_and_push_applies_them(inproc_shard) -> None:
    client = make_client([f"127.0.0.1:{inproc_shard.port}"])
    model = Tiny()
    ps = PSModel(model, client, torch.device("cpu"))
    client.declare([TableConfig("e", 2, SGD, init_scale=0.0)], ps.dense_tensors(), SGD)
    ids = torch.tensor([[5, 7], [5, 9]])  # bags of two ids; id 5 appears twice
    pulled = ps.install(ps.prefetch({"e": ids}))
    assert set(pulled.rows) == {"e"} and pulled.dense["dense"].tolist() == [1.0]
    model(ids).backward()
    sparse, dense = ps.gradients()
    got_ids, grads = sparse["e"]
    assert got_ids.tolist() == [5, 7, 9]
    assert grads.tolist() == [[2.0, 2.0], [1.0, 1.0], [1.0, 1.0]]
    ps.push(clock=1, versions=pulled).result(10)
    rows = client.pull({"e": torch.tensor([5, 7, 9])}).result(10).rows["e"]
    assert rows.tolist() == [[-2.0, -2.0], [-1.0, -1.0], [-1.0, -1.0]]
    client.close()


def test_unbound_ids_are_fetched_for_inference(inproc_shard) -> None:
    client = make_client([f"127.0.0.1:{inproc_shard.port}"])
    model = Tiny()
    ps = PSModel(model, client, torch.device("cpu"))
    client.declare([TableConfig("e", 2, SGD, init_scale=0.0)], ps.dense_tensors(), SGD)
    with torch.no_grad():
        assert model(torch.tensor([1, 2, 3])).item() == 0.0
    with pytest.raises(InvalidArgument, match="ids must be int64"):
        model.bag(torch.tensor([1.0]))
    client.close()


def test_bag_modes() -> None:
    with pytest.raises(ValueError, match="mode must be sum, mean or max"):
        ShardedEmbeddingBag("e", 2, mode="median")
    bag = ShardedEmbeddingBag("e", 2, mode="mean")
    bag.bind(torch.tensor([1, 2]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert bag(torch.tensor([[1, 2]])).tolist() == [[2.0, 3.0]]
    bag.mode = "max"
    assert bag(torch.tensor([[1, 2]])).tolist() == [[3.0, 4.0]]


def test_unique_columns_matches_torch_unique() -> None:
    from tether.worker.embedding import unique_columns

    ids = torch.randint(0, 40, (5, 300), generator=torch.Generator().manual_seed(0))
    unique, counts, inverse = unique_columns(ids)
    for row, part in zip(ids, torch.split(unique, counts)):
        assert torch.equal(part, torch.unique(row))
    assert torch.equal(unique[inverse], ids)


def test_fused_lookup_matches_per_table_lookup_and_gradients(inproc_shard) -> None:
    from tether.worker.model import CTRModel

    client = make_client([f"127.0.0.1:{inproc_shard.port}"])
    torch.manual_seed(0)
    model = CTRModel(3, 4, embedding_dim=2, embedding_factory=lambda name, dim: ShardedEmbeddingBag(name, dim))
    ps = PSModel(model, client, torch.device("cpu"))
    client.declare([TableConfig(t, 2, SGD, init_scale=0.5) for t in model.table_names()], ps.dense_tensors(), SGD)
    dense = torch.randn(6, 3)
    sparse = torch.randint(0, 5, (6, 4), generator=torch.Generator().manual_seed(1))
    runs = []
    for fused in (True, False):
        ps.install(ps.prefetch({f"cat_{j}": sparse[:, j] for j in range(4)}))
        if not fused:
            model.fused_lookup = None
        out = model(dense, sparse)
        out.sum().backward()
        runs.append((out.detach(), ps.gradients()))
        ps._clear()
    (out_f, (sparse_f, dense_f)), (out_t, (sparse_t, dense_t)) = runs
    assert torch.allclose(out_f, out_t)
    assert sparse_f.keys() == sparse_t.keys() == {f"cat_{j}" for j in range(4)}
    for t in sparse_f:
        assert torch.equal(sparse_f[t][0], sparse_t[t][0]) and torch.allclose(sparse_f[t][1], sparse_t[t][1])
    assert torch.allclose(dense_f["dense"], dense_t["dense"])
    client.close()
