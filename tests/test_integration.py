"""End to end: real shard and worker processes on loopback, launched like a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["--steps", "150", "--batch-size", "256", "--vocab-size", "5000", "--eval-samples", "4000", "--log-every", "50"]


def _tether(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tether.deploy.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_two_shards_two_workers_learn(tmp_path: Path) -> None:
    out = tmp_path / "job"
    proc = _tether(["launch", "--num-shards", "2", "--num-workers", "2", "--eval-every", "50", "--out", str(out), *SMALL], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval_loss", "eval_auc", "baseline_loss", "samples_per_sec"):
        assert key in summary
    assert summary["eval_loss"] < summary["baseline_loss"] - 0.02, summary
    assert summary["eval_auc"] > 0.7, summary
    assert summary["total_samples"] == 2 * 150 * 256
    # Loss falls: worker 0's held-out loss at the end is below its first evaluation.
    history = json.loads((out / "worker-0.json").read_text())["history"]
    evals = [p["eval_loss"] for p in history if "eval_loss" in p]
    assert len(evals) >= 3 and evals[-1] < evals[0]
    assert "result: held-out log loss" in proc.stdout
    # Every process was stopped: the shards' logs end with their shutdown.
    for i in range(2):
        assert "stopped" in (out / "logs" / f"shard-{i}.log").read_text()


def test_launch_rejects_bad_flags(tmp_path: Path) -> None:
    proc = _tether(["launch", "--mode", "ssp:-1", "--out", str(tmp_path)], timeout=60)
    assert proc.returncode == 2
    assert "mode must be 'async', 'ssp:S'" in proc.stderr
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("argv, message", [(["worker"], "no shards: set TETHER_SHARDS"), (["server", "--num-shards", "0"], "num_shards must be >= 1")])
def test_entry_points_validate(argv: list[str], message: str) -> None:
    proc = _tether(argv, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


def test_criteo_file_end_to_end(tmp_path: Path) -> None:
    from tether.worker.data.criteo import write_criteo_sample

    data = tmp_path / "sample.tsv"
    write_criteo_sample(data, 30_000, seed=2)
    out = tmp_path / "job"
    proc = _tether(
        ["launch", "--num-shards", "2", "--num-workers", "1", "--data", f"criteo:{data}", "--steps", "200", "--batch-size", "128", "--out", str(out)],
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # One pass over a small file: a modest but real gain over the constant predictor.
    assert summary["eval_loss"] < summary["baseline_loss"] - 0.01, summary
    assert summary["eval_auc"] > 0.58, summary
    assert "bayes_loss" not in summary  # unknown for real data


def test_malformed_criteo_file_fails_clearly(tmp_path: Path) -> None:
    data = tmp_path / "broken.tsv"
    data.write_text("1\t2\t3\n")
    proc = _tether(["launch", "--num-shards", "1", "--num-workers", "1", "--data", f"criteo:{data}", "--steps", "5", "--out", str(tmp_path / "o")], timeout=120)
    assert proc.returncode == 2  # a user's mistake (tests/test_cli_errors.py)
    assert "broken.tsv:1: expected 40 tab-separated columns, got 3" in proc.stderr


def test_shards_die_with_a_killed_launcher() -> None:
    import os
    import time

    code = (
        "import os\nfrom tether.deploy.launch import LocalCluster\n"
        "c = LocalCluster(grace_s=1)\nc.start_shards(1)\nprint(c.shards[0].proc.pid, flush=True)\nos._exit(0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, 9)
    raise AssertionError(f"shard {pid} outlived its launcher")


def test_launch_restarts_a_killed_shard_from_its_checkpoint(tmp_path: Path) -> None:
    import os
    import signal
    import threading
    import time

    from tether.deploy.job import run_job
    from tether.worker.config import WorkerConfig

    out = tmp_path / "job"
    cfg = WorkerConfig(shards=("pending:0",), num_workers=2, steps=400, batch_size=128, vocab_size=3000, eval_samples=2000, log_every=100)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(run_job(cfg, 2, out=out, timeout_s=240, echo=False, checkpoint_every=0.5)))
    runner.start()

    def shard_pid() -> int | None:
        marker = str(out / "logs" / "shard-1.config.json").encode()  # a launched shard reads its config file (--config)
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                        return int(pid)
                except OSError:
                    continue
        return None

    deadline = time.monotonic() + 120
    # Kill once training is under way (a worker logged a step) and shard 1 has a checkpoint: a
    # kill during the workers' declare tests their start-up retries, not the restore.
    def training() -> bool:
        log = out / "logs" / "worker-0.log"
        return log.exists() and " step " in log.read_text(errors="replace")

    while not (list((out / "checkpoints").glob("*/shard-1-of-2.manifest.json")) and training()) and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = shard_pid()
    assert pid is not None, "shard 1 is not running"
    os.kill(pid, signal.SIGKILL)
    runner.join(timeout=240)
    assert not runner.is_alive()
    assert result["total_samples"] == 2 * 400 * 128
    assert result["eval_loss"] < result["baseline_loss"]
    log = (out / "logs" / "shard-1.log").read_text()
    assert "restored" in log.lower(), log[-2000:]
