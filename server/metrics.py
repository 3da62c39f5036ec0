"""What a shard records about itself: the ``ShardRecorder`` protocol, its null object, and
``ShardMetrics``, which exports it to Prometheus in a caller-supplied registry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tether.common.metrics_http import register_process_metrics
from tether.protos.errors import REJECT_REASONS as _ERROR_REASONS

__all__ = [
    "CHECKPOINT_BUCKETS",
    "REJECT_REASONS",
    "REMEDIES",
    "REQUEST_BUCKETS",
    "STALENESS_BUCKETS",
    "UPDATE_KINDS",
    "NullShardMetrics",
    "ShardMetrics",
    "ShardRecorder",
]

# 50us .. 5s: a loopback Info call is ~100us, a 256 MiB push is seconds.
REQUEST_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)
# Clock ticks a pushed gradient's read values were behind; fine-grained where ssp bounds live.
STALENESS_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
CHECKPOINT_BUCKETS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

UPDATE_KINDS: tuple[str, ...] = ("sparse", "dense")
M = TypeVar("M", Counter, Gauge, Histogram)

# Why a push was not applied: an error's reason (``tether.protos.errors.reject_reason``), or
# a retried push the shard had applied already.
REJECT_REASONS: tuple[str, ...] = (*_ERROR_REASONS, "duplicate")

# The staleness remedies a push may ask for, as a shard counts what they change: --staleness-aware,
# DC-ASGD (--delay-compensation), DC-ASGD-a (--dc-adaptive) and --gap-aware.
REMEDIES: tuple[str, ...] = ("staleness_aware", "dc", "dc_adaptive", "gap_aware")


class ShardRecorder(Protocol):
    """What the parts of a shard (request handler, tables, checkpointer, data plane) record."""

    def request(self, rpc: str, code: str, seconds: float, received_bytes: int) -> None:
        """One call handled, with its status code name, duration and request bytes."""

    def refused(self, rpc: str, code: str) -> None:
        """One call refused before it was handled (a missing or wrong token)."""

    def internal_error(self, rpc: str) -> None:
        """One call that failed with an unexpected error (a bug: answered INTERNAL, logged)."""

    def sent(self, rpc: str, nbytes: int) -> None:
        """Response bytes sent for one call."""

    def reject(self, reason: str) -> None:
        """One push not applied, for ``reason`` (one of ``REJECT_REASONS``)."""

    def pulled(self, tables: Sequence[tuple[str, int]]) -> None:
        """Rows returned by one pull, as (table, rows)."""

    def pushed(self, tables: Sequence[tuple[str, int]], dense_blocks: int, staleness: int, clock_staleness: int | None) -> None:
        """One push applied: rows per table, dense chunks, its staleness in updates and (when
        it carried a clock) in clock ticks."""

    def remedied(self, table: str | None, remedy: str, count: int) -> None:
        """In one push, ``count`` rows of ``table`` (None: elements of a dense chunk) whose update
        ``remedy`` (one of ``REMEDIES``) changed."""

    def evicted(self, table: str, rows: int) -> None:
        """Rows evicted from a bounded table."""

    def dropped(self, table: str, rows: int) -> None:
        """Row gradients dropped (ids not admitted yet)."""

    def watch_table(self, name: str, rows: Callable[[], float], memory_bytes: Callable[[], float]) -> None:
        """Export table ``name``'s resident rows and bytes, read when scraped."""

    def set_staleness_bound(self, bound: int | None) -> None:
        """The job's staleness bound; ``None`` means unbounded (async)."""

    def clocks(self, live_workers: int, min_clock: int, max_clock: int) -> None:
        """The live workers and their clocks."""

    def checkpointed(self, created: float, seconds: float) -> None:
        """A checkpoint written at unix time ``created`` in ``seconds``."""

    def restored(self, created: float) -> None:
        """The shard restored a checkpoint written at unix time ``created``."""

    def checkpoint_failed(self, reason: str) -> None:
        """A checkpoint could not be written, for ``reason`` (no_space, read_only, ...)."""

    def connections(self, mode: str, delta: int) -> None:
        """Data-plane connections opened (+) or closed (-), by mode (shm, tcp, tcp+tls)."""

    def set_serving(self, up: bool) -> None:
        """Whether the shard is serving."""


class NullShardMetrics:
    """A ``ShardRecorder`` that records nothing (a shard without a metrics port)."""

    def request(self, rpc: str, code: str, seconds: float, received_bytes: int) -> None:
        pass

    def refused(self, rpc: str, code: str) -> None:
        pass

    def internal_error(self, rpc: str) -> None:
        pass

    def sent(self, rpc: str, nbytes: int) -> None:
        pass

    def reject(self, reason: str) -> None:
        pass

    def pulled(self, tables: Sequence[tuple[str, int]]) -> None:
        pass

    def pushed(self, tables: Sequence[tuple[str, int]], dense_blocks: int, staleness: int, clock_staleness: int | None) -> None:
        pass

    def remedied(self, table: str | None, remedy: str, count: int) -> None:
        pass

    def evicted(self, table: str, rows: int) -> None:
        pass

    def dropped(self, table: str, rows: int) -> None:
        pass

    def watch_table(self, name: str, rows: Callable[[], float], memory_bytes: Callable[[], float]) -> None:
        pass

    def set_staleness_bound(self, bound: int | None) -> None:
        pass

    def clocks(self, live_workers: int, min_clock: int, max_clock: int) -> None:
        pass

    def checkpointed(self, created: float, seconds: float) -> None:
        pass

    def restored(self, created: float) -> None:
        pass

    def checkpoint_failed(self, reason: str) -> None:
        pass

    def connections(self, mode: str, delta: int) -> None:
        pass

    def set_serving(self, up: bool) -> None:
        pass


class ShardMetrics:
    """Every metric a shard exports (a ``ShardRecorder``); label values are bounded (rpc, code,
    table, kind, reason)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        """Create the metrics in ``registry``; a second instance needs a second registry."""
        if registry is None:
            raise ValueError("registry must be a CollectorRegistry, got None")
        r = registry
        self.registry = registry
        self._series: dict[tuple[int, tuple[str, ...]], Any] = {}

        self.requests = Counter(
            "tether_shard_requests_total", "RPCs handled, by method and gRPC status code.",
            ["rpc", "code"], registry=r)
        self.request_seconds = Histogram(
            "tether_shard_request_duration_seconds", "Time to handle one RPC, by method.",
            ["rpc"], buckets=REQUEST_BUCKETS, registry=r)
        self.received_bytes = Counter(
            "tether_shard_received_bytes_total", "Serialized request bytes received, by method.",
            ["rpc"], registry=r)
        self.sent_bytes = Counter(
            "tether_shard_sent_bytes_total", "Serialized response bytes sent, by method.",
            ["rpc"], registry=r)
        self.internal_errors = Counter(
            "tether_shard_internal_errors_total",
            "Calls that failed with an unexpected error (a bug, answered INTERNAL and logged with its traceback), by method.",
            ["rpc"], registry=r)

        self.rows_pulled = Counter(
            "tether_shard_rows_pulled_total", "Embedding rows returned by Pull, by table.",
            ["table"], registry=r)
        self.rows_pushed = Counter(
            "tether_shard_rows_pushed_total", "Embedding row gradients applied, by table.",
            ["table"], registry=r)
        self.table_rows = Gauge(
            "tether_shard_table_rows", "Embedding rows resident on this shard, by table.",
            ["table"], registry=r)
        self.table_memory_bytes = Gauge(
            "tether_shard_table_memory_bytes", "Bytes held by a table's rows and optimizer state.",
            ["table"], registry=r)
        self.rows_evicted = Counter(
            "tether_shard_rows_evicted_total", "Embedding rows evicted, by table.",
            ["table"], registry=r)
        self.rows_dropped = Counter(
            "tether_shard_rows_dropped_total",
            "Row gradients dropped because their id was not admitted yet (min_count), by table.",
            ["table"], registry=r)

        self.updates_applied = Counter(
            "tether_shard_updates_applied_total", "Gradient blocks applied, by kind (sparse or dense).",
            ["kind"], registry=r)
        self.updates_rejected = Counter(
            "tether_shard_updates_rejected_total", "Pushes not applied, by reason.",
            ["reason"], registry=r)
        self.push_staleness = Histogram(
            "tether_shard_push_staleness",
            "Clock ticks the slowest live worker was behind a pushed step (what ssp:S keeps <= S).",
            buckets=STALENESS_BUCKETS, registry=r)
        self.push_update_staleness = Histogram(
            "tether_shard_push_update_staleness",
            "Updates applied to a block between the read of its values and the push of their gradient.",
            buckets=STALENESS_BUCKETS, registry=r)
        self.remedied_rows = Counter(
            "tether_shard_remedied_rows_total",
            "Embedding rows whose update a staleness remedy changed, by table and remedy "
            "(staleness_aware: step damped; dc, dc_adaptive: gradient compensated; gap_aware: step divided).",
            ["table", "remedy"], registry=r)
        self.remedied_dense_elements = Counter(
            "tether_shard_remedied_dense_elements_total",
            "Dense parameter elements whose update a staleness remedy changed, by remedy (as tether_shard_remedied_rows_total).",
            ["remedy"], registry=r)
        self.staleness_bound = Gauge(
            "tether_shard_staleness_bound", "The job's staleness bound S (ssp:S); -1 when unbounded.",
            registry=r)

        self.live_workers = Gauge(
            "tether_shard_live_workers", "Workers whose lease has not expired.", registry=r)
        self.worker_clock_min = Gauge(
            "tether_shard_worker_clock_min", "Smallest clock among live workers.", registry=r)
        self.worker_clock_max = Gauge(
            "tether_shard_worker_clock_max", "Largest clock among live workers.", registry=r)

        self.last_checkpoint_timestamp = Gauge(
            "tether_shard_last_checkpoint_timestamp_seconds",
            "Unix time of the last completed checkpoint.", registry=r)
        self.checkpoint_seconds = Histogram(
            "tether_shard_checkpoint_duration_seconds", "Time to write one checkpoint.",
            buckets=CHECKPOINT_BUCKETS, registry=r)
        self.checkpoint_failures = Counter(
            "tether_shard_checkpoint_failures_total",
            "Checkpoints that could not be written (the last good one stays), by reason: "
            "no_space, read_only, missing_dir, permission, io_error.",
            ["reason"], registry=r)

        self.serving = Gauge("tether_shard_up", "1 while the shard is serving, else 0.", registry=r)
        self.data_connections = Gauge(
            "tether_shard_data_connections",
            "Open data-plane connections, by how their payloads travel "
            "(shm: shared memory, tcp: the socket, tcp+tls: the socket inside TLS).",
            ["mode"], registry=r)

        # Export the bounded series at 0 from the start so rate() and alerts see them.
        for kind in UPDATE_KINDS:
            self.updates_applied.labels(kind=kind)
        for reason in REJECT_REASONS:
            self.updates_rejected.labels(reason=reason)
        for mode in ("shm", "tcp", "tcp+tls"):
            self.data_connections.labels(mode=mode)
        for remedy in REMEDIES:
            self.remedied_dense_elements.labels(remedy=remedy)
        from tether.server.checkpoints.checkpoint_files import FAILURE_REASONS  # torch with it: only where a shard runs

        for why in FAILURE_REASONS:
            self.checkpoint_failures.labels(reason=why)
        self.staleness_bound.set(-1)
        # Memory (RSS), CPU and fds of the process: what the dashboard's process panels read.
        register_process_metrics(r)

    def series(self, metric: M, *values: str) -> M:
        """``metric.labels(*values)``, remembered: ``labels`` checks and locks on every call, and
        a data-plane call records several series (label values are bounded, so is this cache)."""
        key = (id(metric), values)
        try:
            return self._series[key]
        except KeyError:
            child = self._series[key] = metric.labels(*values)
            return child

    def watch_table(self, name: str, rows: Callable[[], float], memory_bytes: Callable[[], float]) -> None:
        """Export table ``name``'s resident rows and bytes, read when Prometheus scrapes."""
        self.table_rows.labels(table=name).set_function(rows)
        self.table_memory_bytes.labels(table=name).set_function(memory_bytes)
        for remedy in REMEDIES:  # at 0 from the table's start, so "never" reads 0
            self.series(self.remedied_rows, name, remedy)

    def set_staleness_bound(self, bound: int | None) -> None:
        """Record the job's staleness bound; ``None`` means unbounded (async)."""
        if bound is None:
            self.staleness_bound.set(-1)
            return
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise ValueError(f"staleness bound must be an int >= 0 or None, got {bound!r}")
        self.staleness_bound.set(bound)

    def reject(self, reason: str) -> None:
        """Count one rejected push; ``reason`` must be one of ``REJECT_REASONS``."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"reason must be one of {REJECT_REASONS}, got {reason!r}")
        self.series(self.updates_rejected, reason).inc()

    def applied(self, kind: str, blocks: int = 1) -> None:
        """Count applied gradient blocks; ``kind`` must be one of ``UPDATE_KINDS``."""
        if kind not in UPDATE_KINDS:
            raise ValueError(f"kind must be one of {UPDATE_KINDS}, got {kind!r}")
        if blocks < 0:
            raise ValueError(f"blocks must be >= 0, got {blocks!r}")
        self.series(self.updates_applied, kind).inc(blocks)

    def request(self, rpc: str, code: str, seconds: float, received_bytes: int) -> None:
        self.series(self.requests, rpc, code).inc()
        self.series(self.request_seconds, rpc).observe(seconds)
        self.series(self.received_bytes, rpc).inc(received_bytes)

    def refused(self, rpc: str, code: str) -> None:
        self.series(self.requests, rpc, code).inc()

    def internal_error(self, rpc: str) -> None:
        self.series(self.internal_errors, rpc).inc()

    def sent(self, rpc: str, nbytes: int) -> None:
        self.series(self.sent_bytes, rpc).inc(nbytes)

    def pulled(self, tables: Sequence[tuple[str, int]]) -> None:
        for name, rows in tables:
            self.series(self.rows_pulled, name).inc(rows)

    def pushed(self, tables: Sequence[tuple[str, int]], dense_blocks: int, staleness: int, clock_staleness: int | None) -> None:
        self.applied("sparse", len(tables))
        self.applied("dense", dense_blocks)
        for name, rows in tables:
            self.series(self.rows_pushed, name).inc(rows)
        self.push_update_staleness.observe(staleness)
        if clock_staleness is not None:
            self.push_staleness.observe(clock_staleness)

    def remedied(self, table: str | None, remedy: str, count: int) -> None:
        if table is None:
            self.series(self.remedied_dense_elements, remedy).inc(count)
        else:
            self.series(self.remedied_rows, table, remedy).inc(count)

    def evicted(self, table: str, rows: int) -> None:
        self.series(self.rows_evicted, table).inc(rows)

    def dropped(self, table: str, rows: int) -> None:
        self.series(self.rows_dropped, table).inc(rows)

    def clocks(self, live_workers: int, min_clock: int, max_clock: int) -> None:
        self.live_workers.set(live_workers)
        self.worker_clock_min.set(min_clock)
        self.worker_clock_max.set(max_clock)

    def checkpointed(self, created: float, seconds: float) -> None:
        self.last_checkpoint_timestamp.set(created)
        self.checkpoint_seconds.observe(seconds)

    def restored(self, created: float) -> None:
        self.last_checkpoint_timestamp.set(created)

    def checkpoint_failed(self, reason: str) -> None:
        self.series(self.checkpoint_failures, reason).inc()

    def connections(self, mode: str, delta: int) -> None:
        self.series(self.data_connections, mode).inc(delta)

    def set_serving(self, up: bool) -> None:
        self.serving.set(1 if up else 0)
