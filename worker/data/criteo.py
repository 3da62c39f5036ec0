"""Criteo-format click logs: the files a source names, streamed a block at a time (plain or
gzip, one or many; memory does not grow with the data), a held-out set, and sample files."""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from tether.worker.data.criteo_parser import CriteoParser
from tether.worker.data.synthetic import Batch, DataError, SyntheticClickLog, SyntheticConfig, check_stream, in_background

__all__ = [
    "CRITEO_DENSE",
    "CRITEO_SPARSE",
    "CriteoStream",
    "criteo_eval_set",
    "criteo_files",
    "write_criteo_sample",
]

CRITEO_DENSE = 13
CRITEO_SPARSE = 26
# Bytes read from a file at a time (decompressed, for gzip): ~4,000 Criteo lines. Bounds what a
# reader holds, whatever the size of the file, and amortises numpy's per-call overhead.
_BLOCK_BYTES = 1 << 20
# Lines ``write_criteo_sample`` formats at a time: its string arrays stay a few tens of MB.
_SAMPLE_CHUNK_LINES = 8192


def criteo_files(source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files a Criteo source names, in reading order.

    Args:
        source: a path; a glob (``day_*.gz``: its matches sorted by name); a comma-separated
            list of paths and globs (``a.tsv,b.tsv``); or a sequence of paths. A leading
            ``criteo:`` is dropped, so ``--data`` values can be passed as they are.

    Raises:
        DataError: an entry that matches no file or is not a regular file, a file named twice,
            or nothing at all.
    """
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        text = text[len("criteo:") :] if text.startswith("criteo:") else text
        # A name that exists is one file even if it holds a comma.
        entries: list[str] = [text] if os.path.exists(text) else [e for e in text.split(",") if e]
    else:
        entries = [os.fspath(e) for e in source]
    files: list[Path] = []
    for entry in entries:
        if glob.has_magic(entry) and not os.path.exists(entry):
            matches = sorted(glob.glob(entry))
            if not matches:
                raise DataError(f"{entry}: no file matches")
        else:
            matches = [entry]
        for m in matches:
            if not os.path.exists(m):
                raise DataError(f"{m}: no such file")
            if not os.path.isfile(m):
                raise DataError(f"{m}: not a file")
            files.append(Path(m))
    if not files:
        raise DataError(f"{source!s}: names no file")
    seen: set[Path] = set()
    for f in files:
        key = f.resolve()
        if key in seen:
            raise DataError(f"{f}: named twice (its lines would be read twice per epoch)")
        seen.add(key)
    return files


def _open(path: Path) -> BinaryIO:
    """``path`` opened for reading.

    Raises:
        DataError: it cannot be (gone since ``criteo_files`` looked, no permission).
    """
    try:
        return open(path, "rb")
    except OSError as exc:
        raise DataError(f"{path}: {exc.strerror or exc}") from exc


def _is_gzip(path: Path) -> bool:
    """Whether ``path`` starts with gzip's magic bytes."""
    with _open(path) as f:
        return f.read(2) == b"\x1f\x8b"


def _blocks(path: Path, block_bytes: int) -> Iterator[bytes]:
    """``path``'s bytes in blocks of whole lines (each ending in ``\\n``, ``\\r\\n`` made
    ``\\n``); a last line without a newline gets one.

    Raises:
        DataError: the file cannot be opened or read, or holds damaged gzip data.
    """
    raw = _open(path)
    f: BinaryIO | gzip.GzipFile = raw
    try:
        if _is_gzip(path):
            f = gzip.GzipFile(fileobj=raw, mode="rb")
        rest = b""
        while True:
            try:
                chunk = f.read(block_bytes)
            except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
                raise DataError(f"{path}: damaged gzip data ({exc})") from exc
            except OSError as exc:
                raise DataError(f"{path}: {exc.strerror or exc}") from exc
            if not chunk:
                break
            data = rest + chunk if rest else chunk
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # a line longer than a block: keep reading
                rest = data
                continue
            rest = data[cut:]
            out = data[:cut]
            yield out.replace(b"\r\n", b"\n") if b"\r" in out else out
        if rest:
            rest += b"\n"
            yield rest.replace(b"\r\n", b"\n") if b"\r" in rest else rest
    finally:
        if f is not raw:
            f.close()
        raw.close()


class CriteoStream(torch.utils.data.IterableDataset):
    """Batches streamed from Criteo-format files, a block at a time: memory does not grow with
    the data.

    The format: ``label``, ``num_dense`` integer columns, ``num_sparse`` hex categorical
    columns, tab-separated, any of them empty; plain or gzip files (found by their magic
    bytes, not their name). Dense values: missing or negative -> 0, clamped at 2**62, then
    ``log1p``. Categorical values (1-16 hex digits, either case): hashed with their field
    index into a non-negative int64 id, ``mix64(value ^ salt(field)) & (2**62 - 1)``, so fields
    do not collide; missing -> one reserved id per field.

    Lines are numbered from 0 across the files in order. Worker ``rank`` of ``world_size``
    takes line ``i`` when ``i % world_size == rank``, so every sample goes to exactly one
    worker per epoch whatever the number of files, and the workers' shares differ by at most
    one line (equal step counts, which sync mode needs). Each worker reads every byte but
    parses only its own lines. With ``holdout_every=k``, line ``i`` is held out when
    ``i % k == k - 1``: it is never in a training stream, and the held-out stream
    (``held_out=True``) is those lines only; the remaining lines are dealt to the workers in
    turn, as above.

    Batches run across epoch boundaries: every batch holds ``batch_size`` samples but the very
    last one, after the last epoch, which holds what is left (dropped with ``drop_last``).
    Epochs read the lines in the same order.

    Under a ``torch.utils.data.DataLoader`` with ``num_workers`` > 0 (pass ``batch_size=None``),
    each loader process takes its own share of this worker's lines.

    Args:
        source: files, as ``criteo_files`` takes them (a path, glob, comma list or sequence).
        batch_size: samples per batch.
        rank: this worker's index in ``[0, world_size)``.
        world_size: workers sharing the data.
        epochs: passes over the data; ``None``: until the consumer stops.
        holdout_every: hold out every ``k``-th line (``k`` >= 2); ``None``: no line is held out.
        held_out: yield the held-out lines instead of the training lines.
        drop_last: drop the short batch at the end.
        num_dense: integer columns per line (13 in Criteo).
        num_sparse: categorical columns per line (26 in Criteo).
        block_bytes: bytes read at a time (memory per reader is a small multiple of this).

    Raises:
        ValueError: a bad size, rank, epoch count or hold-out setting.
        DataError: ``source`` names no readable file (see ``criteo_files``). While iterating:
            ``MalformedLineError`` naming the file and line; ``DataError`` for damaged gzip
            data or a pass that gives this worker no sample.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        epochs: int | None = 1,
        holdout_every: int | None = None,
        held_out: bool = False,
        drop_last: bool = False,
        num_dense: int = CRITEO_DENSE,
        num_sparse: int = CRITEO_SPARSE,
        block_bytes: int = _BLOCK_BYTES,
    ) -> None:
        super().__init__()
        check_stream(batch_size, rank, world_size, epochs)
        if holdout_every is not None and holdout_every < 2:
            raise ValueError(f"holdout_every must be >= 2 or None, got {holdout_every!r}")
        if held_out and holdout_every is None:
            raise ValueError("held_out=True needs holdout_every")
        if num_dense < 1 or num_sparse < 1:
            raise ValueError(f"num_dense and num_sparse must be >= 1, got {num_dense!r}, {num_sparse!r}")
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes!r}")
        self.files = criteo_files(source)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.epochs = epochs
        self.holdout_every = holdout_every
        self.held_out = held_out
        self.drop_last = drop_last
        self.num_dense = num_dense
        self.num_sparse = num_sparse
        self.block_bytes = block_bytes

    def _mine(self, first: int, count: int, rank: int, world: int) -> np.ndarray | None:
        """Which of lines ``first .. first + count - 1`` are this reader's; None: all."""
        k = self.holdout_every
        if k is None and world == 1:
            return None
        i = np.arange(first, first + count, dtype=np.int64)
        if k is None:
            return i % world == rank
        held = i % k == k - 1
        if self.held_out:
            return held if world == 1 else held & ((i // k) % world == rank)
        return ~held & ((i - i // k) % world == rank)

    def samples(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """One pass: this reader's lines as (labels, dense, ids) numpy arrays, a block at a time.

        Raises:
            MalformedLineError, DataError: see the class.
        """
        rank, world = self.rank, self.world_size
        info = torch.utils.data.get_worker_info()
        if info is not None:  # a DataLoader process: every num_workers-th line of this worker's share
            rank, world = rank + world * info.id, world * info.num_workers
        parser = CriteoParser(self.num_dense, self.num_sparse)
        first = 0
        for path in self.files:
            lineno = 1
            blocks = _blocks(path, self.block_bytes)
            if _is_gzip(path):  # zlib lets go of the GIL: decompress the next blocks meanwhile
                blocks = in_background(blocks, depth=2)
            for block in blocks:
                count = block.count(b"\n")
                mine = self._mine(first, count, rank, world)
                if mine is None:
                    yield parser.parse(block, path, np.arange(lineno, lineno + count))
                elif mine.any():
                    # Other readers' lines are dropped unparsed: each pays only for its share.
                    a = np.frombuffer(block, np.uint8)
                    lengths = np.diff(np.flatnonzero(a == 10), prepend=-1)
                    own = a[np.repeat(mine, lengths)].tobytes()
                    yield parser.parse(own, path, lineno + np.flatnonzero(mine))
                first += count
                lineno += count

    def _describe(self, rank: int, world: int) -> str:
        where = str(self.files[0]) if len(self.files) == 1 else f"{self.files[0]} and {len(self.files) - 1} more files"
        what = f"held-out samples (holdout_every={self.holdout_every})" if self.held_out else "samples"
        return f"{where}: no {what}" + (f" for rank {rank} of {world}" if world > 1 else "")

    def __iter__(self) -> Iterator[Batch]:
        bs = self.batch_size
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        have = 0
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            seen = 0
            for part in self.samples():
                parts.append(part)
                have += part[0].size
                seen += part[0].size
                if have < bs:
                    continue
                labels, dense, ids = (np.concatenate(x) if len(parts) > 1 else x[0] for x in zip(*parts, strict=False))
                full = have - have % bs
                for s in range(0, full, bs):
                    yield Batch(
                        torch.from_numpy(dense[s : s + bs]), torch.from_numpy(ids[s : s + bs]), torch.from_numpy(labels[s : s + bs])
                    )
                parts = [(labels[full:], dense[full:], ids[full:])] if full < have else []
                have -= full
            if seen == 0:
                raise DataError(self._describe(self.rank, self.world_size))
            epoch += 1
        if have and not self.drop_last:
            labels, dense, ids = (np.concatenate(x) for x in zip(*parts, strict=False))
            yield Batch(torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(labels))


def criteo_eval_set(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    num_samples: int,
    *,
    holdout_every: int | None = None,
    num_dense: int = CRITEO_DENSE,
    num_sparse: int = CRITEO_SPARSE,
) -> Batch:
    """A held-out set of at most ``num_samples`` samples, read without reading the whole data:
    the first ``num_samples`` held-out lines (``holdout_every=k``: lines ``i % k == k - 1``,
    which ``CriteoStream(..., holdout_every=k)`` never trains on), or, without
    ``holdout_every``, the first ``num_samples`` lines of ``source`` (a separate file or glob).

    Raises:
        ValueError: ``num_samples`` < 1, or a bad ``holdout_every``.
        DataError: no such file, no held-out line, a malformed line (``MalformedLineError``).
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples!r}")
    stream = CriteoStream(
        source, num_samples, holdout_every=holdout_every, held_out=holdout_every is not None, num_dense=num_dense, num_sparse=num_sparse
    )
    batches = iter(stream)
    try:
        return next(batches)
    finally:
        batches.close()  # type: ignore[attr-defined]


def write_criteo_sample(path: str | Path, num_lines: int, seed: int = 0, missing_rate: float = 0.05) -> None:
    """Write a small, valid Criteo-format TSV drawn from the synthetic generator (with missing
    values), for tests and for trying the Criteo path without the real data set."""
    if num_lines < 1:
        raise ValueError(f"num_lines must be >= 1, got {num_lines!r}")
    if not 0 <= missing_rate <= 1:
        raise ValueError(f"missing_rate must be in [0, 1], got {missing_rate!r}")
    # Per-field weights scaled so 26 fields carry about as much signal as the default 8.
    config = SyntheticConfig(num_dense=CRITEO_DENSE, num_sparse=CRITEO_SPARSE, vocab_size=2000, id_scale=0.3, seed=seed)
    gen = SyntheticClickLog(config)
    batch = next(gen.batches(num_lines, 1))
    rng = np.random.default_rng([seed, 99])
    counts = np.floor(np.exp(np.abs(batch.dense.numpy()) * 2)).astype(np.int64)
    cats = batch.sparse.numpy() & 0xFFFFFFFF
    labels = batch.labels.numpy().astype(np.int64)
    # Whole arrays at a time, a chunk of lines each (a line field by field in Python took ~0.1 ms,
    # 15 s of CPU for the 120,000 lines of tests/test_examples.py's files): the same bytes. A line's
    # 13 integer then 26 hex fields draw their missing flags in that order, one line after another,
    # as one (lines, 39) draw does; a hex field is its value's 4 big-endian bytes in hex.
    with Path(path).open("w") as f:
        for start in range(0, num_lines, _SAMPLE_CHUNK_LINES):
            end = min(start + _SAMPLE_CHUNK_LINES, num_lines)
            missing = rng.random((end - start, CRITEO_DENSE + CRITEO_SPARSE)) < missing_rate
            ints = np.where(missing[:, :CRITEO_DENSE], "", counts[start:end].astype(str))
            hex_text = cats[start:end].astype(">u4").tobytes().hex().encode()
            hexes = np.frombuffer(hex_text, dtype="S8").astype(str).reshape(end - start, CRITEO_SPARSE)
            hexes = np.where(missing[:, CRITEO_DENSE:], "", hexes)
            table = np.concatenate([labels[start:end, None].astype(str), ints, hexes], axis=1)
            f.write("".join("\t".join(row) + "\n" for row in table.tolist()))
