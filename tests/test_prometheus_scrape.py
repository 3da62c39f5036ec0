"""The real Prometheus server scrapes a running local cluster; promtool accepts what we serve."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tether.worker.config import WorkerConfig


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} not found: install the Prometheus server and promtool (Debian: apt-get install prometheus)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _wait_for(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except OSError as exc:
            last = exc
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last})")


@pytest.fixture
def running_job(cluster):
    """One shard and two async workers with metrics, training for longer than the test."""
    addresses = cluster.start_shards(1, metrics=True)
    cfg = WorkerConfig(shards=tuple(addresses), num_workers=2, steps=1_000_000, batch_size=64, vocab_size=2000, eval_samples=1, log_every=1000)
    cluster.start_workers(cfg, echo=False, metrics=True)
    ports = dict(cluster.metrics_ports)
    for name, port in ports.items():
        _wait_for(lambda: "tether_" in _get(f"http://127.0.0.1:{port}/metrics"), 60, f"{name} metrics")
    _wait_for(lambda: "tether_worker_samples_total 0.0" not in _get(f"http://127.0.0.1:{ports['worker-0']}/metrics"), 60, "training")
    return ports


def test_promtool_accepts_scraped_metrics(running_job) -> None:
    promtool = _need("promtool")
    for name, port in running_job.items():
        text = _get(f"http://127.0.0.1:{port}/metrics")
        proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"
    shard = _get(f"http://127.0.0.1:{running_job['shard-0']}/metrics")
    assert "tether_shard_push_staleness_bucket" in shard and "tether_shard_rows_pushed_total{table=\"cat_0\"}" in shard


def test_prometheus_server_scrapes_a_local_cluster(running_job, tmp_path: Path) -> None:
    prometheus = _need("prometheus")
    web = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
        f"  - job_name: tether-shard\n    static_configs:\n      - targets: ['127.0.0.1:{running_job['shard-0']}']\n"
        "  - job_name: tether-worker\n    static_configs:\n      - targets: "
        + json.dumps([f"127.0.0.1:{p}" for n, p in running_job.items() if n.startswith("worker")])
        + "\n"
    )
    proc = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        api = f"http://127.0.0.1:{web}/api/v1/query?query="

        def query(q: str) -> float | None:
            body = json.loads(_get(api + urllib.parse.quote(q)))
            result = body["data"]["result"]
            return float(result[0]["value"][1]) if result else None

        _wait_for(lambda: query('count(up{job=~"tether-.*"} == 1)') == 3, 60, "all three targets up")
        first_staleness = _wait_for(lambda: query("sum(tether_shard_push_staleness_count)"), 30, "the staleness histogram")
        first_samples = _wait_for(lambda: query("sum(tether_worker_samples_total)"), 30, "the samples counter")
        assert _wait_for(lambda: (query("sum(tether_shard_push_staleness_count)") or 0) > first_staleness, 30, "staleness to grow")
        assert _wait_for(lambda: (query("sum(tether_worker_samples_total)") or 0) > first_samples, 30, "samples to grow")
        buckets = json.loads(_get(api + urllib.parse.quote("tether_shard_push_staleness_bucket")))["data"]["result"]
        assert {b["metric"]["le"] for b in buckets} >= {"0.0", "1.0", "+Inf"}
        rate = query("sum(rate(tether_worker_samples_total[5s]))")
        assert rate is None or rate > 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
