"""``tether convert``'s writer: Criteo TSV files as one Parquet file that ``ParquetStream`` reads
as the Criteo reader reads the TSV (``tether.worker.data.parquet`` re-exports it)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tether.worker.data.criteo import CRITEO_DENSE, CRITEO_SPARSE, CriteoStream
from tether.worker.data.parquet_schema import load_pyarrow
from tether.worker.data.synthetic import DataError

__all__ = ["CONVERT_ROW_GROUP_ROWS", "write_criteo_parquet"]

# Rows per row group that ``write_criteo_parquet`` writes: big enough that a row group's
# per-read costs vanish, small enough that a day of Criteo (45M rows) deals to hundreds of ranks.
CONVERT_ROW_GROUP_ROWS = 131_072


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
    pa, pq = load_pyarrow()
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
