"""The ``tether`` command: ``server``, ``worker``, ``launch``, ``compare``, ``sweep``, ``export`` and ``convert``."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from tether.common import settings as fields
from tether.common.cli_args import DeprecatedAlias, HelpFormatter
from tether.common.exits import DONE, USAGE, run_command, usage_checks
from tether.deploy import children, shard_count
from tether.deploy.errors import ClusterError
from tether.deploy.shard_args import add_shard_flags, shard_config
from tether.deploy.shard_count import ShardCount
from tether.protos.errors import TetherError, report_usage_error
from tether.worker.config import JOB, MODEL, WorkerConfig
from tether.worker.flags import config_from_args
from tether.worker.training.mode import Mode
from tether.worker.training.tensorboard_writer import require_tensorboard, tensorboard_available

__all__ = ["main"]


def _launch(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tether launch",
        description="Run shards and workers as local processes and report the result. " + _PER_INVOCATION
        + " The shard flags (their own section) are given to every shard, as in 'tether server'.",
        formatter_class=HelpFormatter,
    )
    _add_counts(p, shards=None, workers=2, per="",
                shards_help="shard processes (default: 2 where the workers train on the CPU; where they train on GPUs, one per core "
                "the GPU workers leave, 2 each for their main and transfer threads, at least 2 and at most 16, their kernel threads "
                "given the cores left over: the start line says what it chose; docs/gpu.md)")
    p.add_argument("--out", default=None, help="write summary.json, worker-<i>.json and logs/ here")
    p.add_argument("--job-timeout", type=float, default=3600.0, metavar="SECONDS", help="give up after this many seconds")
    p.add_argument("--metrics", action="store_true", help="give every process a Prometheus /metrics port")
    p.add_argument("--checkpoint-every", type=float, default=None, metavar="SECONDS",
                   help="shards checkpoint to OUT/checkpoints this often (seconds); a shard that dies is restarted from its last one")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart an async or ssp worker that dies (any exit but a usage error or Ctrl-C) up to N times, as a new "
                   "incarnation, for the steps it had not reported done; the others train on meanwhile (0: the first failure ends "
                   "the job). Not for --mode sync, where a rank that dies ends the job naming it")
    _add_program_flags(p, "the workers", "; it trains until its data ends unless --steps (or its own code) sets a step count")
    # The job's flags, from --steps on (the help says this command's own are those before it).
    fields.add_flags(p, WorkerConfig, groups=(JOB, MODEL))
    add_shard_flags(p)
    a = p.parse_args(_joined_script_args(argv))

    def body() -> int:
        # Start-up cost: the tether command's help and usage errors run without torch (tests/test_cli_torch_free.py).
        from tether.deploy.job import run_job

        # Every flag is checked here, before any process starts (the data file included).
        with usage_checks():
            _check_job_flags(a)
            template = config_from_args(a, shards=("pending:0",), num_workers=a.num_workers, worker_index=0)
            if a.max_restarts < 0:
                raise ValueError(f"--max-restarts must be >= 0, got {a.max_restarts}")
            if a.max_restarts and template.mode.kind == "sync":
                raise ValueError(f"--max-restarts {a.max_restarts}: sync ranks are not restarted (a rank that dies ends the job, "
                                 "naming it); use --mode async or ssp:S")
            program = _program(a)
            if program is not None and not _steps_given(argv):
                # --steps' default (2000) is the built-in job's: a user's program runs until its data
                # ends unless --steps (or TETHER_STEPS, or its own code) says otherwise, and its
                # progress shows no made-up total or ETA.
                program = replace(program, steps_from_job=False)
            shard = shard_config(a)
            shards = _shard_count(a.num_shards, template)
        # A UsageError from here on is a worker's own one line (a malformed data line found mid-run).
        summary = run_job(template, shards.num_shards, out=a.out, timeout_s=a.job_timeout, metrics=a.metrics,
                          checkpoint_every=a.checkpoint_every, shard=shard,
                          program=program, max_restarts=a.max_restarts,
                          shard_env=shards.env(), shards_why=shards.why if shards.for_gpus else None)
        print(_result_lines(summary, a.out, program is not None))
        return DONE

    return run_command("tether launch", body, failures=(ClusterError,), say_interrupted=True)


def _shard_count(given: int | None, template: WorkerConfig) -> ShardCount:
    """``tether launch``'s shards: ``--num-shards`` when given, else as many as the host's cores
    allow its GPU workers (``tether.deploy.shard_count``; on a host without GPU workers, 2)."""
    gpus = children.gpu_count() if given is None and template.device != "cpu" else 0
    return shard_count.choose_shards(given, gpus=gpus, cores=shard_count.host_cores(), num_workers=template.num_workers,
                                     device=template.device)


def _add_program_flags(p: argparse.ArgumentParser, who: str, steps_note: str = "") -> None:
    """``--script``/``--entry`` and ``--script-args``: the user's own training program."""
    own = p.add_mutually_exclusive_group()
    own.add_argument("--script", default=None, help=f"run this Python training script as {who} (it reads its place in the job with "
                     f"TrainingConfig.from_env(); under --mode sync torchrun runs it) instead of the built-in CTR model{steps_note}")
    own.add_argument("--entry", default=None, metavar="MODULE:FUNCTION", help="like --script, for a function of an importable module")
    p.add_argument("--script-args", default="", metavar="ARGS",
                   help="arguments for --script or --entry, as one shell-quoted string (one that starts with a dash is taken "
                   "as is: --script-args --eval-first, or --script-args '--data x.dat --eval-first')")


def _steps_given(argv: Sequence[str]) -> bool:
    """Whether the user set the job's step count: ``--steps`` on the command line or ``TETHER_STEPS``."""
    if os.environ.get("TETHER_STEPS", "").strip():
        return True
    return any(arg == "--steps" or arg.startswith("--steps=") for arg in _joined_script_args(argv))


def _joined_script_args(argv: Sequence[str]) -> list[str]:
    """``--script-args VALUE`` as ``--script-args=VALUE``, so a value that starts with a dash
    (``--eval-first``) is the flag's value, not taken by argparse for an option of its own."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--script-args":
            out[i : i + 2] = [f"--script-args={out[i + 1]}"]
            break
    return out


def _program(a: argparse.Namespace) -> Any:
    """The user's program of ``--script``/``--entry`` (None: the built-in CTR model).

    Raises:
        ValueError: no such script or module, or unbalanced quotes in --script-args, named.
    """
    # Start-up cost: the tether command's help and usage errors run without torch (tests/test_cli_torch_free.py).
    from tether.deploy.launch import Program

    if a.script_args and not (a.script or a.entry):
        raise ValueError("--script-args is for --script or --entry; give one of them")
    try:
        args = shlex.split(a.script_args)
    except ValueError as exc:
        raise ValueError(f"--script-args {a.script_args!r}: {exc}") from None
    return Program.script(a.script, args) if a.script else Program.entry(a.entry, args) if a.entry else None


def _result_lines(summary: dict[str, Any], out: str | None, own_program: bool) -> str:
    """What a finished launch prints: the held-out result and the throughput."""
    if own_program:
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in summary["final_eval"].items() if isinstance(v, (int, float)))
        first = f"result: worker 0's held-out {metrics}" if metrics else "result: no held-out metrics (give Trainer.fit an eval_data)"
    else:
        first = (
            f"result: held-out log loss {summary['eval_loss']:.4f} (constant predictor {summary['baseline_loss']:.4f}"
            + (f", best possible {summary['bayes_loss']:.4f}" if "bayes_loss" in summary else "")
            + f"), AUC {summary['eval_auc']:.4f}"
        )
    lines = [
        "",
        first,
        f"        {summary['total_samples']:,} samples in {summary['train_wall_s']:.1f}s = {summary['samples_per_sec']:,.0f} samples/s"
        f" across {summary['num_workers']} worker(s) and {summary['num_shards']} shard(s)",
    ]
    cache = summary.get("row_cache")
    if cache:
        lines.append(f"        row cache: {cache['rows_saved']:.0%} of the rows the steps looked up not moved, for "
                     f"{cache['seconds_per_step'] * 1e3:.2f} ms of its own calls a step ({cache['share_of_step']:.0%} of the workers' "
                     "step time)")
    restarted = {name: n for name, n in summary.get("restarts", {}).items() if n}
    if restarted:
        lines.append("        restarts: " + ", ".join(f"{name} {n}" for name, n in restarted.items())
                     + (" (restarted workers re-read their data from the start: see summary.json)"
                        if "restarted_workers" in summary else ""))
    if out:
        lines.append(f"        summary written to {out}/summary.json")
    return "\n".join(lines)


def _check_job_flags(a: argparse.Namespace) -> None:
    """Launcher flags that no config class checks.

    Raises:
        ValueError: a bad value, named.
    """
    if a.num_shards is not None and a.num_shards < 1:
        raise ValueError(f"--num-shards must be >= 1, got {a.num_shards}")
    if a.num_workers < 1:
        raise ValueError(f"--num-workers must be >= 1, got {a.num_workers}")
    if not a.job_timeout > 0:
        raise ValueError(f"--job-timeout must be > 0, got {a.job_timeout!r}")
    every = getattr(a, "checkpoint_every", None)
    if every is not None and not every > 0:
        raise ValueError(f"--checkpoint-every must be > 0, got {every!r}")
    if a.tensorboard:
        require_tensorboard()


# What the launching commands' help says of their flags and the environment.
_PER_INVOCATION = (
    "The flags listed before --steps are this command's own: per invocation, with no environment variable. "
    "The job's flags (--steps and those after it) fall back to the TETHER_* variable their help names, as in 'tether worker'."
)


def _add_counts(p: argparse.ArgumentParser, shards: int | None, workers: int, per: str, shards_help: str | None = None) -> None:
    """``--num-shards`` and ``--num-workers`` (counts of processes; ``--shards`` is a list of
    addresses in ``tether worker`` and ``export``), and their old spellings for one release.
    ``shards`` None: the command chooses (``shards_help`` says how)."""
    p.add_argument("--num-shards", type=int, default=shards, metavar="N", help=shards_help or f"shard processes{per}")
    p.add_argument("--num-workers", type=int, default=workers, metavar="N", help=f"worker processes{per}")
    p.add_argument("--shards", dest="num_shards", type=int, action=DeprecatedAlias, new="--num-shards", default=argparse.SUPPRESS,
                   metavar="N", help="deprecated spelling of --num-shards, removed in the next release")
    p.add_argument("--workers", dest="num_workers", type=int, action=DeprecatedAlias, new="--num-workers", default=argparse.SUPPRESS,
                   metavar="N", help="deprecated spelling of --num-workers, removed in the next release")


class _Refused(argparse.Action):
    """A flag that means nothing to this command: one error line, exit code 2."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, why: str, **kwargs: Any) -> None:
        self.why = why
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object, option_string: str | None = None
    ) -> None:
        raise SystemExit(report_usage_error(parser.prog, ValueError(f"{option_string} {values}: {self.why}")))


def _comparison(command: str, argv: Sequence[str]) -> int:
    sweep = command == "sweep"
    p = argparse.ArgumentParser(
        prog=f"tether {command}",
        description=("Tune the staleness bound: run ssp:S for each S of --bounds; or, with --remedy, a staleness remedy's strength: "
                     "run sync, async without it and async with it at each strength of --strengths. "
                     if sweep else "Run the same job under several consistency modes. ")
        + _PER_INVOCATION,
        formatter_class=HelpFormatter,
    )
    if sweep:
        p.add_argument("--bounds", default=None, help="comma-separated staleness bounds S to try (default 0,1,2,4,8)")
        p.add_argument("--tolerance", type=float, default=None,
                       help="bounds: final loss may be this much (relative) above the best (default 0.01)")
        p.add_argument("--remedy", default=None, metavar="NAME",
                       help="sweep this remedy's strength instead of the bound: dc (DC-ASGD's lambda, --delay-compensation) or "
                       "dc-adaptive (DC-ASGD-a's lambda0). Runs sync, async without the remedy and async at each strength; "
                       "recommends the strength with the lowest mean final loss if it beats plain async beyond the 95%% interval. "
                       "Other job flags (--staleness-aware, --gap-aware) apply to every async run")
        p.add_argument("--strengths", default=None, metavar="LIST",
                       help="with --remedy: comma-separated strengths >= 0 (0: plain async, run anyway; default 0.5,1,2,4,8)")
    else:
        p.add_argument("--modes", default="sync,ssp:0,ssp:4,async", help="comma-separated modes: async, ssp:S, sync")
    _add_counts(p, shards=2, workers=4, per=" per run")
    # --straggler SPEC is a job flag (declared in TrainingConfig): every mode and repeat sees the same delays.
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run each mode N times with different data orders (--data-seed, +1 per repeat): the table shows mean "
                   "and spread, the plot bands" + (", and a bound is recommended only when its lead exceeds the spread" if sweep else ""))
    p.add_argument("--target-loss", type=float, default=None, help="eval loss for time-to-target (default: 90%% of the worst mode's gain)")
    p.add_argument("--out", required=True, help="write curves.csv, curves.png, summary.json and each run here")
    p.add_argument("--job-timeout", type=float, default=3600.0, metavar="SECONDS", help="limit per run, seconds")
    p.add_argument("--verbose", action="store_true", help="show every worker's progress")
    # Several modes run here: a --mode would mean nothing (and would otherwise abbreviate --modes).
    p.add_argument("--mode", action=_Refused, help=argparse.SUPPRESS, default=argparse.SUPPRESS,
                   why=f"tether {command} runs "
                   + ("ssp:S for every S of --bounds (async with --remedy)" if sweep else "every mode of --modes")
                   + "; --mode is for launch and worker")
    _add_program_flags(p, "the workers of every run")
    p.add_argument("--metric", default=None, metavar="NAME",
                   help="with --script or --entry: the held-out metric of worker 0's evaluation to compare on, lower is better "
                   "(default: eval_loss, what Trainer.fit reports given eval_data and no evaluate)")
    fields.add_flags(p, WorkerConfig, groups=(JOB, MODEL), exclude=("mode",))
    a = p.parse_args(_joined_script_args(argv))
    return run_command(f"tether {command}", lambda: _run_comparison(a, sweep), failures=(ClusterError,), say_interrupted=True)


def _run_comparison(a: argparse.Namespace, sweep: bool) -> int:
    """``tether compare`` or ``sweep`` with its parsed flags; the exit code."""
    # Start-up cost: the tether command's help and usage errors run without torch (tests/test_cli_torch_free.py).
    from tether.deploy.compare import check_arguments, check_remedy_sweep, compare, remedy_sweep
    from tether.deploy.compare import sweep as run_sweep
    from tether.deploy.compare_report import format_table

    # Every flag is checked here, before any process starts (modes, bounds, the data file).
    with usage_checks():
        _check_job_flags(a)
        template = config_from_args(a, shards=("pending:0",), num_workers=a.num_workers, worker_index=0)
        # TensorBoard curves of every mode under one root: --tensorboard DIR, else OUT/tensorboard
        # when the package is installed.
        board = a.tensorboard or (str(Path(a.out) / "tensorboard") if tensorboard_available() else None)
        template = replace(template, tensorboard=board)
        remedy = sweep and a.remedy is not None
        if remedy:
            _check_remedy_flags(a)
            strengths = check_remedy_sweep(template, a.remedy, [_strength(x) for x in (a.strengths or "0.5,1,2,4,8").split(",")])
            texts: list[str] = ["sync", "async"]
        elif sweep:
            if a.strengths is not None:
                raise ValueError(f"--strengths {a.strengths}: is for --remedy (the strengths of the remedy to sweep)")
            bounds = [_bound(b) for b in (a.bounds or "0,1,2,4,8").split(",") if b.strip()]
            texts = [Mode.ssp(b) for b in bounds]
        else:
            texts = [m.strip() for m in a.modes.split(",") if m.strip()]
        tolerance = 0.01 if not sweep or a.tolerance is None else a.tolerance
        # Each mode parsed here, once: compare and sweep hand these on to every run's config.
        modes = check_arguments(texts, straggler=a.straggler, tolerance=tolerance if sweep else 0.0, repeats=a.repeats,
                                flag="--bounds" if sweep and not remedy else "--modes")
        program = _program(a)
        if a.metric is not None and program is None:
            raise ValueError(f"--metric {a.metric}: is for --script or --entry (the built-in job compares its log loss)")
    common = dict(straggler=a.straggler, target_loss=a.target_loss, timeout_s=a.job_timeout, echo=a.verbose, repeats=a.repeats,
                  program=program, metric=a.metric or "eval_loss")
    # A UsageError from here on is a worker's one line, or no bound reached the target.
    if remedy:
        summary = remedy_sweep(template, a.remedy, strengths, a.num_shards, a.out, **common)
    elif sweep:
        summary = run_sweep(template, bounds, a.num_shards, a.out, tolerance=tolerance, **common)
    else:
        summary = compare(template, modes, a.num_shards, a.out, **common)
    print(format_table(summary))
    print(f"wrote {a.out}/summary.json, curves.csv" + (" and curves.png" if summary.get("plotted", True) else ""))
    if template.tensorboard:
        print(f"TensorBoard curves of every mode: tensorboard --logdir {template.tensorboard}")
    return DONE


def _check_remedy_flags(a: argparse.Namespace) -> None:
    """``sweep --remedy``'s flags that belong to the bound sweep.

    Raises:
        ValueError: --bounds or --tolerance given with --remedy, named.
    """
    if a.bounds is not None:
        raise ValueError(f"--bounds {a.bounds}: --remedy {a.remedy} sweeps the remedy's strength under async "
                         "(sweep the bound without --remedy)")
    if a.tolerance is not None:
        raise ValueError(f"--tolerance {a.tolerance:g}: is for the bound sweep (--remedy recommends by the 95% interval "
                         "against plain async)")


def _strength(text: str) -> float:
    """One ``--strengths`` entry.

    Raises:
        ValueError: not a finite number >= 0, named.
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ValueError(f"--strengths: each strength must be a finite number >= 0, got {text.strip()!r}")
    return value


def _bound(text: str) -> int:
    """One ``--bounds`` entry.

    Raises:
        ValueError: not an integer >= 0, named.
    """
    if not text.strip().isdigit():
        raise ValueError(f"--bounds: each bound must be an integer >= 0, got {text.strip()!r}")
    return int(text)


def _export(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tether export",
        description="Write a checkpoint's tables and dense parameters as safetensors files for serving "
        "(load them with tether.worker.serving.load_export). Its flags are per invocation and have no environment variable.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--checkpoint-dir", required=True, help="the shards' --checkpoint-dir (every shard's part must be readable here)")
    p.add_argument("--id", default=None, help="checkpoint id to export (default: every shard's newest part)")
    p.add_argument("--shards", default=None,
                   help="comma-separated host:port of a live cluster: first write checkpoint --id (default export-<unix time>) "
                   "on every shard")
    p.add_argument("--out", required=True, help="folder for model.safetensors and manifest.json")
    p.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                   help="a function of no arguments (package.module:function or file.py:function) that builds the model the job trained: "
                   "each dense parameter is written as dense.<name> with its shape (default: the shards' one flat vector dense.dense)")
    a = p.parse_args(argv)
    # Start-up cost: the tether command's help and usage errors run without torch (tests/test_cli_torch_free.py).
    from tether.deploy.export import export_checkpoint, load_model

    try:
        # Built first: a bad --model is one line before any shard is asked to checkpoint.
        model = load_model(a.model) if a.model is not None else None
        ckpt_id = a.id
        if a.shards is not None:
            # Start-up cost: the tether command's help and usage errors run without torch (tests/test_cli_torch_free.py).
            from tether.worker.client.config import ClientConfig
            from tether.worker.client.ps_client import PSClient

            addresses = tuple(x.strip() for x in a.shards.split(",") if x.strip())
            for address in addresses or (a.shards,):
                if not address.rpartition(":")[2].isdigit():
                    raise ValueError(f"--shards: shard address must be host:port, got {address!r}")
            ckpt_id = ckpt_id or f"export-{int(time.time())}"
            with PSClient(ClientConfig(addresses=addresses, worker_id="tether-export")) as client:
                client.checkpoint(ckpt_id)
        manifest = export_checkpoint(a.checkpoint_dir, a.out, ckpt_id, model=model)
    except (ValueError, TetherError, OSError) as exc:
        return report_usage_error("tether export", exc)
    tables = ", ".join(f"{n} ({t['rows']:,} x {t['dim']})" for n, t in manifest["tables"].items())
    dense = sum(manifest["dense"].values())
    print(f"exported checkpoint {manifest['checkpoint']} to {a.out}: tables {tables or 'none'}; dense {dense:,} values")
    return DONE


def _convert(argv: Sequence[str]) -> int:
    # Start-up cost: the tether command's help and usage errors run without torch (tests/test_cli_torch_free.py).
    from tether.worker.data.parquet import CONVERT_ROW_GROUP_ROWS, write_criteo_parquet

    p = argparse.ArgumentParser(
        prog="tether convert",
        description="Write Criteo-format TSV files (plain or gzip) as one Parquet file that --data parquet:OUT trains on: "
        "label, I1..I13 (float32, log1p of the counts) and C1..C26 (int64 ids, hashed as the Criteo reader hashes them), "
        "so the batches and the held-out rows are those of --data criteo:SOURCE. Needs pip install 'tether[parquet]'. "
        "Its flags are per invocation and have no environment variable.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("source", help="criteo:PATH (or PATH): a file, a glob or a comma-separated list, read in order")
    p.add_argument("out", help="the Parquet file to write (written under a temporary name, renamed once complete)")
    p.add_argument("--row-group-rows", type=int, default=CONVERT_ROW_GROUP_ROWS, metavar="N",
                   help="rows per row group: the unit dealt to workers (the files need at least one row group per worker)")
    p.add_argument("--compression", default="snappy", choices=("snappy", "zstd", "gzip", "lz4", "none"), help="Parquet compression codec")
    a = p.parse_args(argv)
    source = a.source.removeprefix("criteo:")
    try:
        if a.row_group_rows < 1:
            raise ValueError(f"--row-group-rows must be >= 1, got {a.row_group_rows}")
        if Path(a.out).is_dir():
            raise ValueError(f"{a.out}: is a folder; name the Parquet file to write")
        start = time.perf_counter()
        rows = write_criteo_parquet(source, a.out, row_group_rows=a.row_group_rows, compression=a.compression)
    except ValueError as exc:
        return report_usage_error("tether convert", exc)
    size = Path(a.out).stat().st_size / 2**20
    took = time.perf_counter() - start
    print(f"wrote {a.out}: {rows:,} rows, {-(-rows // a.row_group_rows)} row group(s), {size:.1f} MiB in {took:.1f}s")
    return DONE


def _version() -> str:
    """The installed package's version (``unknown`` when tether runs from a tree that was never installed)."""
    try:
        return version("tether")
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tether`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "server": "run one shard",
        "worker": "run one worker",
        "launch": "run a local cluster (shards + workers) and report the result",
        "compare": "run the same job under several consistency modes",
        "sweep": "tune the staleness bound S of ssp:S, or a remedy's strength (--remedy)",
        "export": "write a checkpoint's tables and dense parameters as safetensors for serving",
        "convert": "write Criteo TSV files as a Parquet table (--data parquet:)",
    }
    if argv and argv[0] in ("-V", "--version"):
        print(f"tether {_version()}")
        return DONE
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: tether {" + ",".join(commands) + "} [flags]\n       tether --version\n")
        for name, text in commands.items():
            print(f"  {name:8s} {text}")
        print("\n'tether COMMAND --help' lists a command's flags and their defaults.")
        return DONE if argv and argv[0] in ("-h", "--help") else USAGE
    command, rest = argv[0], argv[1:]
    if command == "server":
        # Start-up cost: the tether command's help and usage errors run without torch (tests/test_cli_torch_free.py).
        from tether.server.__main__ import main as server_main

        return server_main(rest)
    if command == "worker":
        # Start-up cost: the tether command's help and usage errors run without torch (tests/test_cli_torch_free.py).
        from tether.worker.__main__ import main as worker_main

        return worker_main(rest)
    if command == "export":
        return _export(rest)
    if command == "convert":
        return _convert(rest)
    if command in ("compare", "sweep"):
        return _comparison(command, rest)
    return _launch(rest)


if __name__ == "__main__":
    sys.exit(main())
