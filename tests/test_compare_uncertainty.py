"""``tether compare``'s spread of the mean final loss and the difference to sync with its
uncertainty, on fixed inputs worked out by hand."""

from __future__ import annotations

import math

import pytest

from tether.deploy.compare import _add_difference_to_sync
from tether.deploy.compare_report import difference_to, format_table, loss_spread, t_quantile_975

SYNC = [0.50, 0.51, 0.49]   # mean 0.50, sd 0.01, s.e. 0.01 / sqrt(3) = 0.005774
ASYNC = [0.58, 0.60, 0.56]  # mean 0.58, sd 0.02, s.e. 0.02 / sqrt(3) = 0.011547


def test_loss_spread_is_mean_sd_and_standard_error() -> None:
    s = loss_spread(ASYNC)
    assert s["mean"] == pytest.approx(0.58)
    assert s["sd"] == pytest.approx(0.02)
    assert s["sem"] == pytest.approx(0.011547, abs=1e-6)
    one = loss_spread([0.5])
    assert one == {"mean": 0.5, "sd": None, "sem": None}


def test_t_quantiles_err_wide() -> None:
    assert t_quantile_975(1) == 12.706
    assert t_quantile_975(2.94) == 4.303   # rounded down to 2 degrees of freedom
    assert t_quantile_975(35) == 2.042     # 30's
    assert t_quantile_975(1000) == 1.980   # 120's
    assert t_quantile_975(math.inf) == 1.96
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_975(0.5)


def test_difference_to_sync_by_hand() -> None:
    # se = sqrt(0.011547^2 + 0.005774^2) = 0.012910; Welch's df = (1.6667e-4)^2 /
    # ((1.3333e-4)^2 / 2 + (3.3333e-5)^2 / 2) = 2.94 -> 2, t = 4.303; half-width 0.05555.
    d = difference_to(ASYNC, SYNC)
    assert d["diff"] == pytest.approx(0.08)
    assert d["relative"] == pytest.approx(0.16)
    assert d["df"] == pytest.approx(2.941, abs=1e-3)
    assert d["ci95"] == pytest.approx(4.303 * 0.0129099, abs=1e-5)
    assert d["relative_ci95"] == pytest.approx(0.1111, abs=1e-4)
    assert d["verdict"] == "worse, beyond the uncertainty"
    # the same spread around sync's mean: within
    assert difference_to([0.52, 0.48, 0.50], SYNC)["verdict"] == "within the uncertainty"
    assert difference_to([0.40, 0.41, 0.39], SYNC)["verdict"] == "better, beyond the uncertainty"


def test_one_run_gives_no_uncertainty() -> None:
    d = difference_to([0.58], SYNC)
    assert d["diff"] == pytest.approx(0.08) and d["ci95"] is None and d["df"] is None
    assert d["verdict"] == "one run: no uncertainty can be given"
    assert difference_to(ASYNC, [0.5])["ci95"] is None


def _result(mode: str, losses: list[float]) -> dict:
    s = loss_spread(losses)
    return {"mode": mode, "repeats": len(losses), "time_to_target_s": 10.0, "time_to_target_s_std": 1.0,
            "final_eval_loss": s["mean"], "final_eval_loss_std": s["sd"] or 0.0, "final_eval_loss_sem": s["sem"],
            "final_eval_auc": 0.8, "samples_per_sec": 1000.0, "staleness_p50": 1, "staleness_p99": 2, "staleness_max": 3,
            "runs": [{"final_eval_loss": v} for v in losses]}


def test_the_table_prints_the_standard_error_and_the_difference_to_sync() -> None:
    modes = [_result("sync", SYNC), _result("async", ASYNC)]
    _add_difference_to_sync(modes)
    assert "vs_sync" not in modes[0] and modes[1]["vs_sync"]["diff"] == pytest.approx(0.08)
    text = format_table({"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 3, "modes": modes})
    lines = text.splitlines()
    assert "s.e." in lines[2]
    assert "0.5800 +-0.0200  0.0115" in lines[4]
    assert lines[-1] == "async      +0.0800 +- 0.0556 (+16.0% +- 11.1%): worse, beyond the uncertainty"


def test_the_table_says_when_no_uncertainty_or_no_sync_can_be_given() -> None:
    modes = [_result("sync", [0.5]), _result("async", [0.58])]
    _add_difference_to_sync(modes)
    text = format_table({"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 1, "modes": modes})
    assert text.splitlines()[-1] == "async      +0.0800 (+16.0%): one run: no uncertainty can be given"
    alone = [_result("async", ASYNC)]
    _add_difference_to_sync(alone)
    text = format_table({"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 3, "modes": alone})
    assert text.splitlines()[-1] == "final loss against sync: no sync run in this comparison (add sync to --modes)"
