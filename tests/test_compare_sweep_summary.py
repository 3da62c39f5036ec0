"""sweep's summary.json records the row cache settings its runs used; the recommendation reads each
result's parsed ``Mode`` (no mode text parsed again); the progress line says what its bytes are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tether.deploy import compare as compare_module
from tether.deploy import compare_report
from tether.worker.config import WorkerConfig
from tether.worker.training import mode as worker_mode
from tether.worker.training.mode import Mode


@pytest.mark.parametrize("target", [None, 0.5])
def test_sweeps_summary_records_the_cache_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: float | None) -> None:
    results = [{"mode": Mode.ssp(b), "time_to_target_s": 10.0 + b, "time_to_target_s_std": 0.1, "final_eval_loss": 0.47, "repeats": 3}
               for b in (1, 4)]

    def compare(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"target_loss": target, "modes": results}

    monkeypatch.setattr(compare_module, "compare", compare)
    template = WorkerConfig(num_workers=2, steps=4, shards=("127.0.0.1:1",), cache_rows=500, cache_bound=3, cache_policy="lru",
                            cache_hot=4)
    compare_module.sweep(template, [1, 4], 1, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {k: summary[k] for k in ("cache_rows", "cache_bound", "cache_write_bound", "cache_policy", "cache_hot", "cache_admission")} == {
        "cache_rows": 500, "cache_bound": 3, "cache_write_bound": None, "cache_policy": "lru", "cache_hot": 4, "cache_admission": "recurring"}
    assert summary["recommended_staleness"] == (None if target is None else 1)


def test_recommend_reads_the_modes_bound_without_parsing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    results = [{"mode": Mode.ssp(b), "time_to_target_s": t, "time_to_target_s_std": 0.5, "final_eval_loss": 0.47, "repeats": 3}
               for b, t in ((0, 20.0), (2, 12.0), (4, 12.2))]
    calls: list[str] = []
    parse = worker_mode.parse_mode
    monkeypatch.setattr(worker_mode, "parse_mode", lambda text: calls.append(text) or parse(text))
    monkeypatch.setattr(compare_report, "parse_mode", lambda text: calls.append(text) or parse(text), raising=False)
    verdict = compare_report.recommend(results)
    assert verdict["recommended"]["mode"] == "ssp:2" and verdict["message"].startswith("recommended staleness bound: 2;")
    assert calls == []


def test_the_progress_line_names_the_bytes_it_counts() -> None:
    run = {"mode": "async", "repeat": 0, "train_wall_s": 1.0, "samples_per_sec": 100.0, "bytes_per_sample": 300.0,
           "final_eval_loss": 0.5, "curve": [{"wall_s": 0.0, "eval_loss": 0.7}, {"wall_s": 1.0, "eval_loss": 0.5}],
           "summary": {"baseline_loss": 0.7}}
    line = compare_module._progress_line([run], 1, None)
    assert line.endswith("300 B/sample of embedding rows moved"), line


def test_a_run_s_line_shows_no_target_other_than_the_table_s() -> None:
    """Without --target-loss the target is the runs' worst final loss, known once all have run:
    a run's line shows no 'target so far' (it differed from the table's, 0.4837 against 0.4848);
    with one given, the line's target is it."""
    def run(mode: str, final: float) -> dict:
        return {"mode": mode, "repeat": 0, "train_wall_s": 1.0, "samples_per_sec": 100.0, "bytes_per_sample": 300.0,
                "final_eval_loss": final, "curve": [{"wall_s": 0.0, "eval_loss": 0.7}, {"wall_s": 1.0, "eval_loss": final}],
                "summary": {"baseline_loss": 0.7}}
    runs = [run("async", 0.5), run("ssp:1", 0.52)]
    first = compare_module._progress_line(runs[:1], 1, None)
    assert "target" not in first and first.startswith("tether compare: async: final loss 0.5000, training wall"), first
    given = compare_module._progress_line(runs, 1, 0.6)
    assert "to target 0.6000: " in given and "so far" not in given, given
