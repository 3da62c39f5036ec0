"""Straggler scenario: 4 workers, one 3x slower; time-to-target and final loss of sync, ssp and
async, side by side in one run, against DESIGN.md's target (ssp reaches the target loss
>= 1.5x sooner than sync, with a final loss within 1% of sync's).

    python bench/straggler.py [--quick] [--steps N] [--modes sync,ssp:0,ssp:2,ssp:4,async]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import markdown_table

SPEEDUP_TARGET = 1.5
LOSS_TOLERANCE = 0.01


def run(steps: int, modes: list[str], out: str, workers: int = 4, straggler: str | float = 3.0, repeats: int = 1) -> dict:
    """Run ``tether compare`` in-process and return its summary."""
    from tether.deploy.compare import compare
    from tether.worker.config import WorkerConfig

    template = WorkerConfig(shards=("pending:0",), num_workers=workers, steps=steps, eval_every=max(steps // 20, 1), eval_samples=5_000, log_every=steps)
    return compare(template, modes, 2, out, straggler=straggler, repeats=repeats)


def table(summary: dict) -> str:
    """Markdown table with each mode's speed-up over sync and loss gap to sync."""
    by_mode = {m["mode"]: m for m in summary["modes"]}
    sync = by_mode.get("sync")
    rows = []
    for m in summary["modes"]:
        speedup = sync["time_to_target_s"] / m["time_to_target_s"] if sync and sync["time_to_target_s"] and m["time_to_target_s"] else float("nan")
        gap = (m["final_eval_loss"] / sync["final_eval_loss"] - 1) if sync else float("nan")
        verdict = ""
        if m["mode"].startswith("ssp") and sync:
            verdict = "met" if speedup >= SPEEDUP_TARGET and gap <= LOSS_TOLERANCE else "not met"
        ttt = "never" if m["time_to_target_s"] is None else f"{m['time_to_target_s']:.1f}"
        rows.append([m["mode"], ttt, f"{speedup:.2f}x", f"{m['final_eval_loss']:.4f}", f"{gap:+.2%}",
                     m["samples_per_sec"], f"{m['staleness_p50']:.0f}/{m['staleness_p99']:.0f}/{m['staleness_max']:.0f}", verdict])
    return markdown_table(
        ["mode", "time to target (s)", "vs sync", "final eval loss", "loss vs sync", "samples/s", "staleness p50/p99/max", "target"],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--modes", default="sync,ssp:0,ssp:2,ssp:4,async")
    p.add_argument("--out", default=None, help="keep curves.csv/png and summary.json here")
    p.add_argument("--straggler", default="persistent:3", help="persistent:K, transient:P:K or pareto:A (tether.worker.training.stragglers)")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode (different data orders); the table shows their mean")
    a = p.parse_args(argv)
    steps = a.steps or (60 if a.quick else 300)
    modes = [m for m in a.modes.split(",") if m]
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(steps, modes, a.out or tmp, straggler=a.straggler, repeats=a.repeats)
    print(f"4 workers, straggler {summary['straggler']}, 2 shards, {steps} steps each, {a.repeats} run(s) per mode; target eval loss "
          f"{summary['target_loss']:.4f} (constant predictor {summary['baseline_loss']:.4f})\n")
    print(table(summary))


if __name__ == "__main__":
    main()
