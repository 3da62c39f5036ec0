"""The worker's training loop: pull (prefetched) -> forward/backward on device -> push.

Also the held-out evaluation through the shards, used by workers during training and by the
launcher once every worker has finished.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

from tether.protos.errors import DeadlineExceeded, TooStale, UsageError
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.client import ClientConfig, Handle, PSClient, PullResult
from tether.worker.config import WorkerConfig
from tether.worker.data import Batch, SyntheticClickLog, SyntheticConfig, in_background, iterate, load_criteo
from tether.worker.embedding import Prefetch, PSModel, ShardedEmbeddingBag, flat_grads, split_flat
from tether.worker.evaluation import constant_baseline_loss, evaluate
from tether.worker.model import CTRModel

__all__ = [
    "Dataset",
    "build_model",
    "connect",
    "evaluate_job",
    "evaluate_remote",
    "local_optimizer",
    "open_dataset",
    "pick_device",
    "reference_losses",
    "train",
]

log = logging.getLogger(__name__)

_WIRE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    """``auto`` means CUDA when there is a GPU, else the CPU.

    Raises:
        UsageError: CUDA asked for but not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: torch sees no CUDA device")
    return device


@dataclass
class Dataset:
    """Training stream, held-out set and reference losses of one job."""

    num_dense: int
    num_sparse: int
    train_batches: Callable[[int, int, int, int], Iterator[Batch]]
    eval_set: Batch
    label_mean: float
    bayes_loss: float | None


def open_dataset(cfg: WorkerConfig) -> Dataset:
    """The job's data, identical on every worker (same seed).

    Raises:
        UsageError: the Criteo file cannot be read, has a malformed line or too few lines.
    """
    if cfg.data == "synthetic":
        gen = SyntheticClickLog(SyntheticConfig(num_sparse=cfg.num_sparse, vocab_size=cfg.vocab_size, seed=cfg.seed))
        eval_set = gen.eval_set(max(cfg.eval_samples, 1))
        # The constant predictor learns its rate from training data, not from the eval set.
        sample = next(gen.batches(min(20_000, cfg.batch_size * cfg.steps), 1, rank=0, world_size=1))
        return Dataset(
            num_dense=gen.config.num_dense,
            num_sparse=gen.config.num_sparse,
            train_batches=lambda bs, n, rank, world: gen.batches(bs, n, rank=rank, world_size=world),
            eval_set=eval_set,
            label_mean=float(sample.labels.mean()),
            bayes_loss=gen.bayes_log_loss(eval_set),
        )
    path = cfg.data.split(":", 1)[1]
    try:
        train_set, eval_set = load_criteo(path, eval_fraction=0.1)
    except ValueError as exc:
        # A malformed line or too few lines: the message names the file (and line).
        raise UsageError(str(exc)) from exc
    except OSError as exc:
        raise UsageError(f"--data {cfg.data}: {exc.strerror or exc}") from exc

    def batches(bs: int, n: int, rank: int, world: int) -> Iterator[Batch]:
        stream = iterate(train_set, bs, rank=rank, world_size=world, epochs=None)
        for _ in range(n):
            yield next(stream)

    return Dataset(
        num_dense=train_set.dense.shape[1],
        num_sparse=train_set.sparse.shape[1],
        train_batches=batches,
        eval_set=eval_set,
        label_mean=float(train_set.labels.mean()),
        bayes_loss=None,
    )


def build_model(cfg: WorkerConfig, ds: Dataset) -> CTRModel:
    """The CTR model with embedding bags on the shards (same init on every worker)."""
    torch.manual_seed(cfg.seed)
    return CTRModel(
        num_dense=ds.num_dense,
        num_sparse=ds.num_sparse,
        embedding_dim=cfg.embedding_dim,
        embedding_factory=lambda name, dim: ShardedEmbeddingBag(name, dim),
    )


def connect(cfg: WorkerConfig, model: CTRModel, device: torch.device, metrics: object | None = None) -> PSModel:
    """Declare the model on the shards and bind it to them (dense stays local in sync mode)."""
    client = PSClient(
        ClientConfig(
            addresses=cfg.shards,
            worker_id=f"worker-{cfg.worker_index}",
            timeout_s=cfg.timeout_s,
            call_deadline_s=cfg.call_deadline_s,
            wire_dtype=_WIRE[cfg.wire_dtype],
            transport=cfg.transport,
            staleness_aware=cfg.staleness_aware,
            security=cfg.security,
        ),
        metrics,
    )
    opt = OptimizerConfig(name=cfg.optimizer, lr=cfg.lr)
    tables = [TableConfig(name=t, dim=cfg.embedding_dim, optimizer=opt, init_scale=0.05, seed=cfg.seed) for t in model.table_names()]
    dense_on_shards = cfg.consistency[0] != "sync"
    ps = PSModel(model.to(device), client, device, dense_on_shards=dense_on_shards)
    client.declare(tables, ps.dense_tensors() if dense_on_shards else None, opt)
    return ps


def local_optimizer(cfg: WorkerConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer that matches the shards' update rule (sync mode's dense step)."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    if cfg.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=1e-8)
    return torch.optim.Adam(params, lr=cfg.lr, eps=1e-8)


def _sparse(batch: Batch) -> dict[str, torch.Tensor]:
    return {f"cat_{j}": batch.sparse[:, j] for j in range(batch.sparse.shape[1])}


def evaluate_remote(ps: PSModel, batch: Batch, batch_size: int = 4096, timeout: float | None = None) -> dict[str, float]:
    """Held-out log loss and AUC of the model with the shards' current parameters.

    One pull fetches every row the held-out set needs (and the dense values), then the model
    is evaluated in process.
    """
    ps.install(ps.prefetch(_sparse(batch)), train=False, timeout=timeout)
    return evaluate(ps.model, batch, batch_size)


class _AllReduce:
    """Sync mode: average dense gradients over the ranks with one flat all-reduce."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.params = params
        self.world = dist.get_world_size()

    def __call__(self) -> None:
        flat = flat_grads(self.params)
        self.dist.all_reduce(flat)
        flat /= self.world
        for p, grad in zip(self.params, split_flat(flat, self.params)):
            p.grad = grad

    def digest(self) -> str:
        """Short hash of the dense parameters (identical on every rank after every step)."""
        data = torch.cat([p.detach().reshape(-1).cpu() for p in self.params]).numpy().tobytes()
        return hashlib.sha1(data).hexdigest()[:16]


def _init_sync(cfg: WorkerConfig, device: torch.device) -> WorkerConfig:
    """Join the torchrun process group (NCCL when every rank has CUDA, else gloo)."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise UsageError(
            "--mode sync: the ranks run under torchrun, which sets RANK and WORLD_SIZE: start them with "
            "'torchrun --nproc-per-node N -m tether.worker --mode sync ...', or use 'tether launch --mode sync'"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=max(cfg.timeout_s * 4, 60)))
    return replace(cfg, worker_index=dist.get_rank(), num_workers=dist.get_world_size())


def _join(ps: PSModel, cfg: WorkerConfig) -> int:
    """SSP start: register, then wait (bounded) until every worker of the job has, so no one
    runs ahead of a worker that has not started yet.

    Returns:
        The clock to start from: 0 in a new job; a worker restarted into a running job starts
        at the slowest other worker's clock rather than holding everyone back at 0.
    """
    deadline = time.monotonic() + cfg.ssp_timeout_s
    while True:
        reply = ps.client.clock(0)
        if reply.live_workers >= cfg.num_workers:
            return reply.min_other_clock
        if time.monotonic() > deadline:
            raise DeadlineExceeded(
                f"only {reply.live_workers} of {cfg.num_workers} workers joined within {cfg.ssp_timeout_s:.0f}s"
            )
        time.sleep(0.05)


def train(cfg: WorkerConfig, metrics: object | None = None, printer: Callable[[str], None] = print) -> dict[str, object]:
    """Run the training loop of one worker and return its record (also written to ``cfg.out``).

    Raises:
        DeadlineExceeded: an ``ssp`` wait ran past ``cfg.ssp_timeout_s``.
        TetherError: a shard call failed after retries.
        UsageError: sync mode outside torchrun, or a bad data file.
    """
    kind, bound = cfg.consistency
    device = pick_device(cfg.device)
    if kind == "sync":
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        cfg = _init_sync(cfg, device)
    ds = open_dataset(cfg)
    model = build_model(cfg, ds)
    ps = connect(cfg, model, device, metrics)
    allreduce = _AllReduce(list(ps.parameters())) if kind == "sync" else None
    dense_opt = local_optimizer(cfg, list(ps.parameters())) if kind == "sync" else None
    name = f"worker {cfg.worker_index}/{cfg.num_workers}"
    printer(f"{name}: mode {cfg.mode}, {len(cfg.shards)} shard(s), device {device}, {cfg.steps} steps x {cfg.batch_size} samples")
    stream = in_background(ds.train_batches(cfg.batch_size, cfg.steps, cfg.worker_index, cfg.num_workers))
    # Prefetching the next batch during compute reads before this step's push lands: fine
    # without a bound, but ssp and sync pull only once the bound (or the barrier) allows.
    # An async step makes one round trip in steady state: its push carries the pull of the
    # batch after next (push_pull, whose answer holds the push's ack), which then has a whole
    # step of compute to come back in. The rows of a step miss one step's update either
    # way (the previous step's), as with a plain prefetch issued before that step's push.
    prefetch = cfg.prefetch and kind == "async"
    history: list[dict[str, object]] = []
    staleness: list[int] = []
    too_stale = 0

    def settle(handle: Handle) -> None:
        """Wait for a push; one a shard rejected as too stale is dropped and counted."""
        nonlocal too_stale
        try:
            staleness.append(handle.result(cfg.wait_s).clock_staleness)
        except TooStale as exc:
            too_stale += 1
            log.info("%s", exc)

    def install(pending: Prefetch) -> PullResult:
        """Wait for a pull; a push_pull whose push was rejected as too stale is counted and
        its pull made again on its own."""
        nonlocal too_stale
        try:
            pulled = ps.install(pending, train=True, timeout=cfg.wait_s)
        except TooStale as exc:
            too_stale += 1
            log.info("%s", exc)
            return ps.install(ps.prefetch(pending.ids), train=True, timeout=cfg.wait_s)
        if pending.ack is not None:
            staleness.append(pending.ack.clock_staleness)
        return pulled

    digests: list[str] = []
    start_clock = _join(ps, cfg) if kind == "ssp" else 0
    batch = next(stream)
    upcoming = next(stream, None) if cfg.steps > 1 else None
    pending = None  # the pull of this step's batch, if already under way
    ahead = None  # the push_pull carrying the next step's pull
    push = None
    phase = {"staleness_wait": 0.0, "pull_wait": 0.0, "compute": 0.0, "push": 0.0}
    window_loss, window_n, samples, eval_time = 0.0, 0, 0, 0.0
    t_start = time.perf_counter()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        if kind == "ssp":
            reply = ps.client.clock(start_clock + step, wait_bound=bound, timeout_s=cfg.ssp_timeout_s)
            if not reply.ready:
                raise DeadlineExceeded(
                    f"{name} waited {cfg.ssp_timeout_s:.0f}s at clock {start_clock + step} for the slowest live worker (clock {reply.min_clock}, bound {bound})"
                )
        tw = time.perf_counter()
        if pending is None:
            pending = ps.prefetch(_sparse(batch))
        pulled = install(pending)
        pending, ahead = ahead, None
        t1 = time.perf_counter()
        after = next(stream, None) if upcoming is not None and step + 2 < cfg.steps else None
        if prefetch and upcoming is not None and pending is None:
            pending = ps.prefetch(_sparse(upcoming))
        logits = model(batch.dense.to(device, non_blocking=True), batch.sparse.to(device, non_blocking=True))
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(device, non_blocking=True))
        loss.backward()
        if allreduce is not None:
            allreduce()
            dense_opt.step()
            dense_opt.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
        if cfg.my_slowdown > 1.0:
            time.sleep((cfg.my_slowdown - 1.0) * (time.perf_counter() - t1))
        t2 = time.perf_counter()
        if push is not None:
            settle(push)
            push = None
        if prefetch and after is not None:
            ahead = ps.push_pull(clock=start_clock + step + 1, versions=pulled, sparse=_sparse(after))
        else:
            push = ps.push(clock=start_clock + step + 1, versions=pulled, sparse_scale=1.0 / cfg.num_workers if kind == "sync" else 1.0)
        if kind != "async":
            # The step's updates must land before this worker's clock (or the barrier) lets
            # anyone read past them.
            settle(push)
            push = None
            if allreduce is not None:
                allreduce.dist.barrier()
                digests.append(allreduce.digest())
        t3 = time.perf_counter()
        samples += batch.labels.numel()
        window_loss += loss_value
        window_n += 1
        durations = {"staleness_wait": tw - t0, "pull_wait": t1 - tw, "compute": t2 - t1, "push": t3 - t2}
        for key, value in durations.items():
            phase[key] += value
        if metrics is not None:
            for key, value in durations.items():
                metrics.observe_phase(key, value)
            metrics.step_seconds.observe(t3 - t0)
            metrics.samples.inc(batch.labels.numel())
            metrics.steps.inc()
            metrics.train_loss.set(loss_value)
            metrics.clock.set(start_clock + step + 1)
            metrics.last_step_timestamp.set(time.time())
        last = step + 1 == cfg.steps
        evaluate = cfg.worker_index == 0 and cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or last)
        if (step + 1) % cfg.log_every == 0 or last or evaluate:
            wall = time.perf_counter() - t_start - eval_time
            record: dict[str, object] = {
                "step": step + 1,
                "samples": samples,
                "wall_s": round(wall, 4),
                "train_loss": round(window_loss / max(window_n, 1), 6),
            }
            if evaluate:
                # Evaluation time is left out of the wall clock so curves compare training.
                te = time.perf_counter()
                record.update(evaluate_remote(ps, ds.eval_set, timeout=cfg.wait_s))
                eval_time += time.perf_counter() - te
            history.append(record)
            busy = sum(phase.values()) or 1.0
            extra = f" eval_loss {record['eval_loss']:.4f} auc {record['eval_auc']:.4f}" if evaluate else ""
            split = " ".join(f"{k} {v / busy:.0%}" for k, v in phase.items() if k != "staleness_wait" or kind == "ssp")
            printer(f"{name} step {step + 1}/{cfg.steps} loss {record['train_loss']:.4f} {samples / max(wall, 1e-9):,.0f} samples/s ({split}){extra}")
            window_loss, window_n = 0.0, 0
        if upcoming is None:
            break
        batch, upcoming = upcoming, after
    if push is not None:
        settle(push)
    wall = time.perf_counter() - t_start - eval_time
    if kind == "ssp":
        ps.client.clock(start_clock + cfg.steps, leave=True)
    result: dict[str, object] = {
        "worker_index": cfg.worker_index,
        "mode": cfg.mode,
        "device": str(device),
        "samples": samples,
        "wall_s": wall,
        "samples_per_sec": samples / wall if wall > 0 else math.nan,
        "phase_seconds": phase,
        "clock_staleness": staleness,
        "rejected_too_stale": too_stale,
        "history": history,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
    }
    if kind == "sync":
        result["dense_digests"] = digests
        result["backend"] = allreduce.dist.get_backend()
        if cfg.worker_index == 0:
            # Dense parameters live on the ranks in sync mode, so rank 0 reports the final model.
            result["final_eval"] = evaluate_remote(ps, ds.eval_set, timeout=cfg.wait_s)
        allreduce.dist.barrier()
        allreduce.dist.destroy_process_group()
    ps.client.close()
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"worker-{cfg.worker_index}.json").write_text(json.dumps(result, indent=2))
    return result


def reference_losses(ds: Dataset) -> dict[str, float]:
    """The constant predictor's held-out loss (and the best possible, for synthetic data)."""
    out = {"baseline_loss": constant_baseline_loss(ds.label_mean, ds.eval_set.labels)}
    if ds.bayes_loss is not None:
        out["bayes_loss"] = ds.bayes_loss
    return out


def evaluate_job(cfg: WorkerConfig) -> dict[str, float]:
    """Evaluate the job's model as the shards hold it now, with the reference losses."""
    device = pick_device(cfg.device)
    ds = open_dataset(cfg)
    ps = connect(cfg, build_model(cfg, ds), device)
    try:
        result = evaluate_remote(ps, ds.eval_set, timeout=cfg.wait_s)
    finally:
        ps.client.close()
    return {**result, **reference_losses(ds)}
