"""Lines/s of the streaming Criteo reader against the line-at-a-time parser it replaced, side by
side in one run, and the streaming reader's peak memory.

    python bench/criteo_parse.py [--lines N] [--repeats R] [--gzip]

The data is ``write_criteo_sample``'s output (13 integer and 26 hex columns, 5% missing
values, ~255 bytes a line, like Criteo's) repeated to ``--lines``. Each repeat times the old
parser on the first ``--old-lines`` lines and ``CriteoStream`` (one worker, batches of 4096) on
the whole file, alternating which goes first; the figure is the median over the repeats, and
the ratio is new / old lines/s. Both read the file from the page cache. The old parser is kept
below verbatim (``CriteoTSV`` as it was in worker/data/synthetic.py before the streaming reader) and its
batches are checked equal to the new reader's.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tether.protos.partition import mix64
from tether.worker.data.criteo import CriteoStream, write_criteo_sample
from tether.worker.data.synthetic import Batch

# -- the old parser (worker/data/synthetic.py's CriteoTSV before the streaming reader), the baseline ------

_ID_MASK = np.uint64((1 << 62) - 1)
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")
_MISSING = (1 << 64) - 1
_DENSE_CAP = 1 << 62


class OldCriteoTSV:
    """The line-at-a-time parser (``str.split``, Python ints per field)."""

    def __init__(self, path: str | Path, num_dense: int = 13, num_sparse: int = 26) -> None:
        self.path = Path(path)
        self.num_dense = num_dense
        self.num_sparse = num_sparse
        with np.errstate(over="ignore"):
            self._field_salts = mix64(np.arange(num_sparse, dtype=np.uint64)[None, :] + np.uint64(0xC817E0))

    def _parse_line(self, lineno: int, line: str) -> tuple[float, list[int], list[int]]:
        cols = line.rstrip("\r\n").split("\t")
        want = 1 + self.num_dense + self.num_sparse
        if len(cols) != want:
            raise ValueError(f"{self.path}:{lineno}: expected {want} tab-separated columns, got {len(cols)}")
        if cols[0] not in ("0", "1"):
            raise ValueError(f"{self.path}:{lineno}: label must be 0 or 1, got {cols[0]!r}")
        dense = []
        for j, v in enumerate(cols[1 : 1 + self.num_dense]):
            try:
                dense.append(min(max(int(v), 0), _DENSE_CAP) if v else 0)
            except ValueError:
                raise ValueError(f"{self.path}:{lineno}: integer column {j + 1} is not an integer: {v!r}") from None
        cats = []
        for j, v in enumerate(cols[1 + self.num_dense :]):
            if not v:
                cats.append(_MISSING)
            elif _HEX.fullmatch(v):
                cats.append(int(v, 16))
            else:
                raise ValueError(f"{self.path}:{lineno}: categorical column {j + 1} is not hex (1-16 digits): {v!r}")
        return float(cols[0]), dense, cats

    def _to_batch(self, labels: list[float], dense: list[list[int]], cats: list[list[int]]) -> Batch:
        dense_arr = np.log1p(np.asarray(dense, dtype=np.float64).reshape(-1, self.num_dense)).astype(np.float32)
        raw = np.asarray(cats, dtype=np.uint64).reshape(-1, self.num_sparse)
        with np.errstate(over="ignore"):
            ids = mix64(raw ^ self._field_salts)
        return Batch(torch.from_numpy(dense_arr), torch.from_numpy((ids & _ID_MASK).astype(np.int64)), torch.tensor(labels, dtype=torch.float32))

    def batches(self, batch_size: int, num_batches: int | None = None) -> Iterator[Batch]:
        labels: list[float] = []
        dense: list[list[int]] = []
        cats: list[list[int]] = []
        done = 0
        with self.path.open() as f:
            for i, line in enumerate(f):
                label, d, c = self._parse_line(i + 1, line)
                labels.append(label)
                dense.append(d)
                cats.append(c)
                if len(labels) == batch_size:
                    yield self._to_batch(labels, dense, cats)
                    labels, dense, cats = [], [], []
                    done += 1
                    if done == num_batches:
                        return
        if labels:
            yield self._to_batch(labels, dense, cats)


# -- measurement ---------------------------------------------------------------------------------


def _old_rate(path: Path, lines: int, batch_size: int) -> float:
    start = time.perf_counter()
    n = sum(b.labels.numel() for b in OldCriteoTSV(path).batches(batch_size, num_batches=lines // batch_size))
    return n / (time.perf_counter() - start)


def _new_rate(path: Path, batch_size: int) -> float:
    start = time.perf_counter()
    n = sum(b.labels.numel() for b in CriteoStream(path, batch_size))
    return n / (time.perf_counter() - start)


def _check_equal(path: Path, lines: int) -> None:
    old = next(OldCriteoTSV(path).batches(lines))
    new = next(iter(CriteoStream(path, lines)))
    for name, a, b in zip(Batch._fields, old, new, strict=False):
        if not torch.equal(a, b):
            raise SystemExit(f"the new reader's {name} differ from the old parser's")


_PEAK = """
import resource, sys
from tether.worker.data.criteo import CriteoStream
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = sum(b.labels.numel() for b in CriteoStream(sys.argv[1], 4096))
print(n, before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


_OLD_PEAK = """
import resource, sys, torch
sys.path.insert(0, sys.argv[2])
from criteo_parse import OldCriteoTSV
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
parts = list(OldCriteoTSV(sys.argv[1]).batches(1 << 16))  # what load_criteo did: the whole file
everything = [torch.cat(ts) for ts in zip(*parts)]
print(everything[2].numel(), before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _peak_mib(path: Path, old: bool = False) -> tuple[int, float, float]:
    """Lines read, peak RSS after imports and at the end (MiB) of a process streaming ``path``
    (``old``: loading it whole with the old parser, as ``load_criteo`` did)."""
    cmd = [sys.executable, "-c", _OLD_PEAK, str(path), str(Path(__file__).parent)] if old else [sys.executable, "-c", _PEAK, str(path)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
    return int(out[0]), int(out[1]) / 1024, int(out[2]) / 1024


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=400_000, help="lines in the file the new reader streams")
    p.add_argument("--old-lines", type=int, default=40_000, help="lines the old parser reads per repeat (it is slow)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--gzip", action="store_true", help="also time the new reader on a gzipped copy")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base, path = Path(tmp) / "base.tsv", Path(tmp) / "data.tsv"
        write_criteo_sample(base, min(args.lines, 20_000), seed=1)
        with path.open("wb") as out:
            written = 0
            while written < args.lines:
                with base.open("rb") as src:
                    shutil.copyfileobj(src, out)
                written += min(args.lines, 20_000)
        lines = written
        _check_equal(path, min(lines, 20_000))
        old, new, gz = [], [], []
        if args.gzip:
            gz_path = Path(tmp) / "data.tsv.gz"
            with path.open("rb") as src, gzip.open(gz_path, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
        for r in range(args.repeats):
            if r % 2:
                new.append(_new_rate(path, args.batch_size))
                old.append(_old_rate(path, args.old_lines, args.batch_size))
            else:
                old.append(_old_rate(path, args.old_lines, args.batch_size))
                new.append(_new_rate(path, args.batch_size))
            if args.gzip:
                gz.append(_new_rate(gz_path, args.batch_size))
        small = Path(tmp) / "small.tsv"
        with path.open("rb") as src, small.open("wb") as dst:
            dst.write(b"".join(src.readline() for _ in range(lines // 10)))
        n_small, base_small, peak_small = _peak_mib(small)
        n_big, base_big, peak_big = _peak_mib(path)
        n_old, base_old, peak_old = _peak_mib(small, old=True)
        size_mib = path.stat().st_size / 2**20
    load = os.getloadavg()[0]
    print(f"machine: {_cpu_model()}, nproc {os.cpu_count()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, load {load:.2f}")
    print(f"file: {lines:,} lines, {size_mib:.1f} MiB; batch {args.batch_size}; {args.repeats} repeats, median")
    print(f"old parser (line at a time):  {statistics.median(old):>10,.0f} lines/s  {[round(x) for x in old]}")
    print(f"CriteoStream (blocks, numpy): {statistics.median(new):>10,.0f} lines/s  {[round(x) for x in new]}")
    if gz:
        print(f"CriteoStream on gzip:         {statistics.median(gz):>10,.0f} lines/s  {[round(x) for x in gz]}")
    print(f"ratio new / old: {statistics.median(new) / statistics.median(old):.1f}x")
    print(f"peak RSS streaming {n_small:,} lines: {peak_small:.0f} MiB (after imports {base_small:.0f}); "
          f"{n_big:,} lines: {peak_big:.0f} MiB (after imports {base_big:.0f}); growth for 10x the lines: {peak_big - peak_small:+.0f} MiB")
    print(f"peak RSS of the old whole-file load of {n_old:,} lines: {peak_old:.0f} MiB (after imports {base_old:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
