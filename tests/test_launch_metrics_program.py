"""``tether launch --metrics`` with a user's program: its workers get no metrics port (a Trainer
serves none), and the launcher says so in one line instead of leaving it to be found out."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.deploy.launch import LocalCluster, Program
from tether.worker.config import WorkerConfig


def test_a_programs_workers_under_metrics_are_named_as_having_no_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "quiet.py"
    script.write_text("")
    template = WorkerConfig(num_workers=2, steps=1, shards=("127.0.0.1:1",))
    with LocalCluster(log_dir=tmp_path / "logs") as cluster:
        cluster.addresses = ["127.0.0.1:1"]  # no shard runs: the program exits at once
        cluster.start_workers(template, echo=False, metrics=True, program=Program.script(str(script)))
        cluster.wait_workers(timeout_s=60)
        assert not any(name.startswith("worker") for name in cluster.metrics_ports)
    out = capsys.readouterr().out
    assert out.count("a --script/--entry program's workers get no metrics port") == 1, out
