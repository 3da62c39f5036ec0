"""The built-in CTR job: the synthetic click log, Criteo files or a Criteo-shaped Parquet table, the DLRM-style model, and
its training through the public API (``tether.worker.training.trainer.Trainer``), as ``tether worker``
runs it.

Also the held-out evaluation through the shards, used by the launcher once every worker has
finished.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tether.protos.errors import UsageError
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.config import WorkerConfig
from tether.worker.ctr.model import CTRModel
from tether.worker.data.criteo import CRITEO_DENSE, CRITEO_SPARSE, CriteoStream, criteo_eval_set, criteo_files
from tether.worker.data.positions import read_position
from tether.worker.data.synthetic import Batch, SyntheticClickLog, SyntheticConfig, SyntheticStream
from tether.worker.metrics import WorkerRecorder
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.evaluation import constant_baseline_loss, evaluate
from tether.worker.training.run_record import RunRecord
from tether.worker.training.trainer import Trainer, print_line

__all__ = [
    "Dataset",
    "build_model",
    "ctr_loss",
    "ctr_sparse",
    "ctr_trainer",
    "evaluate_job",
    "open_dataset",
    "reference_losses",
    "train",
]

log = logging.getLogger(__name__)

# Criteo files: line i is held out when i % CRITEO_HOLDOUT == CRITEO_HOLDOUT - 1 (Parquet
# tables: row i, rows numbered across the files in order).
CRITEO_HOLDOUT = 10
# Parquet tables: rows in each worker's shuffle buffer (~17 MiB of a Criteo-shaped table).
PARQUET_SHUFFLE_ROWS = 65_536


@dataclass
class Dataset:
    """Training stream, held-out set and reference losses of one job."""

    num_dense: int
    num_sparse: int
    # (batch_size, batches, rank, world_size) -> the batches of that worker.
    train_batches: Callable[[int, int, int, int], Iterable[Batch]]
    eval_set: Batch
    label_mean: float
    bayes_loss: float | None


def open_dataset(cfg: WorkerConfig) -> Dataset:
    """The job's data, identical on every worker (same seed).

    Raises:
        UsageError: the Criteo or Parquet files cannot be read, have a malformed line, a missing
            column or one of the wrong type (``DataError``).
    """
    if cfg.data.startswith("parquet:"):
        return _parquet_dataset(cfg)
    if cfg.data == "synthetic":
        gen = SyntheticClickLog(SyntheticConfig(num_sparse=cfg.num_sparse, vocab_size=cfg.vocab_size, seed=cfg.seed))
        eval_set = gen.eval_set(max(cfg.eval_samples, 1))
        # The constant predictor learns its rate from training data, not from the eval set.
        sample = next(gen.batches(min(20_000, cfg.batch_size * cfg.steps), 1, rank=0, world_size=1))
        return Dataset(
            num_dense=gen.config.num_dense,
            num_sparse=gen.config.num_sparse,
            # A stream with a position (state_dict), so a restarted worker reads on from where it stopped (--resume-data).
            train_batches=lambda bs, n, rank, world: SyntheticStream(gen, bs, n, rank=rank, world_size=world, order=cfg.data_seed,
                                                                     resume=_resume_position(cfg, rank)),
            eval_set=eval_set,
            label_mean=float(sample.labels.mean()),
            bayes_loss=gen.bayes_log_loss(eval_set),
        )
    # Criteo files stream: every 10th line (i % 10 == 9) is held out and never trained on,
    # the rest is dealt to the workers line by line, so memory does not grow with the data.
    files = criteo_files(cfg.data)
    # The constant predictor learns its rate from training lines, not from the held-out ones.
    # (Read first: the file's first lines are training lines, so a malformed one is named.)
    label_mean = float(next(iter(CriteoStream(files, 20_000, holdout_every=CRITEO_HOLDOUT))).labels.mean())
    eval_set = criteo_eval_set(files, max(cfg.eval_samples, 1), holdout_every=CRITEO_HOLDOUT)

    def batches(bs: int, n: int, rank: int, world: int) -> Iterator[Batch]:
        stream = CriteoStream(files, bs, rank=rank, world_size=world, epochs=None, holdout_every=CRITEO_HOLDOUT)
        return itertools.islice(stream, n)

    return Dataset(
        num_dense=CRITEO_DENSE,
        num_sparse=CRITEO_SPARSE,
        train_batches=batches,
        eval_set=eval_set,
        label_mean=label_mean,
        bayes_loss=None,
    )


def _parquet_dataset(cfg: WorkerConfig) -> Dataset:
    """A Criteo-shaped Parquet table (``--data parquet:GLOB``): ``label``, float columns as dense
    features and integer or string columns as ids (``criteo_parquet_columns``); row ``i``
    (numbered across the files) held out when ``i % 10 == 9``, as the Criteo reader holds out
    lines; row groups dealt to the workers, each shuffling its share in a buffer of
    ``PARQUET_SHUFFLE_ROWS`` rows seeded by ``seed`` and ``data_seed``.

    Raises:
        DataError: see ``ParquetStream``.
    """
    # Optional dependency: pyarrow (tether[parquet]), only for a Parquet source.
    from tether.worker.data.parquet import HoldOut, ParquetStream, criteo_parquet_columns, parquet_files

    files = parquet_files(cfg.data)
    dense, ids = criteo_parquet_columns(files)
    holdout = HoldOut.every_nth(CRITEO_HOLDOUT)
    columns: dict[str, Any] = {"dense": dense, "ids": ids, "ctr": True, "holdout": holdout}
    # The constant predictor learns its rate from training rows, not from the held-out ones.
    label_mean = float(next(iter(ParquetStream(files, 20_000, **columns))).labels.mean())
    eval_set = next(iter(ParquetStream(files, max(cfg.eval_samples, 1), held_out=True, **columns)))

    def batches(bs: int, n: int, rank: int, world: int) -> Iterable[Batch]:
        # The stream itself, not an islice of it: Trainer.fit finds its position (state_dict) there.
        return ParquetStream(files, bs, rank=rank, world_size=world, epochs=None, shuffle_rows=PARQUET_SHUFFLE_ROWS,
                             seed=cfg.seed * 1_000_003 + cfg.data_seed, max_batches=n, resume=_resume_position(cfg, rank), **columns)

    return Dataset(
        num_dense=len(dense),
        num_sparse=len(ids),
        train_batches=batches,
        eval_set=eval_set,
        label_mean=label_mean,
        bayes_loss=None,
    )


def _resume_position(cfg: WorkerConfig, rank: int) -> dict[str, Any] | None:
    """Worker ``rank``'s stream position in ``cfg.resume_data`` (``worker-<rank>.json``: what
    ``Trainer.fit`` writes, ``{"step": n, "position": {...}}``, or a position alone), or None
    without ``--resume-data``.

    Raises:
        UsageError: the file is missing or is not such JSON.
    """
    if cfg.resume_data is None:
        return None
    path = Path(cfg.resume_data) / f"worker-{rank}.json"
    try:
        return read_position(path)["position"]
    except OSError as exc:
        raise UsageError(f"--resume-data {cfg.resume_data}: cannot read worker {rank}'s position {path}: {exc}") from None
    except ValueError as exc:
        raise UsageError(f"--resume-data {cfg.resume_data}: {path}: {exc}") from None


def build_model(cfg: WorkerConfig, ds: Dataset) -> CTRModel:
    """The CTR model with embedding bags on the shards (same init on every worker)."""
    torch.manual_seed(cfg.seed)
    return CTRModel(
        num_dense=ds.num_dense,
        num_sparse=ds.num_sparse,
        embedding_dim=cfg.embedding_dim,
        embedding_factory=lambda name, dim: ShardedEmbeddingBag(name, dim),
    )


def ctr_sparse(batch: Batch) -> dict[str, torch.Tensor]:
    """The ids a CTR batch looks up: column ``j`` of ``batch.sparse`` in table ``cat_j``."""
    return {f"cat_{j}": batch.sparse[:, j] for j in range(batch.sparse.shape[1])}


def ctr_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Binary cross-entropy of the click logits."""
    return F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)


def _ctr_metrics(model: nn.Module, batch: Batch) -> dict[str, float]:
    return evaluate(model, batch, 4096)


def ctr_trainer(
    cfg: WorkerConfig, ds: Dataset, metrics: WorkerRecorder | None = None, printer: Callable[[str], None] = print_line
) -> Trainer[Batch]:
    """A ``Trainer`` of the CTR model on the shards of ``cfg`` (rows init ``init_scale``, seeded)."""
    model = build_model(cfg, ds)
    opt = OptimizerConfig(name=cfg.optimizer, lr=cfg.lr)
    tables = [
        TableConfig(name=t, dim=cfg.embedding_dim, optimizer=opt, init_scale=cfg.init_scale, seed=cfg.seed) for t in model.table_names()
    ]
    return Trainer(model, cfg, loss=ctr_loss, sparse=ctr_sparse, tables=tables, metrics=metrics, printer=printer)


def train(cfg: WorkerConfig, metrics: WorkerRecorder | None = None, printer: Callable[[str], None] = print_line) -> RunRecord:
    """Run one worker of the CTR job and return its record (also written to ``cfg.out``).

    Raises:
        DeadlineExceeded: not every worker joined within ``cfg.wait_timeout_s`` (the start-up
            join, every mode), or an ``ssp`` wait on the bound ran past it.
        TetherError: a shard call failed after retries.
        UsageError: sync mode outside torchrun, or a bad data file.
    """
    ds = open_dataset(cfg)
    with ctr_trainer(cfg, ds, metrics, printer) as trainer:
        rank = trainer.config  # in sync mode the rank and world size come from torchrun
        data = ds.train_batches(cfg.batch_size, cfg.steps, rank.worker_index, rank.num_workers)
        return trainer.fit(data, eval_data=[ds.eval_set], evaluate=_ctr_metrics)


def reference_losses(ds: Dataset) -> dict[str, float]:
    """The constant predictor's held-out loss (and the best possible, for synthetic data)."""
    out = {"baseline_loss": constant_baseline_loss(ds.label_mean, ds.eval_set.labels)}
    if ds.bayes_loss is not None:
        out["bayes_loss"] = ds.bayes_loss
    return out


def evaluate_job(cfg: WorkerConfig) -> dict[str, float]:
    """Evaluate the job's model as the shards hold it now, with the reference losses."""
    ds = open_dataset(cfg)
    # No TensorBoard writer: the workers wrote the curves; this is one evaluation.
    with ctr_trainer(replace(cfg, tensorboard=None), ds, printer=lambda line: None) as trainer:
        result = trainer.evaluate([ds.eval_set], _ctr_metrics)
    return {**result, **reference_losses(ds)}
