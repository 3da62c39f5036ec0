"""What a Parquet stream does with missing dense values (``ParquetStream(dense_nulls=...)``):
nulls (pandas writes NaN in a float column as a Parquet null) and NaN read as 0, as the column's
mean over the files, or as values the caller gives, with one warning naming the columns and their
counts; or they are refused. ``tether.worker.data.parquet`` re-exports ``DENSE_NULLS``."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tether.worker.data.parquet_schema import open_file
from tether.worker.data.synthetic import DataError

__all__ = ["DENSE_NULLS", "DenseNulls"]

log = logging.getLogger(__name__)

# The choices by name; a mapping {column: value} gives the values itself.
DENSE_NULLS = ("zero", "mean", "error")


def _check_choice(choice: str | Mapping[str, float], dense: Sequence[str]) -> None:
    """Raises ValueError: a name not in ``DENSE_NULLS``, or a mapping naming a column that is not
    dense or giving a value that is not a finite number."""
    if isinstance(choice, str):
        if choice not in DENSE_NULLS:
            raise ValueError(f"dense_nulls must be one of {', '.join(map(repr, DENSE_NULLS))} or a {{column: value}} mapping, "
                             f"got {choice!r}")
        return
    if not isinstance(choice, Mapping):
        raise ValueError(f"dense_nulls must be one of {', '.join(map(repr, DENSE_NULLS))} or a {{column: value}} mapping, got {choice!r}")
    other = sorted(set(choice) - set(dense))
    if other:
        raise ValueError(f"dense_nulls names column(s) {', '.join(map(repr, other))}, which are not dense columns (dense: {list(dense)})")
    for name, value in choice.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"dense_nulls[{name!r}] must be a finite number, got {value!r}")


def null_counts(metadata: Sequence[Any], dense: Sequence[str]) -> dict[str, int | None]:
    """Nulls per dense column over all the files, from their row groups' statistics (None for a
    column some row group keeps no count of)."""
    counts: dict[str, int | None] = dict.fromkeys(dense, 0)
    for meta in metadata:
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            for i in range(rg.num_columns):
                col = rg.column(i)
                name = col.path_in_schema
                so_far = counts.get(name)
                if so_far is None:  # not a dense column, or a count already unknown
                    continue
                stats = col.statistics
                counts[name] = None if stats is None or not stats.has_null_count else so_far + stats.null_count
    return counts


def column_means(files: Sequence[Path], columns: Sequence[str]) -> dict[str, float]:
    """Each column's mean over every row of ``files`` (nulls and NaN left out; 0 where a column
    has no value at all), read a row group at a time."""
    sums = dict.fromkeys(columns, 0.0)
    counts = dict.fromkeys(columns, 0)
    for path in files:
        pf = open_file(path)
        for g in range(pf.metadata.num_row_groups):
            table = pf.read_row_group(g, columns=list(columns), use_threads=False)
            for name in columns:
                a = np.asarray(table.column(name).to_numpy(), dtype=np.float64)
                ok = ~np.isnan(a)
                sums[name] += float(a[ok].sum())
                counts[name] += int(ok.sum())
    return {name: sums[name] / counts[name] if counts[name] else 0.0 for name in columns}


@dataclass
class DenseNulls:
    """A stream's missing dense values: the value each dense column's nulls and NaN read as
    (``fill``), or refused (``error``); which columns were already named in a warning."""

    fill: dict[str, float]
    error: bool
    warned: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, choice: str | Mapping[str, float], files: Sequence[Path], metadata: Sequence[Any], dense: Sequence[str]) -> DenseNulls:
        """The policy for ``dense`` of ``files``, checked up front: with the files' statistics, a
        refusal or the one warning comes before the first batch.

        Raises:
            ValueError: a bad ``choice``.
            DataError: ``choice="error"`` and the statistics count nulls in a dense column.
        """
        _check_choice(choice, dense)
        if not dense:
            return cls({}, choice == "error")
        counts = null_counts(metadata, dense)
        rows = sum(meta.num_rows for meta in metadata)
        where = str(files[0]) if len(files) == 1 else f"{files[0]} and {len(files) - 1} more files"
        having = {name: n for name, n in counts.items() if n}
        listed = ", ".join(f"{name!r} {n:,} of {rows:,} rows" for name, n in having.items())
        if choice == "error":
            if having:
                raise DataError(f"{where}: null(s) in dense column(s) {listed} (dense_nulls='error'; "
                                "dense_nulls='zero' or 'mean' fills them)")
            return cls(dict.fromkeys(dense, 0.0), True)
        fill = dict.fromkeys(dense, 0.0)
        if choice == "mean":
            # Columns the statistics do not vouch for are read too: a NaN is not counted as a null.
            fill.update(column_means(files, list(dense)))
        elif not isinstance(choice, str):
            fill.update({name: float(v) for name, v in choice.items()})
        policy = cls(fill, False)
        if having:
            log.warning("%s: dense column(s) with nulls: %s; they read as %s", where, listed, policy.describe(having))
            policy.warned.update(having)
        return policy

    def describe(self, columns: Mapping[str, Any]) -> str:
        """What ``columns``' missing values read as, in words (with the choices there are)."""
        values = ", ".join(f"{name!r} {self.fill[name]:.6g}" for name in columns)
        return f"{values} (ParquetStream(dense_nulls=...): 'zero', 'mean' of the column over the files, 'error', or {{column: value}})"

    def apply(self, values: np.ndarray, name: str, path: Path, group: int) -> None:
        """Fill the NaN (nulls read as NaN) of dense column ``name``'s ``values`` in place; the
        first time a column has some that no warning named, say so once.

        Raises:
            DataError: ``error`` and there are some (naming the file, the row group and the column).
        """
        missing = np.isnan(values)
        if not missing.any():
            return
        k = int(missing.sum())
        if self.error:
            raise DataError(f"{path}: dense column {name!r} has {k} null or NaN value(s) in row group {group} (dense_nulls='error')")
        values[missing] = self.fill[name]
        if name not in self.warned:
            self.warned.add(name)
            log.warning("%s: row group %d: dense column %r has %d null or NaN value(s) (more may follow), read as %s",
                        path, group, name, k, self.describe({name: k}))
