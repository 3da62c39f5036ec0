"""Configs declared once (``tether.common.settings``): every flag of ``tether worker`` and ``tether
server`` is made from a field's declaration and defaults to it, a concept two configs share has
one default, and what a launcher hands a child (its config file, flags or ``TETHER_*`` variables)
reproduces the config field for field, every field set to a value that is not its default; a
process parses its consistency mode once."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tether.common import cli_args
from tether.common import settings as fields
from tether.common.cli_args import DeprecatedAlias
from tether.common.config_file import to_json
from tether.common.settings import to_argv as worker_argv
from tether.common.settings import to_env as job_env
from tether.protos.codec import WIRE_DTYPES
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server import config as server_config
from tether.server.config import ShardConfig
from tether.worker import flags as worker_flags
from tether.worker.client.config import ClientConfig
from tether.worker.client.local import LocalClient
from tether.worker.config import TrainingConfig, WorkerConfig

# Flags a parser has that are no config field: help, the preset that fills three fields, and the
# file of field values a launcher hands a worker.
NOT_FIELDS = {"help", "preset", "config"}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TETHER_* variable (parsers and from_env read them), no torchrun rank."""
    for name in list(os.environ):
        if name.startswith("TETHER_") or name in ("JOB_COMPLETION_INDEX", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)


def non_default(cls: type, special: Mapping[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """A value for every declared field of ``cls`` that is not its default: made from the field's
    declaration (a switch flipped, another choice, a number moved, a name made up), or taken from
    ``special`` for a field whose values are constrained. A field added later gets one too, or
    this fails naming it, so no field can be left out of the round trips below."""
    values: dict[str, Any] = {}
    for f, decl in fields.declared(cls):
        if f.name in keep:
            continue
        default = fields.default_of(cls, f.name)
        if f.name in special:
            value = special[f.name]
        elif decl.switch:
            value = not default
        elif decl.choices:
            value = next(c for c in decl.choices if c != default)
        elif isinstance(default, float):
            value = default * 2 + 0.5
        elif isinstance(default, int):
            value = default + 3
        elif decl.parse is cli_args.optional_int:
            value = 7
        elif decl.parse is cli_args.optional_float:
            value = 2.5
        elif decl.parse is cli_args.optional_str:
            value = f"/tmp/tether-{f.name}"
        else:
            raise AssertionError(f"{cls.__name__}.{f.name}: give it a value that is not its default in this test's special values")
        assert value != default, (cls.__name__, f.name, value)
        values[f.name] = value
    return values


def _token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    return str(path)


def _optimizer_file(tmp_path: Path) -> str:
    path = tmp_path / "optimizers.json"
    path.write_text('{"u": {"rule": "adagrad", "lr": 0.2}}')
    return str(path)


def _special(tmp_path: Path) -> dict[str, object]:
    """Hand-picked non-default values for the fields an automatic change would not make valid,
    shared by the worker's config and the script's (``TrainingConfig``)."""
    return {
        "shards": ("127.0.0.1:1", "127.0.0.1:2"),
        "mode": "ssp:3",
        "remedy_decay": 0.9,  # in (0, 1)
        "device": "cpu",
        "straggler": "transient:0.5:3",
        "auth_token_file": _token_file(tmp_path),
        "optimizer_config": _optimizer_file(tmp_path),
        "resume_data": _positions_folder(tmp_path),
    }


def _positions_folder(tmp_path: Path) -> str:
    path = tmp_path / "positions"
    path.mkdir(exist_ok=True)
    return str(path)


def _worker_config(tmp_path: Path) -> WorkerConfig:
    """Every field away from its default: a Parquet table (row groups for 4 workers), since the
    folder of positions (``_special``) is refused with Criteo files."""
    pytest.importorskip("pyarrow")
    from tether.worker.data.criteo import write_criteo_sample
    from tether.worker.data.parquet import write_criteo_parquet

    write_criteo_sample(tmp_path / "day.tsv", 400)
    write_criteo_parquet(str(tmp_path / "day.tsv"), str(tmp_path / "day.parquet"), row_group_rows=50)
    special = {
        **_special(tmp_path),
        "data": f"parquet:{tmp_path / 'day.parquet'}",
        "table_optimizers": ("t=sgd:lr=0.1,warmup_steps=5,decay=cosine,decay_steps=20", "dense=adam:weight_decay=0.001"),
    }
    # Local mode and a shard list exclude each other: local gets its own round trip. Pushes in
    # flight (push_window > 1) need async with prefetching: test_a_push_window_travels_in_the_config_file.
    return WorkerConfig(**non_default(WorkerConfig, special, keep=("local", "push_window")), auth_token="s3cret-token")


def _shard_config(tmp_path: Path) -> ShardConfig:
    pem = {name: tmp_path / f"{name}.pem" for name in ("tls_cert", "tls_key", "tls_client_ca")}
    for path in pem.values():
        path.write_text("")
    special = {
        "host": "0.0.0.0",
        "max_message_bytes": 300 * server_config.MIB,
        "data_buffer_bytes": 2048 * server_config.MIB,
        "auth_token_file": _token_file(tmp_path),
        **{name: str(path) for name, path in pem.items()},
    }
    # A test hook with no flag: the environment of the shard's own process sets it.
    values = non_default(ShardConfig, special, keep=("crash_before_manifest",))
    return ShardConfig(**values, auth_token="s3cret-token")


# -- every flag is a declaration, with the declaration's default ------------------------------------


@pytest.mark.parametrize("cls, parser", [(WorkerConfig, worker_flags.build_parser), (ShardConfig, server_config.build_parser)])
def test_every_flag_is_made_from_a_declaration_and_defaults_to_it(cls: type, parser: Any, clean_env: None) -> None:
    built: argparse.ArgumentParser = parser()
    declared = {decl.dest: (f, decl) for f, decl in fields.declared(cls) if decl.flag is not None}
    actions = {a.dest: a for a in built._actions if a.dest not in NOT_FIELDS and not isinstance(a, DeprecatedAlias)}  # old spellings
    # Every flag is declared, and every declared flag is there: nothing is written twice.
    assert set(actions) == set(declared)
    for dest, action in actions.items():
        f, decl = declared[dest]
        default = fields.default_of(cls, f.name)
        if decl.switch:
            expected: Any = bool(default) != decl.negated
        elif decl.unset or default is None:
            expected = None
        else:
            expected = decl.show(default)
        assert action.default == expected, (cls.__name__, f.name, action.default, default)
        assert action.option_strings == [decl.flag]
        assert decl.env == "TETHER_" + decl.dest.upper(), (f.name, decl.env)  # the rule a child's environment is written by
        # The help names the variable once, where HelpFormatter finds it.
        assert decl.env_note() in (action.help or "") and "(env " not in decl.help, f.name
        if not decl.switch and default is not None and not decl.unset:
            assert decl.parse(decl.show(default)) == default, f.name  # the text form reads back


def test_declarations_name_each_flag_and_variable_once() -> None:
    for cls in (WorkerConfig, ShardConfig):
        decls = [decl for _, decl in fields.declared(cls)]
        flags = [d.flag for d in decls if d.flag is not None]
        assert len(flags) == len(set(flags)), cls
        assert len({d.env for d in decls}) == len(decls), cls


def test_one_default_per_concept(clean_env: None) -> None:
    """A setting two configs share has the one default: the training job's connection settings
    are the client's, its update rule and rate the optimizer's, its new rows' scale the
    table's (so passing tables= does not change where rows start)."""
    address = ("127.0.0.1:1",)
    assert TrainingConfig(shards=address).client_config() == ClientConfig(addresses=address, worker_id="worker-0")
    assert fields.default_of(TrainingConfig, "wire_dtype") in WIRE_DTYPES
    optimizer = OptimizerConfig()
    job = TrainingConfig(local=True)
    assert (job.optimizer, job.lr) == (optimizer.name, optimizer.lr)
    assert job.init_scale == TableConfig("t", 1).init_scale
    local = LocalClient().config
    assert (local.timeout_s, local.call_deadline_s) == (job.timeout_s, job.call_deadline_s)
    # The worker's built-in job runs 2000 steps; a user's until its data ends.
    assert (WorkerConfig(local=True).steps, job.steps) == (2000, None)
    # from_env and the flags agree on every default.
    assert TrainingConfig.from_env(local=True) == job
    assert worker_flags.load_config(["--local"]) == WorkerConfig(local=True)
    assert server_config.load_config([]) == ShardConfig() == ShardConfig.from_env()


def test_a_job_setting_reaches_the_client_in_one_call() -> None:
    cfg = TrainingConfig(shards=("127.0.0.1:1",), worker_index=2, num_workers=3, timeout_s=7.0, call_deadline_s=9.0,
                         wire_dtype="bfloat16", transport="tcp", staleness_aware=True)
    client = cfg.client_config()
    assert (client.worker_id, client.timeout_s, client.call_deadline_s) == ("worker-2", 7.0, 9.0)
    assert (client.wire_dtype, client.transport, client.staleness_aware) == (WIRE_DTYPES["bfloat16"], "tcp", True)
    # In sync no gradient is stale: the shards are never asked to scale for it.
    assert not dataclasses.replace(cfg, mode="sync").client_config().staleness_aware


# -- round trips: argv and environment, every field not at its default -----------------------------


def test_a_launched_worker_gets_every_setting_through_flags_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    """What tether launch hands a worker (flags for tether worker, TETHER_* for a user's script)
    reproduces the job's config field for field, every field set away from its default."""
    cfg = _worker_config(tmp_path)
    assert cfg.auth_token == "s3cret-token"
    again = worker_flags.config_from_args(worker_flags.build_parser().parse_args(worker_argv(cfg)))
    assert again == cfg
    assert "s3cret-token" not in " ".join(worker_argv(cfg)) and "s3cret-token" not in job_env(cfg).values()
    for name, value in job_env(cfg).items():
        monkeypatch.setenv(name, value)
    assert WorkerConfig.from_env() == cfg
    from_env = TrainingConfig.from_env()
    for f in dataclasses.fields(TrainingConfig):
        assert getattr(from_env, f.name) == getattr(cfg, f.name), f.name
    # Local mode (which takes no shards) the same way.
    local = dataclasses.replace(cfg, shards=(), local=True, delay_compensation=0.0, dc_adaptive=False,
                                gap_aware=False)  # DC and gap-aware need shards
    for name in ("TETHER_DC_ADAPTIVE", "TETHER_GAP_AWARE"):  # a switch that is off has no flag: its variable would win
        monkeypatch.delenv(name)
    assert worker_flags.config_from_args(worker_flags.build_parser().parse_args(worker_argv(local))) == local


@dataclasses.dataclass(frozen=True)
class _Job:
    limit: int | None = fields.setting(5, flag="--limit", parse=cli_args.optional_int, help="a limit; empty: none")
    name: str | None = fields.setting(None, flag="--name", parse=cli_args.optional_str, help="a name")


def test_unset_values_travel_too() -> None:
    """A field set to None where its default is not is told as an empty value, not left to the
    child's default; a None that is the default too is left out (a variable the child inherits
    may still set it)."""
    cfg = _Job(limit=None)
    assert fields.to_argv(cfg) == ["--limit", ""] and fields.to_env(cfg) == {"TETHER_LIMIT": ""}
    parser = argparse.ArgumentParser()
    fields.add_flags(parser, _Job, environ={})
    assert _Job(**fields.values_from_args(_Job, parser.parse_args(fields.to_argv(cfg)), environ={})) == cfg
    assert fields.from_env(_Job, environ=fields.to_env(cfg)) == cfg
    assert fields.from_env(_Job, {"name": "x"}, environ={"TETHER_LIMIT": "9"}) == _Job(limit=9, name="x")


def test_a_shard_config_round_trips_through_flags_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    cfg = _shard_config(tmp_path)
    assert server_config.load_config(fields.to_argv(cfg)) == cfg
    assert "s3cret-token" not in fields.to_argv(cfg)
    off = dataclasses.replace(cfg, data_port=None)
    assert server_config.load_config(fields.to_argv(off)).data_port is None
    for name, value in fields.to_env(cfg).items():
        monkeypatch.setenv(name, value)
    assert ShardConfig.from_env() == cfg
    assert server_config.load_config([]) == cfg  # every flag falls back to its variable


def test_the_round_trips_cover_every_field() -> None:
    """Every field of the configs a launcher hands on is declared (so ``non_default`` moves it and
    the round trips above check it) or derived and set by hand there: a plain dataclass field
    added later fails here instead of going untested."""
    for cls, by_hand in ((WorkerConfig, {"auth_token"}), (ShardConfig, {"auth_token"})):
        declared = {f.name for f, _ in fields.declared(cls)}
        assert {f.name for f in dataclasses.fields(cls)} == declared | by_hand, cls.__name__


def test_launch_gives_every_shard_each_cluster_wide_setting(tmp_path: Path, clean_env: None) -> None:
    """``tether launch``'s shard flags: every ShardConfig field but those the launcher sets per
    shard, each away from its default, reaches the shard's own parser unchanged, through the
    config file the launcher hands each shard."""
    from tether.deploy.shard_args import LAUNCHER_SET, add_shard_flags, shard_config

    cfg = _shard_config(tmp_path)
    parser = argparse.ArgumentParser()
    add_shard_flags(parser)
    file = tmp_path / "shard-0.config.json"
    file.write_text(to_json(shard_config(parser.parse_args(fields.to_argv(cfg, exclude=LAUNCHER_SET)))))
    again = server_config.load_config(["--config", str(file)])
    passed = [f.name for f, d in fields.declared(ShardConfig) if d.flag is not None and f.name not in LAUNCHER_SET]
    assert len(passed) >= 10
    for name in passed:
        assert getattr(again, name) == getattr(cfg, name) != fields.default_of(ShardConfig, name), name


# -- the environment's mistakes are named -----------------------------------------------------------


def test_a_bad_variable_is_named_with_its_value(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_LR", "fast")
    with pytest.raises(ValueError, match="TETHER_LR='fast'"):
        TrainingConfig.from_env(local=True)
    assert TrainingConfig.from_env(local=True, lr=0.5).lr == 0.5  # an override is not read from the environment
    monkeypatch.setenv("TETHER_DATA_PORT", "some")
    with pytest.raises(ValueError, match="TETHER_DATA_PORT='some': must be a port number or 'off'"):
        ShardConfig.from_env()


def test_the_worker_index_falls_back_to_the_kubernetes_completion_index(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    assert TrainingConfig.from_env(local=True, num_workers=3).worker_index == 2
    assert worker_flags.load_config(["--local", "--num-workers", "3"]).worker_index == 2
    monkeypatch.setenv("TETHER_WORKER_INDEX", "1")
    assert TrainingConfig.from_env(local=True, num_workers=3).worker_index == 1


def test_the_shard_test_hook_is_read_from_its_variable_only(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not server_config.load_config([]).crash_before_manifest
    monkeypatch.setenv(server_config.CRASH_BEFORE_MANIFEST_ENV, "1")
    assert server_config.load_config([]).crash_before_manifest
    assert "--crash-before-manifest" not in server_config.build_parser().format_help()


def test_a_declaration_needs_what_cannot_be_guessed() -> None:
    with pytest.raises(ValueError, match="give parse="):
        fields.setting(None, flag="--x", help="x")
    with pytest.raises(ValueError, match="needs env="):
        fields.setting(0, flag=None, help="x")


# -- tether launch hands each worker one file: every field as it is, the mode parsed once per process ----


class _Spawned:
    """What ``LocalCluster.start_workers`` started, recorded instead of started."""

    def __init__(self) -> None:
        self.argv: dict[str, list[str]] = {}
        self.env: dict[str, dict[str, str]] = {}
        self.unset: dict[str, tuple[str, ...]] = {}

    def __call__(
        self, log_dir: Path, name: str, argv: list[str], echo: bool, env: dict[str, str] | None = None, unset: Any = (), notices: Any = None,
    ) -> Any:
        self.argv[name], self.env[name], self.unset[name] = list(argv), dict(env or {}), tuple(unset)
        return SimpleNamespace(name=name, argv=argv, env=env, steps=None)


def _start_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cfg: WorkerConfig, addresses: tuple[str, ...]) -> dict[str, list[str]]:
    """The ``tether worker`` argv of each worker ``start_workers`` starts for ``cfg`` against ``addresses``."""
    from tether.deploy import launch

    spawned = _Spawned()
    monkeypatch.setattr(launch, "spawn", spawned)
    cluster = launch.LocalCluster(log_dir=tmp_path / "logs")
    cluster.addresses = list(addresses)
    cluster.start_workers(cfg, echo=False)
    return {name: argv[argv.index("tether.worker") + 1:] for name, argv in spawned.argv.items()}


def test_a_push_window_travels_in_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    cfg = dataclasses.replace(_worker_config(tmp_path), mode="async", prefetch=True, push_window=4)
    argv = _start_workers(tmp_path, monkeypatch, cfg, ("127.0.0.1:7001", "127.0.0.1:7002"))["worker-0"]
    assert worker_flags.load_config(argv).push_window == 4


def test_a_launched_worker_reads_every_field_from_its_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    """``tether launch`` gives each worker ``--config FILE``: the job's config as typed JSON, read
    back into the very config, every field away from its default (the token is never written: the
    worker reads it from its file again). A flag given beside the file wins."""
    cfg = _worker_config(tmp_path)
    addresses = ("127.0.0.1:7001", "127.0.0.1:7002")
    argvs = _start_workers(tmp_path, monkeypatch, cfg, addresses)
    assert sorted(argvs) == [f"worker-{i}" for i in range(cfg.num_workers)]
    for i in range(cfg.num_workers):
        argv = argvs[f"worker-{i}"]
        assert argv[0] == "--config" and len(argv) == 2, argv  # one file, no flags rendered
        assert "s3cret-token" not in Path(argv[1]).read_text()
        assert '"mode": "ssp:3"' in Path(argv[1]).read_text()
        got = worker_flags.load_config(argv)
        expected = dataclasses.replace(cfg, shards=addresses, worker_index=i)
        for f in dataclasses.fields(WorkerConfig):
            assert getattr(got, f.name) == getattr(expected, f.name), f.name
            assert type(getattr(got, f.name)) is type(getattr(expected, f.name)), f.name
        assert got == expected
    # A restart's --steps (or any flag) beside the file wins; the rest is the file's.
    again = worker_flags.load_config([*argvs["worker-1"], "--steps", "9", "--no-prefetch"])
    assert (again.steps, again.prefetch, again.worker_index, again.lr) == (9, False, 1, cfg.lr)
    # A None the default is too is not written (a switch that is off neither): what the worker inherits
    # still sets it, as with flags (a TLS file or a worker name given to tether launch's environment).
    unnamed = _start_workers(tmp_path, monkeypatch, dataclasses.replace(cfg, worker_id=None), addresses)["worker-0"]
    assert "worker_id" not in Path(unnamed[1]).read_text() and worker_flags.load_config(unnamed).worker_id is None
    monkeypatch.setenv("TETHER_WORKER_ID", "inherited")
    assert worker_flags.load_config(unnamed).worker_id == "inherited"
    # Sync: one file for torchrun's ranks (each takes its rank from torchrun).
    sync = _start_workers(tmp_path, monkeypatch, dataclasses.replace(cfg, mode="sync", delay_compensation=0.0, dc_adaptive=False,
                                                                 gap_aware=False, **cfg.without_cache()), addresses)
    assert (lambda m: (m.kind, m.bound))(worker_flags.load_config(sync["torchrun"]).mode) == ("sync", None)


def test_a_bad_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None) -> None:
    from tether.worker.__main__ import main

    bad = {"missing.json": None, "list.json": "[1]", "unknown.json": '{"speed": 3}', "typed.json": '{"lr": "fast"}',
           "mode.json": '{"mode": "ssp:x", "local": true}'}
    lines = {}
    for name, text in bad.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        assert main(["--config", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("tether worker: error: "), err
        # What the file holds is checked as a flag's value is (the mode names itself); the rest names the file.
        assert name == "mode.json" or f"--config {tmp_path / name}: " in err, err
        lines[name] = err
    assert "No such file" in lines["missing.json"] and "expected a JSON object" in lines["list.json"]
    assert "has no field speed" in lines["unknown.json"] and "lr: expected float, got 'fast'" in lines["typed.json"]
    assert "mode must be 'async', 'ssp:S'" in lines["mode.json"]


def test_the_mode_is_parsed_once_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    """``tether launch --mode ssp:2`` parses the mode once (the config keeps the parsed ``Mode``,
    and every copy and reader shares it); a worker started from the file parses it once and
    trains (local mode, so no shard is needed) without parsing it again."""
    from tether.deploy import cli, job
    from tether.worker.ctr.job import train
    from tether.worker.training import mode as worker_mode

    calls: list[object] = []
    parse = worker_mode.parse_mode
    monkeypatch.setattr(worker_mode, "parse_mode", lambda text: calls.append(text) or parse(text))
    argvs: dict[str, list[str]] = {}

    def run_job(template: WorkerConfig, num_shards: int, out: str | None = None, **_: Any) -> dict[str, Any]:
        # run_job's own copy, then start_workers' per worker, with their processes recorded.
        argvs.update(_start_workers(tmp_path, monkeypatch, dataclasses.replace(template, out=out), ("127.0.0.1:7001",)))
        return {"eval_loss": 0.5, "baseline_loss": 0.6, "eval_auc": 0.7, "total_samples": 1, "train_wall_s": 1.0,
                "samples_per_sec": 1.0, "num_workers": template.num_workers, "num_shards": num_shards}

    monkeypatch.setattr(job, "run_job", run_job)
    assert cli.main(["launch", "--mode", "ssp:2", "--num-workers", "2", "--steps", "2", "--out", str(tmp_path / "out")]) == 0
    assert calls == ["ssp:2"] and sorted(argvs) == ["worker-0", "worker-1"]
    calls.clear()
    local = ["--shards", "", "--local", "--num-workers", "1", "--worker-index", "0", "--vocab-size", "500", "--eval-samples", "64",
             "--batch-size", "16", "--log-every", "1"]
    config = worker_flags.load_config([*argvs["worker-1"], *local])
    assert ((config.mode.kind, config.mode.bound), config.local, config.steps) == (("ssp", 2), True, 2)
    record = train(config, printer=lambda line: None)
    assert calls == ["ssp:2"], calls  # the worker's one parse, when its config was made
    assert (record.mode, record.steps) == ("ssp:2", 2)


@dataclasses.dataclass(frozen=True)
class _Sized:
    PRESETS = fields.Presets(flag="--size", group="m", help="sizes by name", values={"default": {"rows": 4, "width": 2}, "big": {"rows": 64, "width": 8}})

    rows: int = fields.setting(4, flag="--rows", unset=True, group="m", help="rows")
    width: int = fields.setting(2, flag="--width", unset=True, group="m", help="width")
    wait: float = fields.setting(1.0, flag="--wait", old_flag="--old-wait", fallback_env=("TETHER_OLD_WAIT",), group="m", help="wait")
    tags: tuple[str, ...] = fields.setting((), flag="--tag", separator=";", show=";".join, group="m", help="tags")


def test_presets_old_spellings_and_repeatable_flags_are_declared(capsys: pytest.CaptureFixture[str]) -> None:
    """What a launcher's job flags need beyond a field's own flag is declared with the fields: a
    preset fills the ``unset`` fields no flag gave, an old spelling warns and stores under the new
    name, and a repeatable flag's entries replace the variable's."""
    def parse(argv: list[str], environ: Mapping[str, str]) -> _Sized:
        parser = argparse.ArgumentParser(prog="t")
        fields.add_flags(parser, _Sized, environ=environ)
        return _Sized(**fields.values_from_args(_Sized, parser.parse_args(argv), environ=environ))

    assert parse([], {}) == _Sized()
    assert parse(["--size", "big"], {}) == _Sized(rows=64, width=8)
    assert parse(["--size", "big", "--width", "3"], {}) == _Sized(rows=64, width=3)  # a flag given wins
    assert parse([], {"TETHER_SIZE": "big"}).rows == 64
    assert parse(["--old-wait", "7"], {}).wait == 7.0
    assert capsys.readouterr().err.strip() == "t: warning: --old-wait is deprecated and will be removed in the next release; use --wait"
    assert parse([], {"TETHER_OLD_WAIT": "3"}).wait == 3.0
    assert parse(["--tag", "a;b", "--tag", "c"], {"TETHER_TAG": "x;y"}).tags == ("a", "b", "c")
    assert parse([], {"TETHER_TAG": "x;y"}).tags == ("x", "y")
    with pytest.raises(SystemExit):
        parse(["--size", "huge"], {})


@dataclasses.dataclass(frozen=True)
class _Windowed:
    PRESETS = fields.Presets(flag="--size", group="m", help="sizes by name",
                             values={"default": {}, "big": {"rows": 64, "window": lambda v: 2 if v["kind"] == "fast" else 1}})

    rows: int = fields.setting(4, flag="--rows", unset=True, group="m", help="rows")
    kind: str = fields.setting("fast", flag="--kind", group="m", help="kind")
    window: int = fields.setting(1, flag="--window", unset=True, group="m", help="window")


def test_a_preset_value_may_depend_on_the_other_values() -> None:
    """A preset's value may be a function of the flags' values over the defaults (--preset gpu's
    push window is 2 in async only); a flag given for the field still wins."""
    def parse(argv: list[str]) -> _Windowed:
        parser = argparse.ArgumentParser(prog="t")
        fields.add_flags(parser, _Windowed, environ={})
        return _Windowed(**fields.values_from_args(_Windowed, parser.parse_args(argv), environ={}))

    assert parse([]) == _Windowed()
    assert parse(["--size", "big"]) == _Windowed(rows=64, window=2)
    assert parse(["--size", "big", "--kind", "slow"]).window == 1
    assert parse(["--size", "big", "--window", "5"]).window == 5


def test_data_files_are_checked_once_at_the_entry_point_not_at_every_replace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.worker import config as worker_config
    from tether.worker import flags as worker_flags

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(worker_config, "check_parquet_data", lambda data, workers: calls.append((data, workers)))
    data = f"parquet:{tmp_path / 'day.parquet'}"
    config = worker_flags.config_from_args(worker_flags.build_parser().parse_args(["--data", data, "--local"]))
    for i in range(3):
        config = dataclasses.replace(config, steps=10 + i)
    assert calls == [(data, 1)] and config.steps == 12
    with pytest.raises(ValueError, match=r"--data criteo:.*no file matches"):
        worker_flags.config_from_args(worker_flags.build_parser().parse_args(["--data", f"criteo:{tmp_path}/none-*.tsv", "--local"]))


def test_an_optimizer_config_file_is_read_once_for_a_config_and_its_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--optimizer-config``'s file is parsed when the config is made, and not again by each
    ``dataclasses.replace`` (a job makes several copies); a file changed since is read again."""
    from tether.worker.training import table_rules

    reads: list[str] = []
    read = table_rules._read_file
    monkeypatch.setattr(table_rules, "_read_file", lambda path: reads.append(path) or read(path))
    path = tmp_path / "rules.json"
    path.write_text('{"u": {"rule": "adagrad", "lr": 0.2}}')
    config = TrainingConfig(local=True, optimizer_config=str(path))
    for i in range(8):
        config = dataclasses.replace(config, steps=10 + i, lr=0.01 * (i + 1))
    assert reads == [str(path)] and config.table_rules.optimizer("u").lr == 0.2
    path.write_text('{"u": {"rule": "sgd", "lr": 0.25}}')  # another size: read again
    assert dataclasses.replace(config, steps=3).table_rules.optimizer("u") == OptimizerConfig("sgd", lr=0.25)
    assert reads == [str(path)] * 2


# -- every child gets its config as one file: shards, workers, a user's program ---------------------


def test_a_shard_config_round_trips_through_its_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    """``tether server --config FILE`` (or ``TETHER_SHARD_CONFIG``): every field away from its
    default is read back as it was (the token is never written: the shard reads it from its file
    again); a flag beside the file wins."""
    cfg = _shard_config(tmp_path)
    file = tmp_path / "shard.config.json"
    file.write_text(to_json(cfg))
    assert "s3cret-token" not in file.read_text()
    assert server_config.load_config(["--config", str(file)]) == cfg
    with monkeypatch.context() as m:
        m.setenv(server_config.SHARD_CONFIG_ENV, str(file))
        m.setenv("TETHER_THREADS", "3")  # the file's value wins over a variable, as for a worker
        assert server_config.load_config([]) == cfg
    again = server_config.load_config(["--config", str(file), "--port", "7007", "--data-port", "off"])
    assert (again.port, again.data_port, again.lease_seconds) == (7007, None, cfg.lease_seconds)
    file.write_text(to_json(dataclasses.replace(cfg, data_port=None)))  # null where the default is a number
    assert server_config.load_config(["--config", str(file)]).data_port is None


def test_a_bad_shard_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None) -> None:
    from tether.server.__main__ import main

    bad = {"missing.json": None, "broken.json": '{"port": ', "unknown.json": '{"shards": "a:1"}', "typed.json": '{"threads": "8"}'}
    for name, text in bad.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        assert main(["--config", str(tmp_path / name), "--port-file", str(tmp_path / "port")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"tether server: error: --config {tmp_path / name}: "), err
        assert {"missing.json": "No such file", "broken.json": "not JSON", "unknown.json": "ShardConfig has no field shards",
                "typed.json": "threads: expected int, got '8'"}[name] in err, err
    assert not (tmp_path / "port").exists()  # no shard started


def _training_config(tmp_path: Path) -> TrainingConfig:
    """Every TrainingConfig field away from its default (local mode gets its own check)."""
    special = {
        **_special(tmp_path),
        "table_optimizers": ("t=sgd:lr=0.1", "dense=adam:weight_decay=0.001"),
    }
    return TrainingConfig(**non_default(TrainingConfig, special, keep=("local", "push_window")), auth_token="s3cret-token")


def test_from_env_reads_the_file_tether_config_names_with_variables_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    cfg = _training_config(tmp_path)
    file = tmp_path / "worker-0.config.json"
    file.write_text(to_json(cfg))
    monkeypatch.setenv("TETHER_CONFIG", str(file))
    got = TrainingConfig.from_env()
    for f in dataclasses.fields(TrainingConfig):
        assert getattr(got, f.name) == getattr(cfg, f.name), f.name
        assert type(getattr(got, f.name)) is type(getattr(cfg, f.name)), f.name
    # A variable set by hand wins over the file, and the code's override over both.
    monkeypatch.setenv("TETHER_LR", "0.125")
    monkeypatch.setenv("TETHER_MODE", "async")
    assert (lambda c: (c.lr, c.mode.kind, c.seed))(TrainingConfig.from_env()) == (0.125, "async", cfg.seed)
    assert TrainingConfig.from_env(lr=0.5).lr == 0.5
    # The file's worker in local mode.
    file.write_text('{"local": true, "num_workers": 1, "steps": 4}')
    assert (lambda c: (c.local, c.shards, c.steps, c.lr))(TrainingConfig.from_env()) == (True, (), 4, 0.125)


def test_a_bad_tether_config_file_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    from tether.protos.errors import UsageError

    bad = {"missing.json": None, "broken.json": "{", "unknown.json": '{"batch_size": 64}', "typed.json": '{"local": "yes"}'}
    for name, text in bad.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        monkeypatch.setenv("TETHER_CONFIG", str(tmp_path / name))
        with pytest.raises(UsageError) as info:
            TrainingConfig.from_env()
        line = str(info.value)
        assert len(line.splitlines()) == 1 and line.startswith(f"TETHER_CONFIG={tmp_path / name}: "), line
        assert {"missing.json": "No such file", "broken.json": "not JSON", "unknown.json": "TrainingConfig has no field batch_size",
                "typed.json": "local: expected bool, got 'yes'"}[name] in line, line


@pytest.mark.parametrize("steps_from_job", [True, False])
def test_a_launched_program_reads_its_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None, steps_from_job: bool
) -> None:
    """``tether launch --script``: each worker gets ``TETHER_CONFIG`` naming its config file (the
    TrainingConfig fields, as ``tether worker``'s file holds them), and the job's other flags as
    variables for the program's own use. What the launcher's shell set is out of the worker's
    environment for the fields the file holds (the launcher read them), so it cannot win over the file."""
    from tether.deploy import launch

    cfg = WorkerConfig(shards=("pending:0",), num_workers=2, mode="ssp:2", lr=0.3, batch_size=64, steps=7, data_seed=3)
    spawned = _Spawned()
    monkeypatch.setattr(launch, "spawn", spawned)
    cluster = launch.LocalCluster(log_dir=tmp_path / "logs")
    cluster.addresses = ["127.0.0.1:7001"]
    cluster.start_workers(cfg, echo=False, program=launch.Program(("train.py",), steps_from_job=steps_from_job))
    monkeypatch.setenv("TETHER_MODE", "async")  # the launcher's shell
    monkeypatch.setenv("TETHER_STEPS", "99")
    for i in range(2):
        env, unset = spawned.env[f"worker-{i}"], spawned.unset[f"worker-{i}"]
        assert spawned.argv[f"worker-{i}"] == ["train.py"]
        assert env["TETHER_CONFIG"] == str(tmp_path / "logs" / f"worker-{i}.config.json") and env["TETHER_BATCH_SIZE"] == "64"
        assert not {"TETHER_SHARDS", "TETHER_MODE", "TETHER_LR", "TETHER_WORKER_INDEX"} & set(env)  # those are in the file
        assert {"TETHER_MODE", "TETHER_STEPS", "TETHER_WORKER_INDEX", "JOB_COMPLETION_INDEX"} <= set(unset)
        with monkeypatch.context() as child:  # the worker's environment, as spawn makes it
            for name in unset:
                child.delenv(name, raising=False)
            for name, value in env.items():
                child.setenv(name, value)
            got = TrainingConfig.from_env()
        assert (got.shards, got.worker_index, got.num_workers, got.mode.kind, got.mode.bound, got.lr) == (
            ("127.0.0.1:7001",), i, 2, "ssp", 2, 0.3)
        # The data order a script seeds its batches with (compare --repeats steps it): in the file,
        # and in TETHER_DATA_SEED as it always was.
        assert got.data_seed == 3 and env["TETHER_DATA_SEED"] == "3"
        assert got.steps == (7 if steps_from_job else None)


def test_a_bad_shard_variable_stops_a_job_in_one_line_before_a_shard_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    """``run_job`` without a shard config (``compare``, ``sweep``) reads the shards' from the
    environment, once, in the launcher: a bad variable is the user's one-line mistake there."""
    from tether.deploy import job, launch
    from tether.protos.errors import UsageError

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a process was started"))
    monkeypatch.setenv("TETHER_LEASE_SECONDS", "soon")
    with pytest.raises(UsageError, match="TETHER_LEASE_SECONDS='soon'"):
        job.run_job(WorkerConfig(shards=("pending:0",)), 1, out=tmp_path / "out", echo=False)
