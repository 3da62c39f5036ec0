"""Click-log data for the CTR model: a synthetic generator with a known best loss, and a
streaming reader of Criteo-format files (plain or gzip, one or many; memory does not grow with
the data).

Feature ids look like hashed production features: large non-negative int64 values, one
column per categorical field (each field is its own embedding table ``cat_<j>``).
"""

from __future__ import annotations

import glob
import gzip
import math
import os
import queue
import re
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple, TypeVar

import numpy as np
import torch

from tether.protos.errors import UsageError
from tether.protos.partition import mix64

__all__ = [
    "Batch",
    "CriteoStream",
    "DataError",
    "MalformedLineError",
    "SyntheticClickLog",
    "SyntheticConfig",
    "criteo_eval_set",
    "criteo_files",
    "in_background",
    "write_criteo_sample",
]

_ID_MASK = np.uint64((1 << 62) - 1)
_T = TypeVar("_T")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class Batch(NamedTuple):
    """A batch of samples."""

    dense: torch.Tensor  # float32 [B, num_dense]
    sparse: torch.Tensor  # int64 [B, num_sparse], ids >= 0
    labels: torch.Tensor  # float32 [B], 0 or 1


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape and difficulty of the synthetic click log."""

    num_dense: int = 13
    num_sparse: int = 8
    vocab_size: int = 100_000
    zipf_exponent: float = 1.1
    interaction_dim: int = 4
    id_scale: float = 0.55
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_dense < 1 or self.num_sparse < 2:
            raise ValueError(f"need num_dense >= 1 and num_sparse >= 2, got {self.num_dense!r}, {self.num_sparse!r}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size!r}")
        if not self.zipf_exponent > 0:
            raise ValueError(f"zipf_exponent must be > 0, got {self.zipf_exponent!r}")
        if not self.id_scale >= 0:
            raise ValueError(f"id_scale must be >= 0, got {self.id_scale!r}")
        if self.interaction_dim < 1:
            raise ValueError(f"interaction_dim must be >= 1, got {self.interaction_dim!r}")


def _uniform(keys: np.ndarray, salt: int) -> np.ndarray:
    """Deterministic uniforms in (0, 1) from uint64 keys."""
    with np.errstate(over="ignore"):
        h = mix64(keys ^ np.uint64(salt & 0xFFFFFFFFFFFFFFFF))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def _normal(keys: np.ndarray, salt: int) -> np.ndarray:
    """Deterministic standard normals from uint64 keys (Box-Muller)."""
    u1, u2 = _uniform(keys, salt), _uniform(keys, salt ^ 0x5DEECE66D)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


class SyntheticClickLog:
    """Clicks drawn from a hidden ground-truth model, so the best achievable loss is known.

    The true logit is a bias, a weight per (field, id) for every field, a linear function of
    the dense features, and a low-rank interaction between fields 0 and 1 (so a model with
    embeddings and an MLP can get close to the best loss, and a linear one cannot).
    Weights are hashed from (seed, field, id): the id space is unbounded and nothing is
    stored per id.
    """

    BIAS = -1.2
    DENSE_SCALE = 0.35
    INTERACTION_SCALE = 0.7

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = config or SyntheticConfig()
        c = self.config
        ranks = np.arange(1, c.vocab_size + 1, dtype=np.float64)
        p = ranks ** -c.zipf_exponent
        self._cdf = np.cumsum(p / p.sum())
        rng = np.random.default_rng([c.seed, 7])
        self._dense_w = rng.normal(0, self.DENSE_SCALE, c.num_dense)

    def _ids(self, ranks: np.ndarray) -> np.ndarray:
        """Scramble Zipf ranks into hashed-looking ids, distinct per field."""
        fields = np.arange(self.config.num_sparse, dtype=np.uint64)[None, :]
        with np.errstate(over="ignore"):
            ids = (ranks.astype(np.uint64) + np.uint64(1)) * _GOLDEN + mix64(fields + np.uint64(self.config.seed << 8))
        return (ids & _ID_MASK).astype(np.int64)

    def _sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        ranks = np.searchsorted(self._cdf, rng.random((n, c.num_sparse)))
        ranks = np.minimum(ranks, c.vocab_size - 1)
        dense = rng.normal(0, 1, (n, c.num_dense)).astype(np.float32)
        return dense, self._ids(ranks)

    def true_logits(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Logits of the hidden model."""
        c = self.config
        keys = ids.astype(np.uint64)
        salt = c.seed * 1_000_003
        logit = self.BIAS + dense.astype(np.float64) @ self._dense_w
        logit = logit + c.id_scale * _normal(keys, salt + 11).sum(axis=1)
        k = c.interaction_dim
        dims = np.arange(k, dtype=np.uint64)[None, :] * _GOLDEN
        with np.errstate(over="ignore"):
            u = _normal(keys[:, 0:1] + dims, salt + 23)
            v = _normal(keys[:, 1:2] + dims, salt + 37)
        return logit + self.INTERACTION_SCALE * (u * v).sum(axis=1) / math.sqrt(k)

    def _batch(self, rng: np.random.Generator, n: int) -> Batch:
        dense, ids = self._sample(rng, n)
        p = 1.0 / (1.0 + np.exp(-self.true_logits(dense, ids)))
        labels = (rng.random(n) < p).astype(np.float32)
        return Batch(torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(labels))

    def batches(
        self, batch_size: int, num_batches: int, rank: int = 0, world_size: int = 1, start: int = 0, order: int = 0
    ) -> Iterator[Batch]:
        """Training batches; ranks of one job get disjoint, deterministic streams. ``order``
        (non-zero) draws other batches from the same distribution (another data order).

        Raises:
            ValueError: bad sizes or rank.
        """
        if batch_size < 1 or num_batches < 0:
            raise ValueError(f"batch_size must be >= 1 and num_batches >= 0, got {batch_size!r}, {num_batches!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size!r}), got {rank!r}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start!r}")
        for i in range(start, start + num_batches):
            key = [self.config.seed, 1, i * world_size + rank] + ([order] if order else [])
            yield self._batch(np.random.default_rng(key), batch_size)

    def eval_set(self, num_samples: int) -> Batch:
        """Held-out samples from a stream no training batch uses."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples!r}")
        return self._batch(np.random.default_rng([self.config.seed, 2]), num_samples)

    def true_probabilities(self, batch: Batch) -> torch.Tensor:
        """Click probabilities of the hidden model."""
        return torch.from_numpy(1.0 / (1.0 + np.exp(-self.true_logits(batch.dense.numpy(), batch.sparse.numpy()))))

    def bayes_log_loss(self, batch: Batch) -> float:
        """Log loss of the hidden model itself: the best any model can do on ``batch``."""
        logits = torch.from_numpy(self.true_logits(batch.dense.numpy(), batch.sparse.numpy()))
        return float(torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.double()))


# Longest a closed background stream waits for its producer to finish the batch in hand.
_JOIN_S = 10.0


def in_background(batches: Iterator[_T], depth: int = 4) -> Iterator[_T]:
    """Batches of ``batches`` produced on a background thread, up to ``depth`` ahead (like a
    DataLoader worker), so data preparation overlaps the step instead of adding to it.

    An exception in the producer is raised to the consumer; closing the iterator stops it."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def offer(item: object) -> bool:
        """Queue ``item`` unless the consumer has gone; whether it was queued."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for b in batches:
                if not offer(b):
                    return
            offer(done)
        except BaseException as exc:  # handed to the consumer
            offer(exc)

    producer = threading.Thread(target=produce, name="tether-data", daemon=True)
    producer.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        # Let the producer finish the batch it is making: a thread still inside torch while
        # the interpreter exits can abort the process ("terminate called ...").
        producer.join(_JOIN_S)


# -- Criteo -----------------------------------------------------------------------------------

CRITEO_DENSE = 13
CRITEO_SPARSE = 26

# Missing categorical values are stored as this raw value (so each field gets one reserved id).
_MISSING = (1 << 64) - 1
# Dense counts are clamped here before log1p; far beyond any real count, and float64-safe.
_DENSE_CAP = 1 << 62
# Bytes read from a file at a time (decompressed, for gzip): ~4,000 Criteo lines. Bounds what a
# reader holds, whatever the size of the file, and amortises numpy's per-call overhead.
_BLOCK_BYTES = 1 << 20

_U64 = np.uint64
_ONES = _U64(0x0101010101010101)
_HIGH = _U64(0x8080808080808080)
_LOW7 = _ONES * _U64(127)
_ZEROS = _U64(0x3030303030303030)  # eight ASCII '0'
_CASE = _U64(0x2020202020202020)
# _KEEP[k]: the last k bytes (the most significant, little-endian) of an 8-byte word.
_KEEP = np.array([0] + [((1 << 64) - 1) ^ ((1 << (8 * (8 - k))) - 1) for k in range(1, 9)], dtype=np.uint64)
_PAD = 16  # '0' bytes before a block, so the two words ending at any field's end can be read
_INT = re.compile(rb"[+-]?[0-9]+")
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")


class DataError(UsageError):
    """Data that cannot be read as asked: a source naming no file, a bad file, no samples."""


class MalformedLineError(DataError):
    """A line that is not in Criteo format; the message names the file and the line number."""


def _between(w: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """0x80 in each byte of ``w`` strictly between ``lo`` and ``hi`` (never in a byte >= 0x80)."""
    w7 = w & _LOW7
    return (_ONES * _U64(127 + hi) - w7) & ~w & (w7 + _ONES * _U64(127 - lo)) & _HIGH


def _all_digits(w: np.ndarray) -> np.ndarray:
    return _between(w, 0x2F, 0x3A) == _HIGH


def _all_hex(w: np.ndarray) -> np.ndarray:
    return (_between(w, 0x2F, 0x3A) | _between(w | _CASE, 0x60, 0x67)) == _HIGH


def _decimal8(w: np.ndarray) -> np.ndarray:
    """The value of eight ASCII digits, the first in the lowest byte (SWAR: three multiplies)."""
    v = w - _ZEROS
    v = (v * _U64(10) + (v >> _U64(8))) & _U64(0x00FF00FF00FF00FF)
    v = (v * _U64(100) + (v >> _U64(16))) & _U64(0x0000FFFF0000FFFF)
    return (v * _U64(10000) + (v >> _U64(32))) & _U64(0xFFFFFFFF)


def _hex8(w: np.ndarray) -> np.ndarray:
    """The value of eight ASCII hex digits (either case), the first in the lowest byte."""
    n = (w & _U64(0x0F0F0F0F0F0F0F0F)) + _U64(9) * ((w >> _U64(6)) & _ONES)
    n = ((n << _U64(4)) + (n >> _U64(8))) & _U64(0x00FF00FF00FF00FF)
    n = ((n << _U64(8)) + (n >> _U64(16))) & _U64(0x0000FFFF0000FFFF)
    return ((n << _U64(16)) + (n >> _U64(32))) & _U64(0xFFFFFFFF)


class _CriteoParser:
    """Parses blocks of whole Criteo lines at once with numpy.

    Each field is read as the 8-byte word that ends where the field ends (and the word before
    it, for 9-16 characters), its bytes before the field masked to ASCII '0'; the digits are
    checked and converted within the word (SWAR), so the work per field is a few integer
    operations whatever its content, and nothing is done per byte of the block but finding the
    tabs. Any line that fails a check sends the block to ``_explain``, which finds the first bad
    line with the plain rules and names it.
    """

    def __init__(self, num_dense: int, num_sparse: int) -> None:
        self.num_dense = num_dense
        self.num_sparse = num_sparse
        self.num_cols = 1 + num_dense + num_sparse
        self._field_salts = mix64(np.arange(num_sparse, dtype=np.uint64)[None, :] + _U64(0xC817E0))

    def parse(self, block: bytes, path: Path, linenos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Labels (float32 [n]), dense (float32 [n, num_dense]) and ids (int64 [n, num_sparse])
        of ``block``, whole lines each ending in ``\\n`` (no ``\\r``); ``linenos[i]`` is line
        ``i``'s number in ``path`` (for messages).

        Raises:
            MalformedLineError: the first bad line of the block.
        """
        padded = np.empty(len(block) + _PAD, np.uint8)
        padded[:_PAD] = 0x30
        a = padded[_PAD:]
        a[:] = np.frombuffer(block, np.uint8)
        words = np.ndarray((padded.size - 7,), dtype="<u8", buffer=padded, strides=(1,))
        cols = self.num_cols
        sep = np.flatnonzero(a <= 10)  # tabs and newlines, and any other control byte below
        kinds = a[sep]
        n = int(np.count_nonzero(kinds == 10))
        if sep.size != n * cols or not ((kinds.reshape(n, cols)[:, :-1] == 9).all() and (kinds[cols - 1 :: cols] == 10).all()):
            self._explain(block, path, linenos)
        lens = (np.diff(sep, prepend=-1) - 1).reshape(n, cols)
        ends = sep.reshape(n, cols)
        label = a[ends[:, 0] - 1]
        ok = (lens[:, 0] == 1) & ((label == 0x30) | (label == 0x31))

        nd = self.num_dense
        d_end, d_len = ends[:, 1 : 1 + nd], lens[:, 1 : 1 + nd]
        first = a[d_end - d_len]  # a field's first byte (its tab when empty)
        negative = (d_len > 0) & (first == 0x2D)
        digits = d_len - (negative | ((d_len > 0) & (first == 0x2B)))
        ok &= ((d_len == 0) | (digits > 0)).all(1)
        longest = int(digits.max(initial=0))
        w = self._word(words, d_end, np.minimum(digits, 8))
        ok &= _all_digits(w).all(1)
        counts = _decimal8(w)
        if longest > 8:
            w = self._word(words, d_end - 8, np.clip(digits - 8, 0, 8))
            ok &= _all_digits(w).all(1)
            counts += _decimal8(w) * _U64(100_000_000)
        if longest > 16:  # beyond 16 digits: rare enough for Python ints
            for i, j in zip(*np.nonzero(digits > 16)):
                text = bytes(a[d_end[i, j] - d_len[i, j] : d_end[i, j]])
                if _INT.fullmatch(text):
                    counts[i, j] = min(max(int(text), 0), _DENSE_CAP)
                else:
                    ok[i] = False
        counts[negative] = 0

        c_end, c_len = ends[:, 1 + nd :], lens[:, 1 + nd :]
        ok &= (c_len <= 16).all(1)
        w = self._word(words, c_end, np.minimum(c_len, 8))
        ok &= _all_hex(w).all(1)
        raw = _hex8(w)
        if int(c_len.max(initial=0)) > 8:
            w = self._word(words, c_end - 8, np.clip(c_len - 8, 0, 8))
            ok &= _all_hex(w).all(1)
            raw |= _hex8(w) << _U64(32)
        if not ok.all():
            self._explain(block, path, linenos)
        raw[c_len == 0] = _U64(_MISSING)
        raw ^= self._field_salts
        ids = (mix64(raw) & _ID_MASK).view(np.int64)
        dense = np.log1p(counts.astype(np.float64)).astype(np.float32)
        return (label == 0x31).astype(np.float32), dense, ids

    @staticmethod
    def _word(words: np.ndarray, ends: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """The 8 bytes before each of ``ends``, all but the last ``keep`` set to ASCII '0'."""
        w = words[ends + (_PAD - 8)]
        k = _KEEP[keep]
        return (w & k) | (_ZEROS & ~k)

    def _explain(self, block: bytes, path: Path, linenos: np.ndarray) -> None:
        """Raise for the first bad line of ``block``, checked one line at a time.

        Raises:
            MalformedLineError: always.
        """
        lines = block.split(b"\n")[:-1]
        for line, lineno in zip(lines, linenos.tolist()):
            problem = self._problem(line)
            if problem:
                raise MalformedLineError(f"{path}:{lineno}: {problem}")
        raise MalformedLineError(f"{path}:{int(linenos[0])}: a malformed line in the {len(lines)} lines from here")  # not reached

    def _problem(self, line: bytes) -> str | None:
        """What is wrong with one line (no newline), or None."""
        cols = line.split(b"\t")
        if len(cols) != self.num_cols:
            return f"expected {self.num_cols} tab-separated columns, got {len(cols)}"

        def text(v: bytes) -> str:
            return v.decode("utf-8", "backslashreplace")

        if cols[0] not in (b"0", b"1"):
            return f"label must be 0 or 1, got {text(cols[0])!r}"
        for j, v in enumerate(cols[1 : 1 + self.num_dense]):
            if v and not _INT.fullmatch(v):
                return f"integer column {j + 1} is not an integer: {text(v)!r}"
        for j, v in enumerate(cols[1 + self.num_dense :]):
            if v and not _HEX.fullmatch(v):
                return f"categorical column {j + 1} is not hex (1-16 digits): {text(v)!r}"
        return None


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
        return open(path, "rb")  # noqa: SIM115 (the caller closes it)
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
    f: BinaryIO = raw
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
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size!r}), got {rank!r}")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be >= 0 or None, got {epochs!r}")
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
        parser = _CriteoParser(self.num_dense, self.num_sparse)
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
                labels, dense, ids = (np.concatenate(x) if len(parts) > 1 else x[0] for x in zip(*parts))
                full = have - have % bs
                for s in range(0, full, bs):
                    yield Batch(torch.from_numpy(dense[s : s + bs]), torch.from_numpy(ids[s : s + bs]), torch.from_numpy(labels[s : s + bs]))
                parts = [(labels[full:], dense[full:], ids[full:])] if full < have else []
                have -= full
            if seen == 0:
                raise DataError(self._describe(self.rank, self.world_size))
            epoch += 1
        if have and not self.drop_last:
            labels, dense, ids = (np.concatenate(x) for x in zip(*parts))
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
    with Path(path).open("w") as f:
        for i in range(num_lines):
            ints = ["" if rng.random() < missing_rate else str(v) for v in counts[i]]
            hexes = ["" if rng.random() < missing_rate else f"{v:08x}" for v in cats[i]]
            f.write("\t".join([str(int(batch.labels[i])), *ints, *hexes]) + "\n")
