"""Per-table rules, schedules and DC-ASGD in real jobs, as a team meets them with a model of its own
(tests/scripts/two_table_model.py: two tables of different widths, negative 64-bit ids, a
two-head dense tower, dataclass batches) through ``TrainingConfig`` and ``tether launch
--script``, and the rules' edge cases that surfaced there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tether.protos.schedules import Schedule
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.optimizers import rule
from tether.server.storage.tables import EmbeddingTable

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "two_table_model.py"


def _run_script(tmp_path: Path, env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env}, cwd=ROOT)


def _launch(tmp_path: Path, *flags: str, script_args: str = "", timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tether.deploy.cli", "launch", "--script", str(SCRIPT),
         "--script-args", f"--out {tmp_path / 'out'} {script_args}", "--out", str(tmp_path / "job"), *flags],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


def _records(tmp_path: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((tmp_path / "out").glob("worker-*.json"))]


# -- FTRL at a zero rate ------------------------------------------------------------------------------


def test_ftrl_at_a_zero_rate_leaves_rows_and_state_unchanged_in_both_forms() -> None:
    """A cosine schedule's default floor is a rate of 0; FTRL's step divides by the rate
    (sigma = rise / lr, the denominator (beta + sqrt(n)) / lr), so a push at rate 0 used to turn
    the rows into NaN on the shard (stored silently; the next push failed with 'gradients
    contain NaN or Inf'). At rate 0 nothing moves, as for every other rule."""
    cfg = OptimizerConfig("ftrl", lr=0.3)
    table = EmbeddingTable(TableConfig("t", 4, cfg, init_scale=0.1, seed=3))
    ids = np.arange(5, dtype=np.int64)
    g = torch.linspace(-1, 1, 20).reshape(5, 4)
    table.push(ids, g)  # one real step: z, n and the weights move
    before = {"weights": table.snapshot()["weights"].clone(), "state": {k: v.clone() for k, v in table.snapshot()["state"].items()}}
    table.push(ids, g, lr_scale=0.0)
    table.push(ids, g, lr_scale=np.zeros(5))
    after = table.snapshot()
    assert torch.isfinite(after["weights"]).all()
    assert torch.equal(after["weights"], before["weights"])
    for k in ("z", "n"):
        assert torch.equal(after["state"][k], before["state"][k]), k
    # The torch form (local mode, dense chunks, sync's dense optimizer) does the same.
    r = rule("ftrl")
    w = torch.full((3, 4), 0.2)
    state = {"z": torch.zeros(3, 4), "n": torch.zeros(3, 4)}
    r.apply(cfg, w, torch.ones(3, 4), state)
    w1, z1, n1 = w.clone(), state["z"].clone(), state["n"].clone()
    r.apply(cfg, w, torch.ones(3, 4), state, lr_scale=0.0)
    assert torch.equal(w, w1) and torch.equal(state["z"], z1) and torch.equal(state["n"], n1)


def test_ftrl_under_a_cosine_schedule_to_zero_trains_in_local_mode(tmp_path: Path) -> None:
    """The outsider's run that failed: items=ftrl with decay=cosine (min_lr 0 by default) past
    its decay_steps, and dense=ftrl too; local mode, 8 steps."""
    proc = _run_script(tmp_path, {
        "TETHER_LOCAL": "1", "TETHER_STEPS": "8",
        "TETHER_TABLE_OPTIMIZER": "items=ftrl:lr=0.3,decay=cosine,decay_steps=3;dense=ftrl:lr=0.1,decay=cosine,decay_steps=3",
    })
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record,) = _records(tmp_path)
    assert record["steps"] == 8
    assert np.isfinite(np.array(record["rows"]["items"])).all()
    # Local mode's Info answers as one shard would (it used to answer []): the rules are checkable.
    assert record["info"] == [{"tables": {"ctx": "adagrad", "items": "ftrl"}, "dense": ["ftrl"]}]


def test_the_schedule_floor_is_a_step_function_of_the_clock() -> None:
    """cosine over 3 steps: steps 0, 1, 2 move (1, 3/4, 1/4 of lr), step 3 on does not."""
    s = Schedule(decay="cosine", decay_steps=3)
    assert [round(s.lr_at(0.4, k), 6) for k in range(5)] == [0.4, 0.3, 0.1, 0.0, 0.0]


# -- per-table rules from code ------------------------------------------------------------------------


def test_table_optimizers_in_code_take_a_text_a_list_or_a_path(tmp_path: Path) -> None:
    """An outsider writes ``table_optimizers="items=adam"`` (the variable's form), a list, or
    ``optimizer_config=Path(...)``: the text used to be read one character per entry ('i':
    expected NAME=RULE), the Path failed with AttributeError ('endswith'), and a list made the
    config unhashable. Each is now held as the flags hold it."""
    from tether.worker.config import TrainingConfig

    file = tmp_path / "rules.toml"
    file.write_text('[ctx]\nrule = "ftrl"\nlr = 0.2\n')
    text = TrainingConfig(local=True, table_optimizers="items=adam:lr=0.01;dense=sgd", optimizer_config=file)
    assert text.table_optimizers == ("items=adam:lr=0.01", "dense=sgd")
    assert text.optimizer_config == str(file)
    rules = text.table_rules
    assert {n: rules.optimizer(n).name for n in ("items", "ctx", "dense")} == {"items": "adam", "ctx": "ftrl", "dense": "sgd"}
    assert rules.optimizer("items").lr == 0.01 and rules.optimizer("ctx").lr == 0.2
    listed = TrainingConfig(local=True, table_optimizers=["items=adam:lr=0.01", "dense=sgd"], optimizer_config=file)
    assert listed == text and hash(listed) == hash(text)
    with pytest.raises(ValueError, match="unknown key 'lrr'"):
        TrainingConfig(local=True, table_optimizers="items=adam:lrr=1")


# -- schedules: the floor holds rows and dense parameters ---------------------------------------------


def test_a_zero_rate_floor_keeps_rows_and_dense_fixed_in_local_mode(tmp_path: Path) -> None:
    """cosine over 3 steps with the default floor (0): 3 and 6 steps end with the same rows and
    dense parameters, 2 and 3 steps do not (step 2 takes a quarter of the rate), for sgd rows,
    FTRL rows and Adam's dense parameters (read back through trainer.evaluate)."""
    rules = ("ctx=sgd:lr=0.5,decay=cosine,decay_steps=3;items=ftrl:lr=0.3,decay=cosine,decay_steps=3;"
             "dense=adam:lr=0.01,decay=cosine,decay_steps=3")
    ends = {}
    for steps in (2, 3, 6):
        proc = _run_script(tmp_path / str(steps), {"TETHER_LOCAL": "1", "TETHER_STEPS": str(steps), "TETHER_TABLE_OPTIMIZER": rules})
        assert proc.returncode == 0, proc.stderr[-2000:]
        (ends[steps],) = _records(tmp_path / str(steps))
    for t in ("ctx", "items"):
        assert ends[3]["rows"][t] == ends[6]["rows"][t], t
        assert ends[2]["rows"][t] != ends[3]["rows"][t], t
    assert ends[3]["dense"] == ends[6]["dense"]
    moved = max(float(np.abs(np.array(ends[2]["dense"][k]) - np.array(ends[3]["dense"][k])).max()) for k in ends[2]["dense"])
    assert 0.2 * 0.01 < moved <= 0.26 * 0.01  # Adam moves an element by about its rate: step 2's is lr / 4


# -- tether launch --script in sync: flags and a file, each shard's Info ------------------------------


def test_sync_launch_applies_per_table_rules_from_flags_and_a_file(tmp_path: Path) -> None:
    """The cheap CI run of the per-table path under torchrun: a JSON file names items and ctx,
    a flag replaces ctx's entry and sets dense's; every shard's Info reports each table's rule,
    the ranks end with equal dense parameters and the loss falls."""
    file = tmp_path / "rules.json"
    file.write_text(json.dumps({"items": {"rule": "ftrl", "lr": 0.3}, "ctx": {"rule": "sgd", "lr": 0.1}}))
    proc = _launch(tmp_path, "--mode", "sync", "--num-workers", "2", "--num-shards", "2", "--steps", "25",
                   "--optimizer-config", str(file), "--table-optimizer", "ctx=rowwise_adagrad:lr=0.3",
                   "--table-optimizer", "dense=adam:lr=0.01,warmup_steps=5,decay=cosine,decay_steps=20,min_lr=0.001")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = _records(tmp_path)
    assert [r["steps"] for r in records] == [25, 25]
    for r in records:
        assert r["info"] == [{"tables": {"ctx": "rowwise_adagrad", "items": "ftrl"}, "dense": []}] * 2
        assert r["last_loss"] < 0.5 * r["first_loss"], r
    assert records[0]["dense_after_fit"] == records[1]["dense_after_fit"]


# -- the rest of the modes (slow: a launch each) ------------------------------------------------------


def _lingering(tmp_path: Path) -> list[str]:
    """Processes still running whose command line names this test's directory."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(tmp_path) in line and "ps -eo" not in line]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "ssp:2"])
def test_async_and_ssp_apply_per_table_rules_with_delay_compensation(tmp_path: Path, mode: str) -> None:
    proc = _launch(tmp_path, "--mode", mode, "--num-workers", "2", "--num-shards", "2", "--delay-compensation", "0.5",
                   "--table-optimizer", "items=rowwise_adagrad:lr=0.2", "--table-optimizer", "ctx=ftrl:lr=0.5",
                   "--table-optimizer", "dense=adam:lr=0.01,warmup_steps=5")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for r in _records(tmp_path):
        assert r["steps"] == 40
        assert [s["tables"] for s in r["info"]] == [{"ctx": "ftrl", "items": "rowwise_adagrad"}] * 2
        assert sorted(d for s in r["info"] for d in s["dense"]) == ["adam"]  # one chunk, on one shard
        assert r["last_loss"] < 0.2 * r["first_loss"], r


@pytest.mark.slow
def test_sync_schedule_floor_holds_rows_and_the_ranks_dense_optimizer(tmp_path: Path) -> None:
    rules = ("--table-optimizer", "ctx=sgd:lr=0.5,warmup_steps=2,decay=cosine,decay_steps=3",
             "--table-optimizer", "dense=adam:lr=0.01,decay=cosine,decay_steps=3")
    ends = {}
    for steps in (1, 6, 12):
        proc = _launch(tmp_path / str(steps), "--mode", "sync", "--num-workers", "2", "--num-shards", "2", "--steps", str(steps), *rules)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        ends[steps] = _records(tmp_path / str(steps))[0]
    assert ends[1]["rows"]["ctx"] != ends[6]["rows"]["ctx"] and ends[6]["rows"]["ctx"] == ends[12]["rows"]["ctx"]
    assert ends[6]["rows"]["items"] != ends[12]["rows"]["items"]  # the job's default rule, no schedule
    assert ends[1]["dense"] != ends[6]["dense"] and ends[6]["dense"] == ends[12]["dense"]


@pytest.mark.slow
@pytest.mark.parametrize("flags, code, line", [
    (["--mode", "sync", "--delay-compensation", "0.5"], 2, "--delay-compensation is for async and ssp:S: sync has no stale"),
    (["--table-optimizer", "items=adamw"], 2, "optimizer of 'items': unknown rule 'adamw'"),
    (["--table-optimizer", "items=adam:lrr=0.1"], 2, "optimizer of 'items': unknown key 'lrr'"),
    (["--table-optimizer", "items=ftrl:beta=0,l2=0,initial_accumulator=0"], 2, "ftrl needs beta > 0, l2 > 0 or initial_accumulator > 0"),
    (["--mode", "sync", "--table-optimizer", "ctx=sgd:decay=cosine"], 2, "decay=cosine needs decay_steps >= 1"),
    (["--table-optimizer", "users=adam"], 1, "name table 'users', which the model does not have (its tables: ctx, items"),
])
def test_bad_entries_end_the_launch_with_their_line_and_leave_nothing(tmp_path: Path, flags: list[str], code: int, line: str) -> None:
    proc = _launch(tmp_path, "--num-workers", "2", "--num-shards", "1", *flags, timeout=120)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert line in proc.stderr.strip().splitlines()[-1]
    if code == 2:  # refused before anything started: one line
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    assert not _lingering(tmp_path)


@pytest.mark.slow
def test_delay_compensation_is_refused_in_local_mode(tmp_path: Path) -> None:
    """A script's TrainingConfig.from_env() raises the line (its documented ValueError)."""
    local = _run_script(tmp_path, {"TETHER_LOCAL": "1", "TETHER_DELAY_COMPENSATION": "0.5"})
    assert local.returncode == 1 and "local mode has no stale gradient" in local.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_a_table_spec_in_code_with_another_dim_than_the_module_is_one_line() -> None:
    """Trainer(tables=[TableConfig("items", 5, ...)]) for a ShardedEmbeddingBag("items", 6) used to
    declare dim 5 and fail in the user's forward pass ('mat1 and mat2 shapes cannot be multiplied')."""
    from torch import nn

    from tether.protos.errors import UsageError
    from tether.worker.config import TrainingConfig
    from tether.worker.training.embedding_bag import ShardedEmbeddingBag
    from tether.worker.training.trainer import Trainer

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items, self.ctx = ShardedEmbeddingBag("items", 6), ShardedEmbeddingBag("ctx", 2)

        def forward(self, b: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.items(b), self.ctx(b)], 1).sum(1)

    tables = [TableConfig("items", 5, OptimizerConfig("adam", lr=0.01)), TableConfig("ctx", 2)]
    with pytest.raises(UsageError, match=r"declares table 'items' with dim 5, but the model's ShardedEmbeddingBag\('items', \.\.\.\) has dim 6"):
        Trainer(Model(), TrainingConfig(local=True), loss=lambda m, b: m(b).sum(), sparse=lambda b: {"items": b, "ctx": b}, tables=tables)
    fine = [TableConfig("items", 6, OptimizerConfig("adam", lr=0.01)), TableConfig("ctx", 2)]
    with Trainer(Model(), TrainingConfig(local=True, table_optimizers=("ctx=ftrl",)), loss=lambda m, b: m(b).sum(),
                 sparse=lambda b: {"items": b, "ctx": b}, tables=fine) as trainer:
        assert {t.name: t.optimizer for t in trainer.client.info()[0].tables} == {"items": "adam", "ctx": "ftrl"}  # the code's spec; the entry wins
