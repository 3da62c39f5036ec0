"""``tether sweep --remedy NAME --strengths LIST`` (issue 42 item 4): a remedy's strength swept the
way the bound is, on a fake job runner (no processes): which runs it makes, the recommendation's
rule on hand-picked losses, and bad input refused in one line before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tether.deploy import compare as compare_module
from tether.deploy.compare_report import format_table, recommend_strength
from tether.protos.errors import UsageError
from tether.worker.config import WorkerConfig
from tether.worker.training.run_record import RunRecord

TEMPLATE = WorkerConfig(shards=("pending:0",), num_workers=2, steps=10, eval_every=5)

# Final loss per (run kind, data order): sync 0.50; plain async 0.58 +- 0.01; lambda0 2 the
# lowest, 0.52 +- 0.01 (beyond the uncertainty of plain's); 4 within the uncertainty of 2; 1 not.
LOSSES = {
    "sync": [0.500, 0.505, 0.495],
    "async": [0.580, 0.590, 0.570],
    1.0: [0.560, 0.570, 0.550],
    2.0: [0.520, 0.530, 0.510],
    4.0: [0.525, 0.535, 0.515],
}


def _fake_runner(ran: list[WorkerConfig], losses: dict[Any, list[float]]) -> Any:
    """A ``run_job`` that writes two workers' records and returns the summary ``compare`` reads:
    the final loss ``losses`` gives the run's kind (its remedy's strength, else its mode) and order."""

    def run_job(cfg: WorkerConfig, num_shards: int, out: Path, **kwargs: Any) -> dict[str, Any]:
        ran.append(cfg)
        kind = cfg.delay_compensation or str(cfg.mode)
        final = losses[kind][cfg.data_seed]
        for w in range(cfg.num_workers):
            history = [{"step": 0, "samples": 0, "wall_s": 0.0, "eval_loss": 0.6},
                       {"step": 5, "samples": 640, "time": 1.0, "wall_s": 1.0, "eval_loss": 0.55},
                       {"step": 10, "samples": 1280, "time": 2.0, "wall_s": 2.0, "eval_loss": final}]
            RunRecord(worker_index=w, mode=str(cfg.mode), device="cpu", steps=10, samples=1280, wall_s=2.0, samples_per_sec=640.0,
                      phase_seconds={}, clock_staleness=[0, 1, 2], update_staleness=[1], start_time=0.0, rejected_too_stale=0,
                      history=history, config={}).write(out)
        return {"eval_loss": final, "eval_auc": 0.7, "baseline_loss": 0.6, "samples_per_sec": 1280.0, "train_wall_s": 2.0}

    return run_job


def test_a_remedy_sweep_runs_sync_plain_async_and_each_strength_and_recommends_the_lowest_beyond_the_uncertainty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[WorkerConfig] = []
    monkeypatch.setattr(compare_module, "run_job", _fake_runner(ran, LOSSES))
    template = WorkerConfig(shards=("pending:0",), num_workers=2, steps=10, eval_every=5, staleness_aware=True)
    summary = compare_module.remedy_sweep(template, "dc-adaptive", [1, 2, 4], 1, tmp_path, repeats=3, printer=lambda line: None)
    # Interleaved: every kind once per data order; sync without the remedy, the others async with it
    # at their strength (lambda0), --staleness-aware on every run as the template has it.
    kinds = [(str(c.mode), c.delay_compensation, c.dc_adaptive, c.data_seed) for c in ran]
    assert kinds == [(m, x, x > 0, seed) for seed in (0, 1, 2)
                     for m, x in (("sync", 0.0), ("async", 0.0), ("async", 1.0), ("async", 2.0), ("async", 4.0))]
    assert all(c.staleness_aware for c in ran)
    assert [m["mode"] for m in summary["modes"]] == ["sync", "async", "dc-a:1", "dc-a:2", "dc-a:4"]
    assert (tmp_path / "dc-a-2" / "repeat-2" / "worker-0.json").exists()
    best = summary["modes"][3]
    assert best["final_eval_loss"] == pytest.approx(0.52) and best["vs_sync"]["diff"] == pytest.approx(0.02)
    assert summary["recommended_strength"] == 2.0 and summary["tied_strengths"] == [4.0]
    # plain 0.58 +- 0.01 (sd) against 0.52 +- 0.01: Welch df 4, t 2.776: -0.06 +- 2.776 * sqrt(2 * 0.01^2 / 3) = 0.0227
    assert summary["recommendation"] == ("recommended dc-adaptive strength: 2 (lowest mean final loss, -0.0600 +- 0.0227 against "
                                         "plain async, 95%; 4 within the uncertainty of it)")
    written = json.loads((tmp_path / "summary.json").read_text())
    assert {k: written[k] for k in ("remedy", "strengths", "reference", "recommended_strength")} == {
        "remedy": "dc-adaptive", "strengths": [0.0, 1.0, 2.0, 4.0], "reference": "async", "recommended_strength": 2.0}
    # Paired by data order (0, 1, 2 in every kind): lambda0 2 against sync per order +0.020, +0.025,
    # +0.015: sd 0.005, 4.303 * 0.005 / sqrt(3) = 0.0124, worse beyond it, where Welch's interval
    # (sds 0.01 and 0.005, df 2.94 -> 2: 4.303 * 0.006455 = 0.0278) is within.
    paired = written["modes"][3]["vs_sync_paired"]
    assert paired["pairs"] == 3 and paired["data_seeds"] == [0, 1, 2] and paired["diff"] == pytest.approx(0.02)
    assert paired["ci95"] == pytest.approx(4.303 * 0.005 / 3 ** 0.5) and paired["relative"] == pytest.approx(0.04)
    assert paired["verdict"] == "worse, beyond the uncertainty" and written["modes"][3]["vs_sync"]["verdict"] == "within the uncertainty"
    assert "vs_sync_paired" not in written["modes"][0]  # sync itself
    table = format_table(summary).splitlines()
    assert "dc-a:2     +0.0200 +- 0.0278 (+4.0% +- 5.6%): within the uncertainty" in table
    paired_lines = table[table.index(next(x for x in table if x.startswith("final loss against sync, paired by data order"))) + 1:]
    # Every kind's losses here move with sync's by order, spread +-0.005 about it: the same 0.0124 each.
    assert paired_lines[:4] == ["async      +0.0800 +- 0.0124 (+16.0% +- 2.5%), 3 pairs: worse, beyond the uncertainty",
                                "dc-a:1     +0.0600 +- 0.0124 (+12.0% +- 2.5%), 3 pairs: worse, beyond the uncertainty",
                                "dc-a:2     +0.0200 +- 0.0124 (+4.0% +- 2.5%), 3 pairs: worse, beyond the uncertainty",
                                "dc-a:4     +0.0250 +- 0.0124 (+5.0% +- 2.5%), 3 pairs: worse, beyond the uncertainty"]
    assert table[-1] == summary["recommendation"]


def test_dc_sets_lambda_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[WorkerConfig] = []
    losses = {"sync": [0.5], "async": [0.58], 0.04: [0.57]}
    monkeypatch.setattr(compare_module, "run_job", _fake_runner(ran, losses))
    summary = compare_module.remedy_sweep(TEMPLATE, "dc", [0, 0.04], 1, tmp_path, printer=lambda line: None)
    assert [(str(c.mode), c.delay_compensation, c.dc_adaptive) for c in ran] == [("sync", 0, False), ("async", 0, False),
                                                                                ("async", 0.04, False)]
    # One run per strength: the lowest is recommended if below plain async, and the message says the spread is unknown.
    assert summary["recommended_strength"] == 0.04 and "one run per strength" in summary["recommendation"]
    worse = [{"mode": "async", "runs": [{"final_eval_loss": 0.58}]}, {"mode": "dc:1", "runs": [{"final_eval_loss": 0.59}]}]
    verdict = recommend_strength(worse, {"dc:1": 1.0}, "dc")
    assert verdict["strength"] is None and verdict["message"].startswith("no dc strength recommended: the best, 1, is +0.0100 against")


def test_no_strength_is_recommended_when_the_best_is_within_the_uncertainty_of_plain_async() -> None:
    def result(mode: str, losses: list[float]) -> dict[str, Any]:
        return {"mode": mode, "runs": [{"final_eval_loss": x} for x in losses]}

    results = [result("sync", [0.50, 0.51, 0.49]), result("async", [0.58, 0.62, 0.54]), result("dc:1", [0.56, 0.60, 0.55])]
    verdict = recommend_strength(results, {"dc:1": 1.0}, "dc")
    assert verdict["strength"] is None and verdict["message"].startswith("no dc strength recommended: the best, 1, is -0.0100 +- ")
    assert verdict["message"].endswith("against plain async: not better beyond the uncertainty")
    no_loss = [result("async", [0.5]), {"mode": "dc:1", "runs": [{"final_eval_loss": None}]}]
    assert recommend_strength(no_loss, {"dc:1": 1.0}, "dc")["strength"] is None


@pytest.mark.parametrize("remedy, strengths, match", [
    ("gap-aware", [1.0], "must be one of dc, dc-adaptive"),
    ("dc", [], "at least one strength"),
    ("dc", [0], "at least one strength > 0"),
    ("dc", [1.0, 1.0], "1 is given twice"),
    ("dc", [-1.0], "finite number >= 0"),
])
def test_bad_remedy_sweeps_are_refused_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, remedy: str, strengths: list[float], match: str,
) -> None:
    ran: list[WorkerConfig] = []
    monkeypatch.setattr(compare_module, "run_job", _fake_runner(ran, LOSSES))
    with pytest.raises(UsageError, match=match):
        compare_module.remedy_sweep(TEMPLATE, remedy, strengths, 1, tmp_path / "out")
    assert not ran and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, named", [
    (["--remedy", "gap-aware"], "--remedy 'gap-aware'"),
    (["--remedy", "dc-adaptive", "--strengths", "1,x"], "got 'x'"),
    (["--remedy", "dc", "--strengths", "2,2"], "2 is given twice"),
    (["--remedy", "dc", "--bounds", "2"], "--bounds 2"),
    (["--remedy", "dc", "--tolerance", "0.1"], "--tolerance 0.1"),
    (["--remedy", "dc-adaptive", "--delay-compensation", "1"], "--delay-compensation"),
    (["--strengths", "1"], "--strengths 1: is for --remedy"),
])
def test_the_command_refuses_bad_input_in_one_line(tmp_path: Path, args: list[str], named: str) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "tether.deploy.cli", "sweep", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("tether sweep: error: ") and named in lines[0], proc.stderr
    assert not out.exists()
