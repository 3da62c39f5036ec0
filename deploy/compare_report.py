"""What ``tether compare`` and ``tether sweep`` print: the per-mode results as a table, and the
staleness bound the sweep's runs recommend (``tether.deploy.compare`` runs them)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from tether.deploy.compare_program import format_program_table
from tether.protos.errors import UsageError
from tether.worker.training.mode import Mode

__all__ = ["difference_to", "format_against_sync", "format_identical_repeats", "format_table", "loss_spread", "paired_difference",
           "recommend", "recommend_strength", "t_quantile_975"]


# Student's t, two-sided 95% (the 0.975 quantile) for 1..30 degrees of freedom, then 40, 60, 120.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_T975_TAIL = ((40, 2.021), (60, 2.000), (120, 1.980))


def t_quantile_975(df: float) -> float:
    """Student's t 0.975 quantile (a two-sided 95% interval's factor) at ``df`` degrees of freedom,
    rounded down to the table's next lower entry (so the interval errs wide); 1.96 beyond 120."""
    if not df >= 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df!r}")
    if df < 31:
        return _T975[int(df) - 1]
    factor = _T975[-1]
    for at, t in _T975_TAIL:
        if df >= at:
            factor = t
    return factor if df < math.inf else 1.96


def loss_spread(losses: Sequence[float]) -> dict[str, float | None]:
    """The final losses' mean, sample standard deviation and standard error of the mean
    (``sd / sqrt(n)``; None for one run: its spread is unknown)."""
    n = len(losses)
    mean = statistics.fmean(losses)
    sd = statistics.stdev(losses) if n > 1 else None
    return {"mean": mean, "sd": sd, "sem": None if sd is None else sd / math.sqrt(n)}


def difference_to(losses: Sequence[float], reference: Sequence[float]) -> dict[str, Any]:
    """How far ``losses``' mean lies from ``reference``'s (sync's), with its uncertainty.

    The difference of the means, and a 95% interval around it from the two standard errors:
    ``+- t * sqrt(se1^2 + se2^2)``, ``t`` Student's at Welch-Satterthwaite's degrees of freedom
    (rounded down). With one run on either side no interval can be given (``ci95`` None). The
    verdict says whether the interval excludes 0.

    Returns:
        ``{"diff", "relative", "ci95", "relative_ci95", "df", "verdict"}`` (``relative``: the
        difference over the reference mean).
    """
    a, b = loss_spread(losses), loss_spread(reference)
    diff = float(a["mean"]) - float(b["mean"])  # type: ignore[arg-type]
    ref = float(b["mean"])  # type: ignore[arg-type]
    out: dict[str, Any] = {"diff": diff, "relative": diff / ref if ref else None, "ci95": None, "relative_ci95": None, "df": None}
    if a["sem"] is None or b["sem"] is None:
        out["verdict"] = "one run: no uncertainty can be given"
        return out
    va, vb = float(a["sem"]) ** 2, float(b["sem"]) ** 2
    se = math.sqrt(va + vb)
    if se == 0:
        df = math.inf
    else:
        df = (va + vb) ** 2 / (va ** 2 / (len(losses) - 1) + vb ** 2 / (len(reference) - 1))
    half = t_quantile_975(df) * se
    out.update(ci95=half, relative_ci95=half / ref if ref else None, df=df, verdict=_verdict(diff, half))
    return out


def _verdict(diff: float, half: float) -> str:
    """Whether the 95% interval ``diff +- half`` excludes 0, and on which side."""
    if diff - half > 0:
        return "worse, beyond the uncertainty"
    if diff + half < 0:
        return "better, beyond the uncertainty"
    return "within the uncertainty"


def paired_difference(runs: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]) -> dict[str, Any] | str:
    """How far ``runs``' final losses lie from ``reference``'s (sync's), paired by data order.

    ``runs`` and ``reference`` are a result's ``runs`` (each with ``data_seed`` and
    ``final_eval_loss``). Every run must have a reference run of the same data order (the
    reference may have more); per order the difference is the run's loss minus the reference's.
    Their mean, and a 95% interval ``+- t * sd / sqrt(n)`` (``sd`` the differences' sample
    standard deviation, ``t`` Student's at ``n - 1`` degrees of freedom); the relative figures are
    over the reference's mean on the same orders. The verdict is ``difference_to``'s.

    Returns:
        ``{"pairs", "data_seeds", "diff", "sd", "relative", "ci95", "relative_ci95", "df",
        "verdict"}``, or why the runs cannot be paired (a string: no data order recorded, a run
        without a final loss, an order run twice, an order the reference lacks, one pair).
    """
    sides = []
    for side in (runs, reference):
        if any(r.get("data_seed") is None for r in side):
            return "the runs' data orders are not recorded"
        if any(r.get("final_eval_loss") is None for r in side):
            return "a run has no final loss"
        seeds = [int(r["data_seed"]) for r in side]
        if len(set(seeds)) < len(seeds):
            return "two runs share a data order"
        sides.append({int(r["data_seed"]): float(r["final_eval_loss"]) for r in side})
    mine, theirs = sides
    missing = sorted(set(mine) - set(theirs))
    if missing:
        return f"the runs' data orders differ (sync has no run of data seed {', '.join(map(str, missing))})"
    if len(mine) < 2:
        return "one pair: no uncertainty can be given"
    seeds = sorted(mine)
    spread = loss_spread([mine[s] - theirs[s] for s in seeds])
    diff, sd = float(spread["mean"]), float(spread["sd"])  # type: ignore[arg-type]
    ref = statistics.fmean(theirs[s] for s in seeds)
    df = len(seeds) - 1
    half = t_quantile_975(df) * float(spread["sem"])  # type: ignore[arg-type]
    return {"pairs": len(seeds), "data_seeds": seeds, "diff": diff, "sd": sd, "relative": diff / ref if ref else None, "ci95": half,
            "relative_ci95": half / ref if ref else None, "df": df, "verdict": _verdict(diff, half)}


def format_identical_repeats(summary: dict[str, Any]) -> list[str]:
    """A line naming the modes whose repeats ended bitwise equal (``repeats_identical``): their
    runs trained one data order, so a spread or interval drawn from them is of timing alone."""
    same = [r for r in summary["modes"] if r.get("repeats_identical")]
    if not same:
        return []
    return [f"{', '.join(r['mode'] for r in same)}: the {same[0]['repeats']} repeats ended bitwise equal, though each had its own "
            "data seed: the program does not seed its data order with config.data_seed (TETHER_DATA_SEED), so they trained one "
            "order, and the spreads and intervals here are of timing alone (docs/your-model.md, \"Comparing modes on your model\")"]


def format_against_sync(summary: dict[str, Any]) -> list[str]:
    """The lines under a table: each mode's final loss against sync's (``vs_sync`` of a mode's
    result, Welch's), then the same paired by data order (``vs_sync_paired``, or why the runs
    could not be paired), or why there are none."""
    modes = summary["modes"]
    others = [r for r in modes if r["mode"] != "sync"]
    if not others:
        return []
    if not any(r["mode"] == "sync" for r in modes):
        # A sweep (of bounds, or of a remedy's strength) runs no sync and has no --modes to add it to:
        # its recommendation line compares its runs.
        return [] if "recommendation" in summary else ["final loss against sync: no sync run in this comparison (add sync to --modes)"]
    lines = ["final loss against sync: difference of the means, 95% interval from both standard errors (Student's t, Welch)"]
    for r in others:
        d = r.get("vs_sync")
        if d is None:
            lines.append(f"{r['mode']:10s} no final loss to compare")
            continue
        rel = "" if d["relative"] is None else f" ({100 * d['relative']:+.1f}%"
        if d["ci95"] is None:
            lines.append(f"{r['mode']:10s} {d['diff']:+.4f}{rel + ')' if rel else ''}: {d['verdict']}")
            continue
        if rel:
            rel += f" +- {100 * d['relative_ci95']:.1f}%)"
        lines.append(f"{r['mode']:10s} {d['diff']:+.4f} +- {d['ci95']:.4f}{rel}: {d['verdict']}")
    return lines + _format_paired(others)


def _format_paired(others: Sequence[dict[str, Any]]) -> list[str]:
    """The lines paired by data order (``vs_sync_paired``, or ``vs_sync_not_paired``'s reason):
    one a mode, or one line in all when no mode could be paired, for the same reason."""
    paired = [r for r in others if "vs_sync_paired" in r]
    if not paired:
        return []
    head = "final loss against sync, paired by data order"
    reasons = {r["vs_sync_paired"] is None and r.get("vs_sync_not_paired") for r in paired}
    if len(reasons) == 1 and next(iter(reasons)):
        return [f"{head}: not paired: {next(iter(reasons))}"]
    lines = [f"{head}: per order, the mode's loss minus sync's; their mean, 95% interval from their standard deviation "
             "(Student's t, pairs - 1 degrees of freedom)"]
    for r in paired:
        d = r["vs_sync_paired"]
        if d is None:
            lines.append(f"{r['mode']:10s} not paired: {r.get('vs_sync_not_paired') or 'unknown'}")
            continue
        rel = "" if d["relative"] is None else f" ({100 * d['relative']:+.1f}% +- {100 * d['relative_ci95']:.1f}%)"
        lines.append(f"{r['mode']:10s} {d['diff']:+.4f} +- {d['ci95']:.4f}{rel}, {d['pairs']} pairs: {d['verdict']}")
    return lines


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


def _losses(result: dict[str, Any]) -> list[float] | None:
    """A result's runs' final losses (None when a run has none)."""
    losses = [r.get("final_eval_loss") for r in result.get("runs", [])]
    return None if not losses or any(v is None for v in losses) else [float(v) for v in losses]


def recommend_strength(results: Sequence[dict[str, Any]], strengths: dict[str, float], remedy: str, plain: str = "async") -> dict[str, Any]:
    """The remedy strength to use, if the runs can tell.

    The rule: the strength with the lowest mean final loss is recommended when its difference to
    plain async (``plain``, the same job without the remedy) is better beyond the uncertainty
    (``difference_to``'s 95% interval lies below 0). Strengths whose difference to it is within
    the uncertainty are listed as tied. With one run per strength no uncertainty can be given:
    the lowest is recommended if it is below plain async, and the message says the spread is unknown.

    Args:
        results: the sweep's per-run-kind results (``mode`` the label).
        strengths: label -> strength of the remedy's runs.

    Returns:
        ``{"strength": float or None, "tied": [strengths], "message": str}``.
    """
    reference = next((r for r in results if r["mode"] == plain), None)
    runs = [(r, _losses(r)) for r in results if r["mode"] in strengths]
    scored = [(r, losses) for r, losses in runs if losses is not None]
    ref_losses = None if reference is None else _losses(reference)
    if not scored or len(scored) < len(runs) or ref_losses is None:
        return {"strength": None, "tied": [], "message": f"no {remedy} strength recommended (it needs an eval loss)"}
    best, best_losses = min(scored, key=lambda item: statistics.fmean(item[1]))
    strength = strengths[best["mode"]]
    tied = [strengths[r["mode"]] for r, losses in scored
            if r is not best and difference_to(losses, best_losses)["verdict"] == "within the uncertainty"]
    d = difference_to(best_losses, ref_losses)
    against = f"{d['diff']:+.4f}" + ("" if d["ci95"] is None else f" +- {d['ci95']:.4f}") + f" against plain {plain}"
    if d["ci95"] is None:
        if d["diff"] >= 0:
            return {"strength": None, "tied": [],
                    "message": f"no {remedy} strength recommended: the best, {strength:g}, is {against} (one run per strength: "
                               "the spread is unknown, use --repeats 3)"}
        return {"strength": strength, "tied": [],
                "message": f"recommended {remedy} strength: {strength:g} ({against}; one run per strength: the spread is unknown, "
                           "use --repeats 3)"}
    ties = f"; {', '.join(f'{x:g}' for x in tied)} within the uncertainty of it" if tied else ""
    if d["verdict"] != "better, beyond the uncertainty":
        return {"strength": None, "tied": tied,
                "message": f"no {remedy} strength recommended: the best, {strength:g}, is {against}: not better beyond the "
                           f"uncertainty{ties}"}
    return {"strength": strength, "tied": tied,
            "message": f"recommended {remedy} strength: {strength:g} (lowest mean final loss, {against}, 95%{ties})"}


def format_table(summary: dict[str, Any]) -> str:
    """The per-mode results as an aligned text table (mean +- standard deviation over repeats, the
    standard error of the mean), and each mode's final loss against sync's with its uncertainty."""
    if "program" in summary:
        text = format_program_table(summary)
        extra = format_against_sync(summary) if summary.get("target_loss") is not None else []
        return "\n".join([text, *format_identical_repeats(summary), *extra])
    repeats = int(summary.get("repeats", 1))
    pm = repeats > 1

    def fmt(mean: Any, std: Any, digits: int, width: int) -> str:
        if mean is None:
            return f"{'never':>{width}s}"
        text = f"{float(mean):.{digits}f}" + (f" +-{float(std or 0):.{digits}f}" if pm else "")
        return f"{text:>{width}s}"

    def sem(r: dict[str, Any]) -> str:
        value = r.get("final_eval_loss_sem")
        return f"{'-' if value is None else f'{float(value):.4f}':>7s}"

    tw, lw = (15, 17) if pm else (13, 10)
    head = (
        f"{'mode':10s} {'to target (s)':>{tw}s} {'final loss':>{lw}s}" + (f" {'s.e.':>7s}" if pm else "")
        + f" {'AUC':>7s} {'samples/s':>10s} {'stale p50':>9s} {'p99':>5s} {'max':>5s}"
    )
    lines = [
        f"target eval loss {summary['target_loss']:.4f} (constant predictor {summary['baseline_loss']:.4f}"
        + (f", best possible {summary['bayes_loss']:.4f}" if "bayes_loss" in summary else "")
        + f"); straggler {summary.get('straggler', 'none')}"
        + (f"; {repeats} runs per mode, mean +- standard deviation, s.e. the standard error of the mean" if pm else ""),
        "time to target: worker 0's training time, evaluations left out, interpolated between evaluations",
        head,
    ]
    for r in summary["modes"]:
        lines.append(
            f"{r['mode']:10s} {fmt(r['time_to_target_s'], r.get('time_to_target_s_std'), 1, tw)} "
            f"{fmt(r['final_eval_loss'], r.get('final_eval_loss_std'), 4, lw)}" + (f" {sem(r)}" if pm else "")
            + f" {r['final_eval_auc']:7.4f} {r['samples_per_sec']:10,.0f}"
            f" {r['staleness_p50']:9.0f} {r['staleness_p99']:5.0f} {r['staleness_max']:5.0f}"
        )
    lines.extend(format_identical_repeats(summary))
    lines.extend(format_against_sync(summary))
    if "recommendation" in summary:
        lines.append(str(summary["recommendation"]))
    return "\n".join(lines)
