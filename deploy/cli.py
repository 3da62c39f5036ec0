"""The ``tether`` command: ``server``, ``worker`` and ``launch``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from tether.worker.config import add_training_flags, config_from_args

__all__ = ["main"]


def _launch(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="tether launch", description="Run shards and workers as local processes and report the result.")
    p.add_argument("--shards", type=int, default=2, help="number of shard processes")
    p.add_argument("--workers", type=int, default=2, help="number of worker processes")
    p.add_argument("--out", default=None, help="write summary.json, worker-<i>.json and logs/ here")
    p.add_argument("--job-timeout", type=float, default=3600.0, help="give up after this many seconds")
    p.add_argument("--metrics", action="store_true", help="give every process a Prometheus /metrics port")
    add_training_flags(p)
    a = p.parse_args(argv)
    from tether.deploy.launch import ClusterError, run_job

    try:
        if a.shards < 1:
            raise ValueError(f"--shards must be >= 1, got {a.shards}")
        template = config_from_args(a, shards=("pending:0",), num_workers=a.workers, worker_index=0)
    except ValueError as exc:
        print(f"tether launch: {exc}", file=sys.stderr)
        return 2
    try:
        summary = run_job(template, a.shards, out=a.out, timeout_s=a.job_timeout, metrics=a.metrics)
    except ClusterError as exc:
        print(f"tether launch: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tether launch: interrupted; every process was stopped", file=sys.stderr)
        return 130
    lines = [
        "",
        f"result: held-out log loss {summary['eval_loss']:.4f} (constant predictor {summary['baseline_loss']:.4f}"
        + (f", best possible {summary['bayes_loss']:.4f}" if "bayes_loss" in summary else "")
        + f"), AUC {summary['eval_auc']:.4f}",
        f"        {summary['total_samples']:,} samples in {summary['train_wall_s']:.1f}s = {summary['samples_per_sec']:,.0f} samples/s"
        f" across {summary['num_workers']} worker(s) and {summary['num_shards']} shard(s)",
    ]
    if a.out:
        lines.append(f"        summary written to {a.out}/summary.json")
    print("\n".join(lines))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tether`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"server": "run one shard", "worker": "run one worker", "launch": "run a local cluster"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: tether {" + ",".join(commands) + "} [flags]\n")
        for name, text in commands.items():
            print(f"  {name:8s} {text}")
        print("\n'tether COMMAND --help' lists a command's flags.")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "server":
        from tether.server.__main__ import main as server_main

        return server_main(rest)
    if command == "worker":
        from tether.worker.__main__ import main as worker_main

        return worker_main(rest)
    return _launch(rest)


if __name__ == "__main__":
    sys.exit(main())
