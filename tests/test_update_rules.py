"""Row-wise Adagrad and FTRL-Proximal, row by row against references written from their
definitions (NumPy, float64): row-wise Adagrad from FBGEMM's EXACT_ROWWISE_ADAGRAD (duplicate ids
summed, then one step), FTRL from Algorithm 1 of McMahan et al. 2013 transcribed per coordinate.
Both forms are checked: the shard's compiled row kernel (a table's push) and the torch form (what
local mode applies), over several random sparse pushes, to 1e-6."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tether.protos.errors import InvalidArgument
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.optimizers import rule
from tether.server.storage.dense import DenseChunk
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import SparseUpdate
from tether.server.storage.tables import EmbeddingTable

DIM, POOL, STEPS = 8, 60, 8


def rowwise_reference(w: np.ndarray, acc: np.ndarray, ids: np.ndarray, grads: np.ndarray, cfg: OptimizerConfig) -> None:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD on rows ``ids`` of ``w`` (float64, in place): the gradients of
    an id named more than once are summed first, then each id is stepped once."""
    unique, where = np.unique(ids, return_inverse=True)
    summed = np.zeros((len(unique), w.shape[1]))
    np.add.at(summed, where, grads)
    for k, i in enumerate(unique):
        g = summed[k] + cfg.weight_decay * w[i]
        acc[i] += np.mean(g * g)
        w[i] -= cfg.lr * g / (math.sqrt(acc[i]) + cfg.eps)


class FtrlReference:
    """Algorithm 1 of the paper per coordinate, float64: ``w`` is computed from ``z`` and ``n``
    when a coordinate is used (the rows start at w = 0: z = 0), then ``sigma``, ``z`` and ``n``
    take the gradient. ``lr_power`` other than -0.5 is TensorFlow's generalisation."""

    def __init__(self, rows: int, dim: int, cfg: OptimizerConfig) -> None:
        self.cfg = cfg
        self.z = np.zeros((rows, dim))
        self.n = np.full((rows, dim), cfg.initial_accumulator)

    def weight(self, i: int, j: int) -> float:
        c, z, n = self.cfg, self.z[i, j], self.n[i, j]
        if abs(z) <= c.l1:
            return 0.0
        return -(z - math.copysign(c.l1, z)) / ((c.beta + n ** -c.lr_power) / c.lr + c.l2)

    def push(self, ids: np.ndarray, grads: np.ndarray) -> None:
        c = self.cfg
        for k, i in enumerate(ids):
            for j in range(grads.shape[1]):
                w = self.weight(i, j)
                g = grads[k, j] + c.weight_decay * w
                sigma = ((self.n[i, j] + g * g) ** -c.lr_power - self.n[i, j] ** -c.lr_power) / c.lr
                self.z[i, j] += g - sigma * w
                self.n[i, j] += g * g

    def weights(self) -> np.ndarray:
        return np.array([[self.weight(i, j) for j in range(self.z.shape[1])] for i in range(self.z.shape[0])])


def _pushes(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random sparse pushes: unique ids drawn from the pool, gradients from 1e-3 to 1."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        ids = np.sort(rng.choice(POOL, size=int(rng.integers(5, POOL)), replace=False)).astype(np.int64)
        grads = rng.standard_normal((len(ids), DIM)) * 10.0 ** rng.uniform(-3, 0, (len(ids), 1))
        out.append((ids, grads.astype(np.float32)))
    return out


def _torch_form(cfg: OptimizerConfig, w0: torch.Tensor, pushes: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, dict]:
    """The rule's torch form on gathered rows, as local mode applies it."""
    r = rule(cfg.name)
    w = w0.clone()
    state = {k: torch.full((len(w0), *s), r.initial_state(cfg).get(k, 0.0)) for k, s in r.state_shapes(DIM).items()}
    for ids, grads in pushes:
        idx = torch.from_numpy(ids)
        rows, st = w[idx], {k: t[idx] for k, t in state.items()}
        r.apply(cfg, rows, torch.from_numpy(grads), st)
        w[idx] = rows
        for k, t in state.items():
            t[idx] = st[k]
    return w, state


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("initial_accumulator", [0.0, 0.1])
def test_rowwise_adagrad_is_its_definition_row_by_row(weight_decay: float, initial_accumulator: float) -> None:
    cfg = OptimizerConfig("rowwise_adagrad", lr=0.1, weight_decay=weight_decay, initial_accumulator=initial_accumulator)
    table = EmbeddingTable(TableConfig("t", DIM, cfg, init_scale=0.5, seed=3))
    ids_all = np.arange(POOL, dtype=np.int64)
    w0 = table.pull(ids_all)[0].clone()
    w_ref, acc_ref = w0.double().numpy().copy(), np.full(POOL, initial_accumulator)
    pushes = _pushes(1)
    for ids, grads in pushes:
        table.push(ids, torch.from_numpy(grads))
        rowwise_reference(w_ref, acc_ref, ids, grads.astype(np.float64), cfg)
    snap = table.snapshot()
    # One float of state per row: the accumulator.
    assert set(snap["state"]) == {"sum"} and tuple(snap["state"]["sum"].shape) == (POOL,)
    assert np.abs(snap["weights"].numpy() - w_ref).max() <= 1e-6
    assert np.abs(snap["state"]["sum"].numpy() - acc_ref).max() <= 1e-6 * acc_ref.max()
    w_torch, state_torch = _torch_form(cfg, w0, pushes)
    assert np.abs(w_torch.numpy() - w_ref).max() <= 1e-6
    assert np.abs(state_torch["sum"].numpy() - acc_ref).max() <= 1e-6 * acc_ref.max()
    assert np.abs(w_ref - w0.numpy()).max() > 0.05  # the rows moved


def test_rowwise_adagrad_sums_duplicate_ids_before_one_step() -> None:
    """FBGEMM's semantics for an id named twice: one step with the summed gradient, which is not
    two steps (the accumulator grows by mean((g1 + g2)**2), the row moves once). A shard refuses a
    push that names an id twice and changes nothing; the worker's path sums them first (see
    test_a_worker_sums_an_ids_lookups_into_one_rowwise_step)."""
    cfg = OptimizerConfig("rowwise_adagrad", lr=0.1)
    g = np.array([[1.0, -2.0, 0.5, 0.0], [0.5, 1.0, -1.0, 2.0]])
    w_once, acc_once = np.zeros((1, 4)), np.zeros(1)
    rowwise_reference(w_once, acc_once, np.array([0, 0]), g, cfg)
    assert acc_once[0] == pytest.approx(np.mean((g[0] + g[1]) ** 2))
    w_twice, acc_twice = np.zeros((1, 4)), np.zeros(1)
    for k in range(2):
        rowwise_reference(w_twice, acc_twice, np.array([0]), g[k:k + 1], cfg)
    assert np.abs(w_once - w_twice).max() > 0.01
    # The shard's table stepped once with the sum equals the reference.
    table = EmbeddingTable(TableConfig("t", 4, cfg, init_scale=0.0))
    table.push(np.array([7]), torch.from_numpy(g.sum(0, keepdims=True).astype(np.float32)))
    assert np.abs(table.pull(np.array([7]))[0].numpy() - w_once).max() <= 1e-6

    shard = Shard()
    shard.declare([TableConfig("t", 4, cfg, init_scale=0.0)], [])
    before = shard.tables["t"].snapshot()
    with pytest.raises(InvalidArgument, match="ids in one push must be unique"):
        shard.push("w", 1, [SparseUpdate("t", np.array([3, 3]), torch.ones(2, 4))], [], incarnation=1)
    after = shard.tables["t"].snapshot()
    assert after["version"] == before["version"] and np.array_equal(after["ids"], before["ids"])


_FTRL = [
    {"beta": 1.0, "l1": 0.5, "l2": 0.2},  # the paper's n0 = 0, with L1 zeroing weights
    {"beta": 0.0, "l1": 0.05, "l2": 0.0, "initial_accumulator": 0.1},  # TensorFlow's defaults
    {"beta": 0.5, "l1": 0.0, "l2": 1.0, "lr_power": -0.25, "weight_decay": 0.01},  # TF's lr_power
]


@pytest.mark.parametrize("constants", _FTRL, ids=["paper-l1", "tf-defaults", "lr-power"])
def test_ftrl_is_the_papers_algorithm_1_row_by_row(constants: dict) -> None:
    cfg = OptimizerConfig("ftrl", lr=0.1, **constants)
    # Rows start at the paper's w = 0 (init_scale 0).
    table = EmbeddingTable(TableConfig("t", DIM, cfg, init_scale=0.0))
    ids_all = np.arange(POOL, dtype=np.int64)
    w0 = table.pull(ids_all)[0].clone()
    ref = FtrlReference(POOL, DIM, cfg)
    pushes = _pushes(2)
    for ids, grads in pushes:
        table.push(ids, torch.from_numpy(grads))
        ref.push(ids, grads.astype(np.float64))
    w_ref = ref.weights()
    snap = table.snapshot()
    assert np.abs(snap["weights"].numpy() - w_ref).max() <= 1e-6
    for k, want in (("z", ref.z), ("n", ref.n)):
        assert np.abs(snap["state"][k].numpy() - want).max() <= 1e-6 * max(1.0, np.abs(want).max()), k
    w_torch, state_torch = _torch_form(cfg, w0, pushes)
    assert np.abs(w_torch.numpy() - w_ref).max() <= 1e-6
    assert np.abs(state_torch["z"].numpy() - ref.z).max() <= 1e-6 * max(1.0, np.abs(ref.z).max())
    # L1 keeps weights at exactly 0 where |z| <= l1; the others moved.
    moved = np.abs(w_ref) > 1e-3
    assert moved.any()
    if cfg.l1:
        zeroed = np.abs(ref.z) <= cfg.l1
        assert zeroed.any() and (snap["weights"].numpy()[zeroed] == 0).all()


def test_ftrl_starts_a_row_from_its_initial_value_as_a_tensorflow_variable() -> None:
    """With init_scale > 0 the first step reads the row's initial weight (z += g - sigma * w0),
    as TensorFlow's Ftrl does for a variable with an initial value; after it the weight is the
    function of z and n."""
    cfg = OptimizerConfig("ftrl", lr=0.1, initial_accumulator=0.1, beta=0.0)
    table = EmbeddingTable(TableConfig("t", 3, cfg, init_scale=0.5, seed=1))
    w0 = table.pull(np.array([4]))[0][0].double().numpy()
    g = np.array([0.3, -0.2, 0.0])
    table.push(np.array([4]), torch.from_numpy(g[None].astype(np.float32)))
    n1 = 0.1 + g * g
    z1 = g - (np.sqrt(n1) - np.sqrt(0.1)) / 0.1 * w0
    assert np.abs(table.pull(np.array([4]))[0][0].numpy() - (-z1 / (np.sqrt(n1) / 0.1))).max() <= 1e-6


def test_rowwise_adagrad_steps_dense_values_as_adagrad_and_refuses_flat_rows() -> None:
    """A dense chunk has no rows: it is stepped with Adagrad (each element a row of one), so the
    dense parameters get the same steps whatever the chunking; the row form refuses a flat value."""
    cfg = OptimizerConfig("rowwise_adagrad", lr=0.1, initial_accumulator=0.1)
    w0, grad = torch.linspace(-1, 1, 6), torch.linspace(0.3, -0.2, 6)
    chunk = DenseChunk("w", 0, w0, cfg)
    chunk.push(grad)
    p = torch.nn.Parameter(w0.clone())
    p.grad = grad.clone()
    torch.optim.Adagrad([p], lr=0.1, eps=cfg.eps, initial_accumulator_value=0.1).step()
    assert torch.allclose(chunk.value, p.detach(), atol=1e-7)
    assert tuple(chunk.snapshot()["state"]["sum"].shape) == (6,)
    assert chunk.optimizer.name == "rowwise_adagrad"  # declared as it was declared
    with pytest.raises(ValueError, match="dense_rule"):
        rule("rowwise_adagrad").apply(cfg, torch.zeros(6), grad, {"sum": torch.zeros(())})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"l1": -1.0}, "l1 must be a finite number >= 0"),
        ({"l2": float("inf")}, "l2 must be a finite number >= 0"),
        ({"beta": float("nan")}, "beta must be"),
        ({"lr_power": 0.5}, "lr_power must be a finite number <= 0"),
        ({"name": "ftrl", "beta": 0.0}, "ftrl needs beta > 0, l2 > 0 or initial_accumulator > 0"),
    ],
)
def test_ftrl_constants_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)


def test_ftrl_constants_travel_on_the_wire_with_zero_as_a_value() -> None:
    cfg = OptimizerConfig("ftrl", lr=0.25, beta=0.0, l1=0.5, l2=2.0, lr_power=0.0)
    back = OptimizerConfig.from_proto(cfg.to_proto())
    assert (back.name, back.beta, back.l1, back.l2, back.lr_power) == ("ftrl", 0.0, 0.5, 2.0, 0.0)
    # A spec without them (a client from before they existed) takes the defaults.
    old = cfg.to_proto()
    for f in ("beta", "l1", "l2", "lr_power"):
        old.ClearField(f)
    back = OptimizerConfig.from_proto(old)
    assert (back.beta, back.l1, back.l2, back.lr_power) == (1.0, 0.0, 0.0, -0.5)


# -- through real shards: declare, push, pull; checkpoint, restore onto another shard count, export --

_LR = 0.125  # exact in float32, as the wire carries it
_E2E = {
    "rw": OptimizerConfig("rowwise_adagrad", lr=_LR),
    "ft": OptimizerConfig("ftrl", lr=_LR, l1=0.015625, l2=0.5),
}


def _e2e_steps(seed: int, steps: int) -> list[tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        sparse = {}
        for t in _E2E:
            ids = torch.unique(torch.randint(0, 400, (120,), generator=gen)) * 7919
            sparse[t] = (ids, torch.randn(len(ids), DIM, generator=gen) * 0.3)
        out.append((sparse, {"w": torch.randn(10, generator=gen)}))
    return out


def _run(client, steps) -> None:
    for sparse, dense in steps:
        client.push(sparse, dense).result(30)


def _read(client, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pulled = client.pull(ids, ["w"]).result(30)
    return {**pulled.rows, **pulled.dense}


def test_both_rules_through_shards_checkpoint_restore_onto_three_shards_and_export(tmp_path) -> None:
    from conftest import make_client
    from safetensors.torch import load_file

    from tether.deploy.export import export_checkpoint
    from tether.server.config import ShardConfig
    from tether.server.serving.serve import start_shard

    def start(n: int) -> list:
        return [start_shard(ShardConfig(port=0, shard_index=i, num_shards=n, checkpoint_dir=str(tmp_path / "ck"))) for i in range(n)]

    def declare(client) -> None:
        tables = [TableConfig("rw", DIM, _E2E["rw"], init_scale=0.1), TableConfig("ft", DIM, _E2E["ft"], init_scale=0.0)]
        client.declare(tables, {"w": torch.linspace(-1, 1, 10)}, OptimizerConfig("rowwise_adagrad", lr=_LR))

    first, then = _e2e_steps(0, 3), _e2e_steps(1, 2)
    ids = {t: torch.unique(torch.cat([s[0][t][0] for s in first + then])) for t in _E2E}
    shards = start(2)
    try:
        client = make_client([f"127.0.0.1:{s.port}" for s in shards], "rules")
        declare(client)
        start_rows = _read(client, ids)
        _run(client, first)
        got = _read(client, ids)
        # The references, from the rows the shards started with.
        index = {t: {int(v): k for k, v in enumerate(ids[t])} for t in _E2E}
        w_rw, acc = start_rows["rw"].double().numpy().copy(), np.zeros(len(ids["rw"]))
        ftrl = FtrlReference(len(ids["ft"]), DIM, _E2E["ft"])
        dense = torch.nn.Parameter(torch.linspace(-1, 1, 10))
        adagrad = torch.optim.Adagrad([dense], lr=_LR, eps=1e-8)
        for sparse, d in first:
            rows = np.array([index["rw"][int(i)] for i in sparse["rw"][0]])
            rowwise_reference(w_rw, acc, rows, sparse["rw"][1].double().numpy(), _E2E["rw"])
            ftrl.push(np.array([index["ft"][int(i)] for i in sparse["ft"][0]]), sparse["ft"][1].double().numpy())
            dense.grad = d["w"].clone()
            adagrad.step()
        assert np.abs(got["rw"].numpy() - w_rw).max() <= 1e-6
        assert np.abs(got["ft"].numpy() - ftrl.weights()).max() <= 1e-6
        # Dense values under rowwise_adagrad take Adagrad's steps (its dense form).
        assert torch.allclose(got["w"], dense.detach(), atol=1e-6)
        assert (got["ft"] == 0).any() and (got["ft"] != 0).any()
        client.checkpoint("c1")
        _run(client, then)
        expected = _read(client, ids)
        client.close()
    finally:
        for s in shards:
            s.stop(0)

    shards = start(3)  # restored onto another shard count: rows re-partitioned with their state
    try:
        client = make_client([f"127.0.0.1:{s.port}" for s in shards], "rules-2")
        assert {i.restored_checkpoint for i in client.info()} == {"c1"}
        declare(client)  # a no-op on restored tables
        restored = _read(client, ids)
        for name in got:
            assert torch.equal(restored[name], got[name]), name
        _run(client, then)  # the state came back: the same steps give the same parameters
        after = _read(client, ids)
        for name in expected:
            assert torch.allclose(after[name], expected[name], atol=1e-6), name
        client.close()
    finally:
        for s in shards:
            s.stop(0)

    # The export carries the parameters (FTRL's stored weights, L1's zeros included); optimizer
    # state is left out of an export by its contract (deploy/export.py).
    manifest = export_checkpoint(tmp_path / "ck", tmp_path / "out", "c1")
    assert manifest["tables"]["ft"]["optimizer"] == "ftrl" and manifest["tables"]["rw"]["optimizer"] == "rowwise_adagrad"
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    for t in _E2E:
        assert torch.equal(exported[f"{t}.ids"], ids[t]) and torch.equal(exported[f"{t}.rows"], got[t]), t


def test_a_checkpoints_optimizer_record_from_before_these_rules_restores() -> None:
    """A checkpoint written before FTRL's constants existed records no beta, l1, l2 or lr_power:
    its tables and dense chunks read back with the defaults (the rest of the format is unchanged,
    and tests/test_checkpoint.py restores SGD, Adagrad and Adam checkpoints as before)."""
    from dataclasses import asdict

    from tether.server.checkpoints.checkpoint_files import _optimizer, _table_config

    cfg = TableConfig("t", 4, OptimizerConfig("adagrad", lr=0.1, initial_accumulator=0.1))
    old = asdict(cfg)
    for key in ("beta", "l1", "l2", "lr_power"):
        del old["optimizer"][key]
    assert _table_config(old) == cfg
    assert _optimizer(dict(old["optimizer"])) == cfg.optimizer


def test_a_worker_sums_an_ids_lookups_into_one_rowwise_step() -> None:
    """Through the training API and a real shard: a batch that looks id 5 up twice pushes id 5's
    row once with the sum of both lookups' gradients, and the shard steps it once (FBGEMM's
    semantics), which is not the two steps one push per lookup would take."""
    from torch import nn

    from tether.server.config import ShardConfig
    from tether.server.serving.serve import start_shard
    from tether.worker.config import TrainingConfig
    from tether.worker.training.embedding_bag import ShardedEmbeddingBag
    from tether.worker.training.trainer import Trainer

    class Sum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = ShardedEmbeddingBag("users", 4)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.user(batch["user"]).sum(1)

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch), batch["y"])

    batch = {"user": torch.tensor([5, 5, 9]), "y": torch.tensor([1.0, -2.0, 0.5])}
    cfg = OptimizerConfig("rowwise_adagrad", lr=_LR)
    shard = start_shard(ShardConfig(port=0))
    try:
        config = TrainingConfig(
            shards=(f"127.0.0.1:{shard.port}",), optimizer="rowwise_adagrad", lr=_LR, prefetch=False, log_every=100,
            init_scale=0.3, device="cpu",
        )
        with Trainer(Sum(), config, loss=loss, sparse=lambda b: {"users": b["user"]}, printer=lambda line: None) as trainer:
            ids = torch.tensor([5, 9])
            start = trainer.client.pull({"users": ids}).result(30).rows["users"]
            trainer.fit([batch])
            after = trainer.client.pull({"users": ids}).result(30).rows["users"]
    finally:
        shard.stop(0)
    # The gradient of each lookup, from the same rows in one process.
    rows = nn.Parameter(start.clone())
    lookups = rows[torch.tensor([0, 0, 1])]
    per_lookup = torch.autograd.grad(nn.functional.mse_loss(lookups.sum(1), batch["y"]), lookups)[0].double().numpy()
    w_ref, acc = start.double().numpy().copy(), np.zeros(2)
    rowwise_reference(w_ref, acc, np.array([0, 0, 1]), per_lookup, cfg)
    assert np.abs(after.numpy() - w_ref).max() <= 1e-6
    w_twice, acc_twice = start.double().numpy().copy(), np.zeros(2)
    for k, row in enumerate([0, 0, 1]):
        rowwise_reference(w_twice, acc_twice, np.array([row]), per_lookup[k:k + 1], cfg)
    assert np.abs(after.numpy() - w_twice).max() > 1e-3
