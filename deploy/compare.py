"""``tether compare`` and ``tether sweep``: the same job under several consistency modes.

Each mode runs the same model, data, seed, straggler schedule and total samples on a fresh
local cluster, ``repeats`` times with different data orders (``data_seed``; runs interleaved,
so a change in the machine's load falls on every mode alike). Outputs (``--out DIR``):
``curves.csv`` (mode, repeat, worker, step, samples, all workers' samples, wall time, train
loss, eval loss, clock staleness), ``curves.png`` (eval loss against wall time and against all
workers' samples, mean and band over the repeats, a line at the best possible loss, and clock
staleness over time), ``summary.json`` (per mode: mean and spread; per run: its figures; the
bound sweep adds ``recommended_staleness``, the remedy sweep ``recommended_strength``), and each
run's own folder. A remedy sweep (``remedy_sweep``) names its runs ``sync``, ``async`` and
``dc-a:2``-like labels in place of modes.

Wall time is worker 0's training time: its evaluations are left out (it evaluates before
training, at step 0, and every ``eval_every`` steps). Time to target is read off that curve,
interpolated linearly between evaluations.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from tether.deploy.compare_program import no_eval_loss, program_mode_figures, program_run_figures
from tether.deploy.compare_report import difference_to, loss_spread, paired_difference, recommend, recommend_strength
from tether.deploy.job import run_job, staleness_summary
from tether.deploy.launch import Program
from tether.deploy.plot import write_plot
from tether.protos.errors import UsageError
from tether.worker.config import CACHE_FIELDS, WorkerConfig
from tether.worker.training.mode import Mode
from tether.worker.training.run_record import RunRecord
from tether.worker.training.stragglers import StragglerSpec, parse_straggler

__all__ = ["REMEDIES", "check_arguments", "check_remedy_sweep", "compare", "remedy_sweep", "strength_label", "sweep", "time_to_target"]

CSV_FIELDS = ("mode", "repeat", "worker", "step", "samples", "total_samples", "wall_s", "train_loss", "eval_loss", "staleness_mean")


def time_to_target(curve: Sequence[dict[str, Any]], target: float, x: str = "wall_s") -> float | None:
    """When the eval loss first reaches ``target``: ``x`` (wall seconds) interpolated linearly
    between the evaluation before and the first at or below it (None if never)."""
    prev: tuple[float, float] | None = None
    for point in curve:
        if "eval_loss" not in point:
            continue
        y, t = float(point["eval_loss"]), float(point[x])
        if y <= target:
            if prev is None or prev[1] <= target:
                return t
            return prev[0] + (prev[1] - target) / (prev[1] - y) * (t - prev[0])
        prev = (t, y)
    return None


def _with_job_end(curve: list[dict[str, Any]], summary: dict[str, Any], records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """The curve ending at the run's final loss: when the job's final evaluation (after every
    worker finished) differs from worker 0's last one, it is added as a last point at the job's
    training end (the slowest worker's training time) with every worker's samples. Without it,
    in async or ssp:S, a worker 0 that finished before the others could end its curve above
    the final loss the table reports, and never reach a target taken from those losses."""
    final = float(summary["eval_loss"])
    last = curve[-1]
    if "eval_loss" in last and abs(float(last["eval_loss"]) - final) <= 1e-9:
        return curve
    end = {
        "step": last["step"],
        "samples": last["samples"],
        "total_samples": sum(r.samples for r in records),
        "wall_s": max(float(last["wall_s"]), float(summary["train_wall_s"])),
        "eval_loss": final,
        "job_end": True,
    }
    return [*curve, end]


def _mode_dir(mode: str) -> str:
    return mode.replace(":", "-")


def check_arguments(
    modes: Sequence[str], straggler: object = None, target_fraction: float = 0.9, tolerance: float = 0.0, repeats: int = 1,
    flag: str = "--modes",
) -> list[Mode]:
    """Check what ``compare`` and ``sweep`` are asked before any process starts; returns the modes
    parsed (each text once: a ``Mode`` given is kept as it is, and every run's config shares it).
    ``flag``: where the modes came from, for the messages (``--bounds``: a sweep's, named by bound).

    Raises:
        UsageError: a bad mode, an empty mode list, a mode given twice, a bad straggler spec, a
            target fraction outside (0, 1], a negative tolerance or fewer than 1 repeat.
    """
    if not modes:
        raise UsageError("at least one mode is needed")
    try:
        parsed = [Mode.of(m) for m in modes]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    keys = [(m.kind, m.bound) for m in parsed]  # ssp:2 and ssp:02 are one mode
    for m, key in zip(parsed, keys, strict=True):
        if keys.count(key) > 1:  # its runs would share one folder and one row of the table
            name = str(m.bound) if flag == "--bounds" else m.kind if m.bound is None else f"{m.kind}:{m.bound}"
            raise UsageError(f"{flag}: {name} is given twice (each runs once a repeat: --repeats N runs each N times)")
    if not 0 < target_fraction <= 1:
        raise UsageError(f"target_fraction must be in (0, 1], got {target_fraction!r}")
    try:
        parse_straggler(straggler)  # type: ignore[arg-type]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not tolerance >= 0:
        raise UsageError(f"--tolerance must be >= 0, got {tolerance!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise UsageError(f"--repeats must be an integer >= 1, got {repeats!r}")
    return parsed


def _spread(values: Sequence[float]) -> float:
    """Sample standard deviation (0 for one value)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _with_total_samples(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Worker 0's curve with ``total_samples``: every worker's samples at the moment of each of
    its points, interpolated from each worker's own (time, samples) records."""
    tracks = []
    for r in records:
        times = [r.start_time] + [float(p["time"]) for p in r.history if "time" in p and int(p["step"]) > 0]
        samples = [0.0] + [float(p["samples"]) for p in r.history if "time" in p and int(p["step"]) > 0]
        tracks.append((np.asarray(times), np.asarray(samples)))
    curve = []
    for point in records[0].history:
        point = dict(point)
        if int(point["step"]) == 0 or "time" not in point:
            point["total_samples"] = int(point["samples"]) * len(records) if int(point["step"]) else 0
        else:
            point["total_samples"] = round(sum(float(np.interp(float(point["time"]), t, n)) for t, n in tracks))
        curve.append(point)
    return curve


def _run_one(
    template: WorkerConfig, mode: Mode, repeat: int, repeats: int, num_shards: int, out_dir: Path, spec: str, timeout_s: float,
    echo: bool, printer: Callable[[str], None], program: Program | None = None, metric: str = "eval_loss",
    label: str | None = None, overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One run of ``compare``: ``template`` (as ``program``'s workers, if given) under ``mode``
    with repeat ``repeat``'s data order, in its own folder; its summary, records, curve and figures.
    ``label`` names the run in the table, folders and curves (default: the mode); ``overrides``
    are config fields set for this run (a remedy sweep's strength)."""
    name = label or str(mode)
    # The sync baseline runs without DC-ASGD, DC-ASGD-a or gap-aware: nothing in sync is stale
    # (the options refuse it).
    remedies: dict[str, Any] = {"delay_compensation": 0.0, "dc_adaptive": False, "gap_aware": False} if mode == "sync" else {}
    # Nor with the row cache: sync reads every row fresh (the option refuses it); the run's line says so.
    no_cache = mode == "sync" and template.cache_rows > 0
    cache: dict[str, Any] = template.without_cache() if no_cache else {}
    # Pushes in flight (--push-window, or --preset gpu's 2) are async's: ssp:S and sync land every
    # push before the next pull (the option refuses more there), so their runs push one at a time.
    window: dict[str, Any] = {"push_window": 1} if template.push_window > 1 and Mode.of(mode).kind != "async" else {}
    cfg = replace(template, mode=mode, data_seed=template.data_seed + repeat, **remedies, **cache, **window, **(overrides or {}))
    if template.tensorboard:  # one run per mode under one root, so TensorBoard overlays them
        board = Path(template.tensorboard) / _mode_dir(name)
        cfg = replace(cfg, tensorboard=str(board / f"repeat-{repeat}" if repeats > 1 else board))
    run_dir = out_dir / _mode_dir(name) / f"repeat-{repeat}" if repeats > 1 else out_dir / _mode_dir(name)
    printer(f"tether compare: running {name}" + (f" ({mode})" if name != mode else "")
            + (f" repeat {repeat + 1}/{repeats}" if repeats > 1 else "")
            + f" ({cfg.num_workers} workers, {num_shards} shards, straggler {spec}"
            + ("; no row cache: sync reads every row fresh" if no_cache else "")
            + (f"; push window 1, not {template.push_window}: {mode} lands every push before the next pull" if window else "") + ")")
    summary = run_job(cfg, num_shards, out=run_dir, timeout_s=timeout_s, echo=echo, program=program)
    records = [RunRecord.load(run_dir / f"worker-{w}.json") for w in range(cfg.num_workers)]
    curve = _with_total_samples(records)
    updates = sorted(x for r in records for x in r.update_staleness)
    run: dict[str, Any] = {
        "mode": name,
        "repeat": repeat,
        "data_seed": cfg.data_seed,
        "summary": summary,
        "records": records,
        "samples_per_sec": float(summary["samples_per_sec"]),
        "train_wall_s": float(summary["train_wall_s"]),
        "update_staleness_p50": float(np.median(updates)) if updates else 0.0,
        # Embedding rows' bytes pulled and pushed per sample, all workers (the row cache's saving);
        # dense parameters' traffic is not in the records' counts, so not in this figure
        "bytes_per_sample": sum(sum(v["pulled_bytes"] + v["pushed_bytes"] for v in (r.traffic or {}).values()) for r in records)
        / max(sum(r.samples for r in records), 1),
    }
    if program is not None:
        # A script's final eval is worker 0's last evaluation, already on its curve.
        run.update(program_run_figures(summary, records, curve, metric))
    else:
        run.update(curve=_with_job_end(curve, summary, records), final_eval_loss=float(summary["eval_loss"]),
                   final_eval_auc=float(summary["eval_auc"]))
    return run


def compare(
    template: WorkerConfig,
    modes: Sequence[str],
    num_shards: int,
    out: str | Path,
    straggler: str | float | StragglerSpec | None = None,
    target_loss: float | None = None,
    target_fraction: float = 0.9,
    timeout_s: float = 3600.0,
    echo: bool = False,
    repeats: int = 1,
    printer: Callable[[str], None] = print,
    program: Program | None = None,
    metric: str = "eval_loss",
) -> dict[str, Any]:
    """Run ``template`` under each mode, ``repeats`` times, and write the comparison to ``out``.

    Args:
        template: the job (its ``mode`` is replaced by each of ``modes``; its ``data_seed`` is
            that of the first repeat, +1 for each next one; its ``tensorboard``, if set, is the
            root of the curves: each mode's workers write to ``<root>/<mode>``).
        modes: e.g. ``["sync", "ssp:0", "ssp:4", "async"]``.
        num_shards: shards per run.
        out: output folder.
        straggler: who computes slower when (``tether.worker.training.stragglers``: ``persistent:3``,
            ``transient:0.1:5``, ``pareto:1.5``; a bare number K is ``persistent:K``); None:
            the template's own.
        target_loss: eval loss whose time-to-target is reported; by default the loss that
            closes ``target_fraction`` of the gap between the constant predictor and the
            worst run's final loss, so every run reaches it.
        target_fraction: see ``target_loss``.
        timeout_s: limit per run.
        repeats: runs per mode, each with its own data order.
        printer: where the line per finished run goes.
        program: a user's training program run as every run's workers (``tether launch
            --script``'s); its runs are compared on what its workers' records report
            (``tether.deploy.compare_program``), ``metric`` (lower is better) as the eval loss.

    Raises:
        UsageError: see ``check_arguments``; or a worker's own one line (a malformed data line).
        ClusterError: a process failed.
        Interrupted: Ctrl-C; every process was stopped.
    """
    spec = parse_straggler(template.straggler if straggler is None else straggler)
    modes = check_arguments(modes, straggler=spec, target_fraction=target_fraction, repeats=repeats)
    return _compare(template, [(str(m), m, {}) for m in modes], num_shards, out, spec, target_loss, target_fraction, timeout_s, echo,
                    repeats, printer, program, metric)


# One run kind of a comparison: its label (the table's "mode" column), its mode, and the config
# fields it sets (a remedy sweep's strength; none for compare's modes).
Variant = tuple[str, Mode, dict[str, Any]]


def _compare(
    template: WorkerConfig, variants: Sequence[Variant], num_shards: int, out: str | Path, spec: StragglerSpec,
    target_loss: float | None, target_fraction: float, timeout_s: float, echo: bool, repeats: int, printer: Callable[[str], None],
    program: Program | None, metric: str,
) -> dict[str, Any]:
    """``compare``'s work over checked arguments: each variant ``repeats`` times, interleaved."""
    modes = [label for label, _, _ in variants]
    if template.eval_every < 1:
        template = replace(template, eval_every=max(template.steps // 20, 1))
    # Every worker records (time, samples) as often as worker 0 evaluates: all workers'
    # samples and the staleness panel are read off those records.
    template = replace(
        template, straggler=str(spec), slowdown=1.0, slow_worker=None, log_every=min(template.log_every, template.eval_every)
    )
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for label, mode, overrides in variants:
            runs.append(_run_one(template, mode, repeat, repeats, num_shards, out_dir, str(spec), timeout_s, echo, printer,
                                 program, metric, label=label, overrides=overrides))
            printer(_progress_line(runs, repeats, target_loss))
    baseline = _baseline(runs)
    if target_loss is None and baseline is not None and all(r["final_eval_loss"] is not None for r in runs):
        # From the runs themselves (the worst final loss), so every run reaches it.
        worst = max(float(r["final_eval_loss"]) for r in runs)
        target_loss = baseline - target_fraction * (baseline - worst)
    for run in runs:
        run["time_to_target_s"] = time_to_target(run["curve"], target_loss) if target_loss is not None else None
    results = [_mode_result(mode, [r for r in runs if r["mode"] == mode]) for mode in modes]
    _mark_identical_repeats(results)
    _add_difference_to_sync(results)
    _write_curves(out_dir / "curves.csv", runs)
    first = runs[0]["summary"]
    best_possible = float(first["bayes_loss"]) if "bayes_loss" in first else None
    plotted = target_loss is not None and baseline is not None
    if plotted:
        assert target_loss is not None and baseline is not None
        write_plot({m: [r for r in runs if r["mode"] == m] for m in modes}, out_dir / "curves.png", target_loss, baseline, best_possible,
                   title=f"{template.num_workers} workers, {num_shards} shards, straggler {spec}"
                   + (f", {repeats} repeats" if repeats > 1 else ""),
                   **({"baseline_label": "initial model", "loss_label": "held-out eval_loss"} if program else {}))
    summary: dict[str, Any] = {
        "target_loss": target_loss,
        "baseline_loss": baseline,
        "straggler": str(spec),
        "straggler_factor": spec.factor if spec.kind == "persistent" else None,
        "num_workers": template.num_workers,
        "num_shards": num_shards,
        "repeats": repeats,
        "samples_per_mode": template.num_workers * template.steps * template.batch_size,
        "wall_time": "worker 0's training time, its evaluations left out; time to target interpolated between evaluations",
        "plotted": plotted,
        "modes": results,
    }
    if program is not None:
        summary["program"] = " ".join(program.argv)
        summary["metric"] = metric
        summary["baseline"] = "the initial model's eval loss (worker 0 at step 0)"
        summary.pop("samples_per_mode")  # the script decides its batches
        if target_loss is None:
            summary["no_eval_loss"] = no_eval_loss(metric)
    if best_possible is not None:
        summary["bayes_loss"] = best_possible
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _baseline(runs: Sequence[dict[str, Any]]) -> float | None:
    """The loss a target is measured from: the constant predictor's (the built-in job), or a
    script's initial model's eval loss (None: its worker 0 reported none)."""
    if "initial_eval_loss" in runs[0]:
        return runs[0]["initial_eval_loss"]
    return float(runs[0]["summary"]["baseline_loss"])


def _progress_line(runs: Sequence[dict[str, Any]], repeats: int, target_loss: float | None) -> str:
    """The line printed as the newest run of ``runs`` finishes. Its time to target only with a
    target given (``--target-loss``): a target taken from the runs (the worst final loss) is known
    once every run is done, and a target from the runs so far would differ from the table's."""
    run = runs[-1]
    head = f"tether compare: {run['mode']}" + (f" repeat {run['repeat'] + 1}/{repeats}" if repeats > 1 else "")
    tail = (f"training wall {run['train_wall_s']:.1f}s, {run['samples_per_sec']:,.0f} samples/s, "
            f"{run['bytes_per_sample']:,.0f} B/sample of embedding rows moved")
    cache = run.get("summary", {}).get("row_cache")
    if cache:
        tail += f" (row cache: {cache['seconds_per_step'] * 1e3:.2f} ms a step, {cache['share_of_step']:.0%} of the step)"
    if "initial_eval_loss" in run and run["final_eval_loss"] is None:
        train = run["final_train_loss"]
        return f"{head}: final train loss {'-' if train is None else f'{train:.4f}'} (no eval loss reported), {tail}"
    if target_loss is None:
        return f"{head}: final loss {run['final_eval_loss']:.4f}, {tail}"
    ttt = time_to_target(run["curve"], target_loss)
    reached = "never" if ttt is None else f"{ttt:.1f}s"
    return f"{head}: final loss {run['final_eval_loss']:.4f}, to target {target_loss:.4f}: {reached}, {tail}"


def _write_curves(path: Path, runs: Sequence[dict[str, Any]]) -> None:
    """``curves.csv``: every run's points, worker 0's from its curve (with all workers' samples), the others' from their records."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        for w, record in enumerate(run["records"]):
            points = run["curve"] if w == 0 else record.history
            for point in points:
                rows.append({"mode": run["mode"], "repeat": run["repeat"], "worker": w, **{k: point.get(k, "") for k in CSV_FIELDS[3:]}})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def _mode_result(mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures over its runs: means, spreads (sample standard deviation) and each run."""
    losses = [float(r["final_eval_loss"]) for r in runs if r["final_eval_loss"] is not None]
    aucs = [float(r["final_eval_auc"]) for r in runs if r["final_eval_auc"] is not None]
    times = [r["time_to_target_s"] for r in runs]
    reached = [float(t) for t in times if t is not None]
    return {
        "mode": mode,
        "repeats": len(runs),
        "time_to_target_s": statistics.fmean(reached) if len(reached) == len(runs) else None,
        "time_to_target_s_std": _spread(reached) if len(reached) == len(runs) else None,
        # None when a script's runs report no eval loss (or AUC)
        "final_eval_loss": statistics.fmean(losses) if len(losses) == len(runs) else None,
        "final_eval_loss_std": _spread(losses) if len(losses) == len(runs) else None,
        # The standard error of the mean final loss (None for one run, or when a run has no loss)
        "final_eval_loss_sem": loss_spread(losses)["sem"] if losses and len(losses) == len(runs) else None,
        "final_eval_auc": statistics.fmean(aucs) if len(aucs) == len(runs) else None,
        "samples_per_sec": statistics.fmean(float(r["samples_per_sec"]) for r in runs),
        "train_wall_s": statistics.fmean(float(r["train_wall_s"]) for r in runs),
        "bytes_per_sample": statistics.fmean(float(r["bytes_per_sample"]) for r in runs),
        **staleness_summary(w for r in runs for w in r["records"]),
        "update_staleness_p50": statistics.fmean(float(r["update_staleness_p50"]) for r in runs),
        "runs": [
            {
                k: r[k]
                for k in ("repeat", "data_seed", "final_eval_loss", "final_eval_auc", "time_to_target_s", "samples_per_sec", "train_wall_s",
                          "bytes_per_sample")
            }
            for r in runs
        ],
        **(program_mode_figures(runs) if "initial_eval_loss" in runs[0] else {}),
    }


def _final_losses(result: dict[str, Any]) -> list[float] | None:
    """A mode's runs' final losses (None when a run has none)."""
    losses = [r["final_eval_loss"] for r in result["runs"]]
    return None if not losses or any(v is None for v in losses) else [float(v) for v in losses]


def _mark_identical_repeats(results: Sequence[dict[str, Any]]) -> None:
    """``repeats_identical`` on a mode whose repeats, each given its own data seed, ended at the
    same final loss to the last bit: a deterministic mode (sync) that trained one data order N
    times, because the program does not seed its order with ``config.data_seed``. (The built-in
    job's orders always differ; async's runs differ by timing even on one order, so it shows in
    sync's runs.)"""
    for result in results:
        losses = _final_losses(result)
        if losses is not None and len(losses) > 1 and len(set(losses)) == 1 and len({r["data_seed"] for r in result["runs"]}) > 1:
            result["repeats_identical"] = True


def _add_difference_to_sync(results: Sequence[dict[str, Any]]) -> None:
    """Each other mode's ``vs_sync`` (``compare_report.difference_to``: its mean final loss minus
    sync's, with a 95% interval) and ``vs_sync_paired`` (``compare_report.paired_difference``: the
    same per data order; None, with ``vs_sync_not_paired`` the reason, when the runs cannot be
    paired), when sync is among the modes and both have final losses."""
    sync = next((r for r in results if r["mode"] == "sync"), None)
    reference = None if sync is None else _final_losses(sync)
    if sync is None or reference is None:
        return
    for result in results:
        losses = _final_losses(result)
        if result is not sync and losses is not None:
            result["vs_sync"] = difference_to(losses, reference)
            paired = paired_difference(result["runs"], sync["runs"])
            result["vs_sync_paired"] = None if isinstance(paired, str) else paired
            if isinstance(paired, str):
                result["vs_sync_not_paired"] = paired


def cache_settings(template: WorkerConfig) -> dict[str, Any]:
    """The row cache settings every run of a sweep used (``cache_rows`` 0: no cache)."""
    return {k: getattr(template, k) for k in CACHE_FIELDS}


def sweep(
    template: WorkerConfig,
    bounds: Sequence[int],
    num_shards: int,
    out: str | Path,
    tolerance: float = 0.01,
    **kwargs: Any,
) -> dict[str, Any]:
    """``compare`` over ``ssp:S`` for each bound, plus the recommendation (see ``recommend``):
    ``recommended_staleness`` is None when the runs show no significant difference."""
    if not bounds or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in bounds):
        raise UsageError(f"--bounds must be a non-empty list of integers >= 0, got {list(bounds)!r}")
    modes = check_arguments([Mode.ssp(b) for b in bounds], tolerance=tolerance, flag="--bounds")
    summary = compare(template, modes, num_shards, out, **kwargs)
    if summary["target_loss"] is None:  # a script whose runs report no eval loss
        summary.update(recommended_staleness=None, recommendation="no staleness bound recommended (it needs an eval loss)",
                       tied_bounds=[], tolerance=tolerance, **cache_settings(template))
        Path(out, "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    verdict = recommend(summary["modes"], tolerance)
    chosen = verdict["recommended"]
    summary["recommended_staleness"] = None if chosen is None else Mode.of(chosen["mode"]).bound
    summary["recommendation"] = verdict["message"]
    summary["tied_bounds"] = verdict["tied"]
    summary["tolerance"] = tolerance
    summary.update(cache_settings(template))
    Path(out, "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# The remedies a sweep can tune: --remedy NAME -> (the label of its runs, what its strength is,
# the config fields a strength sets).
REMEDIES: dict[str, tuple[str, str, Callable[[float], dict[str, Any]]]] = {
    "dc": ("dc", "DC-ASGD's lambda (--delay-compensation)", lambda x: {"delay_compensation": x}),
    "dc-adaptive": ("dc-a", "DC-ASGD-a's lambda0 (--delay-compensation with --dc-adaptive)",
                    lambda x: {"delay_compensation": x, "dc_adaptive": True}),
}
# The runs without the remedy every remedy sweep makes: sync (the target) and async (what a
# strength must beat).
PLAIN = "async"


def check_remedy_sweep(template: WorkerConfig, remedy: str, strengths: Sequence[float]) -> list[float]:
    """What ``remedy_sweep`` is asked, checked before any process starts; returns the strengths
    to run (0, plain async, is run anyway and dropped from them).

    Raises:
        UsageError: an unknown remedy, no strength, a strength that is not a finite number >= 0,
            one given twice, or a template that sets the remedy's flags itself.
    """
    if remedy not in REMEDIES:
        raise UsageError(f"--remedy {remedy!r}: must be one of {', '.join(REMEDIES)} (gap-aware and --staleness-aware have no "
                         "strength to sweep: compare them with tether compare --modes sync,async --gap-aware)")
    values = list(strengths)
    if not values:
        raise UsageError("--strengths: at least one strength is needed")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x < math.inf:
            raise UsageError(f"--strengths: each strength must be a finite number >= 0, got {x!r}")
    twice = sorted({x for x in values if values.count(x) > 1})
    if twice:
        raise UsageError(f"--strengths: {twice[0]:g} is given twice")
    if template.delay_compensation > 0 or template.dc_adaptive:
        raise UsageError(f"--delay-compensation and --dc-adaptive: --remedy {remedy} sets them for each run (its strength); "
                         "leave them out")
    chosen = [float(x) for x in values if x > 0]
    if not chosen:
        raise UsageError("--strengths: at least one strength > 0 is needed (0 is plain async, which every remedy sweep runs)")
    return chosen


def strength_label(remedy: str, strength: float) -> str:
    """A remedy sweep's run name for one strength: ``dc-a:2``, ``dc:0.04``."""
    return f"{REMEDIES[remedy][0]}:{strength:g}"


def remedy_sweep(
    template: WorkerConfig,
    remedy: str,
    strengths: Sequence[float],
    num_shards: int,
    out: str | Path,
    **kwargs: Any,
) -> dict[str, Any]:
    """``compare`` of a staleness remedy at each strength: sync, async without the remedy and
    async with it at every strength (``REMEDIES``: ``dc``'s lambda, ``dc-adaptive``'s lambda0),
    each ``repeats`` times; plus the recommendation (``compare_report.recommend_strength``):
    ``recommended_strength`` is None when no strength beats plain async beyond the uncertainty.
    Other remedies of the template (``--staleness-aware``, ``--gap-aware``) apply to every async run.

    Raises:
        UsageError: see ``check_remedy_sweep`` and ``check_arguments``.
    """
    chosen = check_remedy_sweep(template, remedy, strengths)
    spec = parse_straggler(template.straggler if kwargs.get("straggler") is None else kwargs["straggler"])
    check_arguments(["sync", PLAIN], straggler=spec, repeats=kwargs.get("repeats", 1))
    labels = {strength_label(remedy, x): x for x in chosen}
    variants: list[Variant] = [("sync", Mode.of("sync"), {}), (PLAIN, Mode.of(PLAIN), {})]
    variants += [(label, Mode.of(PLAIN), REMEDIES[remedy][2](x)) for label, x in labels.items()]
    kwargs = {"target_loss": None, "target_fraction": 0.9, "timeout_s": 3600.0, "echo": False, "repeats": 1, "printer": print,
              "program": None, "metric": "eval_loss", **{k: v for k, v in kwargs.items() if k != "straggler"}}
    summary = _compare(template, variants, num_shards, out, spec, **kwargs)
    verdict = recommend_strength(summary["modes"], labels, remedy, PLAIN)
    summary.update(remedy=remedy, strength_is=REMEDIES[remedy][1], strengths=[0.0, *chosen], reference=PLAIN,
                   recommended_strength=verdict["strength"], recommendation=verdict["message"], tied_strengths=verdict["tied"])
    summary.update(cache_settings(template))
    Path(out, "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
