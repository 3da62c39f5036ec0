"""summary.json's counts after a worker restart: the earlier incarnations' steps are counted at
the samples per step the worker itself reported, not the built-in model's batch size (a
``--script`` job's workers use their own)."""

from __future__ import annotations

from tether.deploy.job import _summary
from tether.worker.config import WorkerConfig
from tether.worker.training.run_record import RunRecord


def _record(index: int, steps: int, samples: int, wall: float) -> RunRecord:
    return RunRecord(
        worker_index=index, mode="async", device="cpu", steps=steps, samples=samples, wall_s=wall,
        samples_per_sec=samples / wall, phase_seconds={}, clock_staleness=[], update_staleness=[], start_time=0.0,
        rejected_too_stale=0, history=[], config={},
    )


def test_a_restarted_script_workers_earlier_steps_count_at_its_own_batch_size() -> None:
    template = WorkerConfig(num_workers=2, steps=900, shards=("127.0.0.1:1",))
    assert template.batch_size == 256  # the built-in model's, which the script does not use
    # worker 1 reported 300 steps before it was killed; its second incarnation ran the other 600 at batch 64.
    workers = [_record(0, 900, 900 * 64, 20.0), _record(1, 600, 600 * 64, 15.0)]
    summary = _summary(template, 2, workers, {}, 40.0, {}, {"worker-1": 1}, {"worker-1": 300}, 1)
    assert summary["total_samples"] == 1800 * 64 == 115_200
    assert summary["samples_per_sec"] == 115_200 / 40.0
    assert [w["samples_before_restarts"] for w in summary["workers"]] == [0, 300 * 64]


def test_without_restarts_the_totals_are_the_records_own() -> None:
    workers = [_record(0, 10, 640, 2.0), _record(1, 10, 650, 4.0)]
    summary = _summary(WorkerConfig(num_workers=2, steps=10, shards=("127.0.0.1:1",)), 1, workers, {}, 9.0, {}, {}, {}, 0)
    assert summary["total_samples"] == 1290
    assert summary["samples_per_sec"] == 1290 / 4.0
