"""Shard memory per embedding row for every update rule (issue 28 item 5).

Each rule runs in its own process: a shard table (``EmbeddingTable``) of ``--dim`` floats gets
``--rows`` rows (random int64 ids, created by pulls as a job creates them), then one push to
every row (so each row's optimizer state is written). Per row it prints what the table holds:

- ``values``: the rows' floats (``dim * 4`` bytes: the raw bytes the ratios divide by);
- ``state``: the rule's optimizer state (``tether.rules.optimizers``);
- ``index``: the id index (``tether.server.storage.index``): the ids by slot (int64, 8 bytes a row)
  and the hash's int32 cells at a load factor of 0.6-0.7 (``cells``: 5.7-6.7 bytes a row);
- ``books``: the table's per-row bookkeeping (the version of each row's last update and where
  its entry is in the update log, two int32, for per-row staleness; a bounded table's last-touch
  ticks);
- ``allocated``: every array the table holds, by size (growth leaves room beyond the rows);
- ``resident``: the process's resident memory after the table was filled minus before it was
  created, each read after ``malloc_trim`` (pages never written, such as the room beyond the
  rows, are not resident). This is what the table holds; the update log (the last updates'
  slots and their links, for per-row staleness: at most 2 MiB) is in it too. ``--maps`` names the mappings it
  grew in (``/proc/self/smaps``: rows and state, then the ids, cells and row versions, in
  mappings of their own; the update log in the heap).

Each call goes the way a shard's does: a pull is ``locate`` (where the rows are: the shard copies
them into its reply, memory of the call's size, not the table's), a push ``pulled``,
``staleness``, ``push``.

The ratios are to the raw bytes of the rows (``rows * dim * 4``), and the resident bytes also to
the rows' and the rule's state's (``/ values+state``). Run with no arguments for 1M x 64, the
issue's size (about 1 GB at most per process, Adam and FTRL).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from typing import Any

import numpy as np

_BATCH = 1 << 16


def _rss() -> int:
    """Resident bytes of this process, after glibc has given back the free memory it kept (the
    pulls' copies freed in the fill would otherwise count)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _mappings() -> dict[str, int]:
    """Resident bytes of this process by what is mapped: a file, ``[heap]``, ``[anon]`` (every
    anonymous mapping together: the table's large arrays each have their own)."""
    out: dict[str, int] = {}
    what = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                what = head[5] if len(head) > 5 else "[anon]"
            elif head[0] == "Rss:":
                out[what] = out.get(what, 0) + int(head[1]) * 1024
    return out


def _grown(before: dict[str, int], after: dict[str, int]) -> list[tuple[int, str]]:
    """What moved by more than 64 KiB, largest first."""
    moved = [(after.get(k, 0) - before.get(k, 0), k) for k in after.keys() | before.keys()]
    return sorted(((d, k) for d, k in moved if abs(d) > 64 << 10), reverse=True)


def measure(name: str, rows: int, dim: int) -> dict[str, Any]:
    """Fill one table with the rule ``name`` in this process; its bytes by part."""
    import torch

    from tether.protos.specs import OptimizerConfig, TableConfig
    from tether.rules import row_kernels
    from tether.server.storage.tables import EmbeddingTable

    torch.set_num_threads(1)
    ids = np.unique(np.random.default_rng(0).integers(-(2**62), 2**62, int(rows * 1.01), dtype=np.int64))[:rows]
    np.random.default_rng(1).shuffle(ids)
    grads = torch.full((_BATCH, dim), 1e-2)
    # The kernels compiled (or loaded from the disk cache), as a shard does when it starts, and
    # the code paths run once on a small table first: the memory of compiling is not the table's.
    row_kernels.warm_up()
    # One call of the fill's size too (ids the fill never uses), so the library code a large call
    # runs (torch's, numpy's, the interpreter's) is resident before, not counted as the table's.
    warm = EmbeddingTable(TableConfig("warm", dim, OptimizerConfig(name, lr=0.01)))
    for part in (np.arange(64, dtype=np.int64), np.arange(64, 64 + _BATCH, dtype=np.int64)):
        _, _, read = warm.locate(part)
        pulled = warm.pulled(part)
        warm.staleness(part, max(read - 1, 0), pulled)
        warm.push(part, grads[: len(part)], 1.0, pulled)
        warm.staleness(part, 0, warm.pulled(part))
    del warm, part, pulled
    before = _rss()
    maps = _mappings()
    table = EmbeddingTable(TableConfig("t", dim, OptimizerConfig(name, lr=0.01)))
    start = time.perf_counter()
    for a in range(0, rows, _BATCH):
        batch = np.sort(ids[a:a + _BATCH])
        _, _, read = table.locate(batch)  # as Shard.pull: the reply copies the rows out
        pulled = table.pulled(batch)
        table.staleness(batch, max(read - 1, 0), pulled)
        table.push(batch, grads[: len(batch)], 1.0, pulled)
    seconds = time.perf_counter() - start
    resident = _rss() - before
    grown = _grown(maps, _mappings())
    assert table.rows == rows
    values = table._weights[: table.rows].nbytes
    state = sum(t[: table.rows].nbytes for t in table._state.values())
    books = table._versions.nbytes + (table._touched.nbytes if table._touched is not None else 0)
    return {
        "rule": name, "rows": rows, "dim": dim, "values": values, "state": state, "index": table._index.nbytes,
        "cells": 4 * table._index.cells, "keys": 8 * rows, "books": books,
        "allocated": table.memory_bytes, "resident": resident, "seconds": seconds, "grown": grown,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print one JSON object per rule")
    parser.add_argument("--maps", action="store_true", help="also print, per rule, the mappings whose resident bytes grew")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: measure one rule
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.rows, args.dim)))
        return 0
    from tether.protos.names import OPTIMIZERS

    results = []
    for name in OPTIMIZERS:
        out = subprocess.run(
            [sys.executable, __file__, "--one", name, "--rows", str(args.rows), "--dim", str(args.dim)],
            capture_output=True, text=True, check=True,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.json:
        for r in results:
            print(json.dumps(r))
        return 0
    raw = args.rows * args.dim * 4
    print(f"{args.rows} rows x {args.dim} dims: raw bytes of the rows {raw / 2**20:.1f} MiB ({args.dim * 4} B/row)")
    print(f"{'rule':<16}{'state B/row':>12}{'values+state':>14}{'index B/row':>12}{'cells B/row':>12}{'books B/row':>12}"
          f"{'allocated B/row':>17}{'resident B/row':>16}{'/ values+state':>15}{'fill s':>8}")
    for r in results:
        n = r["rows"]
        print(
            f"{r['rule']:<16}{r['state'] / n:>12.1f}{(r['values'] + r['state']) / raw:>13.3f}x{r['index'] / n:>12.1f}{r['cells'] / n:>12.1f}"
            f"{r['books'] / n:>12.1f}{r['allocated'] / n:>9.1f} {r['allocated'] / raw:>5.2f}x"
            f"{r['resident'] / n:>8.1f} {r['resident'] / raw:>6.3f}x{r['resident'] / (r['values'] + r['state']):>14.3f}x"
            f"{r['seconds']:>8.1f}"
        )
    if args.maps:
        for r in results:
            parts = ", ".join(f"{d / 1e6:.3f} MB {what}" for d, what in r["grown"])
            print(f"{r['rule']}: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
