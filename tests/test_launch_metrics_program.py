"""``tether launch --metrics`` with a user's program: each of its workers gets a metrics port
(``TETHER_METRICS_PORT``, read by ``TrainingConfig.from_env``), and its ``Trainer`` serves
``/metrics`` there (tests/test_worker_main.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.deploy.launch import LocalCluster, Program
from tether.worker.config import WorkerConfig


def _port_script(tmp_path: Path) -> Path:
    script = tmp_path / "port.py"
    script.write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "from tether.worker.config import TrainingConfig\n"
        "c = TrainingConfig.from_env()\n"
        "Path(sys.argv[1], f'port-{c.worker_index}').write_text(str(c.metrics_port))\n"
    )
    return script


def test_a_programs_workers_under_metrics_get_a_port_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _port_script(tmp_path)
    template = WorkerConfig(num_workers=2, steps=1, shards=("127.0.0.1:1",))
    with LocalCluster(log_dir=tmp_path / "logs") as cluster:
        cluster.addresses = ["127.0.0.1:1"]  # no shard runs: the program only reads its config
        cluster.start_workers(template, echo=False, metrics=True, program=Program.script(str(script), [str(tmp_path)]))
        cluster.wait_workers(timeout_s=120)
        ports = {name: port for name, port in cluster.metrics_ports.items() if name.startswith("worker")}
    assert sorted(ports) == ["worker-0", "worker-1"] and len(set(ports.values())) == 2, ports
    for i in range(2):
        assert int((tmp_path / f"port-{i}").read_text()) == ports[f"worker-{i}"]
    assert "no metrics port" not in capsys.readouterr().out


def test_without_metrics_a_port_in_the_launchers_shell_reaches_no_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every worker would otherwise read the same TETHER_METRICS_PORT and the second fail on a taken port.
    monkeypatch.setenv("TETHER_METRICS_PORT", "9464")
    script = _port_script(tmp_path)
    template = WorkerConfig(num_workers=2, steps=1, shards=("127.0.0.1:1",))
    with LocalCluster(log_dir=tmp_path / "logs") as cluster:
        cluster.addresses = ["127.0.0.1:1"]
        cluster.start_workers(template, echo=False, metrics=False, program=Program.script(str(script), [str(tmp_path)]))
        cluster.wait_workers(timeout_s=120)
        assert not [name for name in cluster.metrics_ports if name.startswith("worker")]
    assert [(tmp_path / f"port-{i}").read_text() for i in range(2)] == ["None", "None"]
