"""The row cache's own cost, measured and reported: the seconds its calls take
(``TrafficMeter.cache_seconds``), a worker's progress lines and run record, the job's summary and
result line, ``tether compare``'s line, and the metric a scrape reads. With no cache there is
none of it."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

from tether.deploy import cli
from tether.deploy import compare as compare_module
from tether.deploy.job import row_cache_summary
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.cache.client import CachedClient
from tether.worker.cache.config import RowCacheConfig
from tether.worker.client.local import LocalClient
from tether.worker.client.traffic import TrafficMeter
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.run_record import RunRecord
from tether.worker.training.trainer import Trainer


def _client(rows: int) -> CachedClient:
    local = LocalClient()
    local.declare([TableConfig(name="t", dim=4, optimizer=OptimizerConfig(name="adagrad", lr=0.1))])
    return CachedClient(local, RowCacheConfig(rows, 5 if rows else 0, admission="all"), {"t": 4}, TrafficMeter({"t": 4}, 4))


@pytest.mark.parametrize("rows", [0, 16])
def test_the_caches_own_calls_are_timed_and_nothing_else(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    client = _client(rows)
    if client.cache is not None:  # each of its calls takes 5 ms more here
        for name in ("plan", "merge", "accumulate"):
            real = getattr(client.cache, name)
            monkeypatch.setattr(client.cache, name, lambda *a, _real=real, **k: (time.sleep(0.005), _real(*a, **k))[1])
    ids = torch.tensor([1, 2, 3])
    pulled = client.pull({"t": ids}).result()  # plan and merge
    client.push_pull({"t": (ids, torch.ones(3, 4))}, None, {"t": ids}, clock=1, versions=pulled).result()  # accumulate, plan, merge
    if rows:
        assert 0.025 <= client.meter.cache_seconds < 1.0
    else:
        assert client.meter.cache_seconds == 0.0


class _Dot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = ShardedEmbeddingBag("a", 4)
        self.b = ShardedEmbeddingBag("b", 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.a(batch["a"]) * self.b(batch["b"])).sum(1)


def _fit(**cache: object) -> tuple[RunRecord, list[str]]:
    g = torch.Generator().manual_seed(1)
    batches = [{"a": torch.randint(0, 50, (16,), generator=g), "b": torch.randint(0, 9, (16,), generator=g), "y": torch.rand(16, generator=g)}
               for _ in range(12)]
    config = TrainingConfig(local=True, steps=12, log_every=4, device="cpu", **cache)  # type: ignore[arg-type]
    lines: list[str] = []
    torch.manual_seed(0)
    with Trainer(_Dot(), config, loss=lambda m, b: nn.functional.mse_loss(m(b), b["y"]), sparse=lambda b: {"a": b["a"], "b": b["b"]},
                 batch_size=lambda b: len(b["y"]), printer=lines.append) as trainer:
        record = trainer.fit(batches, background=False)
    return record, [ln for ln in lines if " step " in ln]


def test_a_cached_runs_progress_lines_and_record_say_what_the_cache_cost() -> None:
    record, lines = _fit(cache_rows=64, cache_bound=4)
    assert record.cache_seconds is not None and 0 < record.cache_seconds < sum(record.phase_seconds.values())
    assert len(lines) == 3 and all(re.search(r"\(pull_wait \d+% compute \d+% push \d+%; row cache \d+%\)", ln) for ln in lines), lines
    assert RunRecord.from_json(record.to_json()).cache_seconds == record.cache_seconds
    plain, lines = _fit()
    assert plain.cache_seconds is None and "cache_seconds" not in plain.to_json()
    assert lines and not any("row cache" in ln for ln in lines), lines


def _record(worker: int, steps: int, cache_seconds: float | None, wanted: int, moved: int) -> RunRecord:
    return RunRecord(worker_index=worker, mode="async", device="cpu", steps=steps, samples=steps * 10, wall_s=2.0, samples_per_sec=1.0,
                     phase_seconds={"pull_wait": 0.5, "compute": 1.0, "push": 0.5}, clock_staleness=[], update_staleness=[], start_time=0.0,
                     rejected_too_stale=0, history=[], config={},
                     traffic={"t": {"wanted_rows": wanted, "pulled_rows": moved // 2, "pushed_rows": moved - moved // 2,
                                    "pulled_bytes": 0, "pushed_bytes": 0}}, cache_seconds=cache_seconds)


def test_the_jobs_summary_and_result_line_weigh_the_rows_saved_against_the_caches_time() -> None:
    # Two workers of 100 steps: 1,000 rows looked up each, 1,100 moved of the 2,000 no cache moves; 0.2 s and 0.3 s in the cache.
    workers = [_record(0, 100, 0.2, 1000, 1100), _record(1, 100, 0.3, 1000, 1100)]
    cache = row_cache_summary(workers)
    assert cache == pytest.approx({"rows_saved": 0.45, "seconds_per_step": 0.0025, "share_of_step": 0.125})
    summary = {"final_eval": {"eval_loss": 0.5}, "total_samples": 2000, "train_wall_s": 2.0, "samples_per_sec": 1000.0, "num_workers": 2,
               "num_shards": 1, "row_cache": cache}
    text = cli._result_lines(summary, None, own_program=True)
    assert "row cache: 45% of the rows the steps looked up not moved, for 2.50 ms of its own calls a step (12% of the workers' step time)" \
        in text, text
    assert row_cache_summary([_record(0, 100, None, 1000, 2000)]) is None
    assert "row cache" not in cli._result_lines({**summary, "row_cache": None}, None, own_program=True)


def test_tether_compares_line_names_the_caches_time() -> None:
    run = {"mode": "async", "repeat": 0, "train_wall_s": 1.0, "samples_per_sec": 100.0, "bytes_per_sample": 300.0, "final_eval_loss": 0.5,
           "curve": [{"wall_s": 0.0, "eval_loss": 0.7}, {"wall_s": 1.0, "eval_loss": 0.5}],
           "summary": {"baseline_loss": 0.7, "row_cache": {"rows_saved": 0.4, "seconds_per_step": 0.00125, "share_of_step": 0.2}}}
    line = compare_module._progress_line([run], 1, None)
    assert line.endswith("300 B/sample of embedding rows moved (row cache: 1.25 ms a step, 20% of the step)"), line
