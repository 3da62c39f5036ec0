"""ShardedEmbeddingBag and PSModel against a real in-process shard."""

import pytest
import torch
from conftest import make_client

from tether.protos.errors import InvalidArgument, UsageError
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.training.embedding import PSModel
from tether.worker.training.embedding_bag import ShardedEmbeddingBag

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
    sparse, _dense = ps.gradients()
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
    with pytest.raises(UsageError, match=r"^table 'e': ids must be integers, got a torch.float32 tensor$"):
        model.bag(torch.tensor([1.0]))
    with pytest.raises(UsageError, match=r"^table 'e': ids must be integers, got a torch.bool tensor$"):
        model.bag(torch.tensor([True]))
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
    from tether.worker.training.transfer import unique_columns

    ids = torch.randint(0, 40, (5, 300), generator=torch.Generator().manual_seed(0))
    unique, counts, inverse = unique_columns(ids)
    for row, part in zip(ids, torch.split(unique, counts), strict=False):
        assert torch.equal(part, torch.unique(row))
    assert torch.equal(unique[inverse], ids)


def test_fused_lookup_matches_per_table_lookup_and_gradients(inproc_shard) -> None:
    from tether.worker.ctr.model import CTRModel

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


def _bound(mode: str, padding_id: int | None = None) -> tuple[ShardedEmbeddingBag, torch.Tensor, torch.Tensor, torch.nn.EmbeddingBag]:
    """A bag bound to 6 rows of sorted ids [3, 10, 20, 41, 77, 2**40] and the same rows in torch's
    EmbeddingBag (row k of the table is id k of that list)."""
    torch.manual_seed(0)
    ids = torch.tensor([3, 10, 20, 41, 77, 2**40])
    weight = torch.randn(6, 4)
    rows = weight.clone().requires_grad_(True)
    bag = ShardedEmbeddingBag("e", 4, mode=mode, padding_id=padding_id)
    bag.bind(ids, rows)
    ref = torch.nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, mode=mode)
    return bag, rows, ids, ref


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_variable_length_bags_match_torch_embedding_bag(mode: str) -> None:
    bag, rows, ids, ref = _bound(mode)
    local = torch.tensor([0, 2, 2, 5, 3, 1, 4, 0])  # row numbers
    offsets = torch.tensor([0, 3, 4, 7])  # bags of 3, 1, 3 and 1 ids
    out = bag(ids[local], offsets)
    expected = ref(local, offsets)
    assert torch.allclose(out, expected, atol=1e-6)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out)
    assert torch.allclose(rows.grad, ref.weight.grad, atol=1e-6)


def test_per_sample_weights_match_torch_embedding_bag() -> None:
    bag, rows, ids, ref = _bound("sum")
    local = torch.tensor([1, 2, 5, 5, 0])
    offsets = torch.tensor([0, 2])
    weights = torch.tensor([0.5, 2.0, -1.0, 3.0, 0.25])
    out = bag(ids[local], offsets, per_sample_weights=weights)
    expected = ref(local, offsets, per_sample_weights=weights)
    assert torch.allclose(out, expected, atol=1e-6)
    out.sum().backward()
    expected.sum().backward()
    assert torch.allclose(rows.grad, ref.weight.grad, atol=1e-6)
    # [B, L] bags with weights of the same shape are the same bags.
    two_d = bag(ids[torch.tensor([[1, 2], [5, 0]])], per_sample_weights=torch.tensor([[0.5, 2.0], [3.0, 0.25]]))
    assert torch.allclose(two_d, ref(torch.tensor([[1, 2], [5, 0]]), per_sample_weights=torch.tensor([[0.5, 2.0], [3.0, 0.25]])), atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_padding_ids_are_ignored(mode: str) -> None:
    pad = 2**62
    bag, rows, ids, ref = _bound(mode, padding_id=pad)
    padded = torch.tensor([[int(ids[0]), pad, int(ids[4])], [pad, pad, pad], [int(ids[5]), pad, pad]])
    out = bag(padded)
    assert torch.allclose(out[0], ref(torch.tensor([[0, 4]]))[0], atol=1e-6)  # the mean counts 2 ids, not 3
    assert torch.equal(out[1], torch.zeros(4))
    assert torch.allclose(out[2], rows[5].detach(), atol=1e-6)
    out.sum().backward()
    assert rows.grad[[1, 2, 3]].abs().sum() == 0  # rows never named get nothing
    # Padding is not pulled: PSModel asks only for the ids that need a row.
    assert bag.wanted(padded).tolist() == [int(ids[0]), int(ids[4]), int(ids[5])]


def test_features_sharing_a_table_are_all_bound_and_their_gradients_add_up(inproc_shard) -> None:
    class TwoFeatures(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user_history = ShardedEmbeddingBag("items", 2, mode="sum")
            self.candidate = ShardedEmbeddingBag("items", 2)

        def forward(self, history: torch.Tensor, offsets: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
            return (self.user_history(history, offsets) * self.candidate(item)).sum()

    client = make_client([f"127.0.0.1:{inproc_shard.port}"])
    model = TwoFeatures()
    ps = PSModel(model, client, torch.device("cpu"))
    client.declare([TableConfig("items", 2, SGD, init_scale=0.0)])
    history, offsets, item = torch.tensor([4, 6, 6]), torch.tensor([0]), torch.tensor([6])
    pulled = ps.install(ps.prefetch({"items": [history, item]}))
    # Rows at 0 (init_scale 0): move them to 1 locally so the product has a gradient.
    with torch.no_grad():
        ps._rows.fill_(1.0)
    model(history, offsets, item).backward()
    sparse, _ = ps.gradients()
    got_ids, grads = sparse["items"]
    assert got_ids.tolist() == [4, 6]
    # d/d(row 4) = candidate = 1; d/d(row 6) = 2 * candidate (twice in the history) + history sum (3) = 5.
    assert grads.tolist() == [[1.0, 1.0], [5.0, 5.0]]
    assert pulled.rows["items"].shape == (2, 2)
    client.close()


class TwoTables(torch.nn.Module):
    """Two tables, each looked up by every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.user = ShardedEmbeddingBag("users", 2)
        self.item = ShardedEmbeddingBag("items", 2)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return (self.user(user) * self.item(item)).sum()


def _two_tables(port: int) -> tuple[TwoTables, PSModel]:
    client = make_client([f"127.0.0.1:{port}"])
    model = TwoTables()
    ps = PSModel(model, client, torch.device("cpu"))
    client.declare([TableConfig(t, 2, SGD, init_scale=0.5) for t in ("users", "items")])
    return model, ps


NOT_NAMED = r"^table 'items' was looked up by the forward pass but sparse\(batch\) did not name it: add 'items': <its ids> to sparse$"


def test_a_training_forward_of_a_table_sparse_did_not_name_stops_with_one_line(inproc_shard) -> None:
    model, ps = _two_tables(inproc_shard.port)
    user, item = torch.tensor([1, 2]), torch.tensor([7, 8])
    # The first step: nothing was ever bound to "items".
    ps.install(ps.prefetch({"users": user}))
    with pytest.raises(UsageError, match=NOT_NAMED):
        model(user, item)
    # A step that named both, then one that names only "users": the stale "items" rows of the
    # step before are not looked up.
    ps.install(ps.prefetch({"users": user, "items": item}))
    model(user, item).backward()
    ps._clear()
    ps.install(ps.prefetch({"users": user}))
    with pytest.raises(UsageError, match=NOT_NAMED):
        model(user, item)
    ps.client.close()


def test_outside_a_training_step_tables_not_named_are_pulled_on_demand(inproc_shard) -> None:
    model, ps = _two_tables(inproc_shard.port)
    user, item = torch.tensor([1, 2]), torch.tensor([7, 8])
    full = ps.install(ps.prefetch({"users": user, "items": item}), train=False)
    with torch.no_grad():
        expected = model(user, item)
    # Evaluation (train=False) pulls what sparse did not name.
    ps.install(ps.prefetch({"users": user}), train=False)
    assert torch.allclose(model(user, item), expected)
    # In a training step, a forward without autograd (nothing to push) may pull on demand too,
    # and leaves the step's rows bound.
    ps.install(ps.prefetch({"users": user}))
    with torch.no_grad():
        assert torch.allclose(model(user, item), expected)
    with pytest.raises(UsageError, match=NOT_NAMED):
        model(user, item)
    assert full.rows["items"].shape == (2, 2)
    ps.client.close()


def test_ids_of_a_named_table_that_sparse_left_out_stop_a_training_step(inproc_shard) -> None:
    model, ps = _two_tables(inproc_shard.port)
    ps.install(ps.prefetch({"users": torch.tensor([1, 2]), "items": torch.tensor([7])}))
    with pytest.raises(UsageError, match=r"^table 'items': the forward pass looked up 1 id\(s\) that sparse\(batch\) did not name \(id 8 for one\)"):
        model(torch.tensor([1, 2]), torch.tensor([7, 8]))
    ps.client.close()


def test_a_table_named_in_sparse_but_not_looked_up_is_fine(inproc_shard) -> None:
    client = make_client([f"127.0.0.1:{inproc_shard.port}"])
    model = Tiny()
    ps = PSModel(model, client, torch.device("cpu"))

    class Other(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unused = ShardedEmbeddingBag("unused", 2)

    holder = torch.nn.ModuleDict({"tiny": model, "other": Other()})
    ps = PSModel(holder, client, torch.device("cpu"))
    client.declare([TableConfig(t, 2, SGD, init_scale=0.0) for t in ("e", "unused")], ps.dense_tensors(), SGD)
    ids = torch.tensor([5, 7])
    pulled = ps.install(ps.prefetch({"e": ids, "unused": torch.tensor([3])}))
    model(ids).backward()
    ps.push(clock=1, versions=pulled).result(10)
    rows = client.pull({"e": ids, "unused": torch.tensor([3])}).result(10).rows
    assert rows["e"].tolist() == [[-1.0, -1.0], [-1.0, -1.0]] and rows["unused"].tolist() == [[0.0, 0.0]]
    client.close()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.int8])
def test_narrow_integer_ids_are_the_same_ids_as_int64(inproc_shard, dtype: torch.dtype) -> None:
    client = make_client([f"127.0.0.1:{inproc_shard.port}"])
    model = Tiny()
    ps = PSModel(model, client, torch.device("cpu"))
    client.declare([TableConfig("e", 2, SGD, init_scale=0.0)], ps.dense_tensors(), SGD)
    ids = torch.tensor([[5, 7], [5, 9]])
    pulled = ps.install(ps.prefetch({"e": ids.to(dtype)}))
    assert ps._groups[0][1][0][1].dtype == torch.int64
    model(ids.to(dtype)).backward()
    sparse, _ = ps.gradients()
    assert sparse["e"][0].tolist() == [5, 7, 9] and sparse["e"][0].dtype == torch.int64
    assert sparse["e"][1].tolist() == [[2.0, 2.0], [1.0, 1.0], [1.0, 1.0]]
    ps.push(clock=1, versions=pulled).result(10)
    # The client widens too: int32 ids pull the rows int64 ids name.
    assert torch.equal(client.pull({"e": torch.tensor([5, 7, 9], dtype=dtype)}).result(10).rows["e"],
                       client.pull({"e": torch.tensor([5, 7, 9])}).result(10).rows["e"])
    with pytest.raises(UsageError, match=r"^table 'e': ids must be integers, got a torch.float64 tensor$"):
        ps.prefetch({"e": ids.to(torch.float64)})
    with pytest.raises(InvalidArgument, match=r"table 'e': ids must be integers, got a torch.bool tensor"):
        client.pull({"e": torch.tensor([True])})
    client.close()


def test_negative_ids_and_padding_in_a_bag() -> None:
    pad = -1
    bag = ShardedEmbeddingBag("e", 2, mode="sum", padding_id=pad)
    ids = torch.tensor([-(2**63), -5, 2**63 - 1])
    bag.bind(ids, torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]]))
    out = bag(torch.tensor([[-(2**63), -1, 2**63 - 1], [-5, -1, -1], [-1, -1, -1]]))
    assert out.tolist() == [[5.0, 5.0], [2.0, 2.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match=r"padding_id must be None or an int64 id, got 9223372036854775808"):
        ShardedEmbeddingBag("e", 2, padding_id=2**63)


def test_after_release_forwards_pull_what_they_look_up(inproc_shard) -> None:
    model, ps = _two_tables(inproc_shard.port)
    user, item = torch.tensor([1, 2]), torch.tensor([7, 8])
    ps.install(ps.prefetch({"users": user}))
    with pytest.raises(UsageError, match=NOT_NAMED):
        model(user, item)
    ps.release()  # what the trainer does once training ends
    rows = ps.client.pull({"users": user, "items": item}).result(10).rows
    assert torch.allclose(model(user, item), (rows["users"] * rows["items"]).sum())
    ps.client.close()


class WithDense(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = ShardedEmbeddingBag("tokens", 2, mode="mean")
        self.tower = torch.nn.Linear(3, 2)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.bag(b["ids"]) + self.tower(b["dense"])).sum(1)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_nan_in_a_dense_feature_stops_training_naming_the_step_and_table(prefetch: bool) -> None:
    """A NaN in a batch's dense features makes the loss and every gradient NaN: training stops at
    that step with one UsageError naming the step, the table and the likely cause, raised on the
    worker before the push (not a shard's 'gradients contain NaN or Inf' a step later)."""
    from tether.worker.config import TrainingConfig
    from tether.worker.training.trainer import Trainer

    batches = [{"ids": torch.tensor([[1, 2], [3, 4]]), "dense": torch.ones(2, 3)} for _ in range(5)]
    batches[2]["dense"][1, 0] = float("nan")
    config = TrainingConfig(shards=(), local=True, steps=5, prefetch=prefetch, device="cpu", log_every=100)
    trainer = Trainer(WithDense(), config, loss=lambda m, b: m(b).pow(2).mean(), sparse=lambda b: {"tokens": b["ids"]},
                      printer=lambda line: None)
    with trainer, pytest.raises(UsageError) as raised:
        trainer.fit(batches)
    assert str(raised.value) == (
        "step 3: the gradients of table 'tokens' contain NaN or Inf, so the step's loss or its inputs (a dense feature, "
        "a label) were not finite; caught on this worker before the step's push, nothing of it was sent"
    )
    # Steps 1 and 2 were applied; step 3's rows were not moved by a NaN.
    rows = trainer.client.pull({"tokens": torch.tensor([1, 2, 3, 4])}).result(10).rows["tokens"]
    assert bool(torch.isfinite(rows).all())


def test_check_finite_names_the_dense_parameters_and_passes_finite_gradients() -> None:
    from tether.worker.training.embedding import check_finite

    ok = {"e": (torch.tensor([1]), torch.ones(1, 2))}
    check_finite(4, ok, {"dense": torch.full((3,), 3e38)})  # a sum that overflows is still finite
    with pytest.raises(UsageError, match=r"^step 4: the gradients of the dense parameters contain NaN or Inf"):
        check_finite(4, ok, {"dense": torch.tensor([0.0, float("inf")])})
