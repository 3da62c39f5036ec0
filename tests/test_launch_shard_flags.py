"""``tether launch`` takes the shard's flags (made from ``ShardConfig``'s declarations, but those
the launcher sets per shard) and passes them to every shard it starts, in the shard's config file."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from conftest import make_client
from test_cli_help import _clean_env, option_blocks

from tether.common import settings as fields
from tether.common.config_file import to_json
from tether.deploy import cli
from tether.deploy.launch import LocalCluster
from tether.deploy.shard_args import LAUNCHER_SET
from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.codec import encode_ids, encode_tensor
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig, load_config


def _shard_flags() -> list[str]:
    return [d.flag for f, d in fields.declared(ShardConfig) if d.flag is not None and f.name not in LAUNCHER_SET]


def test_launch_help_lists_every_cluster_wide_shard_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "tether.deploy.cli", "launch", "--help"], capture_output=True, text=True,
                          timeout=60, env={**_clean_env(), "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    assert "shard flags:" in proc.stdout
    blocks = option_blocks(proc.stdout.split("shard flags:", 1)[1])
    flags = _shard_flags()
    assert {"--max-staleness", "--lease-seconds", "--threads", "--checkpoint-keep"} <= set(flags)
    assert set(flags) <= set(blocks), sorted(set(flags) - set(blocks))
    assert "env TETHER_MAX_STALENESS" in blocks["--max-staleness"]
    # Per-shard ones are not there (the launcher gives each shard its own).
    for per_shard in ("--port", "--shard-index", "--port-file", "--health-port", "--tls-cert"):
        assert per_shard not in blocks


def test_every_declared_field_is_a_launch_flag_or_set_by_the_launcher() -> None:
    names = {f.name for f, d in fields.declared(ShardConfig) if d.flag is not None}
    assert set(LAUNCHER_SET) <= names, set(LAUNCHER_SET) - names


def _launch(argv: list[str], monkeypatch: pytest.MonkeyPatch, run_job: Any) -> int:
    import tether.deploy.job

    monkeypatch.setattr(tether.deploy.job, "run_job", run_job)
    return cli.main(["launch", "--num-shards", "1", "--num-workers", "1", "--steps", "1", "--device", "cpu", *argv])


def test_launch_passes_max_staleness_to_its_shards(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The launcher's own path, up to the shards: run_job's shard processes get max_staleness 0 in
    their config files, and a push one update stale is refused (ABORTED) by the shard."""
    seen: dict[str, Any] = {}

    def run_job(template: Any, num_shards: int, shard: ShardConfig | None = None, **kw: Any) -> dict[str, Any]:
        seen["shard"] = shard
        with LocalCluster(log_dir=tmp_path, grace_s=5) as cluster:
            address = cluster.start_shards(num_shards, config=shard)[0]
            seen["argv"], seen["address"] = cluster.shards[0].argv, address
            client = make_client([address])
            client.declare([TableConfig("emb", 4, OptimizerConfig("sgd", 1.0))])
            client.close()
            ids = np.array([1, 2], dtype=np.int64)
            stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(address))
            codes = []
            for seq in (1, 2):  # both computed on version 0 of the rows: the second is 1 update stale
                block = pb.SparseBlock(table="emb", ids=encode_ids(ids), values=encode_tensor(torch.ones(2, 4)), read_version=0)
                try:
                    stub.Push(pb.PushRequest(incarnation=1, worker_id="w", seq=seq, sparse=[block]), timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
            seen["codes"] = codes
        raise KeyboardInterrupt  # what was to be seen is seen: end as Ctrl-C would, without workers

    assert _launch(["--max-staleness", "0", "--lease-seconds", "3"], monkeypatch, run_job) == 130
    assert (seen["shard"].max_staleness, seen["shard"].lease_seconds) == (0, 3.0)
    # The shard was handed its config file (and, once serving, the port it got beside it, for a restart).
    argv = seen["argv"]
    assert argv[:3] == ["-m", "tether.server", "--config"] and argv[4:] == ["--port", seen["address"].rpartition(":")[2]], argv
    handed = json.loads(Path(argv[3]).read_text())
    assert (handed["max_staleness"], handed["lease_seconds"], handed["port"], handed["shard_index"]) == (0, 3.0, 0, 0)
    assert seen["codes"] == [grpc.StatusCode.OK, grpc.StatusCode.ABORTED]


def test_shard_flags_are_checked_before_anything_starts(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def run_job(*args: Any, **kw: Any) -> dict[str, Any]:
        raise AssertionError("started a job despite a bad shard flag")

    assert _launch(["--max-staleness", "-1"], monkeypatch, run_job) == 2
    assert capsys.readouterr().err.splitlines() == ["tether launch: error: max_staleness must be >= 0, got -1"]
    assert _launch(["--max-message-mb", "64", "--data-buffer-mb", "8"], monkeypatch, run_job) == 2
    assert "data_buffer_bytes must be >= max_message_bytes" in capsys.readouterr().err


def test_unset_shard_flags_pass_the_shards_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in [n for n in os.environ if n.startswith("TETHER_")]:
        monkeypatch.delenv(name)
    seen: dict[str, Any] = {}

    def run_job(template: Any, num_shards: int, shard: ShardConfig | None = None, **kw: Any) -> dict[str, Any]:
        seen["shard"] = shard
        raise KeyboardInterrupt

    assert _launch([], monkeypatch, run_job) == 130
    # What each shard reads from its file is ShardConfig's defaults, field for field.
    file = tmp_path / "shard.config.json"
    file.write_text(to_json(seen["shard"]))
    assert dataclasses.asdict(load_config(["--config", str(file)])) == dataclasses.asdict(ShardConfig())
