"""A rule per table everywhere (issue 28 item 2): --table-optimizer and --optimizer-config parsed
with the registry's rules and keys, one line for bad input, their precedence over the code's specs
and --optimizer/--lr, the same entries through flags, the environment and a launcher's child, the
Trainer declaring them, and a shard refusing a table re-declared with another rule, naming both."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_client
from torch import nn

from tether.common.settings import to_argv as worker_argv
from tether.common.settings import to_env as job_env
from tether.protos.errors import FailedPrecondition, UsageError
from tether.protos.names import OPTIMIZERS
from tether.protos.schedules import Schedule
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.serving.serve import RunningShard
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import DenseDecl
from tether.worker import flags as worker_flags
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.table_rules import TableRules, parse_entry
from tether.worker.training.trainer import Trainer


def test_rules_and_keys_come_from_the_registry() -> None:
    # Every registered rule is accepted, with its own constants (FTRL's l1 and l2 among them).
    for name in OPTIMIZERS:
        assert parse_entry(f"t={name}:lr=0.2").config(0.05) == OptimizerConfig(name, 0.2)
    cfg = parse_entry("user=rowwise_adagrad:lr=0.1,weight_decay=1e-5,warmup_steps=100,decay=cosine,decay_steps=900,min_lr=0.001")
    assert cfg.config(0.05) == OptimizerConfig(
        "rowwise_adagrad", 0.1, weight_decay=1e-5, schedule=Schedule(warmup_steps=100, decay="cosine", decay_steps=900, min_lr=0.001)
    )
    assert parse_entry("wide=ftrl:l1=0.5,l2=2").config(0.05) == OptimizerConfig("ftrl", 0.05, l1=0.5, l2=2.0)


@pytest.mark.parametrize(("text", "match"), [
    ("user=nope", r"optimizer of 'user': unknown rule 'nope' \(rules: sgd, adagrad, adam"),
    ("user=sgd:lrr=0.1", r"unknown key 'lrr' \(keys: lr, "),
    ("user=sgd:lr=fast", "lr must be a number, got 'fast'"),
    ("user=sgd:warmup_steps=1.5", "warmup_steps must be an integer"),
    ("user=sgd:decay=step", "decay=step needs decay_steps >= 1"),
    ("user=sgd:lr=-1", "lr must be a positive finite number"),
    ("user=sgd:lr", "expected key=value"),
    ("user", "expected NAME=RULE"),
])
def test_bad_entries_are_one_line(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        TrainingConfig(local=True, table_optimizers=(text,))
    assert "\n" not in str(err.value)


def test_precedence_entry_then_star_then_the_code_then_the_job_default(tmp_path: Path) -> None:
    file = tmp_path / "rules.toml"
    file.write_text('[user]\nrule = "adam"\nlr = 0.01\n\n[item]\nrule = "adagrad"\nwarmup_steps = 10\n\n["*"]\nrule = "sgd"\n')
    rules = TableRules.of(("user=ftrl:l1=1",), str(file), "adagrad", 0.3)
    assert rules.optimizer("user") == OptimizerConfig("ftrl", 0.3, l1=1.0)  # the flag replaces the file's entry
    assert rules.optimizer("item", OptimizerConfig("adam", 0.9)) == OptimizerConfig("adagrad", 0.3, schedule=Schedule(warmup_steps=10))
    assert rules.optimizer("other", OptimizerConfig("adam", 0.9)) == OptimizerConfig("sgd", 0.3)  # * wins over the code
    plain = TableRules.of(("user=sgd",), None, "adagrad", 0.3)
    assert plain.optimizer("other", OptimizerConfig("adam", 0.9)) == OptimizerConfig("adam", 0.9)  # the code over the default
    assert plain.optimizer("other") == plain.optimizer("dense") == OptimizerConfig("adagrad", 0.3)
    # JSON too; a bad file is one line naming it.
    (tmp_path / "rules.json").write_text('{"dense": {"rule": "adam", "lr": 0.002, "weight_decay": 0.01}}')
    assert TableRules.of((), str(tmp_path / "rules.json"), "sgd", 0.1).optimizer("dense") == OptimizerConfig("adam", 0.002, weight_decay=0.01)
    for body, match in [('{"user": {"lr": 1}}', 'needs a mapping with a "rule"'), ("{nope", "Expecting property name"),
                        ('{"user": {"rule": "sgd", "lr": true}}', "lr must be a number")]:
        (tmp_path / "bad.json").write_text(body)
        with pytest.raises(ValueError, match=f"--optimizer-config {tmp_path / 'bad.json'}: .*{match}"):
            TrainingConfig(local=True, optimizer_config=str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match=r"--optimizer-config /nonexistent.json: .*No such file"):
        TrainingConfig(local=True, optimizer_config="/nonexistent.json")


def test_the_flag_repeats_and_reaches_workers_and_scripts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TETHER_TABLE_OPTIMIZER", "from_env=sgd")
    assert worker_flags.load_config(["--local"]).table_optimizers == ("from_env=sgd",)
    cfg = worker_flags.load_config(["--shards", "127.0.0.1:1", "--delay-compensation", "0.04",
                                    "--table-optimizer", "user=adam:lr=0.01", "--table-optimizer", "dense=sgd;*=adagrad:lr=0.2"])
    assert cfg.table_optimizers == ("user=adam:lr=0.01", "dense=sgd", "*=adagrad:lr=0.2") and cfg.delay_compensation == 0.04
    monkeypatch.delenv("TETHER_TABLE_OPTIMIZER")
    # A launched `tether worker` gets the same flags; a launched --script reads the same from its environment.
    child = worker_flags.config_from_args(worker_flags.build_parser().parse_args(worker_argv(cfg)))
    assert child.table_optimizers == cfg.table_optimizers and child.table_rules == cfg.table_rules
    for name, value in job_env(cfg).items():
        monkeypatch.setenv(name, value)
    script = TrainingConfig.from_env()
    assert script.table_optimizers == cfg.table_optimizers and script.delay_compensation == 0.04


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user, self.item = ShardedEmbeddingBag("user", 3), ShardedEmbeddingBag("item", 3)
        self.out = nn.Linear(3, 1)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.out(self.user(b["u"]) * self.item(b["i"])).squeeze(1)


def _trainer(config: TrainingConfig, tables: list[TableConfig] | None = None) -> Trainer:
    return Trainer(_Two(), config, loss=lambda m, b: m(b).pow(2).mean(), sparse=lambda b: {"user": b["u"], "item": b["i"]},
                   tables=tables, printer=lambda line: None)


def test_the_trainer_declares_each_tables_rule_and_refuses_an_unknown_table() -> None:
    config = TrainingConfig(local=True, optimizer="adagrad", lr=0.3,
                            table_optimizers=("user=rowwise_adagrad:lr=0.1,weight_decay=1e-5", "dense=adam:lr=0.01"))
    with _trainer(config) as t:
        assert t.client.tables["user"].config.optimizer == OptimizerConfig("rowwise_adagrad", 0.1, weight_decay=1e-5)
        assert t.client.tables["item"].config.optimizer == OptimizerConfig("adagrad", 0.3)
        assert t.client.dense["dense"].optimizer == OptimizerConfig("adam", 0.01)
    # A spec built in code keeps its rule unless an entry names the table.
    code = [TableConfig("user", 3, optimizer=OptimizerConfig("ftrl", 0.2)), TableConfig("item", 3, optimizer=OptimizerConfig("adam", 0.2))]
    with _trainer(TrainingConfig(local=True, table_optimizers=("item=sgd",)), code) as t:
        assert t.client.tables["user"].config.optimizer == OptimizerConfig("ftrl", 0.2)
        assert t.client.tables["item"].config.optimizer == OptimizerConfig("sgd", 0.05)
    with pytest.raises(UsageError, match=r"name table 'users', which the model does not have \(its tables: item, user; also dense and \*\)"):
        _trainer(TrainingConfig(local=True, table_optimizers=("users=sgd",)))


def test_a_shard_refuses_a_table_redeclared_with_another_rule_naming_both(inproc_shard: RunningShard) -> None:
    shard = Shard()
    shard.declare([TableConfig("user", 4, optimizer=OptimizerConfig("rowwise_adagrad", 0.1))], [])
    with pytest.raises(FailedPrecondition) as err:
        shard.declare([TableConfig("user", 4, optimizer=OptimizerConfig("sgd", 0.1))], [])
    assert str(err.value).startswith("table 'user' exists with rule rowwise_adagrad; this declaration asks for sgd")
    with pytest.raises(FailedPrecondition, match=r"exists with rule rowwise_adagrad and other hyper-parameters: lr 0.1 != 0.2"):
        shard.declare([TableConfig("user", 4, optimizer=OptimizerConfig("rowwise_adagrad", 0.2))], [])
    shard.declare([], [DenseDecl("d", 0, torch.zeros(2), OptimizerConfig("adam"))])
    with pytest.raises(FailedPrecondition, match=r"dense chunk d\[0\] exists with rule adam; this declaration asks for ftrl"):
        shard.declare([], [DenseDecl("d", 0, torch.zeros(2), OptimizerConfig("ftrl"))])
    assert list(shard.tables) == ["user"] and shard.tables["user"].config.optimizer.name == "rowwise_adagrad"
    # Over gRPC, a second worker with another rule gets the same one line.
    address = [f"127.0.0.1:{inproc_shard.port}"]
    a, b = make_client(address, "a"), make_client(address, "b")
    try:
        a.declare([TableConfig("user", 4, optimizer=OptimizerConfig("adagrad", 0.1))])
        with pytest.raises(FailedPrecondition, match="table 'user' exists with rule adagrad; this declaration asks for adam") as err2:
            b.declare([TableConfig("user", 4, optimizer=OptimizerConfig("adam", 0.1))])
        assert "\n" not in str(err2.value)
    finally:
        a.close()
        b.close()


def test_help_names_the_flags() -> None:
    from tether.common import settings as fields
    from tether.worker.config import JOB, MODEL, WorkerConfig

    p = argparse.ArgumentParser()
    fields.add_flags(p, WorkerConfig, groups=(JOB, MODEL))  # the job's flags, as tether launch adds them
    text = p.format_help()
    for flag in ("--table-optimizer", "--optimizer-config", "--delay-compensation"):
        assert flag in text


@pytest.mark.parametrize("where", ["local", "shard"])
def test_specs_naming_some_tables_leave_the_others_as_the_trainer_makes_them(where: str, request: pytest.FixtureRequest) -> None:
    """``Trainer(tables=[...])`` for one table (FTRL's zero start is set only there): the model's
    other tables are declared as without ``tables``, and training pulls and pushes them, in local
    mode and on a shard (which refused the first pull of an undeclared table)."""
    place: dict = {"local": True} if where == "local" else {"shards": (f"127.0.0.1:{request.getfixturevalue('inproc_shard').port}",)}
    config = TrainingConfig(**place, optimizer="adagrad", lr=0.3, init_scale=0.25, seed=7, steps=2, log_every=1, prefetch=False, device="cpu")
    local = TrainingConfig(local=True, optimizer="adagrad", lr=0.3, init_scale=0.25, seed=7)
    with _trainer(local) as full:
        default_item = full.client.tables["item"].config
    user = TableConfig("user", 3, optimizer=OptimizerConfig("ftrl", 0.05), init_scale=0.0)
    with _trainer(config, [user]) as t:
        batch = {"u": torch.tensor([[1], [2]]), "i": torch.tensor([[5], [6]])}
        record = t.fit([batch, batch])
        assert record.steps == 2
    assert default_item == TableConfig("item", 3, OptimizerConfig("adagrad", 0.3), init_scale=0.25, seed=7)
    if where == "local":
        assert t.client.tables["user"].config == user
        assert t.client.tables["item"].config == default_item
        # FTRL's zero start held for the table the spec named; the other started from init_scale.
        assert not t.client.tables["item"].pull(np.array([5, 6], np.int64)).eq(0).all()
    else:
        # What the shard holds came over the wire (float32): the rule, the start and the seed.
        got = {name: (c.optimizer.name, c.init_scale, c.seed) for name, c in ((n, t.config) for n, t in request.getfixturevalue("inproc_shard").shard.tables.items())}
        assert got == {"user": ("ftrl", 0.0, user.seed), "item": ("adagrad", 0.25, 7)}
