"""``tether compare --script`` and ``sweep --script``: what a user's own training script's runs
report, read from its workers' records (``worker-<i>.json``, written by ``Trainer.fit``).

A script's run has no built-in evaluation: its held-out loss is the metric ``--metric`` names
(lower is better; default ``eval_loss``, what ``fit`` reports given ``eval_data`` and no
``evaluate``) as worker 0's ``Trainer.fit`` evaluated it, at ``eval_every`` steps and at its
end, and is compared as the built-in job's eval loss is (``eval_loss`` in curves.csv); its
baseline is the initial model's loss (worker 0's evaluation at step 0; every mode starts from
the same seed). Every run also reports its final training loss (the mean over the workers of
each one's last logged training loss) and worker 0's other final held-out metrics, under the
names the script gave them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from tether.worker.training.run_record import RunRecord

__all__ = ["format_program_table", "no_eval_loss", "program_mode_figures", "program_run_figures"]


def no_eval_loss(metric: str) -> str:
    """The line saying a script's runs report no held-out ``metric``."""
    return (f"the script's runs report no eval loss (worker 0's Trainer.fit had no eval_data, or its evaluate named no {metric!r}; "
            "--metric names another): compared on training loss only; no time to target, no curves.png")


def _last_train_loss(record: RunRecord) -> float | None:
    """A worker's last logged training loss (None: it logged none)."""
    losses = [float(p["train_loss"]) for p in record.history if p.get("train_loss") is not None]
    return losses[-1] if losses else None


def program_run_figures(
    summary: dict[str, Any], records: Sequence[RunRecord], curve: list[dict[str, Any]], metric: str = "eval_loss"
) -> dict[str, Any]:
    """One script run's figures: its final and initial eval loss (``metric``; None when worker 0
    reported none), its curve with ``metric`` as ``eval_loss``, final training loss, and worker
    0's other final metrics."""
    final_eval = {k: float(v) for k, v in (summary.get("final_eval") or {}).items() if isinstance(v, (int, float))}
    loss = final_eval.pop(metric, None)
    if metric != "eval_loss":
        curve = [{**{k: v for k, v in p.items() if k != "eval_loss"}, **({"eval_loss": p[metric]} if metric in p else {})}
                 for p in curve]
    initial = next((float(p["eval_loss"]) for p in curve if int(p["step"]) == 0 and "eval_loss" in p), None)
    trains = [t for t in (_last_train_loss(r) for r in records) if t is not None]
    return {
        "curve": curve,
        "final_eval_loss": loss,
        "initial_eval_loss": initial,
        "final_eval_auc": final_eval.get("eval_auc"),
        "final_train_loss": statistics.fmean(trains) if trains else None,
        "final_eval": final_eval,
        "steps_per_worker": [r.steps for r in records],
    }


def _mean(values: Sequence[float | None]) -> float | None:
    """The mean, or None when any value is missing."""
    return None if not values or any(v is None for v in values) else statistics.fmean(float(v) for v in values if v is not None)


def program_mode_figures(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A mode's figures a script run adds (means over its runs)."""
    names = sorted({k for r in runs for k in r["final_eval"]})
    return {
        "final_train_loss": _mean([r["final_train_loss"] for r in runs]),
        "final_eval": {k: _mean([r["final_eval"].get(k) for r in runs]) for k in names},
        "steps_per_worker": [r["steps_per_worker"] for r in runs],
    }


def _num(value: Any, width: int, digits: int = 4) -> str:
    text = "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{float(value):.{digits}f}"
    return f"{text:>{width}s}"


def format_program_table(summary: dict[str, Any]) -> str:
    """The per-mode results of a script's runs (means over repeats): final training loss, final
    eval loss and time to target when the runs report one, the script's other metrics."""
    modes = summary["modes"]
    has_loss = summary.get("target_loss") is not None
    names = sorted({k for r in modes for k in r.get("final_eval", {})})
    lines = [f"user script {summary['program']}; straggler {summary.get('straggler', 'none')}"
             + (f"; {summary['repeats']} runs per mode, means" if int(summary.get("repeats", 1)) > 1 else "")]
    metric = summary.get("metric", "eval_loss")
    if has_loss:
        lines.append(f"target {metric} {summary['target_loss']:.4f} (initial model {summary['baseline_loss']:.4f}); time to target: "
                     "worker 0's training time, evaluations left out, interpolated between evaluations")
    else:
        lines.append(no_eval_loss(metric))
    head = f"{'mode':10s} {'train loss':>10s}"
    if has_loss:
        head += f" {metric[:10]:>10s} {'to target (s)':>13s}"
    head += "".join(f" {n[:12]:>12s}" for n in names) + f" {'samples/s':>10s} {'stale p50':>9s} {'max':>5s}"
    lines.append(head)
    for r in modes:
        row = f"{r['mode']:10s} {_num(r['final_train_loss'], 10)}"
        if has_loss:
            ttt = r["time_to_target_s"]
            row += f" {_num(r['final_eval_loss'], 10)} {'never' if ttt is None else f'{ttt:.1f}':>13s}"
        row += "".join(f" {_num(r['final_eval'].get(n), 12)}" for n in names)
        row += f" {r['samples_per_sec']:10,.0f} {r['staleness_p50']:9.0f} {r['staleness_max']:5.0f}"
        lines.append(row)
    if "recommendation" in summary:
        lines.append(str(summary["recommendation"]))
    return "\n".join(lines)
