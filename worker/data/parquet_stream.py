"""``ParquetStream``: batches streamed from Parquet files a slice of a row group at a time (memory
does not grow with the data), row groups dealt to ranks, a bounded seeded shuffle, epochs, a
held-out split and a position to resume from (``tether.worker.data.parquet`` re-exports it)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tether.worker.data.parquet_nulls import DenseNulls
from tether.worker.data.parquet_rows import Decoder, HoldOut, Pos, Rows, hash_strings
from tether.worker.data.parquet_schema import Unit, check_schema, deal, group_units, infer, load_pyarrow, open_file, parquet_files
from tether.worker.data.synthetic import ID_MASK, Batch, DataError, check_stream

__all__ = ["PARQUET_READ_ROWS", "ParquetStream"]

# Rows decoded at a time within a row group: what a reader holds is a few of these, whatever
# the size of the files (a Criteo-shaped row is ~260 bytes decoded: ~17 MiB a slice).
PARQUET_READ_ROWS = 65_536
# Positions of the batches a stream yielded last, kept for consumers that read ahead
# (``Trainer.fit`` prepares up to 4 batches on a background thread, and holds 2 more).
_POSITIONS_KEPT = 64
_POSITION_VERSION = 1


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
    floats dense, integers and strings ids, lists bags. A null id (in any integer width: a
    narrower column is widened to int64 first) reads as the column's reserved id
    (``hash_strings`` of the column's name, masked), and so does a null inside a bag (it counts
    in the bag like any id, in a mean bag too); a null bag as an empty bag; a null label stops
    the stream with a ``DataError``. A null or NaN dense value (pandas writes NaN as a null) reads
    as ``dense_nulls`` says, with one warning naming the columns and their null counts.

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
        dense_nulls: what a null or NaN dense value reads as: ``"zero"``; ``"mean"``, the
            column's mean over every row of the files (other ranks' and held-out rows too, so
            every rank fills the same value; one extra read of the dense columns when the
            stream is made); ``"error"``, a ``DataError`` (up front when the files' statistics
            count nulls); or ``{column: value}`` (columns not named: 0), e.g. a held-out
            stream on other files given the training stream's ``dense_fill``.

    Raises:
        ValueError: a bad size, rank, epoch count or setting.
        DataError: pyarrow missing; a source naming no file; a file that is not Parquet or is
            truncated; a missing column or one of the wrong type (one line naming the file and
            the column); a rank with no row group; a position from another setup. While
            iterating: a damaged row group (naming the file, row group and column), a null
            label, or a pass that gives this rank no sample; with ``dense_nulls="error"``, a
            null dense value.
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
        dense_nulls: str | Mapping[str, float] = "zero",
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
        first = open_file(self.files[0])
        schema = first.schema_arrow
        ids, bags, dense = list(ids), list(bags), list(dense)
        if not ids and not bags and not dense:
            ids, bags, dense = infer(schema, label, self.files[0], ctr)
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
            pf = first if i == 0 else open_file(f)
            check_schema(f, pf.schema_arrow, roles, self.files[0], types if i else None)
            if key is not None:
                # The held-out key: any integer or string column, read or not.
                check_schema(f, pf.schema_arrow, {key: "key"}, self.files[0], types if i else None)
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
        all_units = group_units(self.files, metadata)
        self.units = deal(all_units, rank, world_size, self.files)
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
        null_ids = {c: int(hash_strings(load_pyarrow()[0].array([c]))[0] & ID_MASK) for c in [*ids, *bags]}
        self._dense_nulls = DenseNulls.of(dense_nulls, self.files, metadata, dense)
        # The value each dense column's nulls and NaN read as (pass it as a held-out stream's dense_nulls).
        self.dense_fill: dict[str, float] = dict(self._dense_nulls.fill)
        self._decoder = Decoder(label, tuple(ids), tuple(bags), tuple(dense), ctr, holdout, held_out, null_ids, self._dense_nulls)
        self._start = Pos(0, 0, 0, 0)
        self._lock = threading.Lock()
        # (batches yielded by this iteration, the position after them), the newest last.
        self._positions: deque[tuple[int, Pos]] = deque([(0, self._start)], maxlen=_POSITIONS_KEPT)
        if resume is not None:
            self.load_state_dict(resume)

    # -- position ---------------------------------------------------------------------------------

    def _order(self, epoch: int) -> np.ndarray:
        """The order of this rank's row groups in ``epoch``."""
        if not self.shuffle_rows:
            return np.arange(len(self.units))
        return np.random.default_rng([self.seed, epoch, 0x0D]).permutation(len(self.units))

    def _describe(self, pos: Pos) -> dict[str, Any]:
        """``pos`` as a JSON-able dict (see ``state_dict``)."""
        order = self._order(pos.epoch)
        where: dict[str, Any] = {"file": None, "row_group": None, "row": None}
        if pos.unit < len(order):
            u = self.units[int(order[pos.unit])]
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
            pos = Pos(int(state["epoch"]), int(state["unit"]), int(state["piece"]), int(state["skip"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"resume: not a ParquetStream position ({type(exc).__name__}: {exc})") from None
        if version != _POSITION_VERSION:
            raise DataError(f"resume: position version {version!r}, this tether writes {_POSITION_VERSION}")
        for k, mine in self._setup.items():
            if state.get(k) != mine:
                what = "the files or their row groups differ" if k == "data" else f"{k} {state.get(k)!r}, this stream has {mine!r}"
                raise DataError(f"resume: the position was taken with another setup ({what}): it would name other rows")
        if min(pos.epoch, pos.unit, pos.piece, pos.skip) < 0 or pos.unit > len(self.units):
            raise DataError(f"resume: position out of range (unit {pos.unit} of {len(self.units)} row groups)")
        with self._lock:
            self._start = pos
            self._positions.clear()
            self._positions.append((0, pos))

    # -- reading ----------------------------------------------------------------------------------

    def _pieces(self, files: dict[int, Any], unit: Unit, start: int) -> Iterator[tuple[int, int, Any]]:
        """``(piece, first row, record batch)`` of ``unit`` from piece ``start`` on."""
        pa, _ = load_pyarrow()
        path = self.files[unit.file]
        if unit.file not in files:
            files.clear()  # one open file at a time
            files[unit.file] = open_file(path)
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
        pa, _ = load_pyarrow()
        for c in self._read_columns:
            try:
                pf.read_row_group(group, columns=[c], use_threads=False)
            except (pa.ArrowException, OSError):
                return f", column {c!r}"
        return ""

    def _chunks(self, start: Pos) -> Iterator[tuple[Pos, Rows]]:
        """``(where it starts, rows)`` of each shuffle buffer (or slice) from ``start`` on."""
        files: dict[int, Any] = {}
        target = max(self.shuffle_rows, 1)
        epoch, u, p = start.epoch, start.unit, start.piece
        while self.epochs is None or epoch < self.epochs:
            order = self._order(epoch)
            whole_epoch = u == 0 and p == 0
            seen = 0
            buf: list[Rows] = []
            have = 0
            begin = Pos(epoch, u, p, 0)
            while u < len(order):
                unit = self.units[int(order[u])]
                for k, row, batch in self._pieces(files, unit, p):
                    rows = self._decoder.rows(batch, self.files[unit.file], unit.group, unit.first + row)
                    if rows.n:
                        buf.append(rows)
                        have += rows.n
                    if have >= target:
                        yield begin, self._shuffled(begin, buf)
                        seen += have
                        buf, have = [], 0
                        begin = Pos(epoch, u, k + 1, 0)
                u, p = u + 1, 0
                if not buf:  # nothing pending: the next buffer starts at the next row group
                    begin = Pos(epoch, u, 0, 0)
            if buf:
                yield begin, self._shuffled(begin, buf)
                seen += have
            if whole_epoch and seen == 0:
                where = str(self.files[0]) if len(self.files) == 1 else f"{self.files[0]} and {len(self.files) - 1} more files"
                what = f"held-out rows ({self.holdout.describe()})" if self.held_out and self.holdout else "rows"
                raise DataError(f"{where}: no {what}" + (f" for rank {self.rank} of {self.world_size}" if self.world_size > 1 else ""))
            epoch, u, p = epoch + 1, 0, 0

    def _shuffled(self, begin: Pos, buf: list[Rows]) -> Rows:
        if not self.shuffle_rows:
            return Rows.concat(buf)
        n = sum(r.n for r in buf)
        perm = np.random.default_rng([self.seed, begin.epoch, begin.unit, begin.piece, 0x5F]).permutation(n)
        # One column at a time, the slices let go as it goes: the buffer is held about once, not
        # three times (slices, their concatenation, its permutation).
        cols: dict[str, np.ndarray] = {}
        for k in list(buf[0].cols):
            parts = [r.cols.pop(k) for r in buf]
            cols[k] = (parts[0] if len(parts) == 1 else np.concatenate(parts))[perm]
        bags = Rows.concat([Rows(r.n, {}, r.bags) for r in buf]).take(perm).bags if buf[0].bags else {}
        return Rows(n, cols, bags)

    def _batch(self, rows: Rows) -> Batch | dict[str, torch.Tensor]:
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
        pending: list[Rows] = []
        have = 0
        count = 0
        if self.max_batches == 0:
            return
        first = True
        for begin, rows in self._chunks(Pos(start.epoch, start.unit, start.piece, 0)):
            i = start.skip if first else 0
            first = False
            while i < rows.n:
                take = min(bs - have, rows.n - i)
                pending.append(rows.slice(i, i + take))
                i += take
                have += take
                if have == bs:
                    batch = self._batch(Rows.concat(pending))
                    pending, have = [], 0
                    count += 1
                    with self._lock:
                        self._positions.append((count, Pos(begin.epoch, begin.unit, begin.piece, i)))
                    yield batch
                    if count == self.max_batches:
                        return
        if have and not self.drop_last:
            # Past the end of the data: a stream resumed here yields nothing.
            end = Pos(self.epochs if self.epochs is not None else 0, 0, 0, 0)
            with self._lock:
                self._positions.append((count + 1, end))
            yield self._batch(Rows.concat(pending))
