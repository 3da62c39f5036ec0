"""The built-in job's ``--data`` files, checked when its config is made, before any process
starts (``WorkerConfig``). Torch-free: the readers are imported only for the source named."""

from __future__ import annotations

import os

__all__ = ["check_criteo_data", "check_parquet_data"]


def check_criteo_data(data: str) -> None:
    """``criteo:PATH|GLOB|A,B`` names readable files (checked here, before any process starts).

    Raises:
        ValueError: no path, nothing matches, not a file, or not readable.
    """
    # Start-up cost and an optional dependency: the reader (torch; pyarrow for Parquet) only for the source named.
    from tether.worker.data.criteo import criteo_files

    path = data.split(":", 1)[1]
    if not path:
        raise ValueError(f"--data {data}: no path after 'criteo:'")
    try:
        files = criteo_files(path)
    except ValueError as exc:
        raise ValueError(f"--data {data}: {exc}") from None
    for f in files:
        if not os.access(f, os.R_OK):
            raise ValueError(f"--data {data}: {f} is not readable")


def check_parquet_data(data: str, num_workers: int) -> None:
    """``parquet:PATH|GLOB|DIR|A,B`` names Parquet files the built-in CTR job can read: every
    file's schema is read here, before any process starts (a ``label``, float dense columns,
    integer or string id columns, the same in every file), and there are row groups enough for
    ``num_workers`` workers.

    Raises:
        ValueError: one line naming the file and the column (or what else is wrong).
    """
    # Start-up cost and an optional dependency: the reader (torch; pyarrow for Parquet) only for the source named.
    from tether.worker.data.parquet import check_parquet

    path = data.split(":", 1)[1]
    if not path:
        raise ValueError(f"--data {data}: no path after 'parquet:'")
    try:
        check_parquet(path, world_size=num_workers)
    except ValueError as exc:
        raise ValueError(f"--data {data}: {exc}") from None
