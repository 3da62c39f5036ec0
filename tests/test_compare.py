"""compare/sweep helpers without processes (time to target, recommendations, stragglers, the plot), and
compare/sweep --script running a user's script as real processes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import matplotlib.image
import pytest

from tether.deploy.compare import _with_job_end, time_to_target
from tether.deploy.compare_report import format_table, recommend
from tether.deploy.plot import DPI, SIZE, write_plot
from tether.protos.errors import UsageError
from tether.worker.config import TrainingConfig
from tether.worker.training.run_record import RunRecord
from tether.worker.training.stragglers import StragglerSpec, delay_factor, parse_straggler


def test_time_to_target_is_interpolated_between_evaluations() -> None:
    curve = [
        {"step": 0, "wall_s": 0.0, "eval_loss": 0.60},
        {"step": 10, "wall_s": 10.0, "train_loss": 0.5},  # no evaluation: skipped
        {"step": 20, "wall_s": 20.0, "eval_loss": 0.50},
        {"step": 40, "wall_s": 40.0, "eval_loss": 0.40},
    ]
    assert time_to_target(curve, 0.45) == pytest.approx(30.0)
    assert time_to_target(curve, 0.50) == 20.0
    assert time_to_target(curve, 0.60) == 0.0
    assert time_to_target(curve, 0.39) is None
    # Read only at evaluations (the old rule), these two curves swap places: 40 s against 30 s.
    fast_late = [{"wall_s": 0.0, "eval_loss": 0.6}, {"wall_s": 30.0, "eval_loss": 0.451}, {"wall_s": 40.0, "eval_loss": 0.3}]
    slow_early = [{"wall_s": 0.0, "eval_loss": 0.6}, {"wall_s": 30.0, "eval_loss": 0.449}]
    assert time_to_target(fast_late, 0.45) < 31.0 and time_to_target(slow_early, 0.45) > 29.0


def test_the_curve_ends_at_the_jobs_final_loss() -> None:
    # async: worker 0 finished first (its last evaluation 0.574); the job's final evaluation,
    # after the slower worker's last steps, is 0.567. A target taken from the final losses
    # (0.570) must be reached on the curve, at the job's end.
    curve = [{"step": 0, "samples": 0, "total_samples": 0, "wall_s": 0.0, "eval_loss": 0.73},
             {"step": 40, "samples": 5120, "total_samples": 8000, "wall_s": 1.2, "eval_loss": 0.574}]
    records = [replace(_record(w, "async", []), samples=5120) for w in range(2)]
    ended = _with_job_end(curve, {"eval_loss": 0.567, "train_wall_s": 2.0}, records)
    assert ended[-1] == {"step": 40, "samples": 5120, "total_samples": 10240, "wall_s": 2.0, "eval_loss": 0.567, "job_end": True}
    assert time_to_target(curve, 0.570) is None and time_to_target(ended, 0.570) == pytest.approx(1.2 + 0.8 * 4 / 7)
    # sync: rank 0's last evaluation is the job's: nothing added.
    assert _with_job_end(curve, {"eval_loss": 0.574, "train_wall_s": 1.3}, records) == curve


def _result(mode: str, ttt: float, ttt_std: float, loss: float = 0.47, repeats: int = 3) -> dict[str, object]:
    return {"mode": mode, "time_to_target_s": ttt, "time_to_target_s_std": ttt_std, "final_eval_loss": loss, "repeats": repeats}


def test_recommend_needs_a_lead_larger_than_the_spread() -> None:
    clear = recommend([_result("ssp:0", 20.0, 1.0), _result("ssp:2", 12.0, 1.0), _result("ssp:4", 13.0, 1.5)])
    assert clear["recommended"]["mode"] == "ssp:2" and clear["tied"] == ["ssp:2", "ssp:4"]
    assert "recommended staleness bound: 2" in clear["message"]
    noise = recommend([_result("ssp:0", 14.0, 2.0), _result("ssp:2", 12.0, 2.0)])
    assert noise["recommended"] is None and "no significant difference" in noise["message"]
    # Faster but more than 1% worse: not eligible.
    lossy = recommend([_result("ssp:0", 20.0, 0.5, 0.470), _result("ssp:8", 5.0, 0.5, 0.480)])
    assert lossy["recommended"]["mode"] == "ssp:0"
    single = recommend([_result("ssp:0", 14.0, 0.0, repeats=1), _result("ssp:2", 13.9, 0.0, repeats=1)])
    assert single["recommended"]["mode"] == "ssp:2" and "spread is unknown" in single["message"]
    with pytest.raises(UsageError):
        recommend([{"mode": "ssp:0", "time_to_target_s": None, "final_eval_loss": 0.5}])


def test_straggler_specs_parse_and_are_deterministic() -> None:
    assert parse_straggler("persistent:3") == StragglerSpec("persistent", factor=3.0)
    assert parse_straggler("3") == StragglerSpec("persistent", factor=3.0)
    assert parse_straggler(1.0) == parse_straggler("none") == parse_straggler("") == StragglerSpec()
    assert parse_straggler("transient:0.1:5") == StragglerSpec("transient", probability=0.1, factor=5.0)
    assert str(parse_straggler("pareto:1.5")) == "pareto:1.5"
    for bad in ("transient:0.1", "transient:2:5", "persistent:0.5", "pareto:0", "slow:3", "persistent:x"):
        with pytest.raises(ValueError, match="straggler"):
            parse_straggler(bad)
    persistent = parse_straggler("persistent:3")
    assert [delay_factor(persistent, 0, w, 7, 4) for w in range(4)] == [1.0, 1.0, 1.0, 3.0]
    transient = parse_straggler("transient:0.1:5")
    draws = [delay_factor(transient, 11, w, s, 4) for w in range(4) for s in range(5000)]
    assert set(draws) == {1.0, 5.0} and 0.08 < draws.count(5.0) / len(draws) < 0.12
    assert draws == [delay_factor(transient, 11, w, s, 4) for w in range(4) for s in range(5000)]  # the same in every mode
    assert draws != [delay_factor(transient, 12, w, s, 4) for w in range(4) for s in range(5000)]
    heavy = [delay_factor(parse_straggler("pareto:1.5"), 0, 0, s, 4) for s in range(5000)]
    assert min(heavy) >= 1.0 and max(heavy) <= 50.0 and 2.0 < sum(heavy) / len(heavy) < 3.5


def test_old_slowdown_flags_map_onto_a_persistent_spec() -> None:
    cfg = TrainingConfig(shards=("a:1",), num_workers=3, worker_index=0, slowdown=4.0, slow_worker=2)
    assert cfg.straggler_spec == StragglerSpec("persistent", factor=4.0, worker=2)
    assert TrainingConfig(shards=("a:1",), worker_index=0, slowdown=2.0).straggler_spec.worker == 0  # this worker
    assert TrainingConfig(shards=("a:1",), straggler="transient:0.2:3").straggler_spec.kind == "transient"
    with pytest.raises(ValueError, match="straggler"):
        TrainingConfig(shards=("a:1",), straggler="transient:3")


def _record(worker: int, mode: str, history: list[dict[str, float]]) -> RunRecord:
    return RunRecord(worker_index=worker, mode=mode, device="cpu", steps=100, samples=10_000, wall_s=10.0, samples_per_sec=1000.0,
                     phase_seconds={}, clock_staleness=[1] * 100, update_staleness=[1] * 100, start_time=100.0, rejected_too_stale=0,
                     history=history, config={})


def _run(mode: str, repeat: int, slope: float) -> dict[str, object]:
    history = [{"step": 0, "samples": 0, "wall_s": 0.0, "time": 100.0, "eval_loss": 0.69}]
    for i in range(1, 11):
        history.append({"step": 10 * i, "samples": 1000 * i, "wall_s": i * 1.0, "time": 100.0 + i, "eval_loss": 0.45 + 0.24 * slope ** i + 0.001 * repeat,
                        "total_samples": 2000 * i, "staleness_mean": 1.0})
    history[0]["total_samples"] = 0
    records = [_record(w, mode, history) for w in range(2)]
    return {"mode": mode, "repeat": repeat, "curve": history, "records": records}


def test_plot_has_bands_insets_and_a_staleness_panel(tmp_path: Path) -> None:
    runs = {"sync": [_run("sync", r, 0.6) for r in range(3)], "async": [_run("async", r, 0.5) for r in range(3)]}
    path = tmp_path / "curves.png"
    fig = write_plot(runs, path, target=0.47, baseline=0.69, best_possible=0.44, title="test")
    # The file is a PNG of the figure's size.
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (round(SIZE[1] * DPI), round(SIZE[0] * DPI)) and image.std() > 0.05  # not blank
    ax_t, ax_s, ax_z = fig.axes
    assert fig._suptitle.get_text() == "tether: eval loss by consistency mode (test)"
    assert ax_t.get_xlabel().startswith("worker 0's training time") and ax_s.get_xlabel() == "samples, all workers"
    assert ax_t.get_ylabel() == ax_s.get_ylabel() == "held-out log loss"
    assert ax_z.get_ylabel().startswith("clock staleness")
    for ax, end in ((ax_t, 10.0), (ax_s, 20_000.0)):
        lines = {line.get_label(): line for line in ax.get_lines()}
        # One mean line per mode, over its three runs (eval loss 0.69, then 0.45 + 0.24 slope^i + 0.001 repeat).
        for mode, slope in (("sync", 0.6), ("async", 0.5)):
            x, y = lines[mode].get_xdata(), lines[mode].get_ydata()
            assert x[0] == 0.0 and x[-1] == pytest.approx(end) and len(x) == 80
            assert y[0] == pytest.approx(0.69) and y[-1] == pytest.approx(0.45 + 0.24 * slope ** 10 + 0.001)
        # The reference lines, at their losses.
        assert lines["target"].get_ydata()[0] == 0.47 and lines["best possible"].get_ydata()[0] == 0.44
        assert lines["constant predictor"].get_ydata()[0] == 0.69
        assert ax.get_legend() is not None or ax is ax_s
        # Each mode's band spans its runs' spread: 0.002 between repeat 0 and repeat 2.
        bands = [c for c in ax.collections if len(c.get_paths())]
        assert len(bands) == 2
        for band, slope in zip(bands, (0.6, 0.5), strict=False):
            at_end = sorted({round(float(vy), 9) for vx, vy in band.get_paths()[0].vertices if abs(vx - end) < 1e-9})
            assert at_end == pytest.approx([0.45 + 0.24 * slope ** 10, 0.45 + 0.24 * slope ** 10 + 0.002])
        inset = ax.child_axes[0]
        assert inset.get_title() == "second half, zoomed" and inset.get_xlim() == pytest.approx((end / 2, end))
    # The staleness panel: each mode's staleness_mean against the time since the first start.
    lines = {line.get_label(): line for line in ax_z.get_lines()}
    assert set(lines) == {"sync", "async"}
    assert list(lines["sync"].get_xdata()) == [float(i) for i in range(1, 11) for _ in range(2)]  # two workers
    assert set(lines["async"].get_ydata()) == {1.0}


def test_a_plot_of_runs_that_logged_no_staleness_says_so_on_its_panel(tmp_path: Path) -> None:
    runs = {"sync": [_run("sync", r, 0.6) for r in range(2)]}
    for run in runs["sync"]:
        for record in run["records"]:  # type: ignore[attr-defined]
            for point in record.history:
                point.pop("staleness_mean", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns of a legend with no labelled line
        fig = write_plot(runs, tmp_path / "curves.png", target=0.47, baseline=0.69)
    ax_z = fig.axes[2]
    assert not ax_z.get_lines() and ax_z.get_legend() is None
    assert [t.get_text() for t in ax_z.texts] == ["no staleness logged"]
    assert fig.axes[0].get_legend() is not None  # the loss panel keeps its legend

def test_table_shows_mean_and_spread() -> None:
    summary = {"target_loss": 0.47, "baseline_loss": 0.69, "bayes_loss": 0.44, "straggler": "transient:0.1:5", "repeats": 3,
               "modes": [{"mode": "ssp:2", "time_to_target_s": 12.0, "time_to_target_s_std": 0.5, "final_eval_loss": 0.465,
                          "final_eval_loss_std": 0.002, "final_eval_auc": 0.8, "samples_per_sec": 1000.0,
                          "staleness_p50": 1, "staleness_p99": 2, "staleness_max": 2}],
               "recommendation": "recommended staleness bound: 2"}
    text = format_table(summary)
    assert "12.0 +-0.5" in text and "0.4650 +-0.0020" in text and "best possible 0.4400" in text
    assert text.splitlines()[-1] == "recommended staleness bound: 2"


SCRIPT = Path(__file__).resolve().parent / "scripts" / "compare_script.py"
TINY = ["--num-workers", "2", "--num-shards", "1", "--steps", "12", "--eval-every", "4", "--job-timeout", "120"]


def _tether(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tether.deploy.cli", *args], capture_output=True, text=True, timeout=300)


def test_compare_runs_a_users_script_in_every_mode_and_compares_its_records(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    # Compared on the script's own metric name (lower is better).
    proc = _tether("compare", "--script", str(SCRIPT), "--modes", "async,sync", "--metric", "mae", "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["program"].endswith("compare_script.py") and [m["mode"] for m in summary["modes"]] == ["async", "sync"]
    for result in summary["modes"]:
        run_dir = out / result["mode"]
        records = [RunRecord.load(run_dir / f"worker-{w}.json") for w in range(2)]
        # The figures are the script's own records': worker 0's last evaluation, each worker's last train loss.
        assert result["final_eval_loss"] == pytest.approx(records[0].final_eval["mae"])
        assert result["final_eval"] == pytest.approx({k: v for k, v in records[0].final_eval.items() if k != "mae"})
        assert math.isfinite(result["final_eval_loss"]) and 0 <= result["final_eval"]["within_half"] <= 1
        last_train = [[p["train_loss"] for p in r.history if "train_loss" in p][-1] for r in records]
        assert result["final_train_loss"] == pytest.approx(sum(last_train) / 2) and result["steps_per_worker"] == [[12, 12]]
        # Each worker (each sync rank) trained its own slice: disjoint, together every sample.
        seen = [set(json.loads((run_dir / f"seen-{w}.json").read_text())) for w in range(2)]
        assert len(seen[0]) == len(seen[1]) == 192 and not seen[0] & seen[1] and seen[0] | seen[1] == set(range(384))
    # Both modes start from the same initial model: its eval loss is the baseline, above the final losses.
    first = RunRecord.load(out / "async" / "worker-0.json").history[0]
    assert first["step"] == 0 and summary["baseline_loss"] == pytest.approx(first["mae"]) and summary["metric"] == "mae"
    assert all(m["final_eval_loss"] < summary["baseline_loss"] for m in summary["modes"])
    assert summary["target_loss"] is not None and (out / "curves.png").stat().st_size > 0
    assert "within_half" in proc.stdout and "target mae" in proc.stdout and "initial model" in proc.stdout
    assert "no eval loss" not in proc.stdout
    # One run a mode: no pairs by data order to give an interval, said in one line.
    assert summary["modes"][0]["vs_sync_paired"] is None
    assert summary["modes"][0]["vs_sync_not_paired"] == "one pair: no uncertainty can be given"
    assert "final loss against sync, paired by data order: not paired: one pair: no uncertainty can be given" in proc.stdout.splitlines()


def test_a_scripts_repeats_vary_its_data_order_alone(tmp_path: Path) -> None:
    """``--repeats`` with ``--script``: each repeat's workers read their own data seed
    (``config.data_seed``: ``--data-seed`` plus the repeat's number) and the same ``--seed``, so
    the repeats start from one model and train the same samples in other orders. In sync, where a
    run repeats to the bit, the repeats then end apart."""
    out = tmp_path / "rep"
    proc = _tether("compare", "--script", str(SCRIPT), "--modes", "sync", "--repeats", "2", "--data-seed", "5", "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [out / "sync" / f"repeat-{r}" for r in range(2)]
    assert [r["data_seed"] for r in json.loads((out / "summary.json").read_text())["modes"][0]["runs"]] == [5, 6]
    seen = [[json.loads((d / f"seen-{w}.json").read_text()) for w in range(2)] for d in runs]
    for w in range(2):
        assert seen[0][w] != seen[1][w] and sorted(seen[0][w]) == sorted(seen[1][w])  # the same slice, in another order
    records = [RunRecord.load(d / "worker-0.json") for d in runs]
    assert records[0].history[0]["step"] == 0 and records[0].history[0]["eval_loss"] == records[1].history[0]["eval_loss"]
    assert records[0].final_eval["eval_loss"] != records[1].final_eval["eval_loss"]


def test_sweep_of_a_script_without_eval_loss_says_so_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    # A --script-args value that is one token starting with a dash is the script's, not argparse's.
    proc = _tether("sweep", "--script", str(SCRIPT), "--script-args", "--no-eval", "--bounds", "1", "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target_loss"] is None and summary["recommended_staleness"] is None and not summary["plotted"]
    assert math.isfinite(summary["modes"][0]["final_train_loss"]) and summary["modes"][0]["final_eval_loss"] is None
    assert proc.stdout.count("report no eval loss") == 1 and "no staleness bound recommended" in proc.stdout
    assert "to target (s)" not in proc.stdout and not (out / "curves.png").exists()


def test_script_flags_are_checked_before_any_process_starts(tmp_path: Path) -> None:
    missing = _tether("compare", "--script", str(tmp_path / "nope.py"), "--out", str(tmp_path / "o"))
    assert missing.returncode == 2 and missing.stderr.strip() == f"tether compare: error: --script {tmp_path / 'nope.py'}: no such file"
    alone = _tether("sweep", "--script-args", "--no-eval", "--out", str(tmp_path / "o"))
    assert alone.returncode == 2 and "--script-args is for --script or --entry" in alone.stderr and len(alone.stderr.splitlines()) == 1
    builtin = _tether("compare", "--metric", "mae", "--out", str(tmp_path / "o"))
    assert builtin.returncode == 2 and "--metric mae: is for --script or --entry" in builtin.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["compare", "sweep"])
def test_compare_and_sweep_parse_each_mode_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """The launcher of ``compare`` parses each mode text once (``sweep`` makes ``ssp:S`` from its
    bounds: none to parse), and a run's config shares that ``Mode`` (its copy is not parsed again)."""
    from tether.deploy import cli
    from tether.deploy import compare as compare_module
    from tether.deploy.errors import ClusterError
    from tether.worker.training import mode as worker_mode

    calls: list[str] = []
    parse = worker_mode.parse_mode
    monkeypatch.setattr(worker_mode, "parse_mode", lambda text: calls.append(text) or parse(text))
    ran: list[object] = []

    def run_job(cfg: object, *args: object, **kwargs: object) -> None:
        ran.append(cfg.mode)  # type: ignore[attr-defined]
        raise ClusterError("stop after the first run's config")

    monkeypatch.setattr(compare_module, "run_job", run_job)
    chosen = ["--modes", "ssp:3,async,sync"] if command == "compare" else ["--bounds", "2,5"]
    argv = [command, *chosen, "--steps", "4", "--num-workers", "2", "--out", str(tmp_path / "out"), "--tensorboard", str(tmp_path / "tb")]
    assert cli.main(argv) == 1
    # The template's own mode (the default: compare and sweep refuse --mode) first, then each of --modes once.
    assert calls == (["async", "ssp:3", "async", "sync"] if command == "compare" else ["async"])
    first = ran[0]
    assert isinstance(first, worker_mode.Mode) and (first.kind, first.bound) == (("ssp", 3) if command == "compare" else ("ssp", 2))
