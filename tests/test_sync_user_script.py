"""A user's own script under ``tether launch --mode sync``: each rank trains its own slice (its
rank is known from ``TrainingConfig.from_env()``), same-seed runs end bitwise equal, a failing
rank ends the job fast with its own error last, and ranks whose data ends at different steps
stop together."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "ranked_script.py"


def _launch(tmp_path: Path, name: str, *script_args: str, workers: int = 3) -> tuple[subprocess.CompletedProcess, list[dict], float]:
    out = tmp_path / name
    args = " ".join([f"--out {out / 'ranks'}", *script_args])
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tether.deploy.cli", "launch", "--script", str(SCRIPT), "--script-args", args, "--mode", "sync",
         "--num-workers", str(workers), "--num-shards", "2", "--out", str(out / "job")],
        capture_output=True, text=True, timeout=240,
    )
    wall = time.monotonic() - t0
    ranks = [json.loads(f.read_text()) for f in sorted((out / "ranks").glob("rank-*.json"))]
    return proc, ranks, wall


def test_sync_ranks_train_disjoint_slices_and_same_seed_runs_end_equal(tmp_path: Path) -> None:
    first, ranks, _ = _launch(tmp_path, "a", "--eval")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    # The script's own metric name, not only eval_* ones, reaches the result line.
    assert re.search(r"result: worker 0's held-out accuracy [01]\.\d{4}\n", first.stdout), first.stdout[-1000:]
    assert len(ranks) == 3
    seen = [set(r["seen"]) for r in ranks]
    assert all(len(s) == 160 for s in seen)
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert set().union(*seen) == set(range(480))
    again, ranks_again, _ = _launch(tmp_path, "b", "--eval")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    # Dense parameters are stepped on the ranks, rows on the shards: both bitwise equal run to run.
    assert ranks[0]["dense"] == ranks_again[0]["dense"] == ranks[2]["dense"]
    assert ranks[0]["rows"] == ranks_again[0]["rows"]


def test_a_failing_rank_ends_the_job_fast_with_its_own_error_last(tmp_path: Path) -> None:
    proc, _, wall = _launch(tmp_path, "fail", "--fail-rank", "1", "--fail-at", "3")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()
    assert last[-1].endswith("RuntimeError: user error on purpose in rank 1"), proc.stderr[-2000:]
    assert "rank 1 failed first" in proc.stderr
    # Without the fix the other ranks waited in an all-reduce until gloo's 120 s timeout.
    assert wall < 90, wall


def test_ranks_whose_data_ends_at_different_steps_stop_together(tmp_path: Path) -> None:
    proc, ranks, _ = _launch(tmp_path, "short", "--short-rank", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [r["steps"] for r in ranks] == [10, 10, 10]
    assert [len(r["seen"]) for r in ranks] == [80, 80, 80]
    assert "stopping at step 10 with data left: another rank's data ended there" in proc.stdout
    # The script set no step count and --steps was not given: its progress shows no total or ETA
    # (the built-in job's default --steps 2000 was shown: "step 10/2000 ... eta").
    progress = [line for line in proc.stdout.splitlines() if re.search(r"worker \d/3 step \d+", line)]
    assert len(progress) >= 3 and not any(re.search(r"step \d+/|eta ", line) for line in progress), progress
    # The ranks share torchrun's stdout: each line whole, none glued to another, no empty one.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[torchrun]")]
    assert all(line.strip() != "[torchrun]" for line in lines), lines
    assert all(len(re.findall(r"worker \d/3[ :]", line)) <= 1 for line in lines), lines


@pytest.mark.slow  # a minute on a loaded machine; tests/test_run_program.py checks the shim in seconds
def test_a_scripts_flag_that_prefixes_a_torchrun_option_reaches_the_script(tmp_path: Path) -> None:
    # torchrun's parser took --n for its --nnodes/--nproc-per-node ("ambiguous option"), exit 1.
    proc, ranks, _ = _launch(tmp_path, "n", "--n", "240", workers=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [len(r["seen"]) for r in ranks] == [120, 120]
