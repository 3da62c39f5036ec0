"""Local mode (tether.worker.client.local): the same script trains with no shards, in one process, with
the shards' initial rows and update rules, so its result is a 1-shard 1-worker job's."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
from torch import nn

from tether.deploy.launch import LocalCluster
from tether.protos.errors import FailedPrecondition, InvalidArgument, UsageError
from tether.protos.names import OPTIMIZERS
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.initial import init_rows
from tether.worker.client.local import LocalClient
from tether.worker.client.local_table import LocalTable
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.trainer import Trainer

USERS, ITEMS, DENSE = 25, 60, 3


class WideDeep(nn.Module):
    """Two tables of different widths (a single user id; a variable-length bag of items given
    by offsets), dense features and an MLP over them."""

    def __init__(self) -> None:
        super().__init__()
        self.user = ShardedEmbeddingBag("users", 8)
        self.history = ShardedEmbeddingBag("items", 4, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(8 + 4 + DENSE, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [self.user(batch["user"]), self.history(batch["items"], batch["offsets"]), batch["dense"]]
        return self.mlp(torch.cat(parts, 1)).squeeze(1)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(batch), batch["label"])


def _sparse(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"users": batch["user"], "items": batch["items"]}


def _size(batch: dict[str, torch.Tensor]) -> int:
    return len(batch["label"])


def _batches(n: int, size: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        lengths = torch.randint(1, 5, (size,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        out.append({
            "user": torch.randint(0, USERS, (size,), generator=g) * 7_919 + 3,  # sparse ids, not row numbers
            "items": torch.randint(0, ITEMS, (int(lengths.sum()),), generator=g) + 2**33,
            "offsets": offsets,
            "dense": torch.randn(size, DENSE, generator=g),
            "label": torch.randint(0, 2, (size,), generator=g).float(),
        })
    return out


def _train(config: TrainingConfig, batches: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict]:
    """Train a fresh WideDeep; the final rows of every id the data touched, the dense values
    (as the shards or the local tables hold them) and the record."""
    torch.manual_seed(0)
    model = WideDeep()
    ids = {"users": torch.unique(torch.cat([b["user"] for b in batches])),
           "items": torch.unique(torch.cat([b["items"] for b in batches]))}
    with Trainer(model, config, loss=_loss, sparse=_sparse, batch_size=_size, printer=lambda line: None) as trainer:
        record = trainer.fit(batches, background=False)
        final = trainer.client.pull(ids, ["dense"]).result(30)
    return final.rows, final.dense["dense"], record


@pytest.mark.parametrize(("optimizer", "lr"), [("adagrad", 0.1), ("sgd", 0.3), ("adam", 0.02)])
def test_local_mode_ends_where_a_one_shard_job_does(cluster: LocalCluster, optimizer: str, lr: float) -> None:
    batches = _batches(30)
    common = dict(optimizer=optimizer, lr=lr, prefetch=False, device="cpu", init_scale=0.2, seed=4, log_every=100)
    local_rows, local_dense, local_record = _train(TrainingConfig(shards=(), local=True, **common), batches)
    shard_rows, shard_dense, shard_record = _train(TrainingConfig(shards=tuple(cluster.start_shards(1)), **common), batches)
    assert local_record.steps == shard_record.steps == 30
    for table in ("users", "items"):
        assert torch.allclose(local_rows[table], shard_rows[table], rtol=0, atol=1e-5), table
        # The comparison is between trained rows, not two untouched starts.
        start = init_rows(torch.unique(torch.cat([b[{"users": "user", "items": "items"}[table]] for b in batches])).numpy(),
                          local_rows[table].shape[1], 4, table, 0.2)
        assert (local_rows[table] - start).abs().max() > 1e-3
    assert torch.allclose(local_dense, shard_dense, rtol=0, atol=1e-5)
    # The losses along the way agree too (the same sequence of parameters).
    assert [h["train_loss"] for h in local_record.history] == pytest.approx([h["train_loss"] for h in shard_record.history], abs=1e-5)


def test_local_mode_needs_no_network(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """TETHER_LOCAL=1 and no TETHER_SHARDS: TrainingConfig.from_env() trains in this process,
    and nothing opens a socket or a channel."""
    import grpc

    monkeypatch.setenv("TETHER_LOCAL", "1")
    monkeypatch.delenv("TETHER_SHARDS", raising=False)
    config = TrainingConfig.from_env(steps=5, device="cpu", log_every=100, out=str(tmp_path), wait_timeout_s=5.0)
    assert config.local and config.shards == ()

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("local mode opened a connection")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(grpc, "insecure_channel", no_network)
    monkeypatch.setattr(grpc, "secure_channel", no_network)
    torch.manual_seed(0)
    model = WideDeep()
    with Trainer(model, config, loss=_loss, sparse=_sparse, batch_size=_size, printer=lambda line: None) as trainer:
        assert isinstance(trainer.client, LocalClient)
        record = trainer.fit(_batches(8), eval_data=_batches(1))
    assert record.steps == 5 and record.samples == 5 * 16
    assert "eval_loss" in record.history[-1]
    assert (tmp_path / "worker-0.json").exists()


@pytest.mark.parametrize("mode", ["ssp:0", "ssp:3"])
def test_ssp_in_local_mode_never_waits(mode: str) -> None:
    torch.manual_seed(0)
    config = TrainingConfig(shards=(), local=True, mode=mode, steps=6, device="cpu", wait_timeout_s=1.0, log_every=100)
    with Trainer(WideDeep(), config, loss=_loss, sparse=_sparse, batch_size=_size, printer=lambda line: None) as trainer:
        record = trainer.fit(_batches(6))
    assert record.steps == 6


# One line that names both local mode and sync.
_LOCAL_SYNC = r"^(?=.*local mode)(?=.*sync)[^\n]*$"


def test_local_mode_refuses_sync_outside_torchrun() -> None:
    config = TrainingConfig(shards=(), local=True, mode="sync", device="cpu")
    with pytest.raises(UsageError, match=_LOCAL_SYNC):
        Trainer(WideDeep(), config, loss=_loss, sparse=_sparse)


def test_local_mode_refuses_sync_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun (RANK set) too, a local sync job is refused with one line saying why."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    config = TrainingConfig(shards=(), local=True, mode="sync", device="cpu")
    try:
        with pytest.raises(UsageError, match=_LOCAL_SYNC):
            Trainer(WideDeep(), config, loss=_loss, sparse=_sparse)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_local_mode_is_one_worker() -> None:
    config = TrainingConfig(shards=(), local=True, num_workers=2, device="cpu")
    with pytest.raises(UsageError, match="num_workers=2"):
        Trainer(WideDeep(), config, loss=_loss, sparse=_sparse)


def test_local_mode_refuses_checkpoints_at_the_start_when_nothing_would_be_written() -> None:
    """TETHER_CHECKPOINT_EVERY_STEPS in local mode, with no out folder: refused with one line when
    the Trainer is made, not a warning at the first checkpoint step."""
    config = TrainingConfig(shards=(), local=True, checkpoint_every_steps=3, device="cpu")
    with pytest.raises(UsageError) as raised:
        Trainer(WideDeep(), config, loss=_loss, sparse=_sparse)
    assert "\n" not in str(raised.value)
    assert str(raised.value).startswith("local mode (TETHER_LOCAL, --local) has no shards to checkpoint: checkpoint_every_steps=3")


def test_local_mode_with_an_out_folder_says_at_the_start_only_data_positions_are_written(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """With out set, one warning at the start says the tables are not checkpointed; every N steps
    stays on (the data positions beside each would-be checkpoint), with no warning at step N."""
    config = TrainingConfig(shards=(), local=True, checkpoint_every_steps=2, steps=5, out=str(tmp_path), device="cpu")
    with caplog.at_level("WARNING"):
        with Trainer(WideDeep(), config, loss=_loss, sparse=_sparse, batch_size=_size, printer=lambda line: None) as trainer:
            record = trainer.fit(_batches(5), background=False)
    assert record.steps == 5
    assert trainer.config.checkpoint_every_steps == 2  # not turned off at step 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"local mode: the tables live in this process and are not checkpointed; checkpoint_every_steps=2 writes only the "
        f"data positions ({tmp_path}/positions)"
    ]
    assert trainer.client.checkpoint("step-2") == []
    with pytest.raises(FailedPrecondition, match="local mode has no shards"):
        LocalClient().checkpoint("step-2")  # a client made outside a Trainer still refuses


# -- the client on its own ------------------------------------------------------------------------


def test_rows_start_as_a_shards_do_and_any_int64_id_is_a_row() -> None:
    client = LocalClient()
    client.declare([TableConfig("t", 5, init_scale=0.4, seed=9)])
    ids = torch.tensor([7, -1, 2**63 - 1, -(2**63), 7])  # repeats are fine in a pull
    rows = client.pull({"t": ids}).result().rows["t"]
    assert torch.equal(rows, init_rows(ids.numpy(), 5, 9, "t", 0.4))
    assert client.tables["t"].rows == 4
    # Narrower integer ids are widened, as a PSClient widens them; floats are not ids.
    assert torch.equal(client.pull({"t": torch.tensor([7, 3], dtype=torch.int32)}).result().rows["t"],
                       init_rows(np.array([7, 3]), 5, 9, "t", 0.4))
    with pytest.raises(InvalidArgument, match="integers"):
        client.pull({"t": torch.tensor([1.0])})


def test_a_table_grows_past_its_first_storage_as_rows_come() -> None:
    """Rows created by a pull that outgrows the storage (and the id index's merges) keep their
    values and their ids."""
    table = LocalTable(TableConfig("t", 3, OptimizerConfig("sgd", lr=1.0), init_scale=0.5))
    rng = np.random.default_rng(0)
    seen = np.empty(0, np.int64)
    for n in (5, 3000, 2500, 9000):
        ids = np.unique(rng.integers(-(2**62), 2**62, n))
        assert torch.equal(table.pull(ids), init_rows(ids, 3, 0, "t", 0.5))
        seen = np.union1d(seen, ids)
    assert table.rows == len(seen)
    table.push(seen[:2], torch.ones(2, 3))
    assert torch.equal(table.pull(seen), init_rows(seen, 3, 0, "t", 0.5) - torch.tensor([1.0, 1.0] + [0.0] * (len(seen) - 2))[:, None])


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_local_table_steps_as_a_shards_table(name: str, weight_decay: float) -> None:
    """Row for row, the protos-side rule on local rows and the shard's compiled kernels agree
    within float rounding, rows that sit out a push included (Adam's per-row step count)."""
    from tether.server.storage.tables import EmbeddingTable

    cfg = TableConfig("t", 16, OptimizerConfig(name, lr=0.05, weight_decay=weight_decay, initial_accumulator=0.1), init_scale=0.3, seed=2)
    local, shard = LocalTable(cfg), EmbeddingTable(cfg)
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        ids = np.unique(torch.randint(0, 300, (64,), generator=g).numpy())
        grads = torch.randn(len(ids), 16, generator=g)
        local.push(ids, grads)
        shard.push(ids, grads.clone())
    every = np.arange(300)
    assert torch.allclose(local.pull(every), shard.pull(every)[0], rtol=0, atol=1e-5)
    assert local.version == shard.version == 40


def test_pushes_a_shard_refuses_are_refused_and_change_nothing() -> None:
    client = LocalClient()
    client.declare([TableConfig("t", 2)], {"dense": torch.zeros(3)})
    before = client.pull({"t": torch.tensor([1, 2])}, ["dense"]).result()
    bad = [
        ({"t": (torch.tensor([1, 1]), torch.ones(2, 2))}, {}, "unique"),
        ({"t": (torch.tensor([1, 2]), torch.tensor([[1.0, float("nan")], [0.0, 0.0]]))}, {"dense": torch.ones(3)}, "NaN"),
        ({}, {"dense": torch.tensor([1.0, float("inf"), 0.0])}, "NaN or Inf"),
    ]
    for sparse, dense, message in bad:
        handle = client.push(sparse, dense, clock=1)
        with pytest.raises(InvalidArgument, match=message):
            handle.result()
    after = client.pull({"t": torch.tensor([1, 2])}, ["dense"]).result()
    assert torch.equal(before.rows["t"], after.rows["t"]) and torch.equal(before.dense["dense"], after.dense["dense"])
    with pytest.raises(InvalidArgument, match="not declared"):
        client.pull({"nope": torch.tensor([1])})
    with pytest.raises(InvalidArgument, match="gradient shape"):
        client.push({"t": (torch.tensor([1]), torch.ones(1, 3))})


def test_declare_checkpoint_clock_and_bounded_tables() -> None:
    client = LocalClient()
    client.declare([TableConfig("t", 2)], {"dense": torch.zeros(3)}, OptimizerConfig("sgd"))
    client.declare([TableConfig("t", 2)], {"dense": torch.ones(3)}, OptimizerConfig("sgd"))  # the same spec: a no-op
    assert torch.equal(client.pull(dense=["dense"]).result().dense["dense"], torch.zeros(3))
    with pytest.raises(FailedPrecondition, match="another spec"):
        client.declare([TableConfig("t", 3)])
    with pytest.raises(FailedPrecondition, match="another shape or optimizer"):
        client.declare(dense={"dense": torch.zeros(3)}, dense_optimizer=OptimizerConfig("adam"))
    with pytest.raises(FailedPrecondition, match="checkpoint"):
        client.checkpoint("step-1")
    with pytest.raises(UsageError, match="capacity=10"):
        client.declare([TableConfig("bounded", 2, capacity=10)])
    reply = client.clock(4, wait_bound=0)
    assert (reply.ready, reply.live_workers, reply.min_clock) == (True, 1, 4)
    assert client.clock(5, leave=True).live_workers == 0


def test_push_pull_reads_after_its_push_and_counts_staleness_as_a_shard() -> None:
    client = LocalClient()
    client.declare([TableConfig("t", 2, OptimizerConfig("sgd", lr=1.0), init_scale=0.0)])
    ids = torch.tensor([1, 2])
    first = client.pull({"t": ids}).result()
    ahead = client.pull({"t": ids}).result()  # read before the next push lands: one update stale
    moved = client.push_pull({"t": (ids, torch.ones(2, 2))}, pull_sparse={"t": ids}, clock=1, versions=first).result()
    assert torch.equal(moved.rows["t"], -torch.ones(2, 2)) and moved.ack is not None and moved.ack.staleness == 0
    ack = client.push({"t": (ids[:1], torch.ones(1, 2))}, clock=2, versions=ahead).result()
    assert ack.staleness == 1
    untouched = client.push({"t": (torch.tensor([3]), torch.ones(1, 2))}, versions=ahead).result()
    assert untouched.staleness == 0  # row 3 was never updated since that read
