"""DLRM on Criteo-format click logs, streamed from plain or gzipped files, trained through tether.

The model is tether's DLRM-style ``CTRModel`` built with shard-held embedding bags; the data is
``CriteoStream`` (a glob or list of files, every 10th line held out); both are the same public
pieces a team would use for its own click logs.

    python examples/dlrm_criteo/train.py --generate 3 --lines 20000 --data 'day_*.tsv.gz'  # sample files
    tether launch --script examples/dlrm_criteo/train.py --script-args "--data 'day_*.tsv.gz'" \
        --num-workers 2 --mode async --steps 100
"""

from __future__ import annotations

import argparse
import glob
import gzip
import os

import torch

from tether.protos.allocator import tune_malloc
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.criteo import CRITEO_DENSE, CRITEO_SPARSE, CriteoStream, criteo_eval_set, write_criteo_sample
from tether.worker.embedding import ShardedEmbeddingBag
from tether.worker.evaluation import constant_baseline_loss, evaluate
from tether.worker.model import CTRModel
from tether.worker.training import Trainer, TrainingConfig
from tether.worker.trainer import ctr_loss, ctr_sparse

HOLDOUT = 10


def generate(pattern: str, files: int, lines: int) -> None:
    """Write ``files`` gzipped Criteo-format files of ``lines`` lines each, named after
    ``pattern`` (its ``*`` numbered): one click log, drawn from one hidden model, cut in days."""
    whole = pattern.replace("*", "all").removesuffix(".gz") + ".tmp"
    write_criteo_sample(whole, files * lines, seed=0)
    with open(whole, "rb") as src:
        for i in range(files):
            name = pattern.replace("*", f"{i:02d}")
            with (gzip.open(name, "wb") if name.endswith(".gz") else open(name, "wb")) as dst:
                for _ in range(lines):
                    dst.write(src.readline())
    os.remove(whole)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="Criteo-format files: a path, a glob or a comma-separated list")
    p.add_argument("--generate", type=int, default=0, help="first write this many gzipped sample files matching --data, then exit")
    p.add_argument("--lines", type=int, default=20_000, help="lines per generated file")
    p.add_argument("--batch-size", type=int, default=int(os.environ.get("TETHER_BATCH_SIZE", 256)))
    p.add_argument("--dim", type=int, default=int(os.environ.get("TETHER_EMBEDDING_DIM", 16)))
    p.add_argument("--eval-samples", type=int, default=int(os.environ.get("TETHER_EVAL_SAMPLES", 5000)))
    a = p.parse_args()
    if a.generate:
        generate(a.data, a.generate, a.lines)
        print(f"wrote {', '.join(sorted(glob.glob(a.data)))}")
        return
    tune_malloc()  # a worker process: keep each step's MiB-sized tensors in the heap
    config = TrainingConfig.from_env()
    held_out = criteo_eval_set(a.data, a.eval_samples, holdout_every=HOLDOUT)
    click_rate = float(next(iter(CriteoStream(a.data, 20_000, holdout_every=HOLDOUT))).labels.mean())
    torch.manual_seed(config.seed)
    model = CTRModel(CRITEO_DENSE, CRITEO_SPARSE, a.dim, embedding_factory=lambda name, dim: ShardedEmbeddingBag(name, dim))
    opt = OptimizerConfig(config.optimizer, lr=config.lr)
    tables = [TableConfig(t, a.dim, opt, init_scale=config.init_scale, seed=config.seed) for t in model.table_names()]
    train = CriteoStream(a.data, a.batch_size, rank=config.worker_index, world_size=config.num_workers, epochs=None, holdout_every=HOLDOUT)

    def metrics(model: torch.nn.Module, batch) -> dict[str, float]:
        return {**evaluate(model, batch, 4096), "eval_baseline_loss": constant_baseline_loss(click_rate, batch.labels)}

    with Trainer(model, config, loss=ctr_loss, sparse=ctr_sparse, tables=tables) as trainer:
        record = trainer.fit(train, eval_data=[held_out], evaluate=metrics)
    if "final_eval" in record:
        e = record["final_eval"]
        print(f"held-out log loss {e['eval_loss']:.4f}, AUC {e['eval_auc']:.4f} (constant click rate: {e['eval_baseline_loss']:.4f})", flush=True)


if __name__ == "__main__":
    main()
