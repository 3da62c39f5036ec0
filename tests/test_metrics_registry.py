"""ShardMetrics / WorkerMetrics: names, labels, private registries, HTTP exposition, promtool lint."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tether.common import metrics_http
from tether.server import metrics as shard_metrics
from tether.server.metrics import REJECT_REASONS, UPDATE_KINDS, ShardMetrics
from tether.worker import metrics as worker_metrics
from tether.worker.metrics import PHASES, WorkerMetrics

# attribute -> (exposed name, type, label names); prometheus_client names a counter family without _total
SHARD_SPEC: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "requests": ("tether_shard_requests_total", "counter", ("rpc", "code")),
    "request_seconds": ("tether_shard_request_duration_seconds", "histogram", ("rpc",)),
    "received_bytes": ("tether_shard_received_bytes_total", "counter", ("rpc",)),
    "sent_bytes": ("tether_shard_sent_bytes_total", "counter", ("rpc",)),
    "internal_errors": ("tether_shard_internal_errors_total", "counter", ("rpc",)),
    "rows_pulled": ("tether_shard_rows_pulled_total", "counter", ("table",)),
    "rows_pushed": ("tether_shard_rows_pushed_total", "counter", ("table",)),
    "table_rows": ("tether_shard_table_rows", "gauge", ("table",)),
    "table_memory_bytes": ("tether_shard_table_memory_bytes", "gauge", ("table",)),
    "rows_evicted": ("tether_shard_rows_evicted_total", "counter", ("table",)),
    "rows_dropped": ("tether_shard_rows_dropped_total", "counter", ("table",)),
    "remedied_rows": ("tether_shard_remedied_rows_total", "counter", ("table", "remedy")),
    "remedied_dense_elements": ("tether_shard_remedied_dense_elements_total", "counter", ("remedy",)),
    "updates_applied": ("tether_shard_updates_applied_total", "counter", ("kind",)),
    "updates_rejected": ("tether_shard_updates_rejected_total", "counter", ("reason",)),
    "push_staleness": ("tether_shard_push_staleness", "histogram", ()),
    "push_update_staleness": ("tether_shard_push_update_staleness", "histogram", ()),
    "staleness_bound": ("tether_shard_staleness_bound", "gauge", ()),
    "live_workers": ("tether_shard_live_workers", "gauge", ()),
    "worker_clock_min": ("tether_shard_worker_clock_min", "gauge", ()),
    "worker_clock_max": ("tether_shard_worker_clock_max", "gauge", ()),
    "last_checkpoint_timestamp": ("tether_shard_last_checkpoint_timestamp_seconds", "gauge", ()),
    "checkpoint_seconds": ("tether_shard_checkpoint_duration_seconds", "histogram", ()),
    "checkpoint_failures": ("tether_shard_checkpoint_failures_total", "counter", ("reason",)),
    "serving": ("tether_shard_up", "gauge", ()),
    "data_connections": ("tether_shard_data_connections", "gauge", ("mode",)),
}
WORKER_SPEC: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "phase_seconds": ("tether_worker_step_phase_seconds", "histogram", ("phase",)),
    "step_seconds": ("tether_worker_step_duration_seconds", "histogram", ()),
    "samples": ("tether_worker_samples_total", "counter", ()),
    "steps": ("tether_worker_steps_total", "counter", ()),
    "train_loss": ("tether_worker_train_loss", "gauge", ()),
    "clock": ("tether_worker_clock", "gauge", ()),
    "staleness_wait_seconds": ("tether_worker_staleness_wait_seconds_total", "counter", ()),
    "retries": ("tether_worker_retries_total", "counter", ("rpc",)),
    "rpc_errors": ("tether_worker_rpc_errors_total", "counter", ("rpc", "code")),
    "unexpected_duplicates": ("tether_worker_unexpected_duplicate_pushes_total", "counter", ()),
    "last_step_timestamp": ("tether_worker_last_step_timestamp_seconds", "gauge", ()),
    "rows_moved_total": ("tether_worker_rows_moved_total", "counter", ("table", "direction")),
    "bytes_moved_total": ("tether_worker_row_bytes_moved_total", "counter", ("table", "direction")),
    "rows_wanted_total": ("tether_worker_rows_wanted_total", "counter", ("table",)),
    "rows_recent_total": ("tether_worker_rows_recent_total", "counter", ("table", "within")),
}
# The row cache's, read from it by each scrape (``WorkerMetrics.watch_cache``): name, type, labels.
WORKER_CACHE_SPEC: list[tuple[str, str, tuple[str, ...]]] = [
    ("tether_worker_cache_rows_total", "counter", ("table", "outcome")),
    ("tether_worker_cache_held_rows", "gauge", ("table",)),
    ("tether_worker_cache_bytes", "gauge", ("table",)),
    ("tether_worker_cache_pending_rows", "gauge", ()),
    ("tether_worker_cache_seconds_total", "counter", ()),
]
# prometheus_client's process and platform collectors (Linux: read from /proc), in every registry.
PROCESS_FAMILIES: dict[str, str] = {
    "process_virtual_memory_bytes": "gauge",
    "process_resident_memory_bytes": "gauge",
    "process_start_time_seconds": "gauge",
    "process_cpu_seconds": "counter",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
    "python_info": "gauge",
}


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: apt-get install prometheus (Debian/Ubuntu) or put the Prometheus release's promtool on PATH")
    return path


def _families(registry: CollectorRegistry) -> dict[str, str]:
    return {m.name: m.type for m in registry.collect()}


def _family(name: str, kind: str) -> str:
    return name.removesuffix("_total") if kind == "counter" else name


def _observe_some(shard: ShardMetrics, worker: WorkerMetrics) -> None:
    shard.requests.labels(rpc="Pull", code="OK").inc()
    shard.requests.labels(rpc="Push", code="INVALID_ARGUMENT").inc()
    shard.request_seconds.labels(rpc="Pull").observe(0.0004)
    shard.received_bytes.labels(rpc="Push").inc(4096)
    shard.sent_bytes.labels(rpc="Pull").inc(8192)
    shard.rows_pulled.labels(table="user").inc(128)
    shard.rows_pushed.labels(table="user").inc(128)
    shard.table_rows.labels(table="user").set(1000)
    shard.table_memory_bytes.labels(table="user").set(1000 * 64 * 4 * 2)
    shard.rows_evicted.labels(table="user").inc(3)
    shard.rows_dropped.labels(table="user").inc(2)
    shard.applied("sparse", 2)
    shard.reject("too_stale")
    shard.push_staleness.observe(3)
    shard.set_staleness_bound(4)
    shard.live_workers.set(4)
    shard.worker_clock_min.set(10)
    shard.worker_clock_max.set(13)
    shard.last_checkpoint_timestamp.set(1.7e9)
    shard.checkpoint_seconds.observe(1.5)
    shard.serving.set(1)
    for phase in PHASES:
        worker.observe_phase(phase, 0.002)
    worker.step_seconds.observe(0.01)
    worker.samples.inc(256)
    worker.steps.inc()
    worker.train_loss.set(0.69)
    worker.clock.set(1)
    worker.retries.labels(rpc="Push").inc()
    worker.rpc_errors.labels(rpc="Push", code="UNAVAILABLE").inc()
    worker.last_step_timestamp.set(1.7e9)


@pytest.mark.parametrize(("cls", "spec", "read"), [(ShardMetrics, SHARD_SPEC, []), (WorkerMetrics, WORKER_SPEC, WORKER_CACHE_SPEC)])
def test_names_types_and_labels(cls: type, spec: dict[str, tuple[str, str, tuple[str, ...]]], read: list[tuple[str, str, tuple[str, ...]]]) -> None:
    registry = CollectorRegistry()
    metrics = cls(registry)
    want = {_family(name, kind): kind for name, kind, _ in [*spec.values(), *read]}
    assert _families(registry) == want | PROCESS_FAMILIES
    for attr, (name, kind, labels) in spec.items():
        metric = getattr(metrics, attr)
        assert metric._name == _family(name, kind), attr
        assert tuple(metric._labelnames) == labels, attr


def test_the_row_caches_metrics_are_read_from_it_when_scraped() -> None:
    """``watch_cache``: a scrape exports what the reading gives at that moment (counts as
    counters, sizes as gauges), each series with the labels of ``WORKER_CACHE_SPEC``; before a
    cache is watched, only the pending rows at 0. Nothing is read between scrapes."""
    registry = CollectorRegistry()
    worker = WorkerMetrics(registry)
    assert registry.get_sample_value("tether_worker_cache_pending_rows") == 0
    assert registry.get_sample_value("tether_worker_cache_held_rows", {"table": "user"}) is None
    reads: list[int] = []
    state = {"hits": 3, "refreshed": 1, "evicted": 0, "invalidated": 0, "passed": 2}

    def read() -> tuple[dict[str, tuple[dict[str, int], int, int]], int, float]:
        reads.append(1)
        return {"user": (dict(state), 40, 4096), "item": (dict.fromkeys(state, 0), 0, 128)}, 7, 1.25

    worker.watch_cache(read)
    assert reads == []  # nothing read until asked
    text = generate_latest(registry).decode()
    assert len(reads) == 1
    assert 'tether_worker_cache_rows_total{outcome="hits",table="user"} 3.0' in text
    assert 'tether_worker_cache_held_rows{table="user"} 40.0' in text and 'tether_worker_cache_bytes{table="item"} 128.0' in text
    assert "tether_worker_cache_pending_rows 7.0" in text
    assert "tether_worker_cache_seconds_total 1.25" in text
    state["hits"] = 10
    assert registry.get_sample_value("tether_worker_cache_rows_total", {"table": "user", "outcome": "hits"}) == 10
    for name, _, labels in WORKER_CACHE_SPEC:
        samples = [s for m in registry.collect() for s in m.samples if s.name == name]
        assert samples and all(tuple(sorted(s.labels)) == tuple(sorted(labels)) for s in samples), name


def test_two_instances_use_private_registries() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    sa, sb = ShardMetrics(a), ShardMetrics(b)
    wa, wb = WorkerMetrics(a), WorkerMetrics(b)  # shard and worker names share a registry fine
    sa.rows_pulled.labels(table="t").inc(5)
    wa.steps.inc(2)
    assert a.get_sample_value("tether_shard_rows_pulled_total", {"table": "t"}) == 5
    assert b.get_sample_value("tether_shard_rows_pulled_total", {"table": "t"}) is None
    assert a.get_sample_value("tether_worker_steps_total") == 2
    assert b.get_sample_value("tether_worker_steps_total") == 0
    assert sb.registry is b and wb.registry is b
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        ShardMetrics(a)


def test_process_metrics_are_exported_once_per_registry() -> None:
    shared, alone = CollectorRegistry(), CollectorRegistry()
    ShardMetrics(shared)
    WorkerMetrics(shared)  # a second instance in one registry must not export process_* twice
    WorkerMetrics(alone)
    for registry in (shared, alone):
        text = generate_latest(registry).decode()
        rss = [ln for ln in text.splitlines() if ln.startswith("process_resident_memory_bytes ")]
        assert len(rss) == 1, rss
        assert float(rss[0].split()[1]) > 1e6  # this test process's RSS, in bytes
        assert registry.get_sample_value("process_cpu_seconds_total") > 0
        assert registry.get_sample_value("process_open_fds") >= 3
        assert "python_info{" in text


def test_nothing_lands_in_the_default_registry() -> None:
    from prometheus_client import REGISTRY

    ShardMetrics(CollectorRegistry())
    WorkerMetrics(CollectorRegistry())
    leaked = [m.name for m in REGISTRY.collect() if m.name.startswith("tether_")]
    assert leaked == []


def test_bounded_series_start_at_zero() -> None:
    registry = CollectorRegistry()
    ShardMetrics(registry)
    WorkerMetrics(registry)
    for kind in UPDATE_KINDS:
        assert registry.get_sample_value("tether_shard_updates_applied_total", {"kind": kind}) == 0
    for reason in REJECT_REASONS:
        assert registry.get_sample_value("tether_shard_updates_rejected_total", {"reason": reason}) == 0
    for phase in PHASES:
        assert registry.get_sample_value("tether_worker_step_phase_seconds_count", {"phase": phase}) == 0
    assert registry.get_sample_value("tether_shard_staleness_bound") == -1


def test_helpers_validate_label_values() -> None:
    shard = ShardMetrics(CollectorRegistry())
    worker = WorkerMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match=r"reason must be one of .* got 'bogus'"):
        shard.reject("bogus")
    with pytest.raises(ValueError, match=r"kind must be one of .* got 'embedding'"):
        shard.applied("embedding")
    with pytest.raises(ValueError, match=r"staleness bound must be an int >= 0 or None, got -2"):
        shard.set_staleness_bound(-2)
    with pytest.raises(ValueError, match=r"phase must be one of .* got 'eval'"):
        worker.observe_phase("eval", 0.1)
    with pytest.raises(ValueError, match=r"seconds must be >= 0, got -0.5"):
        worker.observe_phase("push", -0.5)
    with pytest.raises(ValueError, match="registry must be a CollectorRegistry, got None"):
        ShardMetrics(None)  # type: ignore[arg-type]

    shard.set_staleness_bound(None)
    assert shard.registry.get_sample_value("tether_shard_staleness_bound") == -1
    shard.set_staleness_bound(0)
    assert shard.registry.get_sample_value("tether_shard_staleness_bound") == 0
    worker.observe_phase("staleness_wait", 1.25)
    assert worker.registry.get_sample_value("tether_worker_staleness_wait_seconds_total") == 1.25


def test_serve_metrics_is_common_to_shards_and_workers() -> None:
    # One HTTP server for both sides: neither metrics module carries a copy or a re-export of it.
    assert not hasattr(shard_metrics, "serve_metrics")
    assert not hasattr(worker_metrics, "serve_metrics")
    assert callable(metrics_http.serve_metrics)


def test_worker_metrics_do_not_import_the_server() -> None:
    code = (
        "import sys, tether.worker.metrics, tether.common.metrics_http\n"
        "bad = sorted(m for m in sys.modules if m.startswith('tether.server'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("port", [-1, 65536, True, 8080.0, "9100"])
def test_serve_metrics_rejects_bad_ports(port: object) -> None:
    with pytest.raises(ValueError, match=r"port must be an int in \[0, 65535\], got "):
        metrics_http.serve_metrics(CollectorRegistry(), port)  # type: ignore[arg-type]


def test_serve_metrics_on_port_zero_serves_the_registry() -> None:
    registry = CollectorRegistry()
    shard, worker = ShardMetrics(registry), WorkerMetrics(registry)
    _observe_some(shard, worker)
    server, port = metrics_http.serve_metrics(registry, 0, host="127.0.0.1")
    try:
        assert 0 < port <= 65535
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    for name, _kind, _labels in [*SHARD_SPEC.values(), *WORKER_SPEC.values()]:
        assert f"# TYPE {name} " in text, name
    assert 'tether_shard_requests_total{code="OK",rpc="Pull"} 1.0' in text
    assert "tether_shard_staleness_bound 4.0" in text


@pytest.mark.parametrize("observed", [False, True], ids=["fresh", "observed"])
def test_promtool_check_metrics_passes(observed: bool) -> None:
    promtool = _promtool()
    registry = CollectorRegistry()
    shard, worker = ShardMetrics(registry), WorkerMetrics(registry)
    if observed:
        _observe_some(shard, worker)
    text = generate_latest(registry)
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    out = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 0, f"promtool check metrics failed:\n{out}"
    assert out.strip() == "", f"promtool reported lint problems:\n{out}"


def test_series_are_remembered_and_table_gauges_read_at_scrape_time() -> None:
    import numpy as np

    from tether.protos.specs import OptimizerConfig, TableConfig
    from tether.server.serving.handler import RequestHandler
    from tether.server.storage.shard import Shard

    registry = CollectorRegistry()
    metrics = ShardMetrics(registry)
    child = metrics.series(metrics.requests, "Pull", "OK")
    assert metrics.series(metrics.requests, "Pull", "OK") is child is metrics.requests.labels(rpc="Pull", code="OK")
    child.inc(3)
    assert registry.get_sample_value("tether_shard_requests_total", {"rpc": "Pull", "code": "OK"}) == 3

    shard = Shard(metrics=metrics)
    shard.declare([TableConfig("t", dim=4, optimizer=OptimizerConfig("sgd", lr=0.1))], [])
    RequestHandler(shard, metrics)  # exports the tables the shard already holds (as after a restore)
    assert registry.get_sample_value("tether_shard_table_rows", {"table": "t"}) == 0
    shard.pull([("t", np.arange(10, dtype=np.int64))], [])
    # No call since the pull: the gauge reads the table when scraped.
    assert registry.get_sample_value("tether_shard_table_rows", {"table": "t"}) == 10
    assert registry.get_sample_value("tether_shard_table_memory_bytes", {"table": "t"}) == shard.tables["t"].memory_bytes
