"""What a worker moves: rows and bytes pulled and pushed per table, and how many of a step's
rows it already wanted within the last S steps (the ceiling of what a row cache can save).

``TrafficMeter`` keeps the totals in process (``totals()``, what ``bench/traffic.py`` prints)
and hands each count to the worker's recorder (Prometheus: ``tether_worker_rows_pulled_total``
and the others, docs/metrics.md). Bytes are the payload a row costs on the wire: its int64 id
and ``dim`` values of the wire dtype (the same for a pull's answer and a push's gradient);
framing is left out. These figures depend on the data and the model, not on the machine. A row
cache's own counts and sizes are read by each scrape instead (``watch``), and the time its own
calls take is summed here (``cache_seconds``: what the rows it saves cost on this machine).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from tether.worker.client.reuse import REUSE_WINDOWS, ReuseTracker
from tether.worker.client.router import PackedParts
from tether.worker.metrics import CacheReading

__all__ = ["TrafficMeter", "TrafficRecorder"]

ID_BYTES = 8


class TrafficRecorder(Protocol):
    """Where a ``TrafficMeter`` reports (``WorkerMetrics``; ``NullWorkerMetrics`` drops it)."""

    def rows_moved(self, table: str, direction: str, rows: int, nbytes: int) -> None: ...

    def rows_wanted(self, table: str, rows: int, recent: Mapping[int, int]) -> None: ...

    def watch_cache(self, read: Callable[[], CacheReading]) -> None: ...


class TrafficMeter:
    """Counts what a worker's steps want, pull and push per table (see the module docstring)."""

    def __init__(self, dims: Mapping[str, int], wire_itemsize: int, recorder: Any = None, reuse: bool = True) -> None:
        self.dims = dict(dims)
        self.itemsize = wire_itemsize
        self.recorder = recorder if recorder is not None and hasattr(recorder, "rows_moved") else None
        self.reuse = ReuseTracker() if reuse else None
        self.steps = 0
        zero = dict.fromkeys(self.dims, 0)
        self.wanted_rows, self.recent = dict(zero), {t: dict.fromkeys(REUSE_WINDOWS, 0) for t in self.dims}
        self.pulled_rows, self.pushed_rows = dict(zero), dict(zero)
        # Bytes pushed beside the rows: a combined push's statistics (float32, rows x columns).
        self.pushed_stats_bytes = dict(zero)
        # Seconds the row cache's own calls took (``cache_time``; a CUDA worker's transfer thread adds too).
        self.cache_seconds = 0.0
        self._time_lock = threading.Lock()

    def row_bytes(self, table: str) -> int:
        return ID_BYTES + self.dims[table] * self.itemsize

    def wanted(self, sparse: Mapping[str, torch.Tensor], clock: int = 0) -> None:
        """One step's rows (table -> unique ids), whether pulled or answered by a cache."""
        self.steps += 1
        recent = self.reuse.observe(sparse) if self.reuse is not None else {}
        for t, ids in sparse.items():
            self.wanted_rows[t] += ids.shape[0]
            for w, n in recent.get(t, {}).items():
                self.recent[t][w] += n
            if self.recorder is not None:
                self.recorder.rows_wanted(t, ids.shape[0], recent.get(t, {}))

    def pulled(self, sparse: Mapping[str, torch.Tensor]) -> None:
        for t, ids in sparse.items():
            self._moved(t, "pull", ids.shape[0])

    def pushed(self, grads: Mapping[str, tuple[torch.Tensor, ...]]) -> None:
        """A push's rows per table: ``(ids, gradients)``, or with a combined push's statistics
        third (their float32s counted in the bytes pushed); a ``PackedParts``' from its layout."""
        if isinstance(grads, PackedParts):
            for t, _, rows, _, k in grads.layout():
                self.pushed_stats_bytes[t] += 4 * rows * k
                self._moved(t, "push", rows, 4 * rows * k)
            return
        for t, part in grads.items():
            extra = 4 * part[2].numel() if len(part) > 2 else 0
            self.pushed_stats_bytes[t] += extra
            self._moved(t, "push", len(part[0]), extra)

    def cache_time(self, seconds: float) -> None:
        """One call of the row cache took ``seconds`` (wall clock, on the thread that made it)."""
        with self._time_lock:
            self.cache_seconds += seconds

    def _moved(self, table: str, direction: str, rows: int, extra: int = 0) -> None:
        if not rows:
            return
        (self.pulled_rows if direction == "pull" else self.pushed_rows)[table] += rows
        if self.recorder is not None:
            self.recorder.rows_moved(table, direction, rows, rows * self.row_bytes(table) + extra)

    def watch(self, cache: Any) -> None:
        """Hand the recorder a reading of ``cache``'s counters and sizes, which it takes when
        they are asked for (a scrape): nothing to do a step."""
        if self.recorder is None:
            return

        def read() -> CacheReading:
            memory = cache.memory_bytes()
            tables = {t: ({"hits": cache.hits[t], "refreshed": cache.refreshed[t], "evicted": cache.evictions[t],
                           "invalidated": cache.invalidated[t], "passed": cache.passed[t]}, tab.held, memory[t])
                      for t, tab in cache.tables.items()}
            return tables, cache.pending_rows(), self.cache_seconds

        self.recorder.watch_cache(read)

    def moved(self) -> dict[str, dict[str, int]]:
        """Per table: rows wanted, rows and bytes pulled and pushed so far (the run record's ``traffic``)."""
        return {t: {k: v for k, v in tot.items() if k != "recent"} for t, tot in self.totals().items()}

    def totals(self) -> dict[str, dict[str, Any]]:
        """Per table: rows wanted, pulled and pushed, their bytes, and the reuse counts."""
        return {
            t: {
                "wanted_rows": self.wanted_rows[t],
                "pulled_rows": self.pulled_rows[t],
                "pushed_rows": self.pushed_rows[t],
                "pulled_bytes": self.pulled_rows[t] * self.row_bytes(t),
                "pushed_bytes": self.pushed_rows[t] * self.row_bytes(t) + self.pushed_stats_bytes[t],
                "recent": dict(self.recent[t]),
            }
            for t in self.dims
        }
