"""Transitional: the shard's compiled kernels moved to ``tether.server.index_kernels`` (the id
index's probes, ``mix64``, ``count_in``) and ``tether.server.row_kernels`` (the rules' row and
combined kernels, ``gather_rows``, ``init_rows_into``, ``warm_up``). These names are kept here
only for the modules that still import them from here (``server/tables.py``,
``server/update_log.py``, ``worker/cache_batch.py``, ``worker/row_slots.py``); delete this file
once they import from the two modules above."""

from __future__ import annotations

from tether.server.index_kernels import EMPTY_SLOT, REMOVED_SLOT, count_in, index_cells, index_lookup, index_place, mix64
from tether.server.row_kernels import init_rows_into, row_kernel, row_update

__all__ = ["EMPTY_SLOT", "REMOVED_SLOT", "count_in", "index_cells", "index_lookup", "index_place", "init_rows_into", "mix64", "row_kernel",
           "row_update"]
