"""The worker's training loop: pull (prefetched) -> forward/backward on device -> push.

Also the held-out evaluation through the shards, used by workers during training and by the
launcher once every worker has finished.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.client import ClientConfig, PSClient
from tether.worker.config import WorkerConfig
from tether.worker.data import Batch, SyntheticClickLog, SyntheticConfig, iterate, load_criteo
from tether.worker.embedding import PSModel, ShardedEmbeddingBag
from tether.worker.evaluation import auc, constant_baseline_loss, log_loss
from tether.worker.model import CTRModel

__all__ = ["Dataset", "build_model", "connect", "evaluate_job", "evaluate_remote", "open_dataset", "pick_device", "train"]

log = logging.getLogger(__name__)

_WIRE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    """``auto`` means CUDA when there is a GPU, else the CPU.

    Raises:
        ValueError: CUDA asked for but not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
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
    """The job's data, identical on every worker (same seed)."""
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
    train_set, eval_set = load_criteo(path, eval_fraction=0.1)

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
    """Declare the model on the shards and bind it to them."""
    client = PSClient(
        ClientConfig(
            addresses=cfg.shards,
            worker_id=f"worker-{cfg.worker_index}",
            timeout_s=cfg.timeout_s,
            wire_dtype=_WIRE[cfg.wire_dtype],
        ),
        metrics,
    )
    opt = OptimizerConfig(name=cfg.optimizer, lr=cfg.lr)
    tables = [TableConfig(name=t, dim=cfg.embedding_dim, optimizer=opt, init_scale=0.05, seed=cfg.seed) for t in model.table_names()]
    ps = PSModel(model.to(device), client, device)
    client.declare(tables, ps.dense_tensors(), opt)
    return ps


def _sparse(batch: Batch) -> dict[str, torch.Tensor]:
    return {f"cat_{j}": batch.sparse[:, j] for j in range(batch.sparse.shape[1])}


def evaluate_remote(ps: PSModel, batch: Batch, batch_size: int = 4096, timeout: float | None = None) -> dict[str, float]:
    """Held-out log loss and AUC of the model with the shards' current parameters."""
    model = ps.model
    was_training = model.training
    model.eval()
    logits = []
    try:
        with torch.no_grad():
            for start in range(0, batch.labels.numel(), batch_size):
                part = Batch(*(t[start : start + batch_size] for t in batch))
                ps.install(ps.prefetch(_sparse(part), with_dense=start == 0), train=False, timeout=timeout)
                logits.append(model(part.dense.to(ps.device), part.sparse.to(ps.device)).float().cpu())
    finally:
        model.train(was_training)
    scores = torch.cat(logits)
    return {"eval_loss": log_loss(scores, batch.labels), "eval_auc": auc(scores, batch.labels)}


def train(cfg: WorkerConfig, metrics: object | None = None, printer: Callable[[str], None] = print) -> dict[str, object]:
    """Run the training loop of one worker and return its record (also written to ``cfg.out``)."""
    device = pick_device(cfg.device)
    ds = open_dataset(cfg)
    model = build_model(cfg, ds)
    ps = connect(cfg, model, device, metrics)
    name = f"worker {cfg.worker_index}/{cfg.num_workers}"
    printer(f"{name}: {len(cfg.shards)} shard(s), device {device}, {cfg.steps} steps x {cfg.batch_size} samples")
    stream = ds.train_batches(cfg.batch_size, cfg.steps, cfg.worker_index, cfg.num_workers)
    history: list[dict[str, object]] = []
    batch = next(stream)
    pending = ps.prefetch(_sparse(batch))
    push = None
    phase = {"pull_wait": 0.0, "compute": 0.0, "push": 0.0}
    window_loss, window_n, samples = 0.0, 0, 0
    t_start = time.perf_counter()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        pulled = ps.install(pending, train=True, timeout=cfg.timeout_s * 4)
        t1 = time.perf_counter()
        upcoming = next(stream, None) if step + 1 < cfg.steps else None
        if cfg.prefetch and upcoming is not None:
            pending = ps.prefetch(_sparse(upcoming))
        logits = model(batch.dense.to(device, non_blocking=True), batch.sparse.to(device, non_blocking=True))
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(device, non_blocking=True))
        loss.backward()
        loss_value = float(loss.detach())
        t2 = time.perf_counter()
        if push is not None:
            push.result(cfg.timeout_s * 4)  # at most one push in flight
        push = ps.push(clock=step + 1, versions=pulled)
        if not cfg.prefetch:
            push.result(cfg.timeout_s * 4)
            if upcoming is not None:
                pending = ps.prefetch(_sparse(upcoming))
        t3 = time.perf_counter()
        samples += batch.labels.numel()
        window_loss += loss_value
        window_n += 1
        phase["pull_wait"] += t1 - t0
        phase["compute"] += t2 - t1
        phase["push"] += t3 - t2
        if metrics is not None:
            metrics.phase_seconds.labels(phase="pull_wait").observe(t1 - t0)
            metrics.phase_seconds.labels(phase="compute").observe(t2 - t1)
            metrics.phase_seconds.labels(phase="push").observe(t3 - t2)
            metrics.step_seconds.observe(t3 - t0)
            metrics.samples.inc(batch.labels.numel())
            metrics.steps.inc()
            metrics.train_loss.set(loss_value)
            metrics.clock.set(step + 1)
            metrics.last_step_timestamp.set(time.time())
        last = step + 1 == cfg.steps
        evaluate = cfg.worker_index == 0 and cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or last)
        if (step + 1) % cfg.log_every == 0 or last or evaluate:
            wall = time.perf_counter() - t_start
            record: dict[str, object] = {
                "step": step + 1,
                "samples": samples,
                "wall_s": round(wall, 4),
                "train_loss": round(window_loss / max(window_n, 1), 6),
            }
            if evaluate:
                push.result(cfg.timeout_s * 4)
                record.update(evaluate_remote(ps, ds.eval_set, timeout=cfg.timeout_s * 4))
            history.append(record)
            busy = sum(phase.values()) or 1.0
            extra = f" eval_loss {record['eval_loss']:.4f} auc {record['eval_auc']:.4f}" if evaluate else ""
            printer(
                f"{name} step {step + 1}/{cfg.steps} loss {record['train_loss']:.4f} {samples / wall:,.0f} samples/s"
                f" (pull {phase['pull_wait'] / busy:.0%} compute {phase['compute'] / busy:.0%} push {phase['push'] / busy:.0%}){extra}"
            )
            window_loss, window_n = 0.0, 0
        if upcoming is None:
            break
        batch = upcoming
    if push is not None:
        push.result(cfg.timeout_s * 4)
    wall = time.perf_counter() - t_start
    result: dict[str, object] = {
        "worker_index": cfg.worker_index,
        "samples": samples,
        "wall_s": wall,
        "samples_per_sec": samples / wall if wall > 0 else math.nan,
        "phase_seconds": phase,
        "history": history,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
    }
    ps.client.close()
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"worker-{cfg.worker_index}.json").write_text(json.dumps(result, indent=2))
    return result


def evaluate_job(cfg: WorkerConfig) -> dict[str, float]:
    """Evaluate the job's model as the shards hold it now, with the reference losses."""
    device = pick_device(cfg.device)
    ds = open_dataset(cfg)
    ps = connect(cfg, build_model(cfg, ds), device)
    try:
        result = evaluate_remote(ps, ds.eval_set, timeout=cfg.timeout_s * 4)
    finally:
        ps.client.close()
    result["baseline_loss"] = constant_baseline_loss(ds.label_mean, ds.eval_set.labels)
    if ds.bayes_loss is not None:
        result["bayes_loss"] = ds.bayes_loss
    return result
