"""The shard's id index: lookups/s and bytes per row of ``tether.server.storage.index.IdIndex`` beside
the index it replaced (issue 28 item 5), side by side in one process.

- old: (key, slot) int64 pairs in one ``[n, 2]`` array, a power of two at a load factor of at
  most 1/3 (``index_kernels.index_place`` / ``index_lookup``, which the worker's row cache still uses):
  64 MiB for a million rows;
- new: ``IdIndex``: the ids by slot (int64) and int32 cells holding a slot and a fingerprint, at a
  load factor of 0.6-0.7.

Both hold the same ``--rows`` random int64 ids (slots in insertion order). A round looks up
``--batch`` ids drawn at random from them (each one present) with each index, alternating which
goes first, each after reading 64 MiB of something else (``--warm``: not); then the same with
ids that are absent (a pull of new rows). Prints the median
lookups/s of each side over ``--rounds`` rounds and the ratio new / old.

Run: ``python bench/index_lookup.py [--rows 1000000] [--batch 65536] [--rounds 30]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from tether.rules import index_kernels
from tether.server.storage.index import IdIndex


def old_cells(ids: np.ndarray) -> np.ndarray:
    """The old index's cells for ``ids`` (slot i for ids[i]), sized as it grew them."""
    cap = 16
    while 3 * len(ids) > cap:
        cap *= 2
    cells = np.full((cap, 2), index_kernels.EMPTY_SLOT, np.int64)
    index_kernels.index_place(cells, ids, np.arange(len(ids), dtype=np.int64))
    return cells


def rate(fn: object, ids: np.ndarray) -> float:
    """Lookups per second of this thread's CPU time (the machine is shared: wall time would
    count the time the thread waited for a core)."""
    start = time.thread_time()
    fn(ids)  # type: ignore[operator]
    return len(ids) / max(time.thread_time() - start, 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=65_536)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warm", action="store_true",
                        help="leave the caches as the last lookup left them (by default each lookup starts after 64 MiB of "
                             "other reads, as in a shard, where the rows it serves push the index out of the caches)")
    args = parser.parse_args()
    flush = None if args.warm else np.ones(8 << 20, np.int64)
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(-(2**62), 2**62, int(args.rows * 1.01), dtype=np.int64))[: args.rows]
    rng.shuffle(ids)
    cells = old_cells(ids)
    index = IdIndex(1024)
    for a in range(0, len(ids), 65_536):  # grown as a table grows it, a pull at a time
        index.insert(ids[a : a + 65_536], np.arange(a, min(a + 65_536, len(ids)), dtype=np.int64))

    def old(q: np.ndarray) -> np.ndarray:
        return index_kernels.index_lookup(cells, q)  # type: ignore[no-any-return]

    want = rng.choice(len(ids), args.batch, replace=False)
    assert np.array_equal(old(ids[want]), want) and np.array_equal(index.lookup(ids[want]), want)
    absent = rng.integers(2**62, 2**63 - 1, args.batch, dtype=np.int64)
    assert (old(absent) == -1).all() and (index.lookup(absent) == -1).all()
    print(f"{args.rows} rows: old index {cells.nbytes / args.rows:.1f} B/row ({len(cells)} cells), "
          f"new {index.nbytes / args.rows:.1f} B/row ({index.cells} cells, load {index.size / index.cells:.2f}; "
          f"keys {index.nbytes - 4 * index.cells} B)")
    for what, source in (("present", ids), ("absent", None)):
        olds, news = [], []
        for r in range(args.rounds):
            q = source[rng.choice(len(source), args.batch, replace=False)] if source is not None else \
                rng.integers(2**62, 2**63 - 1, args.batch, dtype=np.int64)
            sides = [(olds, old), (news, index.lookup)]
            for out, fn in (sides if r % 2 == 0 else sides[::-1]):
                if flush is not None:
                    flush.sum()
                out.append(rate(fn, q))
        o, n = statistics.median(olds), statistics.median(news)
        print(f"{what:>8} ids, batches of {args.batch}: old {o / 1e6:.1f} M lookups/s, new {n / 1e6:.1f} M lookups/s, "
              f"new/old {n / o:.2f}x (median of {args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
