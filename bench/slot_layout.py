"""What the row cache's per-slot layout costs its passes (issue 41 item 3): a pass like
``hold_all``'s over one CTR step's cached rows, with the CPU's caches cold as a training step
leaves them, in three layouts side by side in one process.

The worker row cache keeps a slot's floats in separate per-kind arrays (``worker/cache/slots.py``:
the values, the held sum with its two statistics, the local changes held and lacked by a refresh,
and the local rule's state), so one id touches a line or two in each, scattered over memory. The
passes are memory-bound (bench/RESULTS.md, "Row cache CPU"): what a layout saves is lines fetched
from memory. Layouts:

* ``per kind`` (today's): values, held sums, mine, fresh and the rule's state, five arrays;
* ``held record``: held sums, mine and fresh side by side in one record per slot (values and the
  rule's state apart: the rule kernels the shard shares take a values array and a state array);
* ``one record``: all five side by side.

Each pass adds a step's gradients to the held sums (with the mean square and count), takes an
Adagrad step on the values and state, and adds the change to mine and fresh, for ``--ids`` sorted
random slots of ``--slots`` in each of ``--tables`` tables (dim ``--dim``), after writing 64 MiB
(what the model's compute does to the caches between a step's passes). Arrays in huge pages, as
the cache's (``common/pages.py``). Prints each layout's median time a step and its ratio to today's.

    python bench/slot_layout.py [--tables 8] [--ids 150] [--dim 16] [--slots 100000] [--rounds 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from tether.common import pages


@numba.njit(cache=True)
def _per_kind(vals: np.ndarray, pend: np.ndarray, mine: np.ndarray, fresh: np.ndarray, state: np.ndarray, slots: np.ndarray,
              g: np.ndarray, lr: np.float32) -> None:
    dim = vals.shape[1]
    for i in range(len(slots)):
        s = slots[i]
        sq = np.float32(0.0)
        for j in range(dim):
            x = g[i, j]
            pend[s, j] += x
            sq += x * x
            state[s, j] += x * x
            d = -lr * x / np.sqrt(state[s, j] + np.float32(1e-10))
            vals[s, j] += d
            mine[s, j] += d
            fresh[s, j] += d
        pend[s, dim] += sq / dim
        pend[s, dim + 1] += np.float32(1.0)


@numba.njit(cache=True)
def _held_record(vals: np.ndarray, held: np.ndarray, state: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.float32) -> None:
    dim = vals.shape[1]
    m, f = dim + 2, 2 * dim + 2
    for i in range(len(slots)):
        s = slots[i]
        sq = np.float32(0.0)
        for j in range(dim):
            x = g[i, j]
            held[s, j] += x
            sq += x * x
            state[s, j] += x * x
            d = -lr * x / np.sqrt(state[s, j] + np.float32(1e-10))
            vals[s, j] += d
            held[s, m + j] += d
            held[s, f + j] += d
        held[s, dim] += sq / dim
        held[s, dim + 1] += np.float32(1.0)


@numba.njit(cache=True)
def _one_record(rec: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.float32) -> None:
    dim = g.shape[1]
    p, m, f, st = dim, 2 * dim + 2, 3 * dim + 2, 4 * dim + 2
    for i in range(len(slots)):
        s = slots[i]
        sq = np.float32(0.0)
        for j in range(dim):
            x = g[i, j]
            rec[s, p + j] += x
            sq += x * x
            rec[s, st + j] += x * x
            d = -lr * x / np.sqrt(rec[s, st + j] + np.float32(1e-10))
            rec[s, j] += d
            rec[s, m + j] += d
            rec[s, f + j] += d
        rec[s, p + dim] += sq / dim
        rec[s, p + dim + 1] += np.float32(1.0)


def _filled(shape: tuple[int, ...]) -> np.ndarray:
    a = pages.empty(shape, np.float32)
    a[:] = 0.5  # every page touched before the clock
    return a


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--ids", type=int, default=150, help="ids a table and step (the default CTR step: ~150)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--slots", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=60)
    a = p.parse_args(argv)
    if min(a.tables, a.ids, a.dim, a.rounds) < 1 or a.slots < a.ids:
        p.error("--tables, --ids, --dim, --rounds >= 1 and --slots >= --ids")
    n, d = a.slots, a.dim
    kinds = [[_filled((n, d)), _filled((n, d + 2)), _filled((n, d)), _filled((n, d)), _filled((n, d))] for _ in range(a.tables)]
    held = [(_filled((n, d)), _filled((n, 3 * d + 2)), _filled((n, d))) for _ in range(a.tables)]
    one = [_filled((n, 5 * d + 2)) for _ in range(a.tables)]
    junk = np.ones(16 << 20, np.float32)  # 64 MiB
    rng = np.random.default_rng(0)
    lr = np.float32(0.01)
    layouts = ("per kind", "held record", "one record")
    times: dict[str, list[float]] = {k: [] for k in layouts}

    def run(layout: str, slots: list[np.ndarray], g: np.ndarray) -> None:
        for t in range(a.tables):
            if layout == "per kind":
                v, pe, mi, fr, st = kinds[t]
                _per_kind(v, pe, mi, fr, st, slots[t], g, lr)
            elif layout == "held record":
                _held_record(held[t][0], held[t][1], held[t][2], slots[t], g, lr)
            else:
                _one_record(one[t], slots[t], g, lr)

    for r in range(a.rounds + 1):
        slots = [np.sort(rng.choice(n, a.ids, replace=False)).astype(np.int64) for _ in range(a.tables)]
        g = rng.standard_normal((a.ids, d)).astype(np.float32) * np.float32(0.01)
        for layout in layouts if r % 2 == 0 else tuple(reversed(layouts)):
            junk += 1.0  # the caches cold, as a training step's compute leaves them
            t0 = time.perf_counter()
            run(layout, slots, g)
            if r:  # the first round compiles
                times[layout].append(time.perf_counter() - t0)
    base = statistics.median(times["per kind"])
    print(f"{a.tables} tables x {a.ids} ids a step, dim {d}, {n:,} slots a table, caches cold; median of {a.rounds} rounds")
    for layout in layouts:
        m = statistics.median(times[layout])
        print(f"{layout:12s} {1e3 * m:7.3f} ms a step   {base / m:.2f}x today's speed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
