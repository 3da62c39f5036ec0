"""DLRM on Criteo-format click logs, streamed from TSV files (plain or gzipped) or from Parquet,
trained through tether.

The model is tether's DLRM-style ``CTRModel`` built with shard-held embedding bags; the data is
``CriteoStream`` (a glob or list of TSV files, every 10th line held out) or, with ``--parquet``,
``ParquetStream`` (Parquet files as ``tether convert`` or Spark writes them: row groups dealt to
the workers, a seeded shuffle buffer, every 10th row held out, and a position to resume from);
both are the same public pieces a team would use for its own click logs.

    python examples/dlrm_criteo/train.py --generate 3 --lines 20000 --data 'day_*.tsv.gz'  # sample files
    tether launch --script examples/dlrm_criteo/train.py --script-args "--data 'day_*.tsv.gz'" \\
        --num-workers 2 --mode async --steps 100

    python examples/dlrm_criteo/train.py --parquet --generate 3 --lines 20000 --data 'day_*.parquet'
    tether launch --script examples/dlrm_criteo/train.py \\
        --script-args "--parquet --data 'day_*.parquet' --position positions" --num-workers 2 --steps 100
"""

from __future__ import annotations

import argparse
import glob
import gzip
import itertools
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tether import CriteoStream, OptimizerConfig, ShardedEmbeddingBag, TableConfig, Trainer, TrainingConfig, constant_baseline_loss

# The built-in CTR model and its Criteo helpers (internal modules: this example trains tether's own model).
from tether.worker.ctr.job import ctr_loss, ctr_sparse
from tether.worker.ctr.model import CTRModel
from tether.worker.data.criteo import CRITEO_DENSE, CRITEO_SPARSE, criteo_eval_set, write_criteo_sample
from tether.worker.data.synthetic import Batch
from tether.worker.training.evaluation import evaluate

if TYPE_CHECKING:
    from tether import ParquetStream

HOLDOUT = 10
SHUFFLE_ROWS = 65_536


def generate(pattern: str, files: int, lines: int, parquet: bool) -> None:
    """Write ``files`` Criteo-format files of ``lines`` lines each, named after ``pattern`` (its
    ``*`` numbered): one click log, drawn from one hidden model, cut in days; gzipped TSV, or
    Parquet (``--parquet``: each day converted as ``tether convert`` does it)."""
    whole = pattern.replace("*", "all").removesuffix(".gz").removesuffix(".parquet") + ".tmp"
    write_criteo_sample(whole, files * lines, seed=0)
    with open(whole, "rb") as src:
        for i in range(files):
            name = pattern.replace("*", f"{i:02d}")
            day = name + ".tsv" if parquet else name
            with (gzip.open(day, "wb") if day.endswith(".gz") else open(day, "wb")) as dst:
                # 8,192 lines a write: gzip compresses each write on its own (a line a write was 2.6 s of 7 here).
                for first in range(0, lines, 8192):
                    dst.write(b"".join(itertools.islice(src, min(8192, lines - first))))
            if parquet:
                from tether.worker.data.parquet import write_criteo_parquet

                # Row groups of 4,096 rows: a small sample still deals to several workers.
                write_criteo_parquet(day, name, row_group_rows=4096)
                os.remove(day)
    os.remove(whole)


def _epochs(config: TrainingConfig) -> int | None:
    """Passes over the files: as many as the step count takes, one where none is given (the
    trainer then runs until the data ends)."""
    return None if config.steps else 1


def parquet_data(a: argparse.Namespace, config: TrainingConfig) -> tuple[ParquetStream, Batch, float, Path | None]:
    """The training stream, held-out set and click rate from Parquet files, and where this
    worker's position is kept (``--position DIR``: DIR/worker-<i>.json, read to resume and
    written when training ends)."""
    # Imported here: pyarrow is an optional extra (pip install 'tether[parquet]').
    from tether import HoldOut, ParquetStream
    holdout = HoldOut.every_nth(HOLDOUT)
    held_out = next(iter(ParquetStream(a.data, a.eval_samples, ctr=True, holdout=holdout, held_out=True)))
    click_rate = float(next(iter(ParquetStream(a.data, 20_000, ctr=True, holdout=holdout))).labels.mean())
    position = Path(a.position) / f"worker-{config.worker_index}.json" if a.position else None
    resume = json.loads(position.read_text()) if position is not None and position.exists() else None
    train = ParquetStream(a.data, a.batch_size, ctr=True, rank=config.worker_index, world_size=config.num_workers, epochs=_epochs(config),
                          shuffle_rows=SHUFFLE_ROWS, seed=config.seed, holdout=holdout, resume=resume)
    if resume is not None:
        print(
            f"worker {config.worker_index}: resuming at epoch {resume['epoch']}, {resume['file']} row group {resume['row_group']}",
            flush=True,
        )
    return train, held_out, click_rate, position


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="Criteo-format files: a path, a glob or a comma-separated list (Parquet: a folder too)")
    p.add_argument("--parquet", action="store_true",
                   help="--data names Parquet files (label, float dense and integer id columns, as tether convert writes them)")
    p.add_argument("--position", default=None, metavar="DIR",
                   help="with --parquet: resume each worker from DIR/worker-<i>.json when it exists, and write it there when training ends")
    p.add_argument("--generate", type=int, default=0,
                   help="first write this many sample files matching --data (gzipped TSV, or Parquet with --parquet), then exit")
    p.add_argument("--lines", type=int, default=20_000, help="lines per generated file")
    p.add_argument("--batch-size", type=int, default=int(os.environ.get("TETHER_BATCH_SIZE", 256)))
    p.add_argument("--dim", type=int, default=int(os.environ.get("TETHER_EMBEDDING_DIM", 16)))
    p.add_argument("--eval-samples", type=int, default=int(os.environ.get("TETHER_EVAL_SAMPLES", 5000)))
    a = p.parse_args()
    if a.generate:
        generate(a.data, a.generate, a.lines, a.parquet)
        print(f"wrote {', '.join(sorted(glob.glob(a.data)))}")
        return
    if a.position and not a.parquet:
        p.error("--position needs --parquet (the TSV reader has no position to resume from)")
    config = TrainingConfig.from_env()
    position: Path | None = None
    stream: ParquetStream | None = None
    train: Iterable[Batch]
    if a.parquet:
        stream, held_out, click_rate, position = parquet_data(a, config)
        train = stream
    else:
        held_out = criteo_eval_set(a.data, a.eval_samples, holdout_every=HOLDOUT)
        click_rate = float(next(iter(CriteoStream(a.data, 20_000, holdout_every=HOLDOUT))).labels.mean())
        train = CriteoStream(a.data, a.batch_size, rank=config.worker_index, world_size=config.num_workers, epochs=_epochs(config),
                             holdout_every=HOLDOUT)
    torch.manual_seed(config.seed)
    model = CTRModel(CRITEO_DENSE, CRITEO_SPARSE, a.dim, embedding_factory=lambda name, dim: ShardedEmbeddingBag(name, dim))
    opt = OptimizerConfig(config.optimizer, lr=config.lr)
    tables = [TableConfig(t, a.dim, opt, init_scale=config.init_scale, seed=config.seed) for t in model.table_names()]

    def metrics(model: torch.nn.Module, batch) -> dict[str, float]:
        return {**evaluate(model, batch, 4096), "eval_baseline_loss": constant_baseline_loss(click_rate, batch.labels)}

    with Trainer(model, config, loss=ctr_loss, sparse=ctr_sparse, tables=tables) as trainer:
        record = trainer.fit(train, eval_data=[held_out], evaluate=metrics)
    if stream is not None and position is not None:
        # fit read ahead of the steps it trained on: the position after those steps' batches.
        position.parent.mkdir(parents=True, exist_ok=True)
        position.write_text(json.dumps(stream.state_dict(batches=record.steps), indent=1))
        print(f"worker {config.worker_index}: data position after {record.steps} steps written to {position}", flush=True)
    e = record.final_eval
    if e is not None:
        print(
            f"held-out log loss {e['eval_loss']:.4f}, AUC {e['eval_auc']:.4f} (constant click rate: {e['eval_baseline_loss']:.4f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
