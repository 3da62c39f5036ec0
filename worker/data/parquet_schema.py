"""Parquet files and their schemas: which files a source names, what type each column is and what
the built-in CTR job reads of them, and which row groups each rank reads (``tether.worker.data.parquet``
re-exports the public names).

Needs ``pyarrow`` (``pip install 'tether[parquet]'``); without it, the first call that reads a
file is a one-line ``DataError``.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.worker.data.criteo import criteo_files
from tether.worker.data.synthetic import DataError

__all__ = [
    "Unit", "check_parquet", "check_schema", "criteo_parquet_columns", "deal", "group_units", "infer", "load_pyarrow", "open_file",
    "parquet_files",
]


def load_pyarrow() -> tuple[Any, Any]:
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
class Unit:
    """One row group: the unit dealt to ranks."""

    file: int  # index into the stream's files
    group: int  # row group within the file
    rows: int
    first: int  # number of its first row, counting rows across all files in order


def open_file(path: Path) -> Any:
    """``path`` as a ``pyarrow.parquet.ParquetFile``.

    Raises:
        DataError: missing, unreadable, not Parquet, or truncated (its footer gone).
    """
    pa, pq = load_pyarrow()
    try:
        return pq.ParquetFile(path)
    except OSError as exc:
        raise DataError(f"{path}: {exc.strerror or exc}") from exc
    except (pa.ArrowException, ValueError) as exc:
        raise DataError(f"{path}: not a Parquet file, or truncated ({' '.join(str(exc).split())})") from exc


# -- columns ----------------------------------------------------------------------------------------


def _plain(t: Any) -> Any:
    """A dictionary type's value type (pyarrow reads some string columns as dictionaries)."""
    pa, _ = load_pyarrow()
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_id_type(t: Any) -> bool:
    pa, _ = load_pyarrow()
    t = _plain(t)
    return bool(pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
                or pa.types.is_binary(t) or pa.types.is_large_binary(t))


def _is_number_type(t: Any) -> bool:
    pa, _ = load_pyarrow()
    t = _plain(t)
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


def _is_bag_type(t: Any) -> bool:
    pa, _ = load_pyarrow()
    return bool((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and _is_id_type(t.value_type))


_ROLES = {
    "label": (_is_number_type, "a number (integer, float or bool)"),
    "id": (_is_id_type, "integer or string (ids; strings are hashed)"),
    "bag": (_is_bag_type, "a list of integers or strings (a variable-length bag of ids)"),
    "dense": (_is_number_type, "a number (integer, float or bool; read as float32)"),
    "key": (_is_id_type, "integer or string (the held-out rule hashes it)"),
}


def infer(schema: Any, label: str, path: Path, ctr: bool) -> tuple[list[str], list[str], list[str]]:
    """``(ids, bags, dense)`` from a schema: float columns are dense features, integer and
    string columns ids, list columns bags (the built-in CTR job takes no bags).

    Raises:
        DataError: a column of another type, named with the file.
    """
    pa, _ = load_pyarrow()
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


def check_schema(
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
            article = "an" if role[0] in "aeiou" else "a"  # an id column, a label column
            raise DataError(f"{path}: column {name!r} is {t}, but {article} {role} column must be {expected}")
        if first_types is not None and name in first_types and _kind(t) != _kind(first_types[name]):
            raise DataError(f"{path}: column {name!r} is {t}, but {first} has it as {first_types[name]}")


def _kind(t: Any) -> str:
    """What a type reads as: files that differ only in integer width or dictionary encoding agree."""
    pa, _ = load_pyarrow()
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
    schema = open_file(files[0]).schema_arrow
    if label not in schema.names:
        raise DataError(f"{files[0]}: no column {label!r} (the label; its columns: {', '.join(schema.names[:12])})")
    ids, _, dense = infer(schema, label, files[0], ctr=True)
    if not dense or not ids:
        raise DataError(f"{files[0]}: the built-in CTR job needs float dense columns and integer or string id columns, "
                        f"found {len(dense)} float and {len(ids)} id columns")
    roles = {label: "label", **dict.fromkeys(dense, "dense"), **dict.fromkeys(ids, "id")}
    types = {f.name: f.type for f in schema}
    check_schema(files[0], schema, roles)
    for f in files[1:]:
        check_schema(f, open_file(f).schema_arrow, roles, files[0], types)
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
    deal(group_units(files), 0, world_size, files)
    return dense, ids


def group_units(files: Sequence[Path], metadata: Sequence[Any] | None = None) -> list[Unit]:
    """Every row group of ``files``, in order (from their ``metadata`` when already read).

    Raises:
        DataError: a file that is not Parquet or is truncated.
    """
    units: list[Unit] = []
    first = 0
    for i, path in enumerate(files):
        meta = metadata[i] if metadata is not None else open_file(path).metadata
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            units.append(Unit(i, g, rows, first))
            first += rows
    return units


def deal(units: Sequence[Unit], rank: int, world_size: int, files: Sequence[Path]) -> list[Unit]:
    """Rank ``rank``'s row groups: each goes to the rank holding the fewest rows so far (ties:
    the lowest rank), in file order, so shares differ by at most one row group and every rank
    reads only its own row groups of each file.

    Raises:
        DataError: some rank would get no rows.
    """
    heap = [(0, r) for r in range(world_size)]  # (rows so far, rank): a heap from the start
    mine: list[Unit] = []
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
                        "write smaller row groups (pandas: df.to_parquet(path, row_group_size=N); pyarrow: "
                        "pyarrow.parquet.write_table(table, path, row_group_size=N); tether convert --row-group-rows N) or more files")
    return mine
