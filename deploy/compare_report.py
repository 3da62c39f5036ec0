"""What ``tether compare`` and ``tether sweep`` print: the per-mode results as a table, and the
staleness bound the sweep's runs recommend (``tether.deploy.compare`` runs them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tether.deploy.compare_program import format_program_table
from tether.protos.errors import UsageError
from tether.worker.training.mode import Mode

__all__ = ["format_table", "recommend"]


def recommend(results: Sequence[dict[str, Any]], tolerance: float = 0.01) -> dict[str, Any]:
    """The bound to use, if the runs can tell.

    Eligible bounds reached the target in every run with a mean final loss within
    ``tolerance`` (relative) of the best mean. The fastest of them (mean time to target) leads;
    a bound is tied with it when its lead is no larger than the spread (the sum of the two
    standard deviations). Recommended: the smallest bound among the tied ones, unless every
    eligible bound is tied, which is "no significant difference".

    Returns:
        ``{"best": result, "recommended": result or None, "tied": [modes], "message": str}``.

    Raises:
        UsageError: no result reached the target.
    """
    best_loss = min(float(r["final_eval_loss"]) for r in results)
    eligible = [
        r for r in results
        if float(r["final_eval_loss"]) <= best_loss * (1 + tolerance) and r["time_to_target_s"] is not None
    ]
    if not eligible:
        raise UsageError("no staleness bound reached the target loss in every run; lower the target or train longer")
    best = min(eligible, key=lambda r: float(r["time_to_target_s"]))

    def tied(r: dict[str, Any]) -> bool:
        lead = float(r["time_to_target_s"]) - float(best["time_to_target_s"])
        return lead <= float(best.get("time_to_target_s_std") or 0.0) + float(r.get("time_to_target_s_std") or 0.0)

    group = [r for r in eligible if tied(r)]
    names = [str(r["mode"]) for r in group]
    single = int(best.get("repeats", 1)) < 2
    if len(eligible) > 1 and len(group) == len(eligible) and not single:
        return {"best": best, "recommended": None, "tied": names,
                "message": f"no significant difference: {', '.join(names)} are within the spread of each other's time to target"}
    chosen = min(group, key=lambda r: Mode.of(r["mode"]).bound or 0)
    note = " (one run per bound: the spread is unknown; use --repeats 3)" if single else ""
    if len(group) > 1:
        note += f"; {', '.join(names)} are within the spread of each other, the smallest bound is recommended"
    return {"best": best, "recommended": chosen, "tied": names,
            "message": f"recommended staleness bound: {Mode.of(chosen['mode']).bound}{note}"}


def format_table(summary: dict[str, Any]) -> str:
    """The per-mode results as an aligned text table (mean +- standard deviation over repeats)."""
    if "program" in summary:
        return format_program_table(summary)
    repeats = int(summary.get("repeats", 1))
    pm = repeats > 1

    def fmt(mean: Any, std: Any, digits: int, width: int) -> str:
        if mean is None:
            return f"{'never':>{width}s}"
        text = f"{float(mean):.{digits}f}" + (f" +-{float(std or 0):.{digits}f}" if pm else "")
        return f"{text:>{width}s}"

    tw, lw = (15, 17) if pm else (13, 10)
    head = (
        f"{'mode':10s} {'to target (s)':>{tw}s} {'final loss':>{lw}s} {'AUC':>7s} {'samples/s':>10s} "
        f"{'stale p50':>9s} {'p99':>5s} {'max':>5s}"
    )
    lines = [
        f"target eval loss {summary['target_loss']:.4f} (constant predictor {summary['baseline_loss']:.4f}"
        + (f", best possible {summary['bayes_loss']:.4f}" if "bayes_loss" in summary else "")
        + f"); straggler {summary.get('straggler', 'none')}" + (f"; {repeats} runs per mode, mean +- standard deviation" if pm else ""),
        "time to target: worker 0's training time, evaluations left out, interpolated between evaluations",
        head,
    ]
    for r in summary["modes"]:
        lines.append(
            f"{r['mode']:10s} {fmt(r['time_to_target_s'], r.get('time_to_target_s_std'), 1, tw)} "
            f"{fmt(r['final_eval_loss'], r.get('final_eval_loss_std'), 4, lw)} {r['final_eval_auc']:7.4f} {r['samples_per_sec']:10,.0f}"
            f" {r['staleness_p50']:9.0f} {r['staleness_p99']:5.0f} {r['staleness_max']:5.0f}"
        )
    if "recommendation" in summary:
        lines.append(str(summary["recommendation"]))
    return "\n".join(lines)
