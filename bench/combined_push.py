"""A shard's CPU per row of a row cache's combined push against a plain push (issue 41 item 3),
side by side: ``Shard.push`` in this process, thread CPU time.

W simulated async workers take turns on one shard holding CTR-sized tables (``--tables`` tables
of dim 16, Adagrad, ids Zipf-distributed over ``--vocab``). Each round every worker pushes
``--rows`` rows a table:

* **plain**: each row one gradient, read when the worker last pulled (the W - 1 pushes of the
  round before it overtook it), as a worker without the cache pushes;
* **combined**: each row the sum of ``--held`` gradients with its statistics (Adagrad's sum of
  mean(g * g)), its read version the oldest of them, ``--held`` rounds back (W x held pushes
  overtook it), as the row cache at write bound ``--held`` pushes; with ``--single F``, a fraction F
  of its rows (spread through the push) hold one gradient (statistic -1), as the cache's push mixes
  the rows it holds with the rows it does not admit; with ``--due``, each worker pushes only the
  rows of its batch ``--held`` rounds back that it has not pushed since (a row comes due once per
  ``--held`` rounds, as the cache pushes it at its write bound), so a push's rows are far less
  stale than its table's updates since its read and the shard counts every table's rows, as it
  does in a cached job (without it one table's count bounds the rest).

Neither ``--staleness-aware`` nor a hard limit is set: the shard needs only each push's largest
staleness (metric, ack). Prints thread CPU microseconds per row of each kind (median over rounds
after the first tenth) and their ratio (the issue's target: at most 1.0), then per push, a
worker step's push to the shard: with ``--due`` a combined push carries fewer rows than a plain
one (those come due), so per push is what the cache costs the shard a step against no cache.

    python bench/combined_push.py [--workers 4] [--tables 8] [--rows 80] [--held 20] [--rounds 200] [--single 0.5] [--due]
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
from tether.server.storage.shard_records import SparseUpdate


def _zipf_ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """``n`` distinct sorted ids, Zipf(1.1)-distributed over ``[0, vocab)``."""
    out: set[int] = set()
    while len(out) < n:
        out.update(int(x) % vocab for x in rng.zipf(1.1, 2 * n))
    return np.array(sorted(out)[:n], np.int64)


def run(combined: bool, workers: int, tables: int, rows: int, held: int, rounds: int, vocab: int, seed: int = 0,
        single: float = 0.0, due: bool = False) -> tuple[float, float]:
    """CPU microseconds of ``Shard.push`` per row and per push (medians over rounds of the round's means)."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    shard = Shard()
    opt = OptimizerConfig("adagrad", lr=0.05)
    names = [f"t{k}" for k in range(tables)]
    shard.declare([TableConfig(name=t, dim=16, optimizer=opt) for t in names], [])
    grads = torch.full((rows, 16), 1e-3)
    stats = torch.full((rows, 1), float(held) * 1e-6)
    stats[torch.from_numpy(np.random.default_rng(seed + 1).random(rows) < single), 0] = -1.0  # rows of one gradient
    versions: list[dict[str, int]] = []  # per round: each table's version at the round's start
    history: list[list[dict[str, np.ndarray]]] = []  # per round: each worker's batch
    pushed: list[dict[str, dict[int, int]]] = [{t: {} for t in names} for _ in range(workers)]  # --due: id -> round last pushed
    per_round, per_push = [], []
    seq = 0
    for r in range(rounds):
        batches = [{t: _zipf_ids(rng, rows, vocab) for t in names} for _ in range(workers)]
        for b in batches:  # rows exist (a pull admits them), as in a job
            shard.pull([(t, ids) for t, ids in b.items()], [])
        history.append(batches)
        versions.append({t: shard.tables[t].version for t in names})
        read = versions[max(0, r - held)] if combined else versions[-1]
        spent, moved = 0.0, 0
        for w, b in enumerate(batches):
            if combined and due:
                b = _due_rows(history[r - held][w], pushed[w], r, held) if r >= held else {}
            seq += 1
            updates = [SparseUpdate(t, ids, grads[: ids.size], read[t], combined=stats[: ids.size] if combined else None)
                       for t, ids in b.items() if ids.size]
            t0 = time.thread_time()
            shard.push(f"w{w}", seq, updates, [], incarnation=1)
            spent += time.thread_time() - t0
            moved += sum(ids.size for ids in b.values())
        per_round.append(spent / max(moved, 1) * 1e6)
        per_push.append(spent / workers * 1e6)
    first = max(rounds // 10, held)
    return statistics.median(per_round[first:]), statistics.median(per_push[first:])


def _due(ids: np.ndarray, last: dict[int, int], r: int, held: int) -> np.ndarray:
    """Of a batch's ``ids`` from ``held`` rounds back, those not pushed since (noted as pushed at ``r``)."""
    out = np.array([x for x in ids.tolist() if last.get(x, -held - 1) <= r - held], np.int64)
    for x in out.tolist():
        last[x] = r
    return out


def _due_rows(batch: dict[str, np.ndarray], pushed: dict[str, dict[int, int]], r: int, held: int) -> dict[str, np.ndarray]:
    """``--due``: per table, the rows a worker's cache pushes at round ``r`` (``_due``)."""
    return {t: _due(ids, pushed[t], r, held) for t, ids in batch.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=80, help="rows a table in each push (default 80: CTR's, one of 2 shards)")
    p.add_argument("--held", type=int, default=20, help="gradients summed in a combined row, rounds its read is old (default 20)")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--vocab", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=3, help="alternating plain and combined runs (default 3)")
    p.add_argument("--single", type=float, default=0.0, help="fraction of a combined push's rows holding one gradient (default 0)")
    p.add_argument("--due", action="store_true", help="combined pushes carry only the rows that come due (once per --held rounds)")
    a = p.parse_args()
    if not 0.0 <= a.single <= 1.0:
        p.error(f"--single must be a fraction from 0 to 1, got {a.single}")
    plain, comb = [], []
    for _ in range(a.repeats):
        plain.append(run(False, a.workers, a.tables, a.rows, a.held, a.rounds, a.vocab))
        comb.append(run(True, a.workers, a.tables, a.rows, a.held, a.rounds, a.vocab, single=a.single, due=a.due))
    print(f"{a.workers} workers, {a.tables} tables x {a.rows} rows a push, combined rows of {a.held} gradients read {a.held} rounds back "
          f"({a.single:.0%} of them one gradient{'; only the rows due' if a.due else ''}); "
          f"thread CPU us, median of {a.repeats} alternating runs")
    for k, (what, digits) in enumerate((("per row", 3), ("per push", 1))):
        p_us, c_us = statistics.median(x[k] for x in plain), statistics.median(x[k] for x in comb)
        print(f"{what}: plain {p_us:.{digits}f} ({', '.join(f'{x[k]:.{digits}f}' for x in plain)}); "
              f"combined {c_us:.{digits}f} ({', '.join(f'{x[k]:.{digits}f}' for x in comb)}); combined / plain {c_us / p_us:.2f}x")


if __name__ == "__main__":
    main()
