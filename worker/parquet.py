"""Parquet training data: files by path, glob, folder or list, streamed a slice of a row group at a
time (memory does not grow with the data), row groups dealt to ranks, a bounded seeded shuffle,
epochs, a held-out split by a rule the user names, and a position to resume from.

Needs ``pyarrow`` (``pip install 'tether[parquet]'``); without it, opening a stream is a
one-line ``DataError``.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tether.protos.partition import mix64, mix64_
from tether.worker.criteo import CRITEO_DENSE, CRITEO_SPARSE, CriteoStream, criteo_files
from tether.worker.data import ID_MASK, Batch, DataError, check_stream

__all__ = [
    "CONVERT_ROW_GROUP_ROWS",
    "PARQUET_READ_ROWS",
    "HoldOut",
    "ParquetStream",
    "check_parquet",
    "criteo_parquet_columns",
    "hash_strings",
    "parquet_files",
    "write_criteo_parquet",
]

# Rows decoded at a time within a row group: what a reader holds is a few of these, whatever
# the size of the files (a Criteo-shaped row is ~260 bytes decoded: ~17 MiB a slice).
PARQUET_READ_ROWS = 65_536
# Rows per row group that ``write_criteo_parquet`` writes: big enough that a row group's
# per-read costs vanish, small enough that a day of Criteo (45M rows) deals to hundreds of ranks.
CONVERT_ROW_GROUP_ROWS = 131_072
# Positions of the batches a stream yielded last, kept for consumers that read ahead
# (``Trainer.fit`` prepares up to 4 batches on a background thread, and holds 2 more).
_POSITIONS_KEPT = 64
_POSITION_VERSION = 1
_HASH_SALT = np.uint64(0x7E7E_5A17_0F0F_1234)


def _pyarrow() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``.

    Raises:
        DataError: pyarrow is not installed.
    """
    try:
        import pyarrow as pa  # type: ignore[import-untyped]
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:
        raise DataError("reading Parquet needs pyarrow: pip install 'tether[parquet]'") from None
    return pa, pq


# -- files ------------------------------------------------------------------------------------------


def parquet_files(source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The Parquet files a source names, in reading order.

    Args:
        source: a path; a folder (its ``*.parquet`` files at any depth, sorted by path, as Spark
            and Hive write them); a glob (its matches sorted by name); a comma-separated list
            of these; or a sequence of them. A leading ``parquet:`` is dropped, so ``--data``
            values can be passed as they are.

    Raises:
        DataError: an entry that matches no file, a folder holding no ``.parquet`` file, a
            file named twice, or nothing at all.
    """
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        text = text[len("parquet:") :] if text.startswith("parquet:") else text
        entries: list[str] = [text] if os.path.exists(text) else [e for e in text.split(",") if e]
    else:
        entries = [os.fspath(e) for e in source]
    if not entries:
        raise DataError(f"{source!s}: names no file")
    expanded: list[str] = []
    for entry in entries:
        if os.path.isdir(entry):
            found = sorted(str(p) for p in Path(entry).rglob("*.parquet") if p.is_file())
            if not found:
                raise DataError(f"{entry}: a folder with no .parquet file in it")
            expanded.extend(found)
        else:
            expanded.append(entry)
    return criteo_files(expanded)


@dataclass(frozen=True)
class _Unit:
    """One row group: the unit dealt to ranks."""

    file: int  # index into the stream's files
    group: int  # row group within the file
    rows: int
    first: int  # number of its first row, counting rows across all files in order


def _open(path: Path) -> Any:
    """``path`` as a ``pyarrow.parquet.ParquetFile``.

    Raises:
        DataError: missing, unreadable, not Parquet, or truncated (its footer gone).
    """
    pa, pq = _pyarrow()
    try:
        return pq.ParquetFile(path)
    except OSError as exc:
        raise DataError(f"{path}: {exc.strerror or exc}") from exc
    except (pa.ArrowException, ValueError) as exc:
        raise DataError(f"{path}: not a Parquet file, or truncated ({' '.join(str(exc).split())})") from exc


# -- columns ----------------------------------------------------------------------------------------


def _plain(t: Any) -> Any:
    """A dictionary type's value type (pyarrow reads some string columns as dictionaries)."""
    pa, _ = _pyarrow()
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_id_type(t: Any) -> bool:
    pa, _ = _pyarrow()
    t = _plain(t)
    return bool(pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
                or pa.types.is_binary(t) or pa.types.is_large_binary(t))


def _is_number_type(t: Any) -> bool:
    pa, _ = _pyarrow()
    t = _plain(t)
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _is_bag_type(t: Any) -> bool:
    pa, _ = _pyarrow()
    return bool((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and _is_id_type(t.value_type))


_ROLES = {
    "label": (_is_number_type, "a number (integer, float or bool)"),
    "id": (_is_id_type, "integer or string (ids; strings are hashed)"),
    "bag": (_is_bag_type, "a list of integers or strings (a variable-length bag of ids)"),
    "dense": (_is_number_type, "a number (integer, float or bool; read as float32)"),
    "key": (_is_id_type, "integer or string (the held-out rule hashes it)"),
}


def _infer(schema: Any, label: str, path: Path, ctr: bool) -> tuple[list[str], list[str], list[str]]:
    """``(ids, bags, dense)`` from a schema: float columns are dense features, integer and
    string columns ids, list columns bags (the built-in CTR job takes no bags).

    Raises:
        DataError: a column of another type, named with the file.
    """
    pa, _ = _pyarrow()
    ids: list[str] = []
    bags: list[str] = []
    dense: list[str] = []
    for f in schema:
        if f.name == label:
            continue
        t = _plain(f.type)
        if pa.types.is_floating(t):
            dense.append(f.name)
        elif _is_id_type(t):
            ids.append(f.name)
        elif _is_bag_type(f.type) and not ctr:
            bags.append(f.name)
        else:
            what = (
                "float dense features and integer or string ids"
                if ctr
                else "floats (dense), integers or strings (ids) and lists of them (bags)"
            )
            raise DataError(
                f"{path}: column {f.name!r} is {f.type}: tether reads {what}; "
                "name the columns to read (ids=, bags=, dense=) to leave it out"
            )
    return ids, bags, dense


def _check_schema(
    path: Path, schema: Any, roles: Mapping[str, str], first: Path | None = None, first_types: Mapping[str, Any] | None = None
) -> None:
    """Every column of ``roles`` is in ``schema`` with a type its role takes (and, past the
    first file, the type the first file gave it).

    Raises:
        DataError: one line naming the file and the column.
    """
    names = schema.names
    for name, role in roles.items():
        if name not in names:
            shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
            raise DataError(f"{path}: no column {name!r} (its columns: {shown})")
        t = schema.field(name).type
        check, expected = _ROLES[role]
        if not check(t):
            raise DataError(f"{path}: column {name!r} is {t}, but a {role} column must be {expected}")
        if first_types is not None and name in first_types and _kind(t) != _kind(first_types[name]):
            raise DataError(f"{path}: column {name!r} is {t}, but {first} has it as {first_types[name]}")


def _kind(t: Any) -> str:
    """What a type reads as: files that differ only in integer width or dictionary encoding agree."""
    pa, _ = _pyarrow()
    t = _plain(t)
    if _is_bag_type(t):
        return "bag of " + _kind(t.value_type)
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    return "string"


def criteo_parquet_columns(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], label: str = "label"
) -> tuple[list[str], list[str]]:
    """``(dense, ids)`` of a Criteo-shaped table as the built-in CTR job reads it: every float
    column but ``label`` is a dense feature, every integer or string column an id (one table
    each), in the first file's column order; the other files must agree.

    Raises:
        DataError: no such file, not Parquet, no ``label``, no dense or no id column, a column of
            another type (lists too), or files that disagree; one line naming the file and the column.
    """
    files = parquet_files(source)
    schema = _open(files[0]).schema_arrow
    if label not in schema.names:
        raise DataError(f"{files[0]}: no column {label!r} (the label; its columns: {', '.join(schema.names[:12])})")
    ids, _, dense = _infer(schema, label, files[0], ctr=True)
    if not dense or not ids:
        raise DataError(f"{files[0]}: the built-in CTR job needs float dense columns and integer or string id columns, "
                        f"found {len(dense)} float and {len(ids)} id columns")
    roles = {label: "label", **dict.fromkeys(dense, "dense"), **dict.fromkeys(ids, "id")}
    types = {f.name: f.type for f in schema}
    _check_schema(files[0], schema, roles)
    for f in files[1:]:
        _check_schema(f, _open(f).schema_arrow, roles, files[0], types)
    return dense, ids


def check_parquet(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, world_size: int = 1, label: str = "label"
) -> tuple[list[str], list[str]]:
    """Check up front what ``--data parquet:SOURCE`` will read: every file's schema (as
    ``criteo_parquet_columns``), and enough row groups that each of ``world_size`` workers gets
    some. Returns ``(dense, ids)``.

    Raises:
        DataError: one line naming the file and the column, or the row group count.
    """
    files = parquet_files(source)
    dense, ids = criteo_parquet_columns(files, label)
    _deal(_units(files), 0, world_size, files)
    return dense, ids


def _units(files: Sequence[Path], metadata: Sequence[Any] | None = None) -> list[_Unit]:
    """Every row group of ``files``, in order (from their ``metadata`` when already read).

    Raises:
        DataError: a file that is not Parquet or is truncated.
    """
    units: list[_Unit] = []
    first = 0
    for i, path in enumerate(files):
        meta = metadata[i] if metadata is not None else _open(path).metadata
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            units.append(_Unit(i, g, rows, first))
            first += rows
    return units


def _deal(units: Sequence[_Unit], rank: int, world_size: int, files: Sequence[Path]) -> list[_Unit]:
    """Rank ``rank``'s row groups: each goes to the rank holding the fewest rows so far (ties:
    the lowest rank), in file order, so shares differ by at most one row group and every rank
    reads only its own row groups of each file.

    Raises:
        DataError: some rank would get no rows.
    """
    heap = [(0, r) for r in range(world_size)]  # (rows so far, rank): a heap from the start
    mine: list[_Unit] = []
    for u in units:
        if u.rows == 0:
            continue
        load, r = heapq.heappop(heap)
        heapq.heappush(heap, (load + u.rows, r))
        if r == rank:
            mine.append(u)
    empty = sorted(r for load, r in heap if load == 0)
    if empty:
        where = str(files[0]) if len(files) == 1 else f"{files[0]} and {len(files) - 1} more files"
        groups = sum(1 for u in units if u.rows)
        raise DataError(f"{where}: {groups} non-empty row group(s) for {world_size} workers: worker {empty[0]} would read nothing; "
                        "write smaller row groups (tether convert --row-group-rows) or more files")
    return mine


# -- hashing and held-out rules ---------------------------------------------------------------------


def hash_strings(array: Any) -> np.ndarray:
    """A stable 64-bit hash (uint64) of each value of a pyarrow string or binary array, from its
    bytes alone (the same value hashes the same in every file, process and run); nulls hash as
    the empty string. Vectorised: a few numpy passes over the bytes, nothing per value."""
    pa, _ = _pyarrow()
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
    pa, _ = _pyarrow()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if pa.types.is_integer(col.type):
        raw = np.asarray(col.fill_null(0) if col.null_count else col).astype(np.int64).view(np.uint64)
        return mix64(raw ^ _HASH_SALT)
    return hash_strings(col)


# -- rows: a block of decoded samples as numpy arrays ----------------------------------------------


@dataclass
class _Rows:
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

    def slice(self, a: int, b: int) -> _Rows:
        if a == 0 and b == self.n:
            return self
        bags = {}
        for k, (values, lengths) in self.bags.items():
            ends = self._bag_ends(k)
            lo = int(ends[a - 1]) if a else 0
            hi = int(ends[b - 1]) if b else 0
            bags[k] = (values[lo:hi], lengths[a:b])
        return _Rows(b - a, {k: v[a:b] for k, v in self.cols.items()}, bags)

    def take(self, idx: np.ndarray) -> _Rows:
        bags = {}
        for k, (values, lengths) in self.bags.items():
            starts = self._bag_ends(k) - lengths
            new_lengths = lengths[idx]
            total = int(new_lengths.sum())
            src = np.repeat(starts[idx] - (np.cumsum(new_lengths) - new_lengths), new_lengths) + np.arange(total, dtype=np.int64)
            bags[k] = (values[src], new_lengths)
        return _Rows(len(idx), {k: v[idx] for k, v in self.cols.items()}, bags)

    @staticmethod
    def concat(parts: Sequence[_Rows]) -> _Rows:
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        return _Rows(
            sum(p.n for p in parts),
            {k: np.concatenate([p.cols[k] for p in parts]) for k in first.cols},
            {k: (np.concatenate([p.bags[k][0] for p in parts]), np.concatenate([p.bags[k][1] for p in parts])) for k in first.bags},
        )


@dataclass(frozen=True)
class _Pos:
    """Where a stream is: the chunk being emitted starts at piece ``piece`` of the ``unit``-th
    row group of epoch ``epoch``'s order, and ``skip`` of its rows were emitted already."""

    epoch: int
    unit: int
    piece: int
    skip: int


# -- the stream ------------------------------------------------------------------------------------


class ParquetStream(torch.utils.data.IterableDataset):
    """Batches streamed from Parquet files, a slice of a row group at a time: memory does not
    grow with the data.

    **Columns.** ``label`` (a number) becomes ``batch["label"]``, float32 ``[B]``; each of
    ``ids`` (integer, or string: hashed with ``hash_strings``, masked to 62 bits) becomes
    ``batch[name]``, int64 ``[B]``; each of ``bags`` (a list of integers or strings, any
    length, empty allowed) becomes ``batch[name]``, the bag's ids flat, int64 ``[N]``, and
    ``batch[name + "_offsets"]``, int64 ``[B]``, where each sample's bag starts (the
    ``torch.nn.EmbeddingBag`` convention, as ``ShardedEmbeddingBag`` takes it); ``dense``
    (numbers) are stacked in the order given into ``batch["dense"]``, float32 ``[B, len(dense)]``.
    With none of ``ids``, ``bags`` and ``dense`` named, they come from the first file's schema:
    floats dense, integers and strings ids, lists bags. Null dense values read as 0; a null id
    as the column's reserved id (``hash_strings`` of the column's name, masked); a null bag as
    an empty bag; a null label stops the stream with a ``DataError``.

    With ``ctr=True`` the batches are the built-in CTR model's ``Batch(dense [B, D], sparse
    [B, T], labels [B])``, ``sparse`` column ``j`` from ``ids[j]`` (no bags).

    **Ranks.** Row groups are dealt to ranks once, each to the rank holding the fewest rows so
    far, so no two ranks read the same rows, together they read every row once per epoch, and
    none reads a row group of another (with one file and several ranks, none reads all of it).
    A rank that would get no row group is an error: write smaller row groups.

    **Order.** Without ``shuffle_rows`` a rank reads its row groups in file order. With it, each
    epoch visits the rank's row groups in an order drawn from ``(seed, epoch)``, fills a
    buffer of at least ``shuffle_rows`` rows (whole slices of ``read_rows``), permutes it with a
    generator seeded by ``(seed, epoch, where the buffer starts)``, and empties it before
    filling the next. Memory is bounded by the buffer; the order is the same run to run.

    **Held out.** With ``holdout``, its rows are never in a training stream; with
    ``held_out=True`` the stream yields those rows only.

    **Resuming.** ``state_dict()`` is a small JSON-able position: the epoch, the row group (by
    its place in the epoch's order, and as file and row group for people), the row within it
    where the current shuffle buffer starts, how many of the buffer's rows were yielded, and the
    seed and settings that fix the order. A stream opened with ``resume=`` that position (or
    given it by ``load_state_dict``) yields exactly the batches the first would have yielded
    next, re-reading at most one buffer. ``state_dict(batches=n)`` is the position after the
    ``n``-th batch this iteration yielded, for a consumer that reads ahead (``Trainer.fit``
    does): the last 64 are kept.

    Batches run across epochs; every batch holds ``batch_size`` samples but the very last one,
    after the last epoch, which holds what is left (dropped with ``drop_last``).

    Args:
        source: files, as ``parquet_files`` takes them (a path, folder, glob, comma list or sequence).
        batch_size: samples per batch.
        label: the label column.
        ids, bags, dense: columns read as ids, bags and dense features (see above).
        ctr: yield the CTR model's ``Batch`` instead of a dict.
        rank, world_size: this worker's place among the workers sharing the data.
        epochs: passes over the data; ``None``: until the consumer stops.
        shuffle_rows: rows in the shuffle buffer; 0: no shuffle.
        seed: seed of the row group order and of the shuffle.
        holdout: the held-out rule (``HoldOut``); None: no row is held out.
        held_out: yield the held-out rows instead of the training rows.
        drop_last: drop the short batch at the end.
        max_batches: stop after this many batches (None: when the epochs end).
        read_rows: rows decoded at a time within a row group.
        resume: a position from ``state_dict()`` to start from.

    Raises:
        ValueError: a bad size, rank, epoch count or setting.
        DataError: pyarrow missing; a source naming no file; a file that is not Parquet or is
            truncated; a missing column or one of the wrong type (one line naming the file and
            the column); a rank with no row group; a position from another setup. While
            iterating: a damaged row group (naming the file, row group and column), a null
            label, or a pass that gives this rank no sample.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        batch_size: int,
        *,
        label: str = "label",
        ids: Sequence[str] = (),
        bags: Sequence[str] = (),
        dense: Sequence[str] = (),
        ctr: bool = False,
        rank: int = 0,
        world_size: int = 1,
        epochs: int | None = 1,
        shuffle_rows: int = 0,
        seed: int = 0,
        holdout: HoldOut | None = None,
        held_out: bool = False,
        drop_last: bool = False,
        max_batches: int | None = None,
        read_rows: int = PARQUET_READ_ROWS,
        resume: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        check_stream(batch_size, rank, world_size, epochs)
        if shuffle_rows < 0:
            raise ValueError(f"shuffle_rows must be >= 0 (0: no shuffle), got {shuffle_rows!r}")
        if read_rows < 1:
            raise ValueError(f"read_rows must be >= 1, got {read_rows!r}")
        if max_batches is not None and max_batches < 0:
            raise ValueError(f"max_batches must be >= 0 or None, got {max_batches!r}")
        if held_out and holdout is None:
            raise ValueError("held_out=True needs a holdout rule (HoldOut.every_nth or HoldOut.by_key)")
        if ctr and bags:
            raise ValueError(f"the CTR model's Batch has no bags: got bags={list(bags)!r}")
        self.files = parquet_files(source)
        first = _open(self.files[0])
        schema = first.schema_arrow
        ids, bags, dense = list(ids), list(bags), list(dense)
        if not ids and not bags and not dense:
            ids, bags, dense = _infer(schema, label, self.files[0], ctr)
        if ctr and (not ids or not dense):
            raise ValueError(f"ctr=True needs dense and id columns, got dense={dense!r}, ids={ids!r}")
        named = [label, *ids, *bags, *dense]
        twice = sorted({c for c in named if named.count(c) > 1})
        if twice:
            raise ValueError(f"column(s) {', '.join(map(repr, twice))} named twice (label, ids, bags and dense take each column once)")
        keys = ["label", *ids, *bags, *(b + "_offsets" for b in bags), *(["dense"] if dense else [])]
        clash = sorted({k for k in keys if keys.count(k) > 1})
        if clash and not ctr:
            raise ValueError(f"batch key(s) {', '.join(map(repr, clash))} would hold two things: rename the column(s)")
        roles = {label: "label", **dict.fromkeys(ids, "id"), **dict.fromkeys(bags, "bag"), **dict.fromkeys(dense, "dense")}
        key = holdout.column if holdout is not None else None
        types = {f.name: f.type for f in schema}
        metadata = []
        for i, f in enumerate(self.files):
            pf = first if i == 0 else _open(f)
            _check_schema(f, pf.schema_arrow, roles, self.files[0], types if i else None)
            if key is not None:
                # The held-out key: any integer or string column, read or not.
                _check_schema(f, pf.schema_arrow, {key: "key"}, self.files[0], types if i else None)
            metadata.append(pf.metadata)
        self.label, self.ids, self.bags, self.dense = label, ids, bags, dense
        self._read_columns = list(dict.fromkeys([label, *ids, *bags, *dense, *([key] if key else [])]))
        self.ctr = ctr
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.epochs = epochs
        self.shuffle_rows = shuffle_rows
        self.seed = seed
        self.holdout = holdout
        self.held_out = held_out
        self.drop_last = drop_last
        self.max_batches = max_batches
        self.read_rows = read_rows
        all_units = _units(self.files, metadata)
        self._units = _deal(all_units, rank, world_size, self.files)
        # What fixes the order of the rows: a position from another setup would mean other rows.
        self._setup = {
            "data": hashlib.sha256(json.dumps([(self.files[u.file].name, u.rows) for u in all_units]).encode()).hexdigest()[:16],
            "rank": rank,
            "world_size": world_size,
            "seed": seed,
            "shuffle_rows": shuffle_rows,
            "read_rows": read_rows,
            "holdout": holdout.describe() if holdout is not None else None,
            "held_out": held_out,
        }
        self._null_ids = {c: int(hash_strings(_pyarrow()[0].array([c]))[0] & ID_MASK) for c in [*ids, *bags]}
        self._start = _Pos(0, 0, 0, 0)
        self._lock = threading.Lock()
        # (batches yielded by this iteration, the position after them), the newest last.
        self._positions: deque[tuple[int, _Pos]] = deque([(0, self._start)], maxlen=_POSITIONS_KEPT)
        if resume is not None:
            self.load_state_dict(resume)

    # -- position ---------------------------------------------------------------------------------

    def _order(self, epoch: int) -> np.ndarray:
        """The order of this rank's row groups in ``epoch``."""
        if not self.shuffle_rows:
            return np.arange(len(self._units))
        return np.random.default_rng([self.seed, epoch, 0x0D]).permutation(len(self._units))

    def _describe(self, pos: _Pos) -> dict[str, Any]:
        """``pos`` as a JSON-able dict (see ``state_dict``)."""
        order = self._order(pos.epoch)
        where: dict[str, Any] = {"file": None, "row_group": None, "row": None}
        if pos.unit < len(order):
            u = self._units[int(order[pos.unit])]
            where = {"file": str(self.files[u.file]), "row_group": u.group, "row": pos.piece * self.read_rows}
        return {
            "version": _POSITION_VERSION,
            "epoch": pos.epoch,
            "unit": pos.unit,
            "piece": pos.piece,
            "skip": pos.skip,
            **where,
            **self._setup,
        }

    def state_dict(self, batches: int | None = None) -> dict[str, Any]:
        """Where this stream is, as a small JSON-able dict (pass it as ``resume=``).

        Keys: ``epoch``; ``file``, ``row_group`` and ``row``: where the shuffle buffer (or,
        without shuffle, the slice) being yielded starts; ``skip``: its rows yielded already;
        ``unit`` and ``piece``: the same place as the stream finds it (the row group's place in
        the epoch's order, the slice of ``read_rows`` within it); and the setup that fixes the
        order (``seed``, ``shuffle_rows``, ``rank``, ``world_size``, ``read_rows``, the
        held-out rule, and ``data``: a digest of the files' names and row group sizes).

        Args:
            batches: the position after this many batches of the current iteration (0: where
                it started); None: after the last batch yielded.

        Raises:
            ValueError: ``batches`` is not among the last 64 batches yielded.
        """
        with self._lock:
            if batches is None:
                return self._describe(self._positions[-1][1])
            for count, pos in reversed(self._positions):
                if count == batches:
                    return self._describe(pos)
            have = f"{self._positions[0][0]}..{self._positions[-1][0]}"
        raise ValueError(f"state_dict(batches={batches!r}): the stream keeps the positions after batches {have} of this iteration")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Start the next iteration at ``state`` (from ``state_dict()`` of a stream on the same
        files with the same rank, world size, seed, shuffle and held-out rule).

        Raises:
            DataError: ``state`` was taken with another setup (the difference named) or is not a position.
        """
        try:
            version = state["version"]
            pos = _Pos(int(state["epoch"]), int(state["unit"]), int(state["piece"]), int(state["skip"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"resume: not a ParquetStream position ({type(exc).__name__}: {exc})") from None
        if version != _POSITION_VERSION:
            raise DataError(f"resume: position version {version!r}, this tether writes {_POSITION_VERSION}")
        for k, mine in self._setup.items():
            if state.get(k) != mine:
                what = "the files or their row groups differ" if k == "data" else f"{k} {state.get(k)!r}, this stream has {mine!r}"
                raise DataError(f"resume: the position was taken with another setup ({what}): it would name other rows")
        if min(pos.epoch, pos.unit, pos.piece, pos.skip) < 0 or pos.unit > len(self._units):
            raise DataError(f"resume: position out of range (unit {pos.unit} of {len(self._units)} row groups)")
        with self._lock:
            self._start = pos
            self._positions.clear()
            self._positions.append((0, pos))

    # -- reading ----------------------------------------------------------------------------------

    def _pieces(self, files: dict[int, Any], unit: _Unit, start: int) -> Iterator[tuple[int, int, Any]]:
        """``(piece, first row, record batch)`` of ``unit`` from piece ``start`` on."""
        pa, _ = _pyarrow()
        path = self.files[unit.file]
        if unit.file not in files:
            files.clear()  # one open file at a time
            files[unit.file] = _open(path)
        pf = files[unit.file]
        reader = pf.iter_batches(batch_size=self.read_rows, row_groups=[unit.group], columns=self._read_columns, use_threads=False)
        k, row = 0, 0
        while True:
            try:
                batch = next(reader, None)
            except (pa.ArrowException, OSError) as exc:
                raise DataError(
                    f"{path}: row group {unit.group}{self._bad_column(pf, unit.group)}: cannot be read ({' '.join(str(exc).split())})"
                ) from exc
            if batch is None:
                return
            if k >= start:
                yield k, row, batch
            k += 1
            row += batch.num_rows

    def _bad_column(self, pf: Any, group: int) -> str:
        """``, column 'x'``: the first column of row group ``group`` that cannot be read alone."""
        pa, _ = _pyarrow()
        for c in self._read_columns:
            try:
                pf.read_row_group(group, columns=[c], use_threads=False)
            except (pa.ArrowException, OSError):
                return f", column {c!r}"
        return ""

    def _convert(self, batch: Any, unit: _Unit, row: int) -> _Rows:
        """A record batch as ``_Rows``, the held-out rule applied."""
        pa, _ = _pyarrow()
        path = self.files[unit.file]
        keep: np.ndarray | None = None
        if self.holdout is not None:
            held = self.holdout.held(batch, unit.first + row)
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
            raise DataError(f"{path}: column {self.label!r} (the label) has {lab.null_count} null(s) in row group {unit.group}")
        labels = pick(lab.to_numpy(zero_copy_only=False)).astype(np.float32)
        cols: dict[str, np.ndarray] = {"label": labels}
        if self.dense:
            dense = np.empty((n, len(self.dense)), dtype=np.float32)
            for j, name in enumerate(self.dense):
                col = column(name)
                if col.null_count:
                    col = col.fill_null(0)
                dense[:, j] = pick(col.to_numpy(zero_copy_only=False))
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
        return _Rows(n, cols, bags)

    def _id_values(self, col: Any, name: str) -> np.ndarray:
        """int64 ids of an integer or string column (nulls: the column's reserved id)."""
        pa, _ = _pyarrow()
        if pa.types.is_dictionary(col.type):
            col = col.dictionary_decode()
        if pa.types.is_integer(col.type):
            if col.null_count:
                col = col.fill_null(self._null_ids[name])
            a = col.to_numpy(zero_copy_only=False)
            return a.view(np.int64) if a.dtype == np.uint64 else a.astype(np.int64, copy=False)
        h = hash_strings(col) & ID_MASK
        if col.null_count:
            h[~np.asarray(col.is_valid())] = self._null_ids[name]
        return h.view(np.int64)

    def _chunks(self, start: _Pos) -> Iterator[tuple[_Pos, _Rows]]:
        """``(where it starts, rows)`` of each shuffle buffer (or slice) from ``start`` on."""
        files: dict[int, Any] = {}
        target = max(self.shuffle_rows, 1)
        epoch, u, p = start.epoch, start.unit, start.piece
        while self.epochs is None or epoch < self.epochs:
            order = self._order(epoch)
            whole_epoch = u == 0 and p == 0
            seen = 0
            buf: list[_Rows] = []
            have = 0
            begin = _Pos(epoch, u, p, 0)
            while u < len(order):
                unit = self._units[int(order[u])]
                for k, row, batch in self._pieces(files, unit, p):
                    rows = self._convert(batch, unit, row)
                    if rows.n:
                        buf.append(rows)
                        have += rows.n
                    if have >= target:
                        yield begin, self._shuffled(begin, buf)
                        seen += have
                        buf, have = [], 0
                        begin = _Pos(epoch, u, k + 1, 0)
                u, p = u + 1, 0
                if not buf:  # nothing pending: the next buffer starts at the next row group
                    begin = _Pos(epoch, u, 0, 0)
            if buf:
                yield begin, self._shuffled(begin, buf)
                seen += have
            if whole_epoch and seen == 0:
                where = str(self.files[0]) if len(self.files) == 1 else f"{self.files[0]} and {len(self.files) - 1} more files"
                what = f"held-out rows ({self.holdout.describe()})" if self.held_out and self.holdout else "rows"
                raise DataError(f"{where}: no {what}" + (f" for rank {self.rank} of {self.world_size}" if self.world_size > 1 else ""))
            epoch, u, p = epoch + 1, 0, 0

    def _shuffled(self, begin: _Pos, buf: list[_Rows]) -> _Rows:
        if not self.shuffle_rows:
            return _Rows.concat(buf)
        n = sum(r.n for r in buf)
        perm = np.random.default_rng([self.seed, begin.epoch, begin.unit, begin.piece, 0x5F]).permutation(n)
        # One column at a time, the slices let go as it goes: the buffer is held about once, not
        # three times (slices, their concatenation, its permutation).
        cols: dict[str, np.ndarray] = {}
        for k in list(buf[0].cols):
            parts = [r.cols.pop(k) for r in buf]
            cols[k] = (parts[0] if len(parts) == 1 else np.concatenate(parts))[perm]
        bags = _Rows.concat([_Rows(r.n, {}, r.bags) for r in buf]).take(perm).bags if buf[0].bags else {}
        return _Rows(n, cols, bags)

    def _batch(self, rows: _Rows) -> Batch | dict[str, torch.Tensor]:
        if self.ctr:
            return Batch(torch.from_numpy(rows.cols["dense"]), torch.from_numpy(rows.cols["sparse"]), torch.from_numpy(rows.cols["label"]))
        out = {k: torch.from_numpy(v) for k, v in rows.cols.items()}
        for name, (values, lengths) in rows.bags.items():
            out[name] = torch.from_numpy(values if values.flags.writeable else values.copy())
            out[name + "_offsets"] = torch.from_numpy(np.cumsum(lengths) - lengths)
        return out

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise DataError("ParquetStream under a DataLoader with num_workers > 1: every loader process would read the same rows; "
                            "use num_workers=0 (Trainer.fit already prepares batches on a background thread)")
        with self._lock:
            start = self._start
            self._positions.clear()
            self._positions.append((0, start))
        bs = self.batch_size
        pending: list[_Rows] = []
        have = 0
        count = 0
        if self.max_batches == 0:
            return
        first = True
        for begin, rows in self._chunks(_Pos(start.epoch, start.unit, start.piece, 0)):
            i = start.skip if first else 0
            first = False
            while i < rows.n:
                take = min(bs - have, rows.n - i)
                pending.append(rows.slice(i, i + take))
                i += take
                have += take
                if have == bs:
                    batch = self._batch(_Rows.concat(pending))
                    pending, have = [], 0
                    count += 1
                    with self._lock:
                        self._positions.append((count, _Pos(begin.epoch, begin.unit, begin.piece, i)))
                    yield batch
                    if count == self.max_batches:
                        return
        if have and not self.drop_last:
            # Past the end of the data: a stream resumed here yields nothing.
            end = _Pos(self.epochs if self.epochs is not None else 0, 0, 0, 0)
            with self._lock:
                self._positions.append((count + 1, end))
            yield self._batch(_Rows.concat(pending))


# -- Criteo TSV -> Parquet --------------------------------------------------------------------------


def write_criteo_parquet(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    row_group_rows: int = CONVERT_ROW_GROUP_ROWS,
    compression: str = "snappy",
) -> int:
    """Write Criteo-format TSV files (plain or gzip, read as ``CriteoStream`` reads them) as one
    Parquet file; returns the rows written.

    The columns are what tether's Criteo reader makes of a line: ``label`` (float32), ``I1`` ..
    ``I13`` (float32, ``log1p`` of the counts, missing or negative -> 0) and ``C1`` .. ``C26``
    (int64 ids: the hex values hashed with their field), so ``ParquetStream(out, ctr=True)``
    yields the batches ``CriteoStream`` yields and ``HoldOut.every_nth(10)`` holds out the lines
    ``holdout_every=10`` does. Written to ``out``'s folder under a temporary name and renamed
    once complete: a failed conversion leaves nothing behind.

    Raises:
        ValueError: a bad ``row_group_rows``.
        DataError: no such file, a malformed line (naming the file and the line), pyarrow
            missing, or ``out`` cannot be written.
    """
    if row_group_rows < 1:
        raise ValueError(f"row_group_rows must be >= 1, got {row_group_rows!r}")
    pa, pq = _pyarrow()
    names = ["label", *(f"I{j + 1}" for j in range(CRITEO_DENSE)), *(f"C{j + 1}" for j in range(CRITEO_SPARSE))]
    schema = pa.schema([(n, pa.float32()) for n in names[: 1 + CRITEO_DENSE]] + [(n, pa.int64()) for n in names[1 + CRITEO_DENSE :]])
    stream = CriteoStream(source, row_group_rows)
    target = Path(out)
    if not target.parent.is_dir():
        raise DataError(f"{out}: no such folder {target.parent}")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    rows = 0
    try:
        with pq.ParquetWriter(tmp, schema, compression=None if compression == "none" else compression) as writer:
            for batch in stream:
                dense, sparse = batch.dense.numpy(), batch.sparse.numpy()
                arrays = [pa.array(batch.labels.numpy())]
                arrays += [pa.array(dense[:, j]) for j in range(CRITEO_DENSE)]
                arrays += [pa.array(sparse[:, j]) for j in range(CRITEO_SPARSE)]
                writer.write_batch(pa.record_batch(arrays, schema=schema), row_group_size=row_group_rows)
                rows += len(batch.labels)
        os.replace(tmp, target)
    except OSError as exc:
        raise DataError(f"{out}: cannot be written ({exc.strerror or ' '.join(str(exc).split())})") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return rows
