"""The cost of a shard's push with overtaking workers (issue 17): ``Shard.push`` in this process.

W simulated async workers take turns on one shard that holds one embedding table (Adagrad,
dim 16) and one dense chunk: in each round every worker reads (pull), then all push, so the
k-th push of a round was overtaken by the k-1 before it, as in a Hogwild job. Each push names
``--ids`` unique ids, a quarter of them shared by every worker, so rows are stale too. Only
``Shard.push`` is timed, in CPU time of this thread; neither ``--staleness-aware`` nor a hard
limit is set, the case where the shard needs only a push's largest staleness (metric, ack).

Run it under two trees, alternating, to compare commits, for example
``PYTHONPATH=<dir with a tether/ package of the old tree> python bench/staleness_push.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import DenseDecl, DenseUpdate, SparseUpdate


def run(workers: int, ids: int, dense: int, rounds: int, vocab: int, seed: int = 0) -> tuple[float, float]:
    """CPU microseconds per push (this thread's time, which a loaded machine disturbs less than
    wall time; median over rounds of the mean push in a round), and the CPU microseconds of the
    per-row count (``EmbeddingTable.staleness``) that a push paid before it was skipped."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    shard = Shard()
    opt = OptimizerConfig("adagrad", lr=0.05)
    shard.declare([TableConfig(name="t", dim=16, optimizer=opt)], [DenseDecl("d", 0, torch.zeros(dense), opt)])
    hot = rng.choice(vocab, ids // 4, replace=False)  # shared by every worker
    table = shard.tables["t"]
    grads = torch.full((ids, 16), 1e-3)
    dgrad = torch.full((dense,), 1e-3)
    per_round, per_row = [], []
    seq = 0
    for _ in range(rounds):
        reads = []
        for _w in range(workers):
            own = rng.permutation(np.setdiff1d(rng.integers(0, vocab, 2 * ids), hot))[: ids - hot.size]
            batch = np.concatenate([hot, own])
            rows, values = shard.pull([("t", batch)], [("d", 0)])
            reads.append((batch, rows[0][2], values[0][1]))
        push_s = count_s = 0.0
        for w, (batch, tv, dv) in enumerate(reads):
            seq += 1
            t0 = time.thread_time()
            table.staleness(batch, tv)  # what every push counted before (not part of the push now)
            t1 = time.thread_time()
            shard.push(
                f"w{w}", seq, [SparseUpdate("t", batch, grads[: batch.size], tv)], [DenseUpdate("d", 0, dgrad, dv)], incarnation=1
            )
            push_s += time.thread_time() - t1
            count_s += t1 - t0
        per_round.append(push_s / workers * 1e6)
        per_row.append(count_s / workers * 1e6)
    return statistics.median(per_round[rounds // 10 :]), statistics.median(per_row[rounds // 10 :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--ids", type=int, default=4096)
    p.add_argument("--dense", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--vocab", type=int, default=1 << 18, help="ids are drawn from [0, vocab)")
    a = p.parse_args()
    push_us, rows_us = run(a.workers, a.ids, a.dense, a.rounds, a.vocab)
    print(f"{push_us:.1f} us per push, of which the per-row count would be {rows_us:.1f} us ({a.workers} workers, {a.ids} ids, dense {a.dense})")


if __name__ == "__main__":
    main()
