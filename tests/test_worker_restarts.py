"""Workers that come back: ``tether launch --max-restarts N`` restarts an async worker killed with
SIGKILL mid-job as a new incarnation while the others train on (or after they finished: it only
joins, it waits for none of them); a worker that dies more often than N ends the job naming it;
a sync rank that dies ends the job within 15 s naming the rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Small enough for CI, long enough that a restarted worker (~10 s to start on a busy 2-core
# machine) rejoins while the others are still training.
_JOB = ["--num-shards", "2", "--batch-size", "128", "--vocab-size", "5000", "--eval-samples", "2000", "--log-every", "25"]


def _start(out: Path, *flags: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "tether.deploy.cli", "launch", "--out", str(out), *_JOB, *flags],
        stdout=(out / "stdout.txt").open("w"), stderr=(out / "stderr.txt").open("w"), text=True,
    )


def _start_script(out: Path, *flags: str) -> subprocess.Popen:
    """``tether launch`` of a user's program: the flags given, none of the built-in job's."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "tether.deploy.cli", "launch", "--out", str(out), *flags],
        stdout=(out / "stdout.txt").open("w"), stderr=(out / "stderr.txt").open("w"), text=True,
    )


def _finish(proc: subprocess.Popen, out: Path, timeout_s: float) -> tuple[int, str, str]:
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the launcher stops its children
        proc.wait(timeout=30)
        raise
    return code, (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text()


def _pids(out: Path, marker: str, rank: int | None = None) -> list[int]:
    """Pids of this job's processes whose command line holds ``marker`` (and whose RANK is ``rank``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if str(out).encode() not in b" ".join(cmdline) or marker.encode() not in b"\0".join(cmdline):
                continue
            if rank is not None and f"RANK={rank}".encode() not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def _worker_pid(out: Path, index: int, not_pid: int | None = None, timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [p for p in _pids(out, f"worker-{index}.config.json") if p != not_pid]
        if pids:
            return pids[0]
        time.sleep(0.1)
    raise AssertionError(f"worker {index} of {out} did not start within {timeout_s:.0f}s")


def _wait_for_line(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 120.0, after: int = 0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace")[after:]:
            return
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before {path.name} said {text!r}"
        time.sleep(0.1)
    raise AssertionError(f"{path} did not say {text!r} within {timeout_s:.0f}s")


def test_an_async_worker_killed_mid_job_is_restarted_and_the_job_succeeds(tmp_path: Path) -> None:
    out = tmp_path / "job"
    # Killed at step 100, the restart rejoined with the others at step 400-460 (load 8-11): 600 steps
    # leave them training when it does, as 1200 did at twice the time (eval loss 0.451 vs 0.438, the
    # bar 0.564). A restart that joins after the others finished is the next test's.
    steps = 600
    proc = _start(out, "--mode", "async", "--num-workers", "3", "--steps", str(steps), "--max-restarts", "1")
    try:
        log = out / "logs" / "worker-1.log"
        _wait_for_line(log, f"step 100/{steps}", proc)
        first = _worker_pid(out, 1)
        os.kill(first, signal.SIGKILL)
        code, stdout, stderr = _finish(proc, out, timeout_s=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == {"shard-0": 0, "shard-1": 0, "worker-0": 0, "worker-1": 1, "worker-2": 0}
    assert "restarts: worker-1 1" in stdout
    assert "worker-1 exited with code -9; restart 1 of 1" in stderr
    (w1,) = [w for w in summary["workers"] if w["worker_index"] == 1]
    # The restart ran the steps the first incarnation had not done (it reported >= 100) and read
    # on from where that one stopped: it ended where an undisturbed worker 1 ends.
    done_before = w1["samples_before_restarts"] // 128
    assert done_before >= 100
    assert w1["samples"] == (steps - done_before) * 128
    assert summary["total_samples"] == 3 * steps * 128
    assert "1 restart(s) read on from the newest stream position" in summary["restarted_workers"]
    assert json.loads((out / "worker-1.json").read_text())["data_position"]["synthetic_batch"] == steps
    assert summary["eval_loss"] < summary["baseline_loss"] - 0.03, summary
    # Both incarnations wrote to one log; the second one's pushes were its own (a new incarnation).
    text = log.read_text()
    assert text.count("worker 1/3: mode async") == 2, text[-2000:]


def test_a_worker_killed_after_another_finished_is_restarted_and_the_job_succeeds(tmp_path: Path) -> None:
    out = tmp_path / "job"
    steps = 100
    # Worker 1 computes 8 times slower: in async nobody waits for it, so worker 0 finishes first.
    proc = _start(out, "--mode", "async", "--num-workers", "2", "--steps", str(steps), "--max-restarts", "1",
                  "--straggler", "persistent:8:1")
    try:
        _worker_pid(out, 0, timeout_s=180)
        deadline = time.monotonic() + 300  # a loaded machine starts a worker in tens of seconds
        while _pids(out, "worker-0.config.json") and time.monotonic() < deadline:
            assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before worker 0 finished"
            time.sleep(0.05)
        assert not _pids(out, "worker-0.config.json"), "worker 0 did not finish"
        assert (out / "worker-0.json").exists()
        log = out / "logs" / "worker-1.log"
        assert f"step {steps}/{steps}" not in log.read_text(), "worker 1 finished too: nothing left to kill"
        os.kill(_worker_pid(out, 1), signal.SIGKILL)
        code, stdout, stderr = _finish(proc, out, timeout_s=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The restarted worker joined with worker 0 gone and trained its remaining steps.
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "worker-1 exited with code -9; restart 1 of 1" in stderr, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"]["worker-1"] == 1 and summary["restarts"]["worker-0"] == 0
    assert summary["total_samples"] == 2 * steps * 128
    assert log.read_text().count("worker 1/2: mode async") == 2


def test_a_worker_that_dies_more_often_than_max_restarts_ends_the_job_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "job"
    steps = 4000
    proc = _start(out, "--mode", "ssp:2", "--num-workers", "3", "--steps", str(steps), "--max-restarts", "1")
    try:
        log = out / "logs" / "worker-2.log"
        _wait_for_line(log, f"step 50/{steps}", proc)
        first = _worker_pid(out, 2)
        os.kill(first, signal.SIGKILL)
        size = len(log.read_text(errors="replace"))
        second = _worker_pid(out, 2, not_pid=first)
        _wait_for_line(log, "worker 2/3: mode ssp:2", proc, after=size)
        time.sleep(1.0)
        os.kill(second, signal.SIGKILL)
        code, stdout, stderr = _finish(proc, out, timeout_s=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1, stdout[-3000:] + stderr[-3000:]
    assert "tether launch: worker-2 exited with code -9 (restarted 1 time, --max-restarts 1)" in stderr, stderr[-3000:]
    assert not _pids(out, "tether"), "processes of the job outlived it"


def test_a_killed_sync_rank_ends_the_job_within_15_s_naming_the_rank(tmp_path: Path) -> None:
    out = tmp_path / "job"
    proc = _start(out, "--mode", "sync", "--num-workers", "2", "--steps", "100000")
    try:
        _wait_for_line(out / "stdout.txt", "step 25/100000", proc, timeout_s=180)
        deadline = time.monotonic() + 30
        while not (ranks := _pids(out, "tether.worker", rank=1)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ranks, "rank 1 not found"
        killed = time.monotonic()
        os.kill(ranks[0], signal.SIGKILL)
        code, stdout, stderr = _finish(proc, out, timeout_s=60)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1, stdout[-3000:] + stderr[-3000:]
    assert "rank 1 failed first (exit code -9" in stderr, stderr[-3000:]
    assert ended < 15, ended
    print(f"sync: the job ended {ended:.1f}s after rank 1 was killed")
    assert not _pids(out, "tether"), "processes of the job outlived it"


@pytest.mark.parametrize("flags, message", [
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["--mode", "sync", "--max-restarts", "2"], "--max-restarts 2: sync ranks are not restarted"),
])
def test_max_restarts_is_checked_before_any_process_starts(tmp_path: Path, flags: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tether.deploy.cli", "launch", "--out", str(tmp_path / "o"), *flags],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_restarted_worker_resumes_from_the_newest_position_its_incarnations_saved(tmp_path: Path) -> None:
    """The launcher's restart reads on where the worker stopped (``OUT/positions/latest``), for
    the steps that position says were done; a position older than the job is not resumed from."""
    from tether.deploy.children import spawn
    from tether.deploy.launch import LocalCluster
    from tether.worker.data.positions import latest_position, write_position

    out = tmp_path / "job"
    cluster = LocalCluster(log_dir=out / "logs", max_worker_restarts=3)
    latest = latest_position(out, 1)
    write_position(latest, 90, 90, {"synthetic_batch": 90})  # an earlier job's, in the same OUT
    old = time.time() - 60
    os.utime(latest, (old, old))
    argv = ["-c", "pass", "--config", str(out / "logs" / "worker-1.config.json")]

    def first() -> object:
        child = spawn(out / "logs", "worker-1", argv, echo=False)
        child.proc.wait(timeout=60)
        child.steps = 100
        cluster.workers.append(child)
        cluster._positions[child.name] = latest
        return child

    try:
        # Died after reporting step 25: no position of this job, so its share from the start.
        child = first()
        (out / "logs" / "worker-1.log").write_text("worker 1/3 step 25/100 loss 0.5\n")
        cluster._restart_worker(child, -9)
        fresh = cluster.workers[0]
        assert "--resume-data" not in fresh.argv and fresh.argv[-2:] == ["--steps", "75"] and fresh.steps_done == 25
        fresh.proc.wait(timeout=60)
        # The second incarnation saved its position after 40 steps (and reported 25 of them): its
        # restart resumes there, for the 35 steps left.
        write_position(latest, 40, 70, {"synthetic_batch": 65})
        with (out / "logs" / "worker-1.log").open("a") as log:
            log.write("worker 1/3 step 25/75 loss 0.5\n")
        cluster._restart_worker(fresh, -9)
        third = cluster.workers[0]
        assert third.argv[third.argv.index("--resume-data") + 1] == str(latest.parent)
        assert third.argv[third.argv.index("--steps") + 1] == "35" and third.steps_done == 65
        third.proc.wait(timeout=60)
        # The third died before saving one: the second's position still holds, and no step was done since.
        cluster._restart_worker(third, -9)
        fourth = cluster.workers[0]
        assert fourth.argv.count("--resume-data") == 1 and fourth.argv[fourth.argv.index("--resume-data") + 1] == str(latest.parent)
        assert fourth.argv[fourth.argv.index("--steps") + 1] == "35" and fourth.steps_done == 65
        assert [r["position_step"] for r in cluster.worker_resumes] == [None, 40, 40]
    finally:
        cluster.stop()


def test_a_restarted_script_worker_reads_its_parquet_stream_on_from_where_it_stopped(tmp_path: Path) -> None:
    """A user's ``--script`` that trains on a ``ParquetStream`` (tests/scripts/resumable_script.py)
    dies by SIGKILL after its 4th of 12 steps; ``--max-restarts 1`` starts it again, and the
    restart reads on where the stream left off (``TETHER_RESUME_DATA``, which ``Trainer.fit``
    loads into the stream) for the 8 steps left: the two incarnations together trained every row
    of the file exactly once, the second none of the first's."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import numpy as np

    n, batch = 384, 32  # 12 batches, in row groups of 32
    data = tmp_path / "rows.parquet"
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"row": np.arange(n, dtype=np.int64), "x": rng.random(n), "label": rng.integers(0, 2, n).astype(np.int8)}),
                   data, row_group_size=32)
    script = Path(__file__).resolve().parent / "scripts" / "resumable_script.py"
    out = tmp_path / "job"
    proc = _start_script(out, "--script", str(script), "--script-args", f"--data {data} --batch {batch} --die-after 4",
                         "--num-workers", "1", "--num-shards", "1", "--steps", str(n // batch), "--log-every", "2", "--max-restarts", "1")
    try:
        code, stdout, stderr = _finish(proc, out, timeout_s=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == {"shard-0": 0, "worker-0": 1}
    assert "1 restart(s) read on from the newest stream position" in summary["restarted_workers"]
    first, second = ([[int(x) for x in line.split()] for line in (out / f"rows-0-{k}.txt").read_text().splitlines()] for k in (0, 1))
    assert len(first) == 4 and len(second) == 8, (len(first), len(second))
    rows = [r for b in first + second for r in b]
    assert sorted(rows) == list(range(n))  # every row once: none read twice, none skipped
    assert "data resumed from" in (out / "logs" / "worker-0.log").read_text()
    assert summary["total_samples"] == n
