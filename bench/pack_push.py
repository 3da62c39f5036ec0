"""A cached push's payload (``tether.worker.cache.split.pack_push``: the taken rows grouped by shard
and laid out as each shard's payload) against a plain copy of the same bytes, side by side in one
process (issue 41 items 3 and 5).

``pack_push`` copies every row once; its ceiling is numpy copying the same floats into fresh
memory. Its row copies once ran at a fifth of that (numba wrapped each float's index around
where it might be negative, which kept the loop from being vectorised; bench/RESULTS.md, "The
cache's row copies vectorised"): a ratio far above ~1.5x says a pass's copies lost their
vectorisation again (at ``--size gpu``; at ``default`` a call's fixed cost, its small arrays and
numba's argument checks, ~10 us here, is most of it).

Sizes: ``gpu``, a ``--preset gpu`` push (26 tables x 1,350 rows of 128 floats, ~18 MB) and
``default``, a default CTR push (8 tables x 80 rows of 16), each with a combined push's
statistics (2 columns) on half the tables, to ``--shards`` shards. The two alternate, ``--rounds``
rounds of ``--calls`` calls each; prints each side's median ms a call and the ratio.

    python bench/pack_push.py [--size gpu|default] [--shards 1,2] [--rounds 15] [--calls 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from tether.protos.framing import ALIGN
from tether.protos.partition import shard_of_ids
from tether.worker.cache.slots import warm_up
from tether.worker.cache.split import pack_push

SIZES = {"gpu": (26, 1350, 128), "default": (8, 80, 16)}


def take(size: str, num_shards: int, seed: int = 0) -> tuple[object, ...]:
    """``pack_push``'s arguments for a take of ``size``'s tables, rows and widths."""
    tables, rows, dim = SIZES[size]
    rng = np.random.default_rng(seed)
    ids = np.concatenate([np.sort(rng.choice(1 << 40, rows, replace=False)) for _ in range(tables)]).astype(np.int64)
    count = np.full(tables, rows, np.int64)
    kinds = np.tile(np.array([[1, 0]], np.int64), (tables, 1))
    combined = np.arange(tables) % 2 == 0
    sums = rng.standard_normal(len(ids) * dim, dtype=np.float32)
    stats = rng.standard_normal(len(ids) * 2, dtype=np.float32)
    return (shard_of_ids(ids, num_shards), count, np.int64(num_shards), ids, sums, stats, np.full(tables, dim, np.int64), kinds,
            combined, np.int64(ALIGN // 4))


def per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def fresh_copy(source: np.ndarray) -> np.ndarray:
    """``source``'s floats copied into new memory (the payload is new memory each push too)."""
    out = np.empty_like(source)
    np.copyto(out, source)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="gpu")
    p.add_argument("--shards", default="1,2", help="comma list of shard counts")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=3)
    a = p.parse_args(argv)
    try:
        shard_counts = [int(s) for s in a.shards.split(",") if s.strip()]
    except ValueError:
        p.error(f"--shards must be a comma list of integers, got {a.shards!r}")
    if not shard_counts or min(shard_counts) < 1 or a.rounds < 1 or a.calls < 1:
        p.error("--shards, --rounds and --calls must be >= 1")
    warm_up()
    tables, rows, dim = SIZES[a.size]
    print(f"{a.size}: {tables} tables x {rows} rows of {dim} floats, statistics on half the tables; median ms a call of "
          f"{a.rounds} rounds x {a.calls}")
    print("| shards | pack_push | numpy copy of the same bytes | ratio |")
    print("|---:|---:|---:|---:|")
    for num_shards in shard_counts:
        args = take(a.size, num_shards)
        payload_floats = len(pack_push(*args)[3])
        source = np.random.default_rng(1).standard_normal(payload_floats, dtype=np.float32)

        packed, copied = [], []
        for _ in range(a.rounds):
            packed.append(per_call(lambda args=args: pack_push(*args), a.calls))
            copied.append(per_call(lambda source=source: fresh_copy(source), a.calls))
        mp, mc = statistics.median(packed) * 1e3, statistics.median(copied) * 1e3
        print(f"| {num_shards} | {mp:.3f} | {mc:.3f} | {mp / mc:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
