"""``tether compare``'s spread of the mean final loss and the difference to sync with its
uncertainty (Welch's, and paired by data order), on fixed inputs worked out by hand."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tether.deploy.compare import _add_difference_to_sync
from tether.deploy.compare_report import difference_to, format_table, loss_spread, paired_difference, t_quantile_975

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


def _result(mode: str, losses: list[float], seeds: list[int] | None = None) -> dict:
    """A mode's result as ``compare`` makes it; its runs' data seeds 0, 1, ... unless ``seeds``."""
    s = loss_spread(losses)
    seeds = list(range(len(losses))) if seeds is None else seeds
    return {"mode": mode, "repeats": len(losses), "time_to_target_s": 10.0, "time_to_target_s_std": 1.0,
            "final_eval_loss": s["mean"], "final_eval_loss_std": s["sd"] or 0.0, "final_eval_loss_sem": s["sem"],
            "final_eval_auc": 0.8, "samples_per_sec": 1000.0, "staleness_p50": 1, "staleness_p99": 2, "staleness_max": 3,
            "runs": [{"data_seed": seed, "final_eval_loss": v} for seed, v in zip(seeds, losses, strict=True)]}


def test_the_table_prints_the_standard_error_and_the_difference_to_sync() -> None:
    modes = [_result("sync", SYNC), _result("async", ASYNC)]
    _add_difference_to_sync(modes)
    assert "vs_sync" not in modes[0] and modes[1]["vs_sync"]["diff"] == pytest.approx(0.08)
    text = format_table({"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 3, "modes": modes})
    lines = text.splitlines()
    assert "s.e." in lines[2]
    assert "0.5800 +-0.0200  0.0115" in lines[4]
    # Welch's lines, then the paired ones: per order +0.08, +0.09, +0.07: mean 0.08, sd 0.01,
    # 4.303 * 0.01 / sqrt(3) = 0.0248 (Welch's 0.0556 left the orders' shared part in).
    assert lines[-3:] == [
        "async      +0.0800 +- 0.0556 (+16.0% +- 11.1%): worse, beyond the uncertainty",
        "final loss against sync, paired by data order: per order, the mode's loss minus sync's; their mean, 95% interval from "
        "their standard deviation (Student's t, pairs - 1 degrees of freedom)",
        "async      +0.0800 +- 0.0248 (+16.0% +- 5.0%), 3 pairs: worse, beyond the uncertainty",
    ]


def test_the_table_says_when_no_uncertainty_or_no_sync_can_be_given() -> None:
    modes = [_result("sync", [0.5]), _result("async", [0.58])]
    _add_difference_to_sync(modes)
    text = format_table({"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 1, "modes": modes})
    assert text.splitlines()[-2:] == ["async      +0.0800 (+16.0%): one run: no uncertainty can be given",
                                      "final loss against sync, paired by data order: not paired: one pair: no uncertainty can be given"]
    assert modes[1]["vs_sync_paired"] is None and modes[1]["vs_sync_not_paired"] == "one pair: no uncertainty can be given"
    alone = [_result("async", ASYNC)]
    _add_difference_to_sync(alone)
    text = format_table({"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 3, "modes": alone})
    assert text.splitlines()[-1] == "final loss against sync: no sync run in this comparison (add sync to --modes)"
    # A sweep has no --modes and runs no sync (`tether sweep` printed that hint): its recommendation ends the table.
    swept = {"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 3, "modes": alone,
             "recommendation": "recommended staleness bound: 4"}
    assert "against sync" not in format_table(swept) and format_table(swept).splitlines()[-1] == swept["recommendation"]


def _t975_at_3_degrees_of_freedom() -> float:
    """Student's t 0.975 quantile at 3 degrees of freedom, solved here from its closed-form CDF,
    F(t) = 1/2 + (u / (1 + u^2) + atan(u)) / pi with u = t / sqrt(3), by bisection: 3.182446."""
    def cdf(t: float) -> float:
        u = t / math.sqrt(3)
        return 0.5 + (u / (1 + u * u) + math.atan(u)) / math.pi

    lo, hi = 0.0, 20.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < 0.975 else (lo, mid)
    return lo


def _runs(by_seed: dict[int, float | None]) -> list[dict]:
    return [{"data_seed": seed, "final_eval_loss": loss} for seed, loss in by_seed.items()]


def test_paired_difference_by_hand() -> None:
    t3 = _t975_at_3_degrees_of_freedom()
    assert t3 == pytest.approx(3.182446, abs=1e-6)
    # Four orders, listed out of order; sync also ran order 4, which has no pair and is left out
    # (of the relative figures' sync mean too: 0.61 over orders 0-3, not 0.668 over all five).
    mode = _runs({2: 0.52, 0: 0.55, 3: 0.57, 1: 0.60})
    sync = _runs({0: 0.60, 1: 0.64, 2: 0.58, 3: 0.62, 4: 0.90})
    d = paired_difference(mode, sync)
    assert isinstance(d, dict)
    # Per order -0.05, -0.04, -0.06, -0.05: mean -0.05, sd sqrt(0.0002 / 3) = 0.0081650,
    # standard error 0.0040825, half-width 3.182446 * 0.0040825 = 0.012993.
    assert d["pairs"] == 4 and d["data_seeds"] == [0, 1, 2, 3] and d["df"] == 3
    assert d["diff"] == pytest.approx(-0.05)
    assert d["sd"] == pytest.approx(math.sqrt(0.0002 / 3))
    # The table's t (3.182) lies within 1.5e-4 of the exact quantile.
    assert d["ci95"] == pytest.approx(t3 * math.sqrt(0.0002 / 3) / 2, rel=2e-4)
    assert d["ci95"] == pytest.approx(0.012993, abs=1e-5)
    assert d["relative"] == pytest.approx(-0.05 / 0.61)
    assert d["relative_ci95"] == pytest.approx(0.012993 / 0.61, abs=1e-5)
    assert d["verdict"] == "better, beyond the uncertainty"
    # Welch's interval on the same runs (sync's order 4 left out) is 4.2x as wide and within: the
    # standard errors' squares 0.0034 / 12 and 0.002 / 12, se 0.021213, df 5.62 -> 5, t 2.571.
    welch = difference_to([0.55, 0.60, 0.52, 0.57], [0.60, 0.64, 0.58, 0.62])
    assert welch["diff"] == pytest.approx(-0.05) and welch["ci95"] == pytest.approx(2.571 * math.sqrt(0.00045))
    assert welch["verdict"] == "within the uncertainty"
    # A spread of the differences about their mean that covers 0: within.
    # Differences -0.01, +0.02, 0 about their mean +0.0033 (sd 0.0153, +- 0.0379): within.
    within = paired_difference(_runs({0: 0.60, 1: 0.62, 2: 0.61}), _runs({0: 0.61, 1: 0.60, 2: 0.61}))
    assert isinstance(within, dict) and within["diff"] == pytest.approx(0.01 / 3)
    # sd^2 = (0.0133^2 + 0.0167^2 + 0.0033^2) / 2 = 0.0007 / 3; half-width 4.303 * sd / sqrt(3)
    assert within["ci95"] == pytest.approx(4.303 * math.sqrt(0.0007) / 3) and within["verdict"] == "within the uncertainty"


@pytest.mark.parametrize("mode, sync, why", [
    ({0: 0.5, 1: 0.6, 5: 0.7}, {0: 0.5, 1: 0.5, 2: 0.5}, "the runs' data orders differ (sync has no run of data seed 5)"),
    ({3: 0.5, 4: 0.6}, {0: 0.5, 1: 0.5}, "the runs' data orders differ (sync has no run of data seed 3, 4)"),
    ({0: 0.5}, {0: 0.5, 1: 0.5}, "one pair: no uncertainty can be given"),
    ({0: 0.5, 1: None}, {0: 0.5, 1: 0.5}, "a run has no final loss"),
])
def test_pairing_is_refused_with_its_reason(mode: dict, sync: dict, why: str) -> None:
    assert paired_difference(_runs(mode), _runs(sync)) == why


def test_pairing_needs_one_run_an_order_and_recorded_orders() -> None:
    twice = [{"data_seed": 0, "final_eval_loss": 0.5}, {"data_seed": 0, "final_eval_loss": 0.6}]
    assert paired_difference(twice, _runs({0: 0.5, 1: 0.5})) == "two runs share a data order"
    unrecorded = [{"final_eval_loss": 0.5}, {"final_eval_loss": 0.6}]
    assert paired_difference(_runs({0: 0.5, 1: 0.6}), unrecorded) == "the runs' data orders are not recorded"


def test_the_table_prints_each_modes_paired_line_or_why_it_has_none() -> None:
    # async paired on orders 0-2 (as above); ssp:2 ran orders 1-3, sync 0-2: refused, Welch's stays.
    modes = [_result("sync", SYNC), _result("async", ASYNC), _result("ssp:2", [0.52, 0.50, 0.51], seeds=[1, 2, 3])]
    _add_difference_to_sync(modes)
    assert modes[1]["vs_sync_paired"]["ci95"] == pytest.approx(4.303 * 0.01 / math.sqrt(3))
    assert modes[1]["vs_sync_paired"]["relative_ci95"] == pytest.approx(4.303 * 0.01 / math.sqrt(3) / 0.5)
    assert "vs_sync_not_paired" not in modes[1]
    assert modes[2]["vs_sync_paired"] is None and modes[2]["vs_sync"]["diff"] == pytest.approx(0.01)
    assert modes[2]["vs_sync_not_paired"] == "the runs' data orders differ (sync has no run of data seed 3)"
    lines = format_table({"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 3, "modes": modes}).splitlines()
    assert lines[-3].startswith("final loss against sync, paired by data order: per order, the mode's loss minus sync's")
    assert lines[-2:] == ["async      +0.0800 +- 0.0248 (+16.0% +- 5.0%), 3 pairs: worse, beyond the uncertainty",
                          "ssp:2      not paired: the runs' data orders differ (sync has no run of data seed 3)"]
    assert lines[-5].startswith("async      +0.0800 +- 0.0556") and lines[-4].startswith("ssp:2      +0.0100 +- ")


def test_the_docs_example_of_the_paired_lines_is_what_the_table_prints() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "choosing-a-consistency-mode.md").read_text()
    (block,) = [b for b in re.findall(r"```text\n(.*?)```", page, re.S) if "paired by data order" in b]
    modes = [_result("sync", SYNC), _result("async", ASYNC)]
    _add_difference_to_sync(modes)
    text = format_table({"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 3, "modes": modes})
    assert [line.strip() for line in block.strip().splitlines()] == text.splitlines()[-4:]


def test_repeats_that_trained_one_order_are_named() -> None:
    """`tether compare --repeats 2 --script s.py` where s.py seeds its order with config.seed only:
    sync's two runs ended at the same loss to the last bit, and the table gave sync a spread of 0
    and async a paired difference with an interval, as if two orders had been trained."""
    from tether.deploy.compare import _mark_identical_repeats

    one_order = [_result("sync", [0.5125, 0.5125]), _result("async", [0.5127, 0.5131])]
    _mark_identical_repeats(one_order)
    _add_difference_to_sync(one_order)
    assert one_order[0]["repeats_identical"] is True and "repeats_identical" not in one_order[1]
    text = format_table({"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 2, "modes": one_order})
    said = [line for line in text.splitlines() if "bitwise equal" in line]
    assert len(said) == 1 and said[0].startswith("sync: the 2 repeats ended bitwise equal") and "config.data_seed" in said[0]
    # Two orders, or one run a mode, or repeats given one seed on purpose: nothing to say.
    for modes in ([_result("sync", [0.5125, 0.5126]), _result("async", [0.5127, 0.5131])], [_result("sync", [0.5125])],
                  [_result("sync", [0.5125, 0.5125], seeds=[3, 3])]):
        _mark_identical_repeats(modes)
        assert not any("repeats_identical" in m for m in modes)
        assert "bitwise equal" not in format_table({"target_loss": 0.55, "baseline_loss": 0.6, "straggler": "none", "repeats": 2,
                                                    "modes": modes})
