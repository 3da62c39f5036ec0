"""``TrainingConfig.metrics_port`` is checked when the config is made, as its other fields are:
a port outside [0, 65535] is one line naming the field, from code, the environment and the flag."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tether.protos.errors import UsageError
from tether.worker.config import TrainingConfig, WorkerConfig

MESSAGE = "metrics_port must be in [0, 65535] (0: any free port), got {}"


@pytest.mark.parametrize("port", [-1, 65536, 70000])
def test_a_metrics_port_out_of_range_is_refused_when_the_config_is_made(port: int) -> None:
    with pytest.raises(ValueError) as info:
        TrainingConfig(local=True, metrics_port=port)
    assert str(info.value) == MESSAGE.format(port)


@pytest.mark.parametrize("port", [None, 0, 1, 65535])
def test_a_metrics_port_in_range_is_kept(port: int | None) -> None:
    assert TrainingConfig(local=True, metrics_port=port).metrics_port == port


def test_from_the_environment_it_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_METRICS_PORT", "65536")
    with pytest.raises(UsageError) as info:
        WorkerConfig.from_env(local=True)
    assert str(info.value) == MESSAGE.format(65536)


def test_the_worker_flag_ends_with_one_line_and_exit_code_2() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    out = subprocess.run([sys.executable, "-m", "tether.worker", "--local", "--metrics-port", "-5"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.splitlines() == [f"tether worker: error: {MESSAGE.format(-5)}"]
