"""What a Parquet stream makes of a record batch: stable hashes of string ids, the held-out rule
(``HoldOut``), blocks of decoded samples as numpy arrays, and a stream's position
(``tether.worker.data.parquet`` re-exports the public names)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tether.protos.partition import mix64, mix64_
from tether.worker.data.parquet_nulls import DenseNulls
from tether.worker.data.parquet_schema import load_pyarrow
from tether.worker.data.synthetic import ID_MASK, DataError

__all__ = ["Decoder", "HoldOut", "Pos", "Rows", "hash_strings"]

_HASH_SALT = np.uint64(0x7E7E_5A17_0F0F_1234)


# -- hashing and held-out rules ---------------------------------------------------------------------


def hash_strings(array: Any) -> np.ndarray:
    """A stable 64-bit hash (uint64) of each value of a pyarrow string or binary array, from its
    bytes alone (the same value hashes the same in every file, process and run); nulls hash as
    the empty string. Vectorised: a few numpy passes over the bytes, nothing per value."""
    pa, _ = load_pyarrow()
    arr = array.dictionary_decode() if pa.types.is_dictionary(array.type) else array
    n = len(arr)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset : arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    if arr.null_count:
        valid = np.asarray(arr.is_valid())
        lengths = np.where(valid, lengths, 0)
    begin = offsets[:-1]
    total = int(lengths.sum())
    sums = np.zeros(n, dtype=np.uint64)
    if total:
        starts = np.repeat(begin, lengths)
        seg = np.repeat(np.cumsum(lengths) - lengths, lengths)
        within = np.arange(total, dtype=np.int64) - seg
        byte = data[starts + within].astype(np.uint64) + np.uint64(1)
        byte *= mix64_(within.astype(np.uint64) + _HASH_SALT)
        nonempty = lengths > 0
        sums[nonempty] = np.add.reduceat(byte, (np.cumsum(lengths) - lengths)[nonempty])
    return mix64_(sums ^ mix64_(lengths.astype(np.uint64) + _HASH_SALT))


@dataclass(frozen=True)
class HoldOut:
    """Which rows are held out: never in a training stream, and the only rows of a held-out one
    (``ParquetStream(..., held_out=True)``). Held-out data in separate files needs no rule:
    open a stream on those files.

    Build it with ``HoldOut.every_nth(k)`` or ``HoldOut.by_key(column, fraction)``.

    Attributes:
        every: row ``i`` of the table (rows numbered from 0 across the files in order) is held
            out when ``i % every == every - 1`` (tether's Criteo reader holds out lines the
            same way, so a converted file holds out the same rows).
        column: a key column (integer or string): a row is held out when its key's hash falls
            in the first ``fraction`` of the hash range, so all rows of a user (say) are on one
            side, whatever the files, ranks or order; null keys are all on one side.
        fraction: the share of keys held out, in (0, 1).
    """

    every: int | None = None
    column: str | None = None
    fraction: float = 0.1

    @classmethod
    def every_nth(cls, k: int) -> HoldOut:
        """Hold out row ``i`` when ``i % k == k - 1``."""
        return cls(every=k)

    @classmethod
    def by_key(cls, column: str, fraction: float = 0.1) -> HoldOut:
        """Hold out the rows whose ``column`` hashes into the first ``fraction`` of the range."""
        return cls(column=column, fraction=fraction)

    def __post_init__(self) -> None:
        if (self.every is None) == (self.column is None):
            raise ValueError(f"HoldOut needs exactly one of every= and column=, got every={self.every!r}, column={self.column!r}")
        if self.every is not None and self.every < 2:
            raise ValueError(f"HoldOut every must be >= 2, got {self.every!r}")
        if self.column is not None and not 0 < self.fraction < 1:
            raise ValueError(f"HoldOut fraction must be in (0, 1), got {self.fraction!r}")

    def describe(self) -> str:
        """The rule in words (also what a position records of it)."""
        if self.every is not None:
            return f"every {self.every}th row"
        return f"{self.fraction:g} of the keys of column {self.column!r}"

    def held(self, batch: Any, first_row: int) -> np.ndarray:
        """Which rows of ``batch`` (a pyarrow RecordBatch whose first row is row ``first_row``
        of the table) are held out."""
        if self.every is not None:
            i = np.arange(first_row, first_row + batch.num_rows, dtype=np.int64)
            return i % self.every == self.every - 1
        keys = _key_hash(batch.column(batch.schema.get_field_index(self.column)))
        return (keys >> np.uint64(11)).astype(np.float64) < self.fraction * float(1 << 53)


def _key_hash(col: Any) -> np.ndarray:
    """uint64 hash of each key (integers by their 64 bits, strings by their bytes)."""
    pa, _ = load_pyarrow()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if pa.types.is_integer(col.type):
        raw = np.asarray(col.fill_null(0) if col.null_count else col).astype(np.int64).view(np.uint64)
        return mix64(raw ^ _HASH_SALT)
    return hash_strings(col)


# -- rows: a block of decoded samples as numpy arrays ----------------------------------------------


@dataclass
class Rows:
    """Samples as numpy arrays: ``cols`` per sample ([n] or [n, k]), ``bags`` as (flat values,
    lengths [n])."""

    n: int
    cols: dict[str, np.ndarray]
    bags: dict[str, tuple[np.ndarray, np.ndarray]]
    _ends: dict[str, np.ndarray] = field(default_factory=dict)

    def _bag_ends(self, name: str) -> np.ndarray:
        """Where each sample's bag ends in the flat values (cached: slicing a buffer into
        batches would otherwise sum the lengths again for every batch)."""
        ends = self._ends.get(name)
        if ends is None:
            ends = self._ends[name] = np.cumsum(self.bags[name][1])
        return ends

    def slice(self, a: int, b: int) -> Rows:
        if a == 0 and b == self.n:
            return self
        bags = {}
        for k, (values, lengths) in self.bags.items():
            ends = self._bag_ends(k)
            lo = int(ends[a - 1]) if a else 0
            hi = int(ends[b - 1]) if b else 0
            bags[k] = (values[lo:hi], lengths[a:b])
        return Rows(b - a, {k: v[a:b] for k, v in self.cols.items()}, bags)

    def take(self, idx: np.ndarray) -> Rows:
        bags = {}
        for k, (values, lengths) in self.bags.items():
            starts = self._bag_ends(k) - lengths
            new_lengths = lengths[idx]
            total = int(new_lengths.sum())
            src = np.repeat(starts[idx] - (np.cumsum(new_lengths) - new_lengths), new_lengths) + np.arange(total, dtype=np.int64)
            bags[k] = (values[src], new_lengths)
        return Rows(len(idx), {k: v[idx] for k, v in self.cols.items()}, bags)

    @staticmethod
    def concat(parts: Sequence[Rows]) -> Rows:
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        return Rows(
            sum(p.n for p in parts),
            {k: np.concatenate([p.cols[k] for p in parts]) for k in first.cols},
            {k: (np.concatenate([p.bags[k][0] for p in parts]), np.concatenate([p.bags[k][1] for p in parts])) for k in first.bags},
        )


@dataclass(frozen=True)
class Pos:
    """Where a stream is: the chunk being emitted starts at piece ``piece`` of the ``unit``-th
    row group of epoch ``epoch``'s order, and ``skip`` of its rows were emitted already."""

    epoch: int
    unit: int
    piece: int
    skip: int


@dataclass(frozen=True)
class Decoder:
    """What a stream makes of each record batch it reads: its label, ids, bags and dense
    columns (the CTR model's layout with ``ctr``), the held-out rule and which side of it the
    stream yields, each id or bag column's id for a null, and what a missing dense value reads as."""

    label: str
    ids: tuple[str, ...]
    bags: tuple[str, ...]
    dense: tuple[str, ...]
    ctr: bool
    holdout: HoldOut | None
    held_out: bool
    null_ids: Mapping[str, int]
    dense_nulls: DenseNulls

    def rows(self, batch: Any, path: Path, group: int, first_row: int) -> Rows:
        """A record batch (rows from ``first_row`` of the table, in row group ``group`` of
        ``path``) as ``Rows``, the held-out rule applied.

        Raises:
            DataError: a null label, naming the file and the row group.
        """
        pa, _ = load_pyarrow()
        keep: np.ndarray | None = None
        if self.holdout is not None:
            held = self.holdout.held(batch, first_row)
            keep = held if self.held_out else ~held
            if keep.all():
                keep = None
        n = batch.num_rows if keep is None else int(keep.sum())
        names = batch.schema.names

        def column(name: str) -> Any:
            col = batch.column(names.index(name))
            return col.dictionary_decode() if pa.types.is_dictionary(col.type) else col

        def pick(a: np.ndarray) -> np.ndarray:
            return a if keep is None else a[keep]

        lab = column(self.label)
        if lab.null_count:
            raise DataError(f"{path}: column {self.label!r} (the label) has {lab.null_count} null(s) in row group {group}")
        labels = pick(lab.to_numpy(zero_copy_only=False)).astype(np.float32)
        cols: dict[str, np.ndarray] = {"label": labels}
        if self.dense:
            dense = np.empty((n, len(self.dense)), dtype=np.float32)
            for j, name in enumerate(self.dense):
                dense[:, j] = pick(column(name).to_numpy(zero_copy_only=False))  # a null reads as NaN here
                self.dense_nulls.apply(dense[:, j], name, path, group)
            cols["dense"] = dense
        if self.ids:
            stacked = np.empty((n, len(self.ids)), dtype=np.int64) if self.ctr else None
            for j, name in enumerate(self.ids):
                values = pick(self._id_values(column(name), name))
                if stacked is not None:
                    stacked[:, j] = values
                else:
                    cols[name] = values if values.flags.writeable and values.flags.owndata else values.copy()
            if stacked is not None:
                cols["sparse"] = stacked
        bags: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name in self.bags:
            col = column(name)
            lengths = col.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            values = self._id_values(col.flatten(), name)
            if keep is not None:
                values = values[np.repeat(keep, lengths)]
                lengths = lengths[keep]
            bags[name] = (values, lengths)
        return Rows(n, cols, bags)

    def _id_values(self, col: Any, name: str) -> np.ndarray:
        """int64 ids of an integer or string column (nulls: the column's reserved id)."""
        pa, _ = load_pyarrow()
        if pa.types.is_dictionary(col.type):
            col = col.dictionary_decode()
        if pa.types.is_integer(col.type):
            if col.null_count:
                # The reserved id is a 62-bit value: a narrower column (pandas' nullable Int32,
                # Int16, UInt32, a list<int32> bag) is widened before it takes it.
                if col.type.bit_width < 64:
                    col = col.cast(pa.int64())
                col = col.fill_null(self.null_ids[name])
            a = col.to_numpy(zero_copy_only=False)
            return a.view(np.int64) if a.dtype == np.uint64 else a.astype(np.int64, copy=False)
        h = hash_strings(col) & ID_MASK
        if col.null_count:
            h[~np.asarray(col.is_valid())] = self.null_ids[name]
        return h.view(np.int64)
