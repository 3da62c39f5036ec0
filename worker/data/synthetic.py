"""Batches for the CTR model: the ``Batch`` type, a synthetic click log with a known best loss,
and background prefetching of any batch stream (Criteo-format files: ``tether.worker.data.criteo``).

Feature ids look like hashed production features: large non-negative int64 values, one
column per categorical field (each field is its own embedding table ``cat_<j>``).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from tether.protos.errors import UsageError
from tether.protos.partition import mix64
from tether.rules.kernel_cache import compiled

__all__ = [
    "ID_MASK", "Batch", "DataError", "MalformedLineError", "SyntheticClickLog", "SyntheticConfig", "SyntheticStream", "check_stream",
    "in_background",
]

# Feature ids are non-negative int64 values below 2**62.
ID_MASK = np.uint64((1 << 62) - 1)
_T = TypeVar("_T")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class Batch(NamedTuple):
    """A batch of samples."""

    dense: torch.Tensor  # float32 [B, num_dense]
    sparse: torch.Tensor  # int64 [B, num_sparse], ids >= 0
    labels: torch.Tensor  # float32 [B], 0 or 1


class DataError(UsageError):
    """Data that cannot be read as asked: a source naming no file, a bad file, no samples."""


class MalformedLineError(DataError):
    """A line that is not in Criteo format; the message names the file and the line number."""


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


# Parts of [0, 1) that _zipf_ranks looks a uniform's part of the CDF up in (a power of two, so
# that u * _BUCKETS and b / _BUCKETS are exact).
_BUCKETS = 1 << 16


@compiled()
def _zipf_ranks(u: np.ndarray, cdf: np.ndarray, starts: np.ndarray, out: np.ndarray) -> None:
    """``out = np.searchsorted(cdf, u)`` (the first index whose CDF value is >= u), exactly, for
    uniforms in [0, 1): u's part b of [0, 1) bounds the answer by ``starts[b]`` and
    ``starts[b + 1]`` (``searchsorted`` of b / _BUCKETS and (b + 1) / _BUCKETS), and a binary
    search of that span (a few entries of the CDF, near each other) finds it; a search of the
    whole CDF per uniform misses the cache at every step."""
    parts = len(starts) - 1
    for i in range(len(u)):
        x = u[i]
        b = int(x * parts)
        lo, hi = starts[b], starts[b + 1]
        while lo < hi:
            mid = (lo + hi) >> 1
            if cdf[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        out[i] = lo


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
        # Where each of _BUCKETS equal parts of [0, 1) starts in the CDF (see _zipf_ranks).
        self._starts = np.searchsorted(self._cdf, np.arange(_BUCKETS + 1) / _BUCKETS)
        rng = np.random.default_rng([c.seed, 7])
        self._dense_w = rng.normal(0, self.DENSE_SCALE, c.num_dense)

    def _ids(self, ranks: np.ndarray) -> np.ndarray:
        """Scramble Zipf ranks into hashed-looking ids, distinct per field."""
        fields = np.arange(self.config.num_sparse, dtype=np.uint64)[None, :]
        with np.errstate(over="ignore"):
            ids = (ranks.astype(np.uint64) + np.uint64(1)) * _GOLDEN + mix64(fields + np.uint64(self.config.seed << 8))
        return (ids & ID_MASK).astype(np.int64)

    def _sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        u = rng.random((n, c.num_sparse))
        ranks = np.empty(u.shape, np.int64)
        _zipf_ranks(u.reshape(-1), self._cdf, self._starts, ranks.reshape(-1))
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


class SyntheticStream:
    """One worker's batches of a ``SyntheticClickLog`` with a position to resume from, as
    ``ParquetStream`` has: ``state_dict(batches=n)`` says where the stream is after n batches of
    this iteration, and a stream opened with ``resume=`` that position yields the batches that
    follow it (batch ``i`` of a rank is drawn from its own seed, so resuming skips nothing it
    has to compute). A restarted worker given its last position (``--resume-data``) reads on,
    neither replaying its share from the start nor skipping any of it.

    Args:
        log: the click log (its seed fixes every batch).
        batch_size, num_batches: ``num_batches`` batches of ``batch_size`` samples per iteration.
        rank, world_size, order: as ``SyntheticClickLog.batches``.
        resume: a position from ``state_dict()`` of a stream with the same log seed, batch
            size, rank, world size and order.

    Raises:
        ValueError: bad sizes or rank.
        DataError: ``resume`` is not such a position, or was taken with another setup.
    """

    def __init__(self, log: SyntheticClickLog, batch_size: int, num_batches: int, rank: int = 0, world_size: int = 1, order: int = 0,
                 resume: Mapping[str, Any] | None = None) -> None:
        check_stream(batch_size, rank, world_size, epochs=None)
        if num_batches < 0:
            raise ValueError(f"num_batches must be >= 0, got {num_batches!r}")
        self.log, self.batch_size, self.num_batches = log, batch_size, num_batches
        self.rank, self.world_size, self.order = rank, world_size, order
        self.start = 0
        if resume is not None:
            self.load_state_dict(resume)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        return self.log.batches(self.batch_size, self.num_batches, rank=self.rank, world_size=self.world_size, start=self.start,
                                order=self.order)

    def _setup(self) -> dict[str, int]:
        return {"seed": self.log.config.seed, "batch_size": self.batch_size, "rank": self.rank, "world_size": self.world_size,
                "order": self.order}

    def state_dict(self, batches: int = 0) -> dict[str, Any]:
        """Where this stream is after ``batches`` batches of an iteration (0: where it starts),
        as a small JSON-able dict (pass it as ``resume=``): ``synthetic_batch``, the index of
        the next batch of this rank's stream, and the setup that fixes the batches."""
        if batches < 0:
            raise ValueError(f"state_dict(batches={batches!r}): expected batches >= 0")
        return {"synthetic_batch": self.start + batches, **self._setup()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Start the next iteration at ``state`` (from ``state_dict()`` of a stream with the same setup).

        Raises:
            DataError: ``state`` is not a synthetic stream's position, or names another setup.
        """
        batch = state.get("synthetic_batch") if isinstance(state, Mapping) else None
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 0:
            raise DataError(f"resume: not a synthetic stream's position (no batch index >= 0 under 'synthetic_batch'): {dict(state)!r}"
                            if isinstance(state, Mapping) else f"resume: not a synthetic stream's position: {state!r}")
        other = {k: (state.get(k), v) for k, v in self._setup().items() if state.get(k) != v}
        if other:
            what = ", ".join(f"{k} {was!r}, now {now!r}" for k, (was, now) in other.items())
            raise DataError(f"resume: the position was taken with another setup ({what}): it would name other batches")
        self.start = batch


# Longest a closed background stream waits for its producer to finish the batch in hand.
_JOIN_S = 10.0


def check_stream(batch_size: int, rank: int, world_size: int, epochs: int | None) -> None:
    """The settings every file stream takes (Criteo TSV, Parquet).

    Raises:
        ValueError: a batch size below 1, a rank outside [0, world_size), or negative epochs.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size!r}), got {rank!r}")
    if epochs is not None and epochs < 0:
        raise ValueError(f"epochs must be >= 0 or None, got {epochs!r}")


def in_background(batches: Iterator[_T], depth: int = 4) -> Generator[_T, None, None]:
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
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
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
