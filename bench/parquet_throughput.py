"""Rows/s of ``ParquetStream`` turning a Criteo-shaped Parquet table into batches, against a plain
pyarrow read of the same file (the ceiling), side by side in one run, on one core; and the
stream's peak memory for 10x the rows.

    python bench/parquet_throughput.py [--rows N] [--repeats R]

The table: 1 label, 13 float32 and 26 int64 columns (``I1..I13``, ``C1..C26``, as ``tether
convert`` writes them), drawn from the synthetic click log with Zipf ids over 10^6 values per
field (so some columns dictionary-encode and some do not, as in Criteo), snappy, row groups of
131,072 rows (``tether convert``'s default), in the page cache. Each repeat times, alternating
which goes first:

- the ceiling: ``ParquetFile.read_row_group`` of every row group, one thread (Arrow tables, no
  conversion to anything a model takes);
- tether: ``ParquetStream(ctr=True)``, batches of 4096 (the CTR ``Batch``: float32 [B, 13],
  int64 [B, 26], float32 [B]) with the shuffle on (a buffer of 65,536 rows), without it, and as
  the built-in job reads (shuffle on, every 10th row held out: rows of the table per second).

The figure per invocation is the median over its repeats; the ratio is tether / ceiling. Peak
memory: ``VmHWM`` of a fresh process streaming (shuffle on) the first tenth of the file and the
whole file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import torch

from tether.worker.data.parquet import CONVERT_ROW_GROUP_ROWS, HoldOut, ParquetStream
from tether.worker.data.synthetic import SyntheticClickLog, SyntheticConfig

BATCH = 4096
SHUFFLE = 65_536


def write_table(path: Path, rows: int, row_group_rows: int = CONVERT_ROW_GROUP_ROWS, seed: int = 0) -> None:
    """A Criteo-shaped table of ``rows`` rows at ``path``."""
    names = ["label", *(f"I{j + 1}" for j in range(13)), *(f"C{j + 1}" for j in range(26))]
    schema = pa.schema([(n, pa.float32()) for n in names[:14]] + [(n, pa.int64()) for n in names[14:]])
    gen = SyntheticClickLog(SyntheticConfig(num_dense=13, num_sparse=26, vocab_size=1_000_000, seed=seed))
    with pq.ParquetWriter(path, schema) as w:
        for b in gen.batches(row_group_rows, -(-rows // row_group_rows)):
            n = min(row_group_rows, rows)
            rows -= n
            dense, sparse = b.dense.numpy()[:n], b.sparse.numpy()[:n]
            arrays = [pa.array(b.labels.numpy()[:n])] + [pa.array(dense[:, j]) for j in range(13)] + [pa.array(sparse[:, j]) for j in range(26)]
            w.write_batch(pa.record_batch(arrays, schema=schema), row_group_size=row_group_rows)
            if rows <= 0:
                break


def ceiling_rate(path: Path) -> float:
    """Rows/s of a plain one-thread pyarrow read of every row group."""
    start = time.perf_counter()
    pf = pq.ParquetFile(path)
    n = 0
    for g in range(pf.num_row_groups):
        n += pf.read_row_group(g, use_threads=False).num_rows
    return n / (time.perf_counter() - start)


def stream_rate(path: Path, rows: int, **kw: object) -> float:
    """Rows of the table per second through ``ParquetStream(ctr=True, **kw)`` (held-out rows
    count as read: they were decoded to be dropped)."""
    start = time.perf_counter()
    n = 0
    for b in ParquetStream(path, BATCH, ctr=True, **kw):  # type: ignore[arg-type]
        n += len(b.labels)
    elapsed = time.perf_counter() - start
    if not kw.get("holdout") and n != rows:
        raise SystemExit(f"the stream yielded {n} rows of {rows}")
    return rows / elapsed


_PEAK = """
import sys
from tether.worker.data.parquet import ParquetStream
n = sum(len(b.labels) for b in ParquetStream(sys.argv[1], 4096, ctr=True, shuffle_rows=65536))
status = open("/proc/self/status").read().split("\\n")
print(n, *[int(line.split()[1]) for line in status if line.startswith(("VmHWM", "VmRSS"))])
"""


def peak_mib(path: Path) -> tuple[int, float]:
    """Rows streamed and peak RSS (MiB) of a fresh process streaming ``path``, shuffle on."""
    out = subprocess.run([sys.executable, "-c", _PEAK, str(path)], check=True, capture_output=True, text=True).stdout.split()
    return int(out[0]), int(out[1]) / 1024


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="rows in the table")
    p.add_argument("--repeats", type=int, default=3, help="side-by-side repeats in this invocation")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    with tempfile.TemporaryDirectory() as tmp:
        path, small = Path(tmp) / "criteo.parquet", Path(tmp) / "criteo-tenth.parquet"
        write_table(path, args.rows)
        write_table(small, args.rows // 10)
        size = path.stat().st_size / 2**20
        groups = pq.ParquetFile(path).num_row_groups
        ceiling_rate(path)  # the page cache and the allocator warmed for both sides
        runs: dict[str, list[float]] = {"ceiling": [], "shuffle": [], "plain": [], "job": []}
        sides = {
            "ceiling": lambda: ceiling_rate(path),
            "shuffle": lambda: stream_rate(path, args.rows, shuffle_rows=SHUFFLE),
            "plain": lambda: stream_rate(path, args.rows),
            "job": lambda: stream_rate(path, args.rows, shuffle_rows=SHUFFLE, holdout=HoldOut.every_nth(10)),
        }
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                runs[name].append(sides[name]())
        n_small, peak_small = peak_mib(small)
        n_big, peak_big = peak_mib(path)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"machine: {cpu_model()}, nproc {os.cpu_count()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
          f"load {os.getloadavg()[0]:.2f}; pyarrow {pa.__version__}, numpy {np.__version__}, torch {torch.__version__}")
    print(f"table: {args.rows:,} rows x (1 label, 13 float32, 26 int64), {groups} row groups, {size:.0f} MiB snappy; "
          f"batch {BATCH}; one thread; {args.repeats} repeats, median")
    print(f"ceiling (pyarrow read_row_group):          {med['ceiling']:>12,.0f} rows/s  {[round(x) for x in runs['ceiling']]}")
    print(f"ParquetStream, shuffle {SHUFFLE:,} rows:      {med['shuffle']:>12,.0f} rows/s  {[round(x) for x in runs['shuffle']]}")
    print(f"ParquetStream, no shuffle:                 {med['plain']:>12,.0f} rows/s  {[round(x) for x in runs['plain']]}")
    print(f"ParquetStream as the built-in job reads:   {med['job']:>12,.0f} rows/s  {[round(x) for x in runs['job']]}")
    print(f"ratio tether / ceiling: shuffle {med['shuffle'] / med['ceiling']:.2f}x, no shuffle {med['plain'] / med['ceiling']:.2f}x, "
          f"built-in job {med['job'] / med['ceiling']:.2f}x; target >= 1,000,000 rows/s: "
          + ("met" if med["shuffle"] >= 1e6 else "NOT met"))
    print(f"peak RSS streaming {n_small:,} rows: {peak_small:.0f} MiB; {n_big:,} rows: {peak_big:.0f} MiB; "
          f"growth for 10x the rows: {peak_big - peak_small:+.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
