"""CriteoStream: memory that does not grow with the file, each line once per epoch across
workers (plain, gzip, many files), held-out lines never trained on, bad lines named."""

import gzip
import itertools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tether.protos.errors import UsageError
from tether.worker.data.criteo import CriteoStream, criteo_eval_set, criteo_files, write_criteo_sample
from tether.worker.data.synthetic import Batch, DataError, MalformedLineError


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("criteo") / "sample.tsv"
    write_criteo_sample(path, 997, seed=3, missing_rate=0.1)  # a prime: shares are uneven
    return path


def _cat(batches: list[Batch]) -> Batch:
    return Batch(*(torch.cat(ts) for ts in zip(*batches, strict=False)))


def _rows(batch: Batch) -> list[tuple]:
    """Each sample as a hashable tuple (labels, dense and ids together identify a line here)."""
    return [tuple(r) for r in torch.cat([batch.labels[:, None].double(), batch.dense.double(), batch.sparse.double()], 1).tolist()]


def _lines_as_rows(path: Path) -> list[tuple]:
    return _rows(_cat(list(CriteoStream(path, 4096))))


def _gzip(src: Path, dst: Path) -> Path:
    with src.open("rb") as f, gzip.open(dst, "wb") as g:
        g.write(f.read())
    return dst


def test_gzip_and_plain_give_identical_batches(sample: Path, tmp_path: Path) -> None:
    gz = _gzip(sample, tmp_path / "sample.tsv.data")  # no .gz: found by its magic bytes
    for kwargs in ({}, {"rank": 1, "world_size": 3}, {"holdout_every": 4}):
        plain = list(CriteoStream(sample, 64, **kwargs))
        packed = list(CriteoStream(gz, 64, **kwargs))
        assert len(plain) == len(packed) > 1
        for a, b in zip(plain, packed, strict=False):
            for x, y in zip(a, b, strict=False):
                assert torch.equal(x, y)


@pytest.mark.parametrize("layout", ["one file", "gzip", "three files", "glob of gzips"])
@pytest.mark.parametrize("world", [2, 3])
def test_workers_together_see_every_line_once_per_epoch(sample: Path, tmp_path: Path, layout: str, world: int) -> None:
    lines = sample.read_bytes().splitlines(keepends=True)
    if layout == "one file":
        source: str = str(sample)
    elif layout == "gzip":
        source = str(_gzip(sample, tmp_path / "s.gz"))
    else:
        cuts = [0, 300, 301, 997]  # a one-line file in the middle
        names = []
        for k, (a, b) in enumerate(itertools.pairwise(cuts)):
            p = tmp_path / f"part_{k}.tsv"
            p.write_bytes(b"".join(lines[a:b]))
            names.append(str(_gzip(p, tmp_path / f"day_{k}.gz")) if layout == "glob of gzips" else str(p))
        source = ",".join(names) if layout == "three files" else "criteo:" + str(tmp_path / "day_*.gz")
    want = _lines_as_rows(sample)
    epochs = 2
    seen: list[tuple] = []
    for rank in range(world):
        # Small blocks: lines and shares straddle many block boundaries.
        mine = _cat(list(CriteoStream(source, 50, rank=rank, world_size=world, epochs=epochs, block_bytes=4000)))
        assert abs(mine.labels.numel() - epochs * len(want) / world) <= epochs  # shares within a line
        assert _rows(mine) == [r for i, r in enumerate(want) if i % world == rank] * epochs
        seen += _rows(mine)
    assert sorted(seen) == sorted(want * epochs)


def test_batches_span_epochs_and_the_last_is_short_unless_dropped(sample: Path) -> None:
    sizes = [b.labels.numel() for b in CriteoStream(sample, 100, epochs=3)]
    assert sizes == [100] * 29 + [91]  # 2991 samples, batches running across epoch boundaries
    assert [b.labels.numel() for b in CriteoStream(sample, 100, epochs=3, drop_last=True)] == [100] * 29
    forever = iter(CriteoStream(sample, 500, epochs=None))
    assert [next(forever).labels.numel() for _ in range(7)] == [500] * 7  # 3.5 passes, no end
    assert list(CriteoStream(sample, 10, epochs=0)) == []


def test_held_out_lines_are_never_trained_on(sample: Path) -> None:
    k = 7
    everything = _lines_as_rows(sample)
    held = [r for i, r in enumerate(everything) if i % k == k - 1]
    train = []
    for rank in range(2):
        train += _rows(_cat(list(CriteoStream(sample, 64, rank=rank, world_size=2, holdout_every=k))))
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(everything)  # and every other line is trained on
    # The held-out stream is those lines; the eval set is its first eval_samples, read bounded.
    assert _rows(_cat(list(CriteoStream(sample, 64, holdout_every=k, held_out=True)))) == held
    assert _rows(criteo_eval_set(sample, 50, holdout_every=k)) == held[:50]
    assert _rows(criteo_eval_set(sample, 10_000, holdout_every=k)) == held  # fewer than asked
    assert _rows(criteo_eval_set(sample, 30)) == everything[:30]  # a separate eval file: its first lines


def test_eval_set_reads_only_what_it_needs(tmp_path: Path, sample: Path) -> None:
    # Only the first 1.2 MiB are valid: reading past the first block (1 MiB) would fail.
    path = tmp_path / "head_only.tsv"
    path.write_bytes(sample.read_bytes() * 5 + b"garbage\n" * 100_000)
    assert criteo_eval_set(path, 20, holdout_every=10).labels.numel() == 20
    with pytest.raises(MalformedLineError, match=r"head_only.tsv:4986: expected 40"):
        list(CriteoStream(path, 64))


@pytest.mark.parametrize("gzipped", [False, True])
def test_bad_line_names_file_and_line(tmp_path: Path, sample: Path, gzipped: bool) -> None:
    lines = sample.read_bytes().splitlines(keepends=True)
    cols = lines[600].split(b"\t")
    cols[20] = b"xyz"  # categorical column 6
    path = tmp_path / "bad.tsv"
    path.write_bytes(b"".join([*lines[:600], b"\t".join(cols), *lines[601:]]))
    if gzipped:
        path = _gzip(path, tmp_path / "bad.tsv.gz")
    with pytest.raises(MalformedLineError, match=rf"^{re.escape(str(path))}:601: categorical column 7 is not hex \(1-16 digits\): 'xyz'$"):
        list(CriteoStream(path, 64, block_bytes=8192))
    # A reader whose share does not hold the line is not stopped by it (it skips it unparsed).
    assert sum(b.labels.numel() for b in CriteoStream(path, 64, rank=1, world_size=2)) == 498
    with pytest.raises(MalformedLineError) as raised:
        list(CriteoStream(path, 64, rank=0, world_size=2))
    err = raised.value
    assert isinstance(err, UsageError) and isinstance(err, ValueError) and "\n" not in str(err)


@pytest.mark.parametrize(
    "line, message",
    [
        (b"1\t2\n", "expected 40 tab-separated columns, got 2"),
        (b"2" + b"\t" * 39 + b"\n", "label must be 0 or 1, got '2'"),
        (b"1\t1 " + b"\t" * 38 + b"\n", "integer column 1 is not an integer: '1 '"),
        (b"1\t-" + b"\t" * 38 + b"\n", "integer column 1 is not an integer: '-'"),
        (b"1" + b"\t" * 13 + b"\t" + "é".encode() + b"\t" * 25 + b"\n", "categorical column 1 is not hex"),
        (b"1" + b"\t" * 13 + b"\t1\x052" + b"\t" * 25 + b"\n", r"categorical column 1 is not hex \(1-16 digits\): '1\\x052'"),
        (b"1" + b"\t" * 13 + b"\t" + b"a" * 17 + b"\t" * 25 + b"\n", "categorical column 1 is not hex"),
        (b"\n", "expected 40 tab-separated columns, got 1"),
    ],
)
def test_malformed_lines(tmp_path: Path, line: bytes, message: str) -> None:
    path = tmp_path / "m.tsv"
    good = b"0" + b"\t1" * 13 + b"\tabc" * 26 + b"\n"
    path.write_bytes(good * 3 + line + good)
    with pytest.raises(MalformedLineError, match=f"m.tsv:4: {message}"):
        list(CriteoStream(path, 2))


def test_values_beyond_eight_and_sixteen_digits(tmp_path: Path) -> None:
    path = tmp_path / "wide.tsv"
    counts = ["123456789", "9999999999999999", "12345678901234567", "+42", "-7", "9" * 30, "0"]
    cats = ["123456789abcdef0", "ABCDEF012", "", "0"]
    path.write_text("\t".join(["1", *counts, *cats]) + "\n")
    got = next(iter(CriteoStream(path, 1, num_dense=len(counts), num_sparse=len(cats))))
    want = [min(max(int(c), 0), 1 << 62) for c in counts]
    assert torch.equal(got.dense[0], torch.from_numpy(np.log1p(np.array(want, dtype=np.float64)).astype(np.float32)))
    from tether.protos.partition import mix64

    salts = mix64(np.arange(len(cats), dtype=np.uint64) + np.uint64(0xC817E0))
    raw = np.array([int(c, 16) if c else (1 << 64) - 1 for c in cats], dtype=np.uint64)
    assert got.sparse[0].tolist() == (mix64(raw ^ salts) & np.uint64((1 << 62) - 1)).astype(np.int64).tolist()


def test_sources_and_arguments(tmp_path: Path, sample: Path) -> None:
    a, b = tmp_path / "a.tsv", tmp_path / "b,c.tsv"
    a.write_bytes(sample.read_bytes())
    b.write_bytes(sample.read_bytes())
    assert criteo_files(f"criteo:{a}") == [a]
    assert criteo_files(str(b)) == [b]  # an existing name with a comma is one file
    assert criteo_files([b, a]) == [b, a]
    assert criteo_files(str(tmp_path / "*.tsv")) == [a, b]  # sorted by name
    for bad, message in [
        (str(tmp_path / "nope.tsv"), "nope.tsv: no such file"),
        (str(tmp_path / "x_*.gz"), r"x_\*.gz: no file matches"),
        (str(tmp_path), "not a file"),
        (f"{a},{a}", "named twice"),
        ("criteo:", "names no file"),
    ]:
        with pytest.raises(DataError, match=message):
            criteo_files(bad)
    for kwargs, message in [
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"rank": 2, "world_size": 2}, "rank must be in"),
        ({"epochs": -1}, "epochs must be >= 0 or None, got -1"),
        ({"holdout_every": 1}, "holdout_every must be >= 2 or None, got 1"),
        ({"held_out": True}, "held_out=True needs holdout_every"),
    ]:
        with pytest.raises(ValueError, match=message):
            CriteoStream(a, **{"batch_size": 8, **kwargs})
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        criteo_eval_set(a, 0)
    tiny = tmp_path / "tiny.tsv"
    tiny.write_bytes(sample.read_bytes().splitlines(keepends=True)[0])
    with pytest.raises(DataError, match=r"tiny.tsv: no samples for rank 1 of 2"):
        next(iter(CriteoStream(tiny, 8, rank=1, world_size=2, epochs=None)))  # not a silent endless loop
    with pytest.raises(DataError, match=r"no held-out samples \(holdout_every=3\)"):
        criteo_eval_set(tiny, 5, holdout_every=3)


def test_damaged_gzip_and_missing_newline(tmp_path: Path, sample: Path) -> None:
    gz = _gzip(sample, tmp_path / "s.gz")
    cut = tmp_path / "cut.gz"
    cut.write_bytes(gz.read_bytes()[: gz.stat().st_size // 2])
    with pytest.raises(DataError, match=r"cut.gz: damaged gzip data"):
        list(CriteoStream(cut, 64))
    no_nl = tmp_path / "no_newline.tsv"
    no_nl.write_bytes(sample.read_bytes().rstrip(b"\n").replace(b"\n", b"\r\n"))  # CRLF, no final newline
    assert _lines_as_rows(no_nl) == _lines_as_rows(sample)


def test_a_file_gone_before_reading_is_one_line(tmp_path: Path, sample: Path) -> None:
    path = tmp_path / "gone.tsv"
    path.write_bytes(sample.read_bytes())
    stream = CriteoStream(path, 64)
    path.unlink()
    with pytest.raises(DataError, match=r"gone.tsv: No such file or directory"):
        list(stream)


def test_dataloader_processes_split_the_share(sample: Path) -> None:
    stream = CriteoStream(sample, 50, rank=1, world_size=2)
    alone = sorted(_rows(_cat(list(stream))))
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
    assert sorted(_rows(_cat(list(loader)))) == alone


_PEAK = """
import resource, sys
from tether.worker.data.criteo import CriteoStream
n = sum(b.labels.numel() for b in CriteoStream(sys.argv[1], 1024, holdout_every=10))
print(n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _peak_kib(path: Path) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _PEAK, str(path)], check=True, capture_output=True, text=True, timeout=240).stdout.split()
    return int(out[0]), int(out[1])


def test_memory_does_not_grow_with_the_file(tmp_path: Path) -> None:
    base = tmp_path / "base.tsv"
    write_criteo_sample(base, 5_000, seed=1)
    chunk = base.read_bytes()
    small, big = tmp_path / "small.tsv", tmp_path / "big.tsv"
    small.write_bytes(chunk * 6)  # 30,000 lines, 7 MiB: read whole, the old loader took ~110 MiB
    with big.open("wb") as f:
        for _ in range(60):  # 300,000 lines, 73 MiB
            f.write(chunk)
    n_small, kib_small = _peak_kib(small)
    n_big, kib_big = _peak_kib(big)
    assert (n_small, n_big) == (27_000, 270_000)
    assert kib_big - kib_small < 100 * 1024, f"peak RSS {kib_small / 1024:.0f} MiB -> {kib_big / 1024:.0f} MiB"
