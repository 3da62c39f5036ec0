"""Parquet training data: files by path, glob, folder or list, streamed a slice of a row group at a
time (memory does not grow with the data), row groups dealt to ranks, a bounded seeded shuffle,
epochs, a held-out split by a rule the user names, and a position to resume from.

Needs ``pyarrow`` (``pip install 'tether[parquet]'``); without it, opening a stream is a
one-line ``DataError``.

The code lives in five modules; this one gathers their public names, the ones to import:
``parquet_schema`` (files, schemas, dealing row groups to ranks), ``parquet_rows`` (string
hashes, ``HoldOut``, decoded rows, positions), ``parquet_nulls`` (missing dense values),
``parquet_stream`` (``ParquetStream``) and ``parquet_convert`` (``tether convert``'s writer).
"""

from __future__ import annotations

from tether.worker.data.parquet_convert import CONVERT_ROW_GROUP_ROWS, write_criteo_parquet
from tether.worker.data.parquet_nulls import DENSE_NULLS
from tether.worker.data.parquet_rows import HoldOut, hash_strings
from tether.worker.data.parquet_schema import check_parquet, criteo_parquet_columns, parquet_files
from tether.worker.data.parquet_stream import PARQUET_READ_ROWS, ParquetStream

__all__ = [
    "CONVERT_ROW_GROUP_ROWS",
    "DENSE_NULLS",
    "PARQUET_READ_ROWS",
    "HoldOut",
    "ParquetStream",
    "check_parquet",
    "criteo_parquet_columns",
    "hash_strings",
    "parquet_files",
    "write_criteo_parquet",
]
