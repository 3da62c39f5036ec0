"""The real Prometheus server scrapes a running local cluster; promtool accepts what we serve."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tether.common.settings import to_argv as worker_argv
from tether.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
PROM_LOCAL = ROOT / "deploy" / "prometheus" / "prometheus-local.yml"
# docs/running.md's cluster serves metrics on these; the file scrapes them.
SHARD_METRICS_PORTS = (9100, 9101)
WORKER_METRICS_PORTS = (9200, 9201)
# The workers here train until the test has what it scrapes (up to a 15 s scrape interval): each
# computes SLOWDOWN times slower (sleeping, as a straggler does), so they still push every step and
# every counter grows, but the job no longer takes both cores from the test beside it while it waits.
SLOWDOWN = 8.0


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
    cfg = WorkerConfig(shards=tuple(addresses), num_workers=2, steps=1_000_000, batch_size=64, vocab_size=2000, eval_samples=1, log_every=1000,
                       slowdown=SLOWDOWN)
    cluster.start_workers(cfg, echo=False, metrics=True)
    ports = dict(cluster.metrics_ports)
    for name, port in ports.items():
        _wait_for(lambda: "tether_" in _get(f"http://127.0.0.1:{port}/metrics"), 60, f"{name} metrics")  # noqa: B023 - waited on here
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
    # Process metrics (the dashboard's memory and CPU panels): a shard holds at least some MiB.
    for name, port in running_job.items():
        text = _get(f"http://127.0.0.1:{port}/metrics")
        (rss,) = [ln for ln in text.splitlines() if ln.startswith("process_resident_memory_bytes ")]
        assert float(rss.split()[1]) > 10 * 2**20, (name, rss)
        assert "process_cpu_seconds_total " in text and "process_open_fds " in text, name


def _start_prometheus(config: Path, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """The real Prometheus server on ``config``; only its listen address and storage are set here."""
    prometheus = _need("prometheus")
    web = _free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{web}"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    return proc, f"http://127.0.0.1:{web}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def test_prometheus_server_scrapes_a_local_cluster(running_job, tmp_path: Path) -> None:
    """The shipped local config with its targets swapped for this cluster's free ports and a 1 s
    interval (the test waits for counters to grow); test_shipped_local_config_* runs it unmodified."""
    config = yaml.safe_load(PROM_LOCAL.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    config["global"]["scrape_timeout"] = "1s"
    config["rule_files"] = [str(PROM_LOCAL.parent / f) for f in config["rule_files"]]
    targets = {
        "tether-shard-local": [f"127.0.0.1:{p}" for n, p in running_job.items() if n.startswith("shard")],
        "tether-worker-local": [f"127.0.0.1:{p}" for n, p in running_job.items() if n.startswith("worker")],
    }
    for job in config["scrape_configs"]:
        (static,) = job["static_configs"]
        static["targets"] = targets[job["job_name"]]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    proc, base = _start_prometheus(path, tmp_path)
    try:
        api = f"{base}/api/v1/query?query="

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
        _stop(proc)


def _busy(port: int) -> bool:
    # Workers serve metrics on 0.0.0.0 and shards on 127.0.0.1: binding the wildcard tests both.
    # SO_REUSEADDR as the metrics servers set it: a previous run's TIME_WAIT does not count.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def test_shipped_local_config_scrapes_the_documented_cluster(tmp_path: Path) -> None:
    """Users' path, unmodified: docs/running.md's two shards and two workers on their fixed metrics
    ports, and ``prometheus --config.file=deploy/prometheus/prometheus-local.yml``.

    The file's ports are the product, so they are not rewritten; where something else holds one
    (node_exporter also defaults to 9100; a parallel run of this test) the test skips and says
    which. test_prometheus_server_scrapes_a_local_cluster covers the same file on free ports.
    """
    busy = [p for p in (*SHARD_METRICS_PORTS, *WORKER_METRICS_PORTS) if _busy(p)]
    if busy:
        pytest.skip(f"metrics port(s) {busy} in use on this machine; prometheus-local.yml scrapes the fixed ports {SHARD_METRICS_PORTS + WORKER_METRICS_PORTS}")
    _need("prometheus")
    procs: list[tuple[str, subprocess.Popen]] = []
    logs: dict[str, Path] = {}

    def spawn(name: str, argv: list[str]) -> subprocess.Popen:
        logs[name] = tmp_path / f"{name}.log"
        with logs[name].open("w") as log:
            proc = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
        procs.append((name, proc))
        return proc

    def alive() -> None:
        for name, proc in procs:
            if proc.poll() is not None:
                text = logs[name].read_text()
                if "Address already in use" in text:
                    pytest.skip(f"{name}: its fixed metrics port was taken meanwhile: {text.strip().splitlines()[-1]}")
                pytest.fail(f"{name} exited with code {proc.returncode}:\n{text[-3000:]}")

    prom = None
    try:
        addresses = []
        for i, mport in enumerate(SHARD_METRICS_PORTS):
            port_file = tmp_path / f"shard-{i}.port"
            spawn(f"shard-{i}", ["-m", "tether.server", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
                                 "--shard-index", str(i), "--num-shards", str(len(SHARD_METRICS_PORTS)), "--metrics-port", str(mport)])

            def port(pf: Path = port_file) -> int | None:
                alive()
                return int(pf.read_text()) if pf.exists() and pf.read_text().strip() else None

            addresses.append(f"127.0.0.1:{_wait_for(port, 60, f'shard {i} to serve')}")
        cfg = WorkerConfig(shards=tuple(addresses), num_workers=len(WORKER_METRICS_PORTS), steps=1_000_000, batch_size=64,
                           vocab_size=2000, eval_samples=1, log_every=100_000, slowdown=SLOWDOWN)
        for i, mport in enumerate(WORKER_METRICS_PORTS):
            spawn(f"worker-{i}", ["-m", "tether.worker", *worker_argv(replace(cfg, worker_index=i)), "--metrics-port", str(mport)])

        prom, base = _start_prometheus(PROM_LOCAL, tmp_path)  # the shipped file, not a copy

        def targets_up() -> dict[str, str] | None:
            alive()
            if prom.poll() is not None:
                pytest.fail(f"prometheus exited with code {prom.returncode}:\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}")
            active = json.loads(_get(f"{base}/api/v1/targets?state=active"))["data"]["activeTargets"]
            health = {f"{t['labels']['job']} {t['labels']['instance']}": t["health"] for t in active}
            return health if health and all(h == "up" for h in health.values()) else None

        # scrape_interval is 15 s in the file: the first scrape of each target lands within one.
        health = _wait_for(targets_up, 90, "every target of prometheus-local.yml to be up")
        assert health == {
            **{f"tether-shard-local 127.0.0.1:{p}": "up" for p in SHARD_METRICS_PORTS},
            **{f"tether-worker-local 127.0.0.1:{p}": "up" for p in WORKER_METRICS_PORTS},
        }, health

        def query(q: str) -> list[dict]:
            return json.loads(_get(f"{base}/api/v1/query?query={urllib.parse.quote(q)}"))["data"]["result"]

        assert len(query('tether_shard_up{job="tether-shard-local"} == 1')) == len(SHARD_METRICS_PORTS)
        assert len(query('tether_worker_clock{job="tether-worker-local"}')) == len(WORKER_METRICS_PORTS)
        rss = query('process_resident_memory_bytes{cluster="local"}')
        assert len(rss) == 4 and all(float(r["value"][1]) > 10 * 2**20 for r in rss), rss
        # alerts.yml, named relative to the config file, was loaded too.
        groups = json.loads(_get(f"{base}/api/v1/rules"))["data"]["groups"]
        assert {r["name"] for g in groups for r in g["rules"]} >= {"TetherShardDown", "TetherWorkerStuck"}
    finally:
        if prom is not None:
            _stop(prom)
        for _name, proc in reversed(procs):
            _stop(proc)
