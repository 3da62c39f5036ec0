"""A user's own training script (``tether launch --script``, or ``TETHER_LOCAL=1 python
script.py``): tether's usage errors left uncaught end it as they end ``tether worker``, with
one line ``tether worker: error: ...`` and exit code 2; the user's own exceptions keep their
traceback and exit code 1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = '''
import sys, torch
from torch import nn
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.config import TrainingConfig
from tether.worker.training.trainer import Trainer

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = ShardedEmbeddingBag("items", 4)
    def forward(self, b):
        return self.items(b["item"]).sum(1)

what = sys.argv[1]
config = TrainingConfig.from_env(device="cpu", log_every=100)
trainer = Trainer(M(), config, loss=lambda m, b: m(b).pow(2).mean(), sparse=lambda b: {"items": b["item"]})
ids = torch.arange(8) if what == "own" else torch.arange(8).float()
trainer.fit([{"item": ids}] * 2)
if what == "own":
    raise RuntimeError("the user's own mistake")
print("done")
'''


def _run(tmp_path: Path, what: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    environ.update({"TETHER_STEPS": "2", **env})
    if "TETHER_SHARDS" not in environ:
        environ["TETHER_LOCAL"] = "1"
    return subprocess.run([sys.executable, str(script), what], env=environ, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("what", "env", "message"),
    [
        ("floats", {}, "tether worker: error: "),
        ("own", {"TETHER_STEPS": "abc"}, "tether worker: error: TETHER_STEPS"),
        pytest.param("own", {"TETHER_MODE": "ssp:x"}, "tether worker: error: ", marks=pytest.mark.slow),
        pytest.param("own", {"TETHER_NUM_WORKERS": "2"}, "tether worker: error: ", marks=pytest.mark.slow),
    ],
)
def test_a_usage_error_left_uncaught_in_a_script_is_one_line_and_exit_2(
    tmp_path: Path, what: str, env: dict[str, str], message: str
) -> None:
    proc = _run(tmp_path, what, **env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_users_own_exception_keeps_its_traceback(tmp_path: Path) -> None:
    own = _run(tmp_path, "own")
    assert own.returncode == 1
    assert "Traceback" in own.stderr and "RuntimeError: the user's own mistake" in own.stderr


def test_shards_that_cannot_be_reached_end_a_script_in_one_line_and_exit_1(tmp_path: Path) -> None:
    """As ``tether worker`` ends on it (docs/errors.md): ``Unavailable`` once ``--call-deadline``
    (``TETHER_CALL_DEADLINE``) is spent, one line naming the call, no traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket is closed
    proc = _run(tmp_path, "own", TETHER_SHARDS=f"127.0.0.1:{port}", TETHER_CALL_DEADLINE="2", TETHER_TIMEOUT="1")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    # The retries' warning while it waits (the first, then every tenth), then the error's one line.
    assert all(line.startswith("shard 0 Declare: UNAVAILABLE, retry ") for line in lines[:-1]), proc.stderr
    assert lines[-1].startswith(f"tether worker: Unavailable: shard 0 (127.0.0.1:{port}) Declare failed after "), proc.stderr
    assert "the call's deadline spent (--call-deadline 2 s)" in lines[-1], lines[-1]
