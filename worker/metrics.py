"""What a worker records about itself: the ``WorkerRecorder`` protocol, its null object, and
``WorkerMetrics``, which exports it to Prometheus in a caller-supplied registry."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tether.common.metrics_http import register_process_metrics

__all__ = ["PHASES", "PHASE_BUCKETS", "STEP_BUCKETS", "CacheReading", "NullWorkerMetrics", "WorkerMetrics", "WorkerRecorder"]

PHASES: tuple[str, ...] = ("pull_wait", "compute", "push", "staleness_wait")
# 50us .. 10s: a prefetched pull costs ~nothing, an ssp wait behind a straggler costs seconds.
PHASE_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
STEP_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

# The row cache as a scrape reads it: per table (its counts so far: hits, refreshed, evicted,
# invalidated, passed; the rows it holds; its bytes), the rows whose gradients it holds, and the
# seconds its own calls have taken (``TrafficMeter.cache_seconds``).
CacheReading = tuple[Mapping[str, tuple[Mapping[str, int], int, int]], int, float]


class WorkerRecorder(Protocol):
    """What a worker's client and training loop record."""

    def rpc_failed(self, rpc: str, code: str) -> None:
        """One attempt of a call failed with status ``code`` (a name)."""

    def retried(self, rpc: str) -> None:
        """A failed attempt is tried again."""

    def unexpected_duplicate(self) -> None:
        """A shard called a push a duplicate although this client sent it once."""

    def record_step(self, phases: dict[str, float], seconds: float, samples: int, loss: float, clock: int) -> None:
        """One finished training step: its phases, duration, samples, loss and clock."""

    def rows_moved(self, table: str, direction: str, rows: int, nbytes: int) -> None:
        """``rows`` rows (``nbytes`` of ids and values) of ``table`` pulled or pushed (``direction``)."""

    def rows_wanted(self, table: str, rows: int, recent: Mapping[int, int]) -> None:
        """A training step looked up ``rows`` rows of ``table``; ``recent[S]`` of them were
        wanted in one of the last S steps too."""

    def watch_cache(self, read: Callable[[], CacheReading]) -> None:
        """The row cache's counts and sizes are ``read()``'s, read when they are asked for (a
        scrape), never on a training step."""


class NullWorkerMetrics:
    """A ``WorkerRecorder`` that records nothing (a worker without a metrics port)."""

    def rpc_failed(self, rpc: str, code: str) -> None:
        pass

    def retried(self, rpc: str) -> None:
        pass

    def unexpected_duplicate(self) -> None:
        pass

    def record_step(self, phases: dict[str, float], seconds: float, samples: int, loss: float, clock: int) -> None:
        pass

    def rows_moved(self, table: str, direction: str, rows: int, nbytes: int) -> None:
        pass

    def rows_wanted(self, table: str, rows: int, recent: Mapping[int, int]) -> None:
        pass

    def watch_cache(self, read: Callable[[], CacheReading]) -> None:
        pass


class WorkerMetrics:
    """Every metric a worker exports (a ``WorkerRecorder``); label values are bounded (phase,
    rpc, code)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        """Create the metrics in ``registry``; a second instance needs a second registry."""
        if registry is None:
            raise ValueError("registry must be a CollectorRegistry, got None")
        r = registry
        self.registry = registry

        self.phase_seconds = Histogram(
            "tether_worker_step_phase_seconds",
            "Time spent in one phase of a step (pull_wait, compute, push, staleness_wait).",
            ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.step_seconds = Histogram(
            "tether_worker_step_duration_seconds", "Wall time of one training step.",
            buckets=STEP_BUCKETS, registry=r)
        self.samples = Counter("tether_worker_samples_total", "Training samples processed.", registry=r)
        self.steps = Counter("tether_worker_steps_total", "Training steps completed.", registry=r)
        self.train_loss = Gauge("tether_worker_train_loss", "Loss of the last training batch.", registry=r)
        self.clock = Gauge("tether_worker_clock", "This worker's clock (completed steps).", registry=r)
        self.staleness_wait_seconds = Counter(
            "tether_worker_staleness_wait_seconds_total",
            "Seconds spent blocked by the staleness bound.", registry=r)
        self.retries = Counter(
            "tether_worker_retries_total", "RPC attempts retried after a transient failure, by method.",
            ["rpc"], registry=r)
        self.rpc_errors = Counter(
            "tether_worker_rpc_errors_total", "RPCs that failed, by method and gRPC status code.",
            ["rpc", "code"], registry=r)
        self.unexpected_duplicates = Counter(
            "tether_worker_unexpected_duplicate_pushes_total",
            "Pushes a shard acknowledged as duplicates although this client sent them once.", registry=r)
        self.last_step_timestamp = Gauge(
            "tether_worker_last_step_timestamp_seconds", "Unix time the last step finished.", registry=r)

        # What the steps move (tether.worker.client.traffic): per table (a model's tables: few labels).
        self.rows_moved_total = Counter(
            "tether_worker_rows_moved_total", "Embedding rows pulled from or pushed to the shards, by table and direction.",
            ["table", "direction"], registry=r)
        self.bytes_moved_total = Counter(
            "tether_worker_row_bytes_moved_total",
            "Bytes of those rows (int64 id + dim values of the wire dtype each), by table and direction.",
            ["table", "direction"], registry=r)
        self.rows_wanted_total = Counter(
            "tether_worker_rows_wanted_total", "Unique rows training steps looked up (pulled or answered by the cache), by table.",
            ["table"], registry=r)
        self.rows_recent_total = Counter(
            "tether_worker_rows_recent_total",
            "Of those, rows already wanted within the last `within` steps (1, 5, 20, 100): what a cache could answer.",
            ["table", "within"], registry=r)
        # The row cache's: read from it when scraped (``watch_cache``), nothing recorded a step.
        self._cache = _CacheCollector()
        r.register(self._cache)

        # One series per phase, exported at 0 from the start and looked up once.
        self._phases = {phase: self.phase_seconds.labels(phase=phase) for phase in PHASES}
        # The per-step series (per table: rows moved and wanted), each looked up
        # once: ``labels`` costs several microseconds a call, and a cached step makes dozens.
        self._series: dict[tuple[int, tuple[str, ...]], Any] = {}
        # Memory (RSS), CPU and fds of the process (once per registry: a shard may share it).
        register_process_metrics(r)

    def rpc_failed(self, rpc: str, code: str) -> None:
        self.rpc_errors.labels(rpc=rpc, code=code).inc()

    def retried(self, rpc: str) -> None:
        self.retries.labels(rpc=rpc).inc()

    def unexpected_duplicate(self) -> None:
        self.unexpected_duplicates.inc()

    def record_step(self, phases: dict[str, float], seconds: float, samples: int, loss: float, clock: int) -> None:
        """Record one finished training step: its phases, duration, samples, loss and clock."""
        for phase, value in phases.items():
            self.observe_phase(phase, value)
        self.step_seconds.observe(seconds)
        self.samples.inc(samples)
        self.steps.inc()
        self.train_loss.set(loss)
        self.clock.set(clock)
        self.last_step_timestamp.set(time.time())

    def observe_phase(self, phase: str, seconds: float) -> None:
        """Record ``seconds`` spent in ``phase``; staleness waits also feed the wait counter."""
        series = self._phases.get(phase)
        if series is None:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        series.observe(seconds)
        if phase == "staleness_wait":
            self.staleness_wait_seconds.inc(seconds)

    def _of(self, metric: Any, *values: str) -> Any:
        """``metric``'s series of label ``values`` (in its label names' order), looked up once."""
        key = (id(metric), values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(*values)
        return series

    def rows_moved(self, table: str, direction: str, rows: int, nbytes: int) -> None:
        if direction not in ("pull", "push"):
            raise ValueError(f"direction must be pull or push, got {direction!r}")
        self._of(self.rows_moved_total, table, direction).inc(rows)
        self._of(self.bytes_moved_total, table, direction).inc(nbytes)

    def rows_wanted(self, table: str, rows: int, recent: Mapping[int, int]) -> None:
        self._of(self.rows_wanted_total, table).inc(rows)
        for within, n in recent.items():
            self._of(self.rows_recent_total, table, str(within)).inc(n)

    def watch_cache(self, read: Callable[[], CacheReading]) -> None:
        self._cache.read = read


class _CacheCollector(Collector):
    """The worker row cache's metrics, read from the cache by each scrape (``read``, set by
    ``WorkerMetrics.watch_cache``; before that, the families with no series but the pending
    rows at 0): a cached step pays nothing for them."""

    def __init__(self) -> None:
        self.read: Callable[[], CacheReading] | None = None

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self.read() if self.read is not None else None)

    @staticmethod
    def _families(reading: CacheReading | None) -> list[Metric]:
        rows = CounterMetricFamily(
            "tether_worker_cache_rows",
            "Row cache outcomes by table: hits (answered by the cache), refreshed (cached but past the bound: pulled), "
            "evicted, invalidated (a shard's table version went back), passed (missed and not admitted: "
            "--cache-admission recurring).", labels=["table", "outcome"])
        held = GaugeMetricFamily("tether_worker_cache_held_rows", "Rows the cache holds, by table.", labels=["table"])
        nbytes = GaugeMetricFamily("tether_worker_cache_bytes", "Bytes the cache holds (rows, pending gradients, bookkeeping), by table.",
                                   labels=["table"])
        pending = GaugeMetricFamily("tether_worker_cache_pending_rows",
                                    "Rows whose gradients the cache holds, not yet pushed (write bound).")
        seconds = CounterMetricFamily(
            "tether_worker_cache_seconds",
            "Seconds the row cache's own calls took (planning pulls, storing pulled rows, holding and taking gradients): "
            "its bookkeeping, to weigh against the rows it saves.")
        tables, waiting, spent = reading if reading is not None else ({}, 0, 0.0)
        for table, (counts, n, size) in tables.items():
            for outcome, count in counts.items():
                rows.add_metric([table, outcome], count)
            held.add_metric([table], n)
            nbytes.add_metric([table], size)
        pending.add_metric([], waiting)
        seconds.add_metric([], spent)
        return [rows, held, nbytes, pending, seconds]
