"""The public training API with a model that is not CTRModel: tether's result equals the same
model trained in one process with the matching torch optimizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from tether.deploy.launch import LocalCluster
from tether.protos.errors import InvalidArgument
from tether.worker.config import TrainingConfig
from tether.worker.training.batches import batch_size_of, to_device
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.run_record import RunRecord
from tether.worker.training.trainer import Trainer

DIM, USERS, ITEMS = 4, 30, 40


class MF(nn.Module):
    """Matrix factorisation with a bias: rating ~ <user, item> + b, a user's history bag too."""

    def __init__(self, embedding: callable) -> None:
        super().__init__()
        self.user = embedding("users", DIM)
        self.item = embedding("items", DIM)
        self.scale = nn.Linear(1, 1)
        nn.init.ones_(self.scale.weight)
        nn.init.zeros_(self.scale.bias)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        dot = (self.user(batch["user"]) * self.item(batch["item"])).sum(1, keepdim=True)
        return self.scale(dot).squeeze(1)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch), batch["rating"])


def _ids(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"users": batch["user"], "items": batch["item"]}


def _batches(n: int, size: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        user = torch.randint(0, USERS, (size,), generator=g) * 1_000_003  # sparse, unbounded ids
        item = torch.randint(0, ITEMS, (size,), generator=g) + 2**40
        out.append({"user": user, "item": item, "rating": torch.randn(size, generator=g)})
    return out


class _Local(nn.Module):
    """A plain in-process embedding over the given ids, for the reference run."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        super().__init__()
        self.ids = ids
        self.weight = nn.Parameter(rows.clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[torch.searchsorted(self.ids, ids)]


@pytest.mark.parametrize(("optimizer", "lr"), [("sgd", 0.3), ("adagrad", 0.1)])
def test_one_worker_equals_torch_optimizer_in_process(cluster: LocalCluster, optimizer: str, lr: float) -> None:
    addresses = cluster.start_shards(2)
    batches = _batches(25)
    torch.manual_seed(0)
    model = MF(lambda name, dim: ShardedEmbeddingBag(name, dim))
    config = TrainingConfig(shards=tuple(addresses), optimizer=optimizer, lr=lr, prefetch=False, log_every=100, init_scale=0.3, device="cpu")
    with Trainer(model, config, loss=_loss, sparse=_ids, printer=lambda line: None) as trainer:
        # The rows the shards start from (a pull creates them and changes nothing).
        user_ids = torch.unique(torch.cat([b["user"] for b in batches]))
        item_ids = torch.unique(torch.cat([b["item"] for b in batches]))
        start = trainer.client.pull({"users": user_ids, "items": item_ids}).result(30)
        initial_dense = [p.detach().clone() for p in model.parameters()]
        record = trainer.fit(batches)
        final = trainer.client.pull({"users": user_ids, "items": item_ids}, ["dense"]).result(30)
    assert record.steps == 25 and record.samples == 25 * 32

    torch.manual_seed(0)
    ref = MF(lambda name, dim: _Local(user_ids, start.rows["users"]) if name == "users" else _Local(item_ids, start.rows["items"]))
    with torch.no_grad():
        for p, v in zip(ref.scale.parameters(), initial_dense, strict=False):
            p.copy_(v)
    params = list(ref.parameters())
    opt = torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.Adagrad(params, lr=lr, eps=1e-8)
    for b in batches:
        opt.zero_grad()
        _loss(ref, b).backward()
        opt.step()
    assert torch.allclose(final.rows["users"], ref.user.weight.detach(), atol=1e-5)
    assert torch.allclose(final.rows["items"], ref.item.weight.detach(), atol=1e-5)
    dense_ref = torch.cat([p.detach().reshape(-1) for p in ref.scale.parameters()])
    assert torch.allclose(final.dense["dense"], dense_ref, atol=1e-5)
    # And the model moved: the comparison is not between two untouched starts.
    assert (final.rows["users"] - start.rows["users"]).abs().max() > 0.01


def test_evaluate_and_records(cluster: LocalCluster, tmp_path) -> None:
    addresses = cluster.start_shards(1)
    torch.manual_seed(0)
    model = MF(lambda name, dim: ShardedEmbeddingBag(name, dim))
    lines: list[str] = []
    config = TrainingConfig(shards=tuple(addresses), steps=12, log_every=5, eval_every=6, out=str(tmp_path), device="cpu", lr=0.1)
    with Trainer(model, config, loss=_loss, sparse=_ids, printer=lines.append) as trainer:
        record = trainer.fit(_batches(40), eval_data=_batches(2, size=64))
    assert record.steps == 12  # config.steps stops it before the data ends
    evals = [h for h in record.history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [0, 6, 12]  # the initial model too (the curve's first point)
    assert record.final_eval["eval_loss"] == evals[-1]["eval_loss"]
    # The file holds the record's JSON, under the keys it always had, and reads back whole.
    written = json.loads((tmp_path / "worker-0.json").read_text())
    assert list(written) == ["worker_index", "mode", "device", "steps", "samples", "wall_s", "samples_per_sec", "phase_seconds",
                             "clock_staleness", "update_staleness", "start_time", "rejected_too_stale", "history", "config",
                             "final_eval", "traffic"]
    assert written == record.to_json() and RunRecord.load(tmp_path / "worker-0.json") == record
    assert [set(h) for h in record.history[1:]] == [
        {"step", "samples", "wall_s", "time", "train_loss", "staleness_mean", "staleness_max"} | ({"eval_loss"} if h["step"] % 6 == 0 else set())
        for h in record.history[1:]
    ]
    assert record["steps"] == 12 and "final_eval" in record and "data_position" not in record and record.get("backend", "-") == "-"
    with pytest.raises(ValueError, match="not a worker record"):
        RunRecord.from_json({**written, "stepz": 1})
    progress = [line for line in lines if " step " in line]
    assert progress and all("elapsed" in line for line in progress)
    assert "eta" in progress[0] and "eta" not in progress[-1]


def test_batches_of_any_shape_move_and_count() -> None:
    from tether.worker.data.synthetic import Batch

    nested = {"a": torch.ones(3, 2), "b": [torch.zeros(3), (torch.ones(3),)], "name": "x"}
    assert batch_size_of(nested) == 3
    moved = to_device(nested, torch.device("cpu"))
    assert moved["name"] == "x" and torch.equal(moved["b"][1][0], torch.ones(3))
    batch = Batch(torch.zeros(5, 2), torch.zeros(5, 3, dtype=torch.int64), torch.zeros(5))
    assert batch_size_of(batch) == 5 and isinstance(to_device(batch, torch.device("cpu")), Batch)


def test_a_table_the_model_does_not_have_is_a_clear_error(cluster: LocalCluster) -> None:
    addresses = cluster.start_shards(1)
    model = MF(lambda name, dim: ShardedEmbeddingBag(name, dim))
    config = TrainingConfig(shards=tuple(addresses), device="cpu")
    with Trainer(model, config, loss=_loss, sparse=lambda b: {"nope": b["user"]}, printer=lambda line: None) as trainer:
        with pytest.raises(InvalidArgument, match="nope"):
            trainer.fit(_batches(2), background=False)


def test_metric_names_are_kept_one_shot_eval_data_is_refused_and_jagged_batches_count_right(
    cluster: LocalCluster, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    from tether.protos.errors import UsageError

    addresses = cluster.start_shards(1)
    torch.manual_seed(0)
    model = MF(lambda name, dim: ShardedEmbeddingBag(name, dim))
    config = TrainingConfig(shards=tuple(addresses), steps=6, log_every=3, device="cpu", lr=0.1)

    def metrics(m: nn.Module, b: dict[str, torch.Tensor]) -> dict[str, float]:
        err = m(b) - b["rating"]
        return {"rmse": float(err.pow(2).mean().sqrt()), "mae": float(err.abs().mean())}

    # A jagged tensor first: 3 ids per sample, so 96 long for 32 samples.
    jagged = [{"history": torch.arange(96), **b} for b in _batches(10)]
    held_out = _batches(2, size=16)
    lines: list[str] = []
    with Trainer(model, config, loss=_loss, sparse=_ids, printer=lines.append) as trainer:
        with pytest.raises(UsageError, match="eval_data is a one-shot generator"):
            trainer.fit(jagged, eval_data=(b for b in held_out))
        with caplog.at_level("WARNING"):
            record = trainer.fit(jagged, eval_data=held_out, evaluate=metrics)
        with pytest.raises(UsageError, match=r"evaluate returned \['step'\]"):
            trainer.evaluate(held_out, lambda m, b: {"step": 1.0})
    assert set(record.final_eval) == {"rmse", "mae"}
    assert record.final_eval["rmse"] == pytest.approx(record.history[-1]["rmse"])
    assert any("rmse" in line and "mae" in line for line in lines)
    assert record.samples == 6 * 32
    notes = [r.message for r in caplog.records if "differ in length" in r.message]
    assert len(notes) == 1 and "batch['history'] 96" in notes[0] and "counting 32" in notes[0]


def test_endless_data_without_a_step_limit_is_said_once(cluster: LocalCluster) -> None:
    addresses = cluster.start_shards(1)
    model = MF(lambda name, dim: ShardedEmbeddingBag(name, dim))
    lines: list[str] = []
    with Trainer(model, TrainingConfig(shards=tuple(addresses), device="cpu"), loss=_loss, sparse=_ids, printer=lines.append) as trainer:
        trainer.fit(iter(_batches(3)))
        trainer.fit(_batches(3))  # a list has a length: nothing to say
    assert sum("no step limit" in line for line in lines) == 1


def test_a_trainer_changes_nothing_process_wide_and_from_env_makes_a_worker_process() -> None:
    """Trainer installs no hook, malloc setting or thread count; TrainingConfig.from_env (what a
    launched program calls) does: the one-line error hook, malloc, one thread in local mode."""
    code = """
import os, sys, torch
from tether.common import allocator
from tether import ShardedEmbeddingBag, Trainer, TrainingConfig
torch.set_num_threads(2)
hook = sys.excepthook
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.t = ShardedEmbeddingBag("t", 2)
    def forward(self, b):
        return self.t(b).sum(1)
Trainer(M(), TrainingConfig(local=True, device="cpu"), loss=lambda m, b: m(b).sum(), sparse=lambda b: {"t": b}).close()
print(sys.excepthook is hook, allocator._applied is None, torch.get_num_threads(), "OMP_NUM_THREADS" in os.environ)
TrainingConfig.from_env()
print(sys.excepthook is hook, allocator._applied is None, torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_") and k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "TETHER_LOCAL": "1"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True True 2 False", "False False 1 1"]


def test_from_env_knows_the_rank_under_torchrun_and_names_a_missing_shard_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_SHARDS", "127.0.0.1:5000")
    monkeypatch.setenv("TETHER_MODE", "sync")
    monkeypatch.setenv("TETHER_WORKER_INDEX", "0")  # what tether launch gives every rank
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    config = TrainingConfig.from_env()
    assert (config.worker_index, config.num_workers) == (2, 3)
    assert TrainingConfig.from_env(worker_index=1).worker_index == 1  # overrides still win
    assert TrainingConfig.from_env(mode="async").worker_index == 0  # RANK means nothing outside sync
    monkeypatch.delenv("TETHER_SHARDS")
    with pytest.raises(ValueError, match=r"no shards: set TETHER_SHARDS=host:port,... \(flag --shards\), or TETHER_LOCAL=1"):
        TrainingConfig.from_env()


def test_gpus_are_dealt_one_per_worker_and_one_per_sync_rank() -> None:
    from tether.deploy.children import worker_device
    from tether.protos.errors import UsageError
    from tether.worker.training.policies import sync_device

    assert [worker_device("auto", i, 4) for i in range(6)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"]
    assert worker_device("cuda", 3, 2) == "cuda:1"
    assert worker_device("cuda:2", 0, 4) == "cuda:2" and worker_device("cpu", 1, 4) == "cpu" and worker_device("auto", 1, 0) == "auto"
    assert sync_device(torch.device("cuda"), 1, 2, 2) == torch.device("cuda", 1)
    assert sync_device(torch.device("cuda", 3), 0, 1, 4) == torch.device("cuda", 3)
    with pytest.raises(UsageError, match="3 ranks on this host need 3 GPUs"):
        sync_device(torch.device("cuda"), 0, 3, 2)
    with pytest.raises(UsageError, match="--device cuda:0: in sync every rank"):
        sync_device(torch.device("cuda", 0), 0, 2, 2)


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_model_after_fit_holds_the_shards_last_dense_values(prefetch: bool) -> None:
    """After ``fit`` the user's model holds the dense values the shards hold once every push
    landed (the last steps computed on values pulled before their pushes were applied)."""
    torch.manual_seed(0)
    model = MF(lambda name, dim: ShardedEmbeddingBag(name, dim))
    config = TrainingConfig(shards=(), local=True, prefetch=prefetch, log_every=100, device="cpu", lr=0.2)
    with Trainer(model, config, loss=_loss, sparse=_ids, printer=lambda line: None) as trainer:
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        trainer.fit(_batches(8))
        held = trainer.client.pull({}, ["dense"]).result(30).dense["dense"]
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert (held - before).abs().max() > 1e-3  # training moved them
    assert torch.equal(after, held)


@pytest.mark.parametrize("mode", ["async", "ssp:1"])
def test_a_worker_whose_data_ends_before_steps_says_where_it_stopped(mode: str) -> None:
    """Async and ssp say it as sync does: the step it stopped at and the steps asked for; a
    worker whose data holds exactly ``steps`` batches says nothing of it."""
    for batches, said in ((5, ["worker 0/1: stopping at step 5 of 20: the training data ended"]), (20, [])):
        torch.manual_seed(0)
        config = TrainingConfig(shards=(), local=True, mode=mode, steps=20, log_every=100, device="cpu")
        lines: list[str] = []
        with Trainer(MF(lambda name, dim: ShardedEmbeddingBag(name, dim)), config, loss=_loss, sparse=_ids,
                     printer=lines.append) as trainer:
            record = trainer.fit(_batches(batches), background=False)
        assert record.steps == batches
        assert [line for line in lines if "stopping" in line] == said


def test_a_progress_line_is_one_write_so_ranks_sharing_stdout_do_not_glue_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's ranks share one stdout, unbuffered under tether launch: print's two writes (the
    text, then the newline) let another rank's line in between ("...eta 0:43worker 1/2 step 300",
    then an empty line). The Trainer's default printer writes a line at once."""
    import io
    import sys

    from tether.worker.training.trainer import print_line

    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, s: str) -> int:
            writes.append(s)
            return len(s)

    monkeypatch.setattr(sys, "stdout", Recorder())
    torch.manual_seed(0)
    config = TrainingConfig(local=True, steps=3, log_every=1, device="cpu")
    with Trainer(MF(lambda name, dim: ShardedEmbeddingBag(name, dim)), config, loss=_loss, sparse=_ids) as trainer:
        trainer.fit(_batches(3), background=False)
    assert Trainer.__init__.__kwdefaults__["printer"] is print_line
    progress = [w for w in writes if " step " in w]
    assert len(progress) == 3 and all(w.endswith("\n") and w.count("\n") == 1 for w in progress), writes
    assert "\n" not in writes and "" not in writes


def test_a_finite_stream_without_a_length_is_not_called_endless(tmp_path) -> None:
    """A ParquetStream of one epoch ends: no 'forever'; one with epochs=None is said endless."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from tether.worker.data.parquet import ParquetStream

    path = tmp_path / "ratings.parquet"
    pq.write_table(pa.table({"user": list(range(64)), "item": [2**40 + i % 7 for i in range(64)], "label": [0.5] * 64}), path)
    said: dict[object, list[str]] = {}
    for epochs in (1, None):
        torch.manual_seed(0)
        lines: list[str] = []
        config = TrainingConfig(local=True, device="cpu", log_every=100, steps=None)
        with Trainer(MF(lambda name, dim: ShardedEmbeddingBag(name, dim)), config, loss=lambda m, b: nn.functional.mse_loss(m(b), b["label"]),
                     sparse=_ids, printer=lines.append) as trainer:
            trainer.fit(ParquetStream(path, 16, ids=["user", "item"], epochs=epochs, max_batches=6), background=False)
        said[epochs] = [line for line in lines if "no step limit" in line or "forever" in line]
    assert said[1] == [], said[1]
    assert len(said[None]) == 1 and "endless (epochs=None)" in said[None][0] and "forever" not in said[None][0]


def test_local_mode_says_how_many_torch_threads_it_computes_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer leaves torch's thread count alone (from_env sets one thread in local mode) and
    says it, with a hint when it is more than one."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        for threads, said in ((2, "2 torch threads (OMP_NUM_THREADS=1 is often much faster on a busy machine)"), (1, "1 torch thread)")):
            torch.set_num_threads(threads)
            lines: list[str] = []
            with Trainer(MF(lambda name, dim: ShardedEmbeddingBag(name, dim)), TrainingConfig(local=True, steps=1, device="cpu"),
                         loss=_loss, sparse=_ids, printer=lines.append) as trainer:
                assert torch.get_num_threads() == threads
                trainer.fit(_batches(1), background=False)
            assert said in lines[0], lines[0]
    finally:
        torch.set_num_threads(before)
