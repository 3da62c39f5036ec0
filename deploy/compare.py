"""``tether compare`` and ``tether sweep``: the same job under several consistency modes.

Each mode runs the same model, data, seed and total samples on a fresh local cluster.
Outputs (``--out DIR``): ``curves.csv`` (mode, worker, step, samples, wall time, train loss,
eval loss), ``curves.png`` (eval loss against wall time and against samples),
``summary.json`` (one entry per mode; the sweep adds ``recommended_staleness``), and each
mode's own run folder. The table is printed too.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tether.deploy.launch import run_job
from tether.protos.errors import UsageError
from tether.worker.config import WorkerConfig, parse_mode

__all__ = ["check_arguments", "compare", "recommend", "time_to_target", "write_plot"]

CSV_FIELDS = ("mode", "worker", "step", "samples", "wall_s", "train_loss", "eval_loss")


def time_to_target(curve: Sequence[dict[str, object]], target: float) -> float | None:
    """Wall seconds of the first evaluation at or below ``target`` (None if never)."""
    for point in curve:
        if "eval_loss" in point and float(point["eval_loss"]) <= target:
            return float(point["wall_s"])
    return None


def _evals(curve: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    points = [p for p in curve if "eval_loss" in p]
    if not points:
        raise ValueError("worker 0 recorded no evaluation; set eval_every >= 1")
    return points


def _mode_dir(mode: str) -> str:
    return mode.replace(":", "-")


def check_arguments(modes: Sequence[str], straggler: float = 1.0, target_fraction: float = 0.9, tolerance: float = 0.0) -> None:
    """Check what ``compare`` and ``sweep`` are asked before any process starts.

    Raises:
        UsageError: a bad mode, an empty mode list, a straggler factor below 1, a target
            fraction outside (0, 1] or a negative tolerance.
    """
    if not modes:
        raise UsageError("at least one mode is needed")
    for m in modes:
        try:
            parse_mode(m)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if not 0 < target_fraction <= 1:
        raise UsageError(f"target_fraction must be in (0, 1], got {target_fraction!r}")
    if not straggler >= 1:
        raise UsageError(f"--straggler must be >= 1, got {straggler!r}")
    if not tolerance >= 0:
        raise UsageError(f"--tolerance must be >= 0, got {tolerance!r}")


def compare(
    template: WorkerConfig,
    modes: Sequence[str],
    num_shards: int,
    out: str | Path,
    straggler: float = 1.0,
    target_loss: float | None = None,
    target_fraction: float = 0.9,
    timeout_s: float = 3600.0,
    echo: bool = False,
) -> dict[str, object]:
    """Run ``template`` under each mode and write the comparison to ``out``.

    Args:
        template: the job (its ``mode`` is replaced by each of ``modes``; its ``tensorboard``,
            if set, is the root of the curves: each mode's workers write to ``<root>/<mode>``).
        modes: e.g. ``["sync", "ssp:0", "ssp:4", "async"]``.
        num_shards: shards per run.
        out: output folder.
        straggler: the last worker computes this many times slower (1: no straggler).
        target_loss: eval loss whose time-to-target is reported; by default the loss that
            closes ``target_fraction`` of the gap between the constant predictor and the
            worst mode's final loss, so every mode reaches it.
        target_fraction: see ``target_loss``.
        timeout_s: limit per run.

    Raises:
        UsageError: see ``check_arguments``; or a worker's own one line (a malformed data line).
        ClusterError: a process failed.
        Interrupted: Ctrl-C; every process was stopped.
    """
    check_arguments(modes, straggler=straggler, target_fraction=target_fraction)
    if template.eval_every < 1:
        template = replace(template, eval_every=max(template.steps // 10, 1))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, object]] = {}
    curves: dict[str, list[dict[str, object]]] = {}
    rows: list[dict[str, object]] = []
    for mode in modes:
        cfg = replace(template, mode=mode, slowdown=straggler, slow_worker=template.num_workers - 1 if straggler > 1 else None)
        if template.tensorboard:  # one run per mode under one root, so TensorBoard overlays them
            cfg = replace(cfg, tensorboard=str(Path(template.tensorboard) / _mode_dir(mode)))
        run_dir = out_dir / _mode_dir(mode)
        print(f"tether compare: running {mode} ({cfg.num_workers} workers, {num_shards} shards)", flush=True)
        summary = run_job(cfg, num_shards, out=run_dir, timeout_s=timeout_s, echo=echo)
        runs[mode] = summary
        for w in range(cfg.num_workers):
            record = json.loads((run_dir / f"worker-{w}.json").read_text())
            for point in record["history"]:
                rows.append({"mode": mode, "worker": w, **{k: point.get(k, "") for k in CSV_FIELDS[2:]}})
            if w == 0:
                curves[mode] = record["history"]
    baseline = float(next(iter(runs.values()))["baseline_loss"])
    if target_loss is None:
        # From the curves themselves (worker 0's last evaluation), so every mode reaches it.
        worst = max(float(_evals(c)[-1]["eval_loss"]) for c in curves.values())
        target_loss = baseline - target_fraction * (baseline - worst)
    results = []
    for mode, r in runs.items():
        results.append({
            "mode": mode,
            "time_to_target_s": time_to_target(curves[mode], target_loss),
            "final_eval_loss": float(r["eval_loss"]),
            "final_eval_auc": float(r["eval_auc"]),
            "samples_per_sec": float(r["samples_per_sec"]),
            "train_wall_s": float(r["train_wall_s"]),
            "staleness_p50": r["staleness_p50"],
            "staleness_p99": r["staleness_p99"],
            "staleness_max": r["staleness_max"],
        })
    with (out_dir / "curves.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    write_plot(curves, out_dir / "curves.png", target_loss, baseline)
    summary = {
        "target_loss": target_loss,
        "baseline_loss": baseline,
        "straggler_factor": straggler,
        "num_workers": template.num_workers,
        "num_shards": num_shards,
        "samples_per_mode": template.num_workers * template.steps * template.batch_size,
        "modes": results,
    }
    if "bayes_loss" in next(iter(runs.values())):
        summary["bayes_loss"] = next(iter(runs.values()))["bayes_loss"]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def recommend(results: Sequence[dict[str, object]], tolerance: float = 0.01) -> dict[str, object]:
    """The bound with the best time-to-target among those whose final loss is within
    ``tolerance`` (relative) of the best final loss.

    Raises:
        UsageError: no result reached the target.
    """
    best_loss = min(float(r["final_eval_loss"]) for r in results)
    eligible = [
        r for r in results
        if float(r["final_eval_loss"]) <= best_loss * (1 + tolerance) and r["time_to_target_s"] is not None
    ]
    if not eligible:
        raise UsageError("no staleness bound reached the target loss; lower the target or train longer")
    return min(eligible, key=lambda r: float(r["time_to_target_s"]))


def write_plot(curves: dict[str, list[dict[str, object]]], path: Path, target: float, baseline: float) -> None:
    """Eval loss against wall time and against samples, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, curve in curves.items():
        points = _evals(curve)
        ax_t.plot([p["wall_s"] for p in points], [p["eval_loss"] for p in points], marker="o", ms=3, label=mode)
        ax_s.plot([p["samples"] for p in points], [p["eval_loss"] for p in points], marker="o", ms=3, label=mode)
    for ax, xlabel in ((ax_t, "wall time (s)"), (ax_s, "samples seen by worker 0")):
        ax.axhline(target, color="grey", ls="--", lw=1, label="target")
        ax.axhline(baseline, color="black", ls=":", lw=1, label="constant predictor")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out log loss")
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle("tether: eval loss by consistency mode")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(summary: dict[str, object]) -> str:
    """The per-mode results as an aligned text table."""
    head = f"{'mode':10s} {'to target (s)':>13s} {'final loss':>10s} {'AUC':>7s} {'samples/s':>10s} {'stale p50':>9s} {'p99':>5s} {'max':>5s}"
    lines = [f"target eval loss {summary['target_loss']:.4f} (constant predictor {summary['baseline_loss']:.4f})", head]
    for r in summary["modes"]:
        ttt = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        lines.append(
            f"{r['mode']:10s} {ttt:>13s} {r['final_eval_loss']:10.4f} {r['final_eval_auc']:7.4f} {r['samples_per_sec']:10,.0f}"
            f" {r['staleness_p50']:9.0f} {r['staleness_p99']:5.0f} {r['staleness_max']:5.0f}"
        )
    if "recommended_staleness" in summary:
        lines.append(f"recommended staleness bound: {summary['recommended_staleness']}")
    return "\n".join(lines)


def sweep(
    template: WorkerConfig,
    bounds: Sequence[int],
    num_shards: int,
    out: str | Path,
    tolerance: float = 0.01,
    **kwargs: object,
) -> dict[str, object]:
    """``compare`` over ``ssp:S`` for each bound, plus the recommended bound."""
    if not bounds or any(b < 0 for b in bounds):
        raise UsageError(f"--bounds must be a non-empty list of integers >= 0, got {list(bounds)!r}")
    check_arguments([f"ssp:{b}" for b in bounds], tolerance=tolerance)
    summary = compare(template, [f"ssp:{b}" for b in bounds], num_shards, out, **kwargs)
    best = recommend(summary["modes"], tolerance)
    summary["recommended_staleness"] = parse_mode(str(best["mode"]))[1]
    summary["tolerance"] = tolerance
    Path(out, "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
