"""Ids as teams have them: any int64 value (negative 64-bit hashes, INT64_MIN, INT64_MAX) and
ids of any integer dtype train through the public API; a table the forward looks up that
``sparse(batch)`` did not name stops the first step with one line (issue 24, rows 6 and 2)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_client
from torch import nn

from tether.deploy.launch import LocalCluster
from tether.protos.errors import UsageError
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig
from tether.server.serving.serve import RunningShard, start_shard
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.trainer import Trainer

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SGD = OptimizerConfig("sgd", 1.0)


def _string_hash(s: str) -> int:
    """A signed 64-bit hash of a string, as feature pipelines make them (half are negative)."""
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little", signed=True)


def _edge_ids() -> torch.Tensor:
    hashes = [_string_hash(f"user:{k}") for k in range(200)]
    ids = torch.tensor([INT64_MIN, INT64_MIN + 1, -2, -1, 0, 1, INT64_MAX - 1, INT64_MAX, *hashes])
    assert (ids < 0).sum() > 50 and len(torch.unique(ids)) == len(ids)
    return ids


def test_ids_at_the_edges_of_int64_pull_push_and_pull_again_on_shard_processes(cluster: LocalCluster) -> None:
    addresses = cluster.start_shards(2)
    client = make_client(addresses)
    client.declare([
        TableConfig("h", 3, SGD, init_scale=0.5),
        TableConfig("adagrad", 3, OptimizerConfig("adagrad", 0.1), init_scale=0.5),
        TableConfig("bounded", 3, SGD, init_scale=0.5, capacity=64),
    ])
    ids = _edge_ids()
    start = client.pull({"h": ids, "adagrad": ids}).result(30).rows
    # Every id has a row of its own (the initial rows are hashed from the id: all distinct).
    assert len(torch.unique(start["h"], dim=0)) == len(ids)
    # Both shards own some of them: negative ids are partitioned like the others.
    assert all(t.rows > 0 for info in client.info() for t in info.tables if t.name == "h")
    grads = torch.arange(len(ids) * 3, dtype=torch.float32).reshape(-1, 3) / 1000
    client.push({"h": (ids, grads), "adagrad": (ids, grads)}).result(30)
    again = client.pull({"h": ids.flip(0), "adagrad": ids}).result(30).rows
    assert torch.equal(again["h"].flip(0), start["h"] - grads)
    # Adagrad's first step moves each element by lr against its gradient's sign: each id's row
    # took its own step, from its own state.
    assert torch.allclose(again["adagrad"] - start["adagrad"], -0.1 * torch.sign(grads), atol=1e-6)
    # A bounded table evicts and re-admits negative ids like any others.
    for k in range(0, len(ids), 40):
        client.pull({"bounded": ids[k : k + 40]}).result(30)
    last = ids[-32:]
    before = client.pull({"bounded": last}).result(30).rows["bounded"]
    client.push({"bounded": (last, torch.ones(32, 3))}).result(30)
    assert torch.equal(client.pull({"bounded": last}).result(30).rows["bounded"], before - 1)
    assert sum(t.rows for info in client.info() for t in info.tables if t.name == "h") == len(ids)
    client.close()


def _start(n: int, root: Path) -> list[RunningShard]:
    return [start_shard(ShardConfig(port=0, shard_index=i, num_shards=n, checkpoint_dir=str(root))) for i in range(n)]


def test_negative_ids_come_back_from_a_checkpoint_into_another_shard_count(tmp_path: Path) -> None:
    ids = _edge_ids()
    shards = _start(2, tmp_path)
    client = make_client([f"127.0.0.1:{s.port}" for s in shards], "w")
    client.declare([TableConfig("h", 3, OptimizerConfig("adagrad", 0.1), init_scale=0.5)])
    client.pull({"h": ids}).result(30)
    client.push({"h": (ids, torch.randn(len(ids), 3, generator=torch.Generator().manual_seed(0)))}).result(30)
    before = client.pull({"h": ids}).result(30).rows["h"]
    client.checkpoint("c1")
    client.close()
    for s in shards:
        s.stop(0)
    shards = _start(3, tmp_path)
    client = make_client([f"127.0.0.1:{s.port}" for s in shards], "w2")
    assert sum(t.rows for info in client.info() for t in info.tables if t.name == "h") == len(ids)
    client.declare([TableConfig("h", 3, OptimizerConfig("adagrad", 0.1), init_scale=0.5)])
    assert torch.equal(client.pull({"h": ids}).result(30).rows["h"], before)
    client.close()
    for s in shards:
        s.stop(0)


DIM = 4


class MF(nn.Module):
    """rating ~ <user, item>, each id looked up in its table."""

    def __init__(self, embedding=ShardedEmbeddingBag) -> None:
        super().__init__()
        self.user = embedding("users", DIM)
        self.item = embedding("items", DIM)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.user(batch["user"]) * self.item(batch["item"])).sum(1)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch), batch["rating"])


def _both(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"users": batch["user"], "items": batch["item"]}


def _batches(users: torch.Tensor, items: torch.Tensor, n: int = 12, size: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {
            "user": users[torch.randint(0, len(users), (size,), generator=g)],
            "item": items[torch.randint(0, len(items), (size,), generator=g)],
            "rating": torch.randn(size, generator=g),
        }
        for _ in range(n)
    ]


class _Local(nn.Module):
    """An in-process embedding over the given sorted ids, for the reference run."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        super().__init__()
        self.ids = ids
        self.weight = nn.Parameter(rows.clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[torch.searchsorted(self.ids, ids)]


def _config(addresses: list[str]) -> TrainingConfig:
    return TrainingConfig(shards=tuple(addresses), optimizer="sgd", lr=0.5, prefetch=False, log_every=100, init_scale=0.3, device="cpu")


def test_negative_hashed_ids_train_like_torch_in_one_process(cluster: LocalCluster) -> None:
    addresses = cluster.start_shards(2)
    users = _edge_ids()[:40]  # the int64 edges and negative hashes
    items = torch.tensor([_string_hash(f"item:{k}") for k in range(30)] + [INT64_MIN, INT64_MAX])
    batches = _batches(users, items)
    user_ids, item_ids = torch.unique(users), torch.unique(items)
    with Trainer(MF(), _config(addresses), loss=_loss, sparse=_both, printer=lambda line: None) as trainer:
        start = trainer.client.pull({"users": user_ids, "items": item_ids}).result(30).rows
        record = trainer.fit(batches, background=False)
        final = trainer.client.pull({"users": user_ids, "items": item_ids}).result(30).rows
    assert record["steps"] == len(batches)
    ref = MF(lambda name, dim: _Local(user_ids, start["users"]) if name == "users" else _Local(item_ids, start["items"]))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for b in batches:
        opt.zero_grad()
        _loss(ref, b).backward()
        opt.step()
    assert torch.allclose(final["users"], ref.user.weight.detach(), atol=1e-5)
    assert torch.allclose(final["items"], ref.item.weight.detach(), atol=1e-5)
    assert (final["users"] - start["users"]).abs().max() > 0.01


@pytest.fixture
def fresh_shard():
    """A factory of in-process shards (each run starts from untouched tables)."""
    started: list[RunningShard] = []

    def make() -> str:
        started.append(start_shard(ShardConfig(host="127.0.0.1", port=0)))
        return f"127.0.0.1:{started[-1].port}"

    yield make
    for s in started:
        s.stop(0)


def _train(address: str, batches: list[dict[str, torch.Tensor]], user_ids: torch.Tensor, item_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with Trainer(MF(), _config([address]), loss=_loss, sparse=_both, printer=lambda line: None) as trainer:
        trainer.fit(batches, background=False)
        return trainer.client.pull({"users": user_ids, "items": item_ids}).result(30).rows


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_narrow_integer_ids_train_the_same_rows_as_int64(fresh_shard, dtype: torch.dtype) -> None:
    users = torch.arange(0, 200, 7)  # fits every dtype tested
    items = torch.arange(3, 250, 11)
    batches = _batches(users, items)
    narrow = [{**b, "user": b["user"].to(dtype), "item": b["item"].to(dtype)} for b in batches]
    assert narrow[0]["user"].dtype == dtype
    expected = _train(fresh_shard(), batches, users, items)
    got = _train(fresh_shard(), narrow, users, items)
    for table in ("users", "items"):
        assert torch.equal(got[table], expected[table]), table


def test_float_ids_are_refused_with_one_line_naming_the_table(fresh_shard) -> None:
    batches = _batches(torch.arange(5), torch.arange(5), n=2)
    floats = [{**b, "item": b["item"].to(torch.float32)} for b in batches]
    with Trainer(MF(), _config([fresh_shard()]), loss=_loss, sparse=_both, printer=lambda line: None) as trainer:
        with pytest.raises(UsageError, match=r"^table 'items': ids must be integers, got a torch.float32 tensor$"):
            trainer.fit(floats, background=False)


def test_a_table_left_out_of_sparse_stops_the_first_step_with_one_line(cluster: LocalCluster) -> None:
    addresses = cluster.start_shards(1)
    batches = _batches(torch.arange(10), torch.arange(10), n=3)
    with Trainer(MF(), _config(addresses), loss=_loss, sparse=lambda b: {"users": b["user"]}, printer=lambda line: None) as trainer:
        with pytest.raises(UsageError) as err:
            trainer.fit(batches, background=False)
        versions = {t.name: t.version for info in trainer.client.info() for t in info.tables}
    assert str(err.value) == "table 'items' was looked up by the forward pass but sparse(batch) did not name it: add 'items': <its ids> to sparse"
    assert versions == {"users": 0, "items": 0}  # nothing was pushed


def test_admission_eviction_and_snapshots_of_a_table_take_negative_ids() -> None:
    from tether.server.storage.tables import EmbeddingTable

    ids = np.sort(_edge_ids().numpy())
    # Admission (count-min sketch of the ids' 64 bits): a row exists from the second touch.
    admitted = EmbeddingTable(TableConfig("a", 2, SGD, init_scale=0.5, min_count=2))
    first, _ = admitted.pull(ids)
    assert admitted.rows == 0
    again, _ = admitted.pull(ids)
    assert admitted.rows == len(ids) and torch.equal(first, again)
    admitted.push(ids, torch.ones(len(ids), 2))
    assert torch.equal(admitted.pull(ids)[0], first - 1)
    # Eviction: the least recently touched go, negative or not; a re-touched id comes back.
    bounded = EmbeddingTable(TableConfig("b", 2, SGD, init_scale=0.5, capacity=16))
    for k in range(0, len(ids), 8):
        bounded.pull(ids[k : k + 8])
    assert bounded.rows <= 16 and bounded.evicted_rows > 0
    edges = np.array([INT64_MIN, -2, -1, INT64_MAX], dtype=np.int64)
    before, _ = bounded.pull(edges)
    bounded.push(edges, torch.ones(4, 2))
    assert torch.equal(bounded.pull(edges)[0], before - 1)
    # A snapshot is sorted by signed id and loads back.
    snap = admitted.snapshot()
    assert snap["ids"].tolist() == sorted(ids.tolist()) and snap["ids"][0] == INT64_MIN and snap["ids"][-1] == INT64_MAX
    restored = EmbeddingTable(TableConfig("a", 2, SGD, init_scale=0.5, min_count=2))
    restored.load(snap["ids"], snap["weights"], snap["state"], snap["version"])
    assert torch.equal(restored.pull(ids)[0], first - 1)
