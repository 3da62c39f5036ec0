"""The plot ``tether compare`` and ``tether sweep`` write (``curves.png``): eval loss against
wall time and against all workers' samples, per mode the mean of its runs with a band from the
lowest to the highest, and clock staleness over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tether.worker.training.run_record import RunRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["DPI", "SIZE", "write_plot"]

# The figure's size (inches) and resolution: a PNG of 1760 x 506 pixels.
SIZE = (16.0, 4.6)
DPI = 110


def _evals(curve: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    points = [p for p in curve if "eval_loss" in p]
    if not points:
        raise ValueError("worker 0 recorded no evaluation; set eval_every >= 1")
    return points


def _band(runs: list[dict[str, Any]], x: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, low and high of the runs' eval loss on a common grid of ``x`` (up to the shortest run)."""
    curves = [_evals(r["curve"]) for r in runs]
    end = min(float(c[-1][x]) for c in curves)
    grid = np.linspace(0.0, end, 80)
    ys = np.array([np.interp(grid, [float(p[x]) for p in c], [float(p["eval_loss"]) for p in c]) for c in curves])
    return grid, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def write_plot(
    runs: dict[str, list[dict[str, Any]]],
    path: Path,
    target: float,
    baseline: float,
    best_possible: float | None = None,
    title: str = "",
    baseline_label: str = "constant predictor",
    loss_label: str = "held-out log loss",
) -> Figure:
    """Eval loss against wall time and against all workers' samples (one line per mode, the
    mean of its runs, with a band from the lowest to the highest run), each with a zoomed inset
    of the second half; and clock staleness over time. Written to ``path`` (PNG); returns the
    figure (closed: its axes and lines say what was drawn). ``baseline_label`` names the
    horizontal line at ``baseline`` (a user's script: its initial model's eval loss)."""
    # Start-up cost: matplotlib only when a figure is drawn (and its backend chosen before pyplot).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s, ax_z) = plt.subplots(1, 3, figsize=SIZE)
    colors = {mode: f"C{i}" for i, mode in enumerate(runs)}
    for ax, x, xlabel in (
        (ax_t, "wall_s", "worker 0's training time (s), evaluations left out"),
        (ax_s, "total_samples", "samples, all workers"),
    ):
        inset = ax.inset_axes([0.42, 0.42, 0.55, 0.53])
        tail: list[float] = []
        x_end = 0.0
        for mode, mode_runs in runs.items():
            grid, mean, low, high = _band(mode_runs, x)
            for target_ax in (ax, inset):
                target_ax.plot(grid, mean, color=colors[mode], lw=1.4, label=mode if target_ax is ax else None)
                if len(mode_runs) > 1:
                    target_ax.fill_between(grid, low, high, color=colors[mode], alpha=0.18, lw=0)
            points = _evals(mode_runs[0]["curve"])
            ax.plot([float(p[x]) for p in points], [float(p["eval_loss"]) for p in points], "o", ms=2.5, color=colors[mode])
            x_end = max(x_end, float(grid[-1]))
            both = zip(np.concatenate([low, high]), np.concatenate([grid, grid]), strict=True)
            tail += [float(v) for v, g in both if g >= 0.5 * grid[-1]]
        for target_ax in (ax, inset):
            target_ax.axhline(target, color="grey", ls="--", lw=1, label="target" if target_ax is ax else None)
            if best_possible is not None:
                target_ax.axhline(best_possible, color="green", ls="-.", lw=1, label="best possible" if target_ax is ax else None)
            target_ax.grid(alpha=0.3)
        ax.axhline(baseline, color="black", ls=":", lw=1, label=baseline_label)
        lows = [best_possible] if best_possible is not None else []
        everything = [float(p["eval_loss"]) for mode_runs in runs.values() for r in mode_runs for p in _evals(r["curve"])]
        bottom, top = min(everything + lows), max([*everything, baseline])
        pad = 0.04 * (top - bottom)
        ax.set_ylim(bottom - pad, top + pad)
        if tail:
            lo, hi = min([*tail, target]), max([*tail, target])
            span = max(hi - lo, 1e-4)
            inset.set_xlim(0.5 * x_end, x_end)
            inset.set_ylim(lo - 0.15 * span, hi + 0.15 * span)
            inset.tick_params(labelsize=7)
            inset.set_title("second half, zoomed", fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(loss_label)
        ax.set_xlim(left=0)
    if ax_t.get_legend_handles_labels()[0]:
        ax_t.legend(fontsize=7, loc="lower left")
    for mode, mode_runs in runs.items():
        records: Sequence[RunRecord] = mode_runs[0]["records"]
        t0 = min(r.start_time for r in records)
        lags = sorted(
            (float(p["time"]) - t0, float(p["staleness_mean"]))
            for r in records
            for p in r.history
            if "staleness_mean" in p and "time" in p
        )
        if lags:
            ax_z.plot([p[0] for p in lags], [p[1] for p in lags], lw=1, color=colors[mode], label=mode)
    ax_z.set_xlabel("time since the start (s), first run")
    ax_z.set_ylabel("clock staleness (ticks), mean per logged window")
    ax_z.grid(alpha=0.3)
    if ax_z.get_legend_handles_labels()[0]:
        ax_z.legend(fontsize=7)
    else:  # no run logged a staleness window (sync, or too few steps between log lines): say so on the panel
        ax_z.text(0.5, 0.5, "no staleness logged", ha="center", va="center", transform=ax_z.transAxes, fontsize=8)
    fig.suptitle("tether: eval loss by consistency mode" + (f" ({title})" if title else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return fig
