"""A whole training job on this machine (``tether launch``): shards and workers started, waited
for, the result evaluated and summarised in ``summary.json``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from tether.common.exits import usage_checks
from tether.deploy.errors import ClusterError, Interrupted
from tether.deploy.launch import LocalCluster, Program
from tether.server.config import ShardConfig
from tether.worker.config import WorkerConfig
from tether.worker.training.run_record import RunRecord

__all__ = ["quantile", "row_cache_summary", "run_job", "staleness_summary"]


def quantile(sorted_values: Sequence[int], q: float) -> float:
    """Nearest-rank quantile of sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    return float(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))])


def staleness_summary(records: Iterable[RunRecord]) -> dict[str, float]:
    """``staleness_p50``, ``staleness_p99`` and ``staleness_max`` of every push of the records
    (clock staleness; 0 for none)."""
    lags = sorted(x for r in records for x in r.clock_staleness)
    return {"staleness_p50": quantile(lags, 0.5), "staleness_p99": quantile(lags, 0.99), "staleness_max": lags[-1] if lags else 0}


def run_job(
    template: WorkerConfig,
    num_shards: int,
    out: str | Path | None = None,
    timeout_s: float = 3600.0,
    echo: bool = True,
    metrics: bool = False,
    checkpoint_every: float | None = None,
    program: Program | None = None,
    shard: ShardConfig | None = None,
    max_restarts: int = 0,
    shard_restarts: int = 5,
    during: Callable[[LocalCluster], AbstractContextManager[object]] | None = None,
    shard_env: Mapping[str, str] | None = None,
    shards_why: str | None = None,
    resume_workers: bool = True,
) -> dict[str, Any]:
    """Run a whole job locally, evaluate the result, and write ``summary.json`` to ``out``.

    With a ``program`` the workers are the user's code; the result is what its workers
    recorded (worker 0's final held-out metrics, when it evaluated). ``shard``: every shard's
    settings (TLS files, for one; the workers' own come from ``template``; default: those the
    ``TETHER_*`` environment describes), each shard handed its own as a config file.

    Args:
        max_restarts: restart an async or ssp worker that dies up to this many times (see
            ``LocalCluster``); a sync rank that dies ends the job.
        shard_restarts: restart a shard that dies up to this many times.
        resume_workers: a restarted worker reads on from its newest saved stream position
            (``LocalCluster``); False: from the start of its share.
        during: a context entered once the workers have started and left once they have all
            finished, before the evaluation (a fault schedule, for one).
        shard_env: extra environment variables of every shard (``tether.deploy.shard_count``'s kernel threads).
        shards_why: how ``num_shards`` was chosen, said in the start line (None: it was given).

    Raises:
        UsageError: a worker found a mistake in what it was asked (a malformed data line), or a
            ``TETHER_*`` variable of the shards' is bad (without ``shard``).
        ClusterError: a process failed or the job ran past ``timeout_s``.
        Interrupted: Ctrl-C; every process was stopped.
    """
    out_dir = Path(out) if out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    # A shard that dies is restarted on its port; with checkpoint_every it comes back from its
    # last checkpoint (without, it comes back empty).
    cluster = LocalCluster(log_dir=out_dir / "logs" if out_dir else None, restart=True, max_restarts=shard_restarts,
                           max_worker_restarts=max_restarts, resume_workers=resume_workers)
    try:
        with cluster:
            workdir = out_dir or cluster.log_dir
            template = replace(template, out=str(workdir))
            if shard is None:
                with usage_checks():  # a bad TETHER_* variable is the user's mistake: one line, before a shard starts
                    shard = ShardConfig.from_env()
            # The shards checkpoint to OUT/checkpoints when asked to: every checkpoint_every seconds,
            # and at every worker's --checkpoint-every-steps (which asks the shards for step-<n>).
            asked = checkpoint_every is not None or template.checkpoint_every_steps > 0
            checkpoints = Path(workdir, "checkpoints").resolve() if asked else None
            if checkpoints:
                shard = replace(shard, checkpoint_dir=str(checkpoints))
            if checkpoint_every is not None:
                shard = replace(shard, checkpoint_every_s=checkpoint_every)
            addresses = cluster.start_shards(num_shards, config=shard, metrics=metrics, env=dict(shard_env) if shard_env else None)
            chosen = f" ({shards_why})" if shards_why else ""
            print(f"tether: {num_shards} shard(s){chosen} at {', '.join(addresses)}; starting {template.num_workers} worker(s)", flush=True)
            t0 = time.perf_counter()
            cluster.start_workers(template, echo=echo, metrics=metrics, program=program)
            with during(cluster) if during is not None else nullcontext():
                cluster.wait_workers(timeout_s)
            wall = time.perf_counter() - t0
            metrics_ports = dict(cluster.metrics_ports)
            restarts = cluster.restart_counts()
            steps_before = cluster.steps_before_restarts()
            resumed = sum(r["position_step"] is not None for r in cluster.worker_resumes)
            records = [workdir / f"worker-{i}.json" for i in range(template.num_workers)]
            workers = [RunRecord.load(r) for r in records if r.exists()]
            if program is not None:
                if not workers:
                    raise ClusterError(f"the workers wrote no records to {workdir} (train with Trainer and TrainingConfig.from_env())")
                evaluation = dict(workers[0].final_eval or {}) if workers[0].worker_index == 0 else {}
            else:
                evaluation = _evaluate_builtin(template, addresses, workers)
            if checkpoints:
                _final_checkpoint(template, addresses, checkpoints)
    except KeyboardInterrupt:
        # Leaving the with block stopped every process.
        raise Interrupted(cluster.stopped) from None
    summary = _summary(template, num_shards, workers, evaluation, wall, metrics_ports, restarts, steps_before, max_restarts, resumed)
    if out_dir:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _evaluate_builtin(template: WorkerConfig, addresses: Sequence[str], workers: Sequence[RunRecord]) -> dict[str, float]:
    """The built-in CTR job's held-out figures. Imported here, with torch: a launcher of the
    user's own program reads its workers' records and needs none of it."""
    # Start-up cost: the launcher loads torch only once a job runs, not for its help or a refused flag.
    from tether.worker.ctr.job import evaluate_job, open_dataset, reference_losses
    from tether.worker.training.policies import policy_class

    if not policy_class(template.mode.kind).dense_on_shards:
        # Dense parameters live on the ranks (sync), so rank 0 evaluated the final model.
        return {**(workers[0].final_eval or {}), **reference_losses(open_dataset(template))}
    return evaluate_job(replace(template, shards=tuple(addresses)))


def _final_checkpoint(template: WorkerConfig, addresses: Sequence[str], root: Path) -> None:
    """Every shard writes its part of one checkpoint ``final-<unix ms>`` before the launcher stops
    them. Each shard's own shutdown checkpoint would get an id of its own, so their parts would be
    no complete checkpoint, and a relaunch onto another shard count would refuse them; with one
    id they are one, restored onto any count. The shutdown then writes none: nothing changed since.
    A shard that cannot write it is one line; each shard's own shutdown checkpoint then follows."""
    # Start-up cost: the launcher loads torch only once a job runs, not for its help or a refused flag.
    from tether.protos.errors import TetherError
    from tether.worker.client.ps_client import PSClient

    ckpt_id = f"final-{int(time.time() * 1000)}"
    config = replace(replace(template, shards=tuple(addresses)).client_config(), worker_id="launcher")
    client = PSClient(config)
    try:
        client.checkpoint(ckpt_id, timeout_s=120.0)
    except TetherError as exc:
        print(f"tether: the final checkpoint {ckpt_id} failed ({exc}); each shard writes its own as it stops", flush=True)
        return
    finally:
        client.close()
    print(f"tether: final checkpoint {ckpt_id} of all {len(addresses)} shard(s) in {root}", flush=True)


def _samples_of(steps: int, record: RunRecord) -> int:
    """Samples in ``steps`` steps of an earlier incarnation of the worker whose last incarnation
    wrote ``record``: at that incarnation's samples per step."""
    return round(steps * record.samples / record.steps) if steps and record.steps else 0


def row_cache_summary(workers: Sequence[RunRecord]) -> dict[str, float] | None:
    """What the workers' row caches saved and cost (None: no cache): the share of the rows the
    steps looked up that were not moved (pulled and pushed: with no cache, each twice), the
    seconds the caches' own calls took per step, and their share of the steps' time."""
    cached = [w for w in workers if w.cache_seconds is not None]
    if not cached:
        return None
    wanted = sum(v["wanted_rows"] for w in cached for v in (w.traffic or {}).values())
    moved = sum(v["pulled_rows"] + v["pushed_rows"] for w in cached for v in (w.traffic or {}).values())
    seconds = sum(w.cache_seconds or 0.0 for w in cached)
    busy = sum(sum(w.phase_seconds.values()) for w in cached)
    return {"rows_saved": 1.0 - moved / (2 * wanted) if wanted else 0.0, "seconds_per_step": seconds / max(sum(w.steps for w in cached), 1),
            "share_of_step": seconds / busy if busy else 0.0}


def _summary(
    template: WorkerConfig, num_shards: int, workers: Sequence[RunRecord], evaluation: dict[str, float], wall: float,
    metrics_ports: dict[str, int], restarts: dict[str, int], steps_before: dict[str, int], max_restarts: int,
    resumed: int = 0,
) -> dict[str, Any]:
    """The job's ``summary.json``: its evaluation, throughput, staleness and each worker's figures."""
    # A restarted worker's record is its last incarnation's: the steps the earlier ones reported
    # done are added, at the samples per step that last incarnation counted (the same program
    # and flags: a user's script's batch size, not the built-in model's), and the throughput is
    # over the whole job's wall time, restarts included.
    before = {int(name.rpartition("-")[2]): n for name, n in steps_before.items()}
    earlier = {w.worker_index: _samples_of(before.get(w.worker_index, 0), w) for w in workers}
    total = sum(w.samples for w in workers) + sum(earlier.values())
    train_wall = wall if steps_before else max(w.wall_s for w in workers)
    summary: dict[str, Any] = {
        "mode": template.mode,
        **evaluation,
        # The held-out metrics alone, under the names the workers' evaluate gave them.
        "final_eval": evaluation,
        "samples_per_sec": total / train_wall,
        "total_samples": total,
        "train_wall_s": train_wall,
        "job_wall_s": wall,
        "num_shards": num_shards,
        "num_workers": template.num_workers,
        "metrics_ports": metrics_ports,
        **staleness_summary(workers),
        "workers": [
            {"worker_index": w.worker_index, "samples": w.samples, "wall_s": w.wall_s, "samples_per_sec": w.samples_per_sec,
             "phase_seconds": w.phase_seconds, "restarts": restarts.get(f"worker-{w.worker_index}", 0),
             "samples_before_restarts": earlier.get(w.worker_index, 0)}
            for w in workers
        ],
        # Restarts of every process (shard-<i>, worker-<i>; torchrun in sync mode), and what a
        # restarted worker read.
        "restarts": restarts,
        "max_restarts": max_restarts,
    }
    cache = row_cache_summary(workers)
    if cache is not None:
        summary["row_cache"] = cache
    if steps_before:
        how = (
            f"{resumed} restart(s) read on from the newest stream position the earlier incarnations saved (positions/latest), "
            "so the data left and the steps left agree; any other restart read its share of the data from the start again "
            "(its data had no position): it re-read batches its first incarnation trained on, and did not read those after them"
        ) if resumed else (
            "reading its share of the data from the start again (its data had no position): "
            "it re-read batches its first incarnation trained on, and did not read those after them"
        )
        summary["restarted_workers"] = (
            "a restarted worker is a new client incarnation that ran the steps its earlier incarnations had not done "
            f"(progress lines, every --log-every steps, or its newest saved position), {how}; samples_per_sec is over job_wall_s"
        )
    return summary
