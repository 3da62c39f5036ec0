"""Click-log data for the CTR model: a synthetic generator with a known best loss, and the
Criteo TSV format.

Feature ids look like hashed production features: large non-negative int64 values, one
column per categorical field (each field is its own embedding table ``cat_<j>``).
"""

from __future__ import annotations

import math
import queue
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from tether.protos.partition import mix64

__all__ = ["Batch", "CriteoTSV", "SyntheticClickLog", "SyntheticConfig", "in_background", "iterate", "load_criteo", "write_criteo_sample"]

_ID_MASK = np.uint64((1 << 62) - 1)
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

    def batches(self, batch_size: int, num_batches: int, rank: int = 0, world_size: int = 1, start: int = 0) -> Iterator[Batch]:
        """Training batches; ranks of one job get disjoint, deterministic streams.

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
            yield self._batch(np.random.default_rng([self.config.seed, 1, i * world_size + rank]), batch_size)

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


def in_background(batches: Iterator[Batch], depth: int = 4) -> Iterator[Batch]:
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

    threading.Thread(target=produce, name="tether-data", daemon=True).start()
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


# -- Criteo -----------------------------------------------------------------------------------

CRITEO_DENSE = 13
CRITEO_SPARSE = 26

# A categorical value is 1-16 hex digits; int(s, 16) alone would also take "0x1f", "-1f",
# "1_f" and " 1f", and a 17th digit would overflow the uint64 it is stored in.
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")
# Missing categorical values are stored as this raw value (so each field gets one reserved id).
_MISSING = (1 << 64) - 1
# Dense counts are clamped here before log1p; far beyond any real count, and float64-safe.
_DENSE_CAP = 1 << 62


class CriteoTSV:
    """A Criteo-format TSV file: ``label``, integer columns, hex categorical columns, any empty.

    Dense values: missing or negative -> 0, then ``log1p``. Categorical values: the hex value
    hashed with its field index into a non-negative int64 id (so fields do not collide);
    missing -> one reserved id per field.

    Args:
        path: the file.
        num_dense: integer columns per line (13 in Criteo).
        num_sparse: categorical columns per line (26 in Criteo).

    Raises:
        ValueError: a column count below 1.
    """

    def __init__(self, path: str | Path, num_dense: int = CRITEO_DENSE, num_sparse: int = CRITEO_SPARSE) -> None:
        if num_dense < 1 or num_sparse < 1:
            raise ValueError(f"num_dense and num_sparse must be >= 1, got {num_dense!r}, {num_sparse!r}")
        self.path = Path(path)
        self.num_dense = num_dense
        self.num_sparse = num_sparse
        with np.errstate(over="ignore"):
            self._field_salts = mix64(np.arange(num_sparse, dtype=np.uint64)[None, :] + np.uint64(0xC817E0))

    def _parse_line(self, lineno: int, line: str) -> tuple[float, list[int], list[int]]:
        """One line as (label, dense counts, raw categorical values).

        Raises:
            ValueError: a malformed line; the message names the file and line.
        """
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

    def batches(self, batch_size: int, num_batches: int | None = None, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        """One pass over the file in batches of ``rank``'s lines (line ``i`` goes to rank
        ``i % world_size``); the last batch may be short.

        Args:
            batch_size: samples per batch.
            num_batches: stop after this many batches; ``None``: at the end of the file.
            rank: this worker's index in ``[0, world_size)``.
            world_size: workers sharing the file.

        Raises:
            ValueError: bad sizes or rank, or a malformed line of this rank's share.
            FileNotFoundError: no such file.
        """
        if batch_size < 1 or (num_batches is not None and num_batches < 0):
            raise ValueError(f"batch_size must be >= 1 and num_batches >= 0 or None, got {batch_size!r}, {num_batches!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size!r}), got {rank!r}")
        if num_batches == 0:
            return
        done = 0
        labels: list[float] = []
        dense: list[list[int]] = []
        cats: list[list[int]] = []
        with self.path.open() as f:
            for i, line in enumerate(f):
                # Other ranks' lines are skipped unparsed: each worker pays only for its share.
                if i % world_size != rank:
                    continue
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

    def read_all(self) -> Batch:
        """Every line of the file as one batch.

        Raises:
            ValueError: a malformed line, or an empty file.
            FileNotFoundError: no such file.
        """
        parts = list(self.batches(1 << 16))
        if not parts:
            raise ValueError(f"{self.path}: no samples")
        return Batch(*(torch.cat(ts) for ts in zip(*parts)))


def load_criteo(path: str | Path, eval_fraction: float = 0.1) -> tuple[Batch, Batch]:
    """Read a Criteo TSV file (label, 13 integer and 26 hex columns; any may be empty).

    Returns:
        The training samples and the held-out samples (the last ``eval_fraction`` of lines).

    Raises:
        ValueError: a malformed line (the message names the file and line), or too few lines.
        FileNotFoundError: no such file.
    """
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    everything = CriteoTSV(path).read_all()
    n = everything.labels.numel()
    cut = n - max(1, int(round(n * eval_fraction)))
    if cut < 1:
        raise ValueError(f"{path}: {n} samples are too few to split into training and held-out sets")
    train = Batch(*(t[:cut] for t in everything))
    held_out = Batch(*(t[cut:] for t in everything))
    return train, held_out


def iterate(data: Batch, batch_size: int, rank: int = 0, world_size: int = 1, epochs: int | None = 1) -> Iterator[Batch]:
    """Batches of ``rank``'s share of ``data`` (every ``world_size``-th sample), for ``epochs``
    passes (``None``: forever)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size!r}), got {rank!r}")
    if epochs is not None and epochs < 0:
        raise ValueError(f"epochs must be >= 0 or None, got {epochs!r}")
    share = Batch(*(t[rank::world_size] for t in data))
    n = share.labels.numel()
    if n == 0:
        raise ValueError(f"rank {rank} of {world_size} has no samples")
    epoch = 0
    while epochs is None or epoch < epochs:
        for start in range(0, n, batch_size):
            yield Batch(*(t[start : start + batch_size] for t in share))
        epoch += 1


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
