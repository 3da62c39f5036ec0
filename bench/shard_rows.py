"""A shard's pulls and pushes of embedding rows in this process (``Shard.pull`` / ``Shard.push``),
rows per second of this thread's CPU time: the shard-side cost of the id index, the row
versions and the update log (issue 28 item 5).

One table of ``--rows`` rows (row-wise Adagrad, ``--dim`` floats) filled first; then ``--rounds``
rounds in which two workers each pull ``--batch`` sorted unique ids (a quarter shared), then
each pushes them back with ``staleness_aware`` (the second push is overtaken by the first, so
its shared rows are counted one by one over the update log). Prints the median rows/s of pulls
and of pushes over the rounds, as one JSON line with ``--json``.

Run it under two trees, alternating, to compare commits, for example
``PYTHONPATH=<dir with a tether/ package of the old tree> python bench/shard_rows.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import SparseUpdate


def run(rows: int, dim: int, batch: int, rounds: int) -> dict[str, float]:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    shard = Shard()
    shard.declare([TableConfig(name="t", dim=dim, optimizer=OptimizerConfig("rowwise_adagrad", lr=0.05))], [])
    ids = np.unique(rng.integers(-(2**62), 2**62, int(rows * 1.01), dtype=np.int64))[:rows]
    rng.shuffle(ids)
    for a in range(0, rows, 1 << 16):
        shard.pull([("t", np.sort(ids[a : a + (1 << 16)]))], [])
    table = shard.tables["t"]
    grads = torch.full((batch, dim), 1e-3)
    pulls, pushes = [], []
    seqs = {"a": 0, "b": 0}
    for _ in range(rounds):
        shared = rng.choice(rows, batch // 4, replace=False)
        wanted = {w: np.unique(np.concatenate([ids[shared], ids[rng.choice(rows, batch - batch // 4, replace=False)]]))
                  for w in seqs}
        reads = {}
        t = 0.0
        for w, q in wanted.items():
            start = time.thread_time()
            (got,), _ = shard.pull([("t", q)], [])
            t += time.thread_time() - start
            reads[w] = got[2]
        pulls.append(sum(len(q) for q in wanted.values()) / max(t, 1e-9))
        t = 0.0
        for w, q in wanted.items():
            seqs[w] += 1
            update = SparseUpdate("t", q, grads[: len(q)], reads[w])
            start = time.thread_time()
            shard.push(w, seqs[w], [update], [], staleness_aware=True, incarnation=1)
            t += time.thread_time() - start
        pushes.append(sum(len(q) for q in wanted.values()) / max(t, 1e-9))
    assert table.rows == rows
    return {"rows": rows, "batch": batch, "pull_rows_per_s": statistics.median(pulls), "push_rows_per_s": statistics.median(pushes)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    r = run(a.rows, a.dim, a.batch, a.rounds)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{a.rows} rows x {a.dim}, batches of {a.batch}: pull {r['pull_rows_per_s'] / 1e6:.2f} M rows/s, "
              f"push {r['push_rows_per_s'] / 1e6:.2f} M rows/s (median of {a.rounds} rounds, CPU time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
