"""deploy/: Prometheus config and alerts (promtool), Grafana dashboard, Kubernetes manifests, Dockerfile."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tether.server.metrics import ShardMetrics
from tether.worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROM = DEPLOY / "prometheus"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "tether-dashboard.json"
K8S_VERSIONS = ("1.30", "latest")  # 1.30: oldest we support (pod-index label, grpc probes GA)
NAMESPACE = "tether"

# The CLI the manifests call (tether.deploy.cli); every one of these must be passed explicitly.
SERVER_FLAGS = ("--host", "--port", "--shard-index", "--num-shards", "--metrics-port", "--checkpoint-dir")
WORKER_FLAGS = ("--shards", "--worker-index", "--num-workers", "--mode", "--steps", "--batch-size", "--metrics-port")

# ---------------------------------------------------------------- helpers


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        pytest.fail("PyYAML not installed: pip install pyyaml")
    return yaml


def _kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate not installed: pip install kubernetes-validate")
    return kubernetes_validate


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: apt-get install prometheus (Debian/Ubuntu) or put the Prometheus release's promtool on PATH")
    return path


def _run_promtool(*args: str) -> str:
    proc = subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed:\n{out}"
    return out


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in _yaml().safe_load_all(path.read_text()) if d]


def _k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in _load_all(p)]


def _find(kind: str, name: str) -> dict[str, Any]:
    hits = [d for _, d in _k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name} under deploy/k8s, found {len(hits)}"
    return hits[0]


def _exposed_names() -> set[str]:
    """Every series name ShardMetrics and WorkerMetrics can expose, suffixes included."""
    registry = CollectorRegistry()
    ShardMetrics(registry)
    WorkerMetrics(registry)
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
        "info": ("_info",),
    }
    return {m.name + s for m in registry.collect() for s in suffixes[m.type]}


_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on", "ignoring",
             "group_left", "group_right"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (Grafana $variables allowed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()", s):
        if m.group(1).lower() not in _KEYWORDS:
            names.add(m.group(1))
    return names


def test_promql_metric_names_parser() -> None:
    expr = ('histogram_quantile(0.99, sum by (job, le) (rate(tether_shard_push_staleness_bucket'
            '{job=~"$shard_job", le!="x y"}[$__rate_interval]))) >= on (job) 0.8 * max(foo:bar) > 1e9'
            ' and time() - up offset 5m')
    assert promql_metric_names(expr) == {"tether_shard_push_staleness_bucket", "foo:bar", "up"}


# ---------------------------------------------------------------- prometheus


PROM_LOCAL = PROM / "prometheus-local.yml"
PROM_K8S = PROM / "prometheus-k8s.yml"


def _kubernetes_sd_missing(tmp_path: Path) -> str | None:
    """Why this promtool cannot check Kubernetes discovery (Debian builds it out), or None."""
    probe = tmp_path / "probe.yml"
    probe.write_text("scrape_configs:\n  - job_name: p\n    kubernetes_sd_configs:\n      - role: pod\n")
    proc = subprocess.run([_promtool(), "check", "config", str(probe)], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0:
        return None
    out = (proc.stdout + proc.stderr).strip()
    assert "kubernetes_sd_configs not found" in out, f"promtool rejected a minimal kubernetes_sd config for another reason:\n{out}"
    return f"this promtool ({_promtool()}) is built without Kubernetes discovery: {out.splitlines()[-1].strip()}"


def readme_metrics_ports() -> dict[str, list[int]]:
    """--metrics-port of the shards and workers in docs/running.md's first command block."""
    page = (ROOT / "docs" / "running.md").read_text()
    section = page.split("```bash", 1)[1].split("```", 1)[0]
    ports: dict[str, list[int]] = {"server": [], "worker": []}
    for line in section.splitlines():
        m = re.match(r"\s*tether (server|worker) .*--metrics-port (\d+)", line)
        if m:
            ports[m.group(1)].append(int(m.group(2)))
    return ports


def test_prometheus_configs_are_the_local_and_the_kubernetes_one() -> None:
    # prometheus.yml mixed both and did not load on Debian's Prometheus, which the README installs.
    assert sorted(p.name for p in PROM.glob("prometheus*.yml")) == ["prometheus-k8s.yml", "prometheus-local.yml"]


def test_prometheus_local_config_loads_unmodified() -> None:
    """promtool accepts the shipped file as it is (no stripping), alerts.yml included."""
    out = _run_promtool("check", "config", str(PROM_LOCAL))
    assert f"SUCCESS: {PROM_LOCAL} is valid prometheus config file syntax" in out, out
    assert "SUCCESS: 1 rule files found" in out and "SUCCESS: 4 rules found" in out, out
    config = _yaml().safe_load(PROM_LOCAL.read_text())
    assert not any("kubernetes_sd_configs" in j for j in config["scrape_configs"])


def test_prometheus_local_config_scrapes_the_readme_ports() -> None:
    config = _yaml().safe_load(PROM_LOCAL.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"tether-shard-local", "tether-worker-local"}, set(jobs)
    ports = readme_metrics_ports()
    assert ports == {"server": [9100, 9101], "worker": [9200, 9201]}, ports
    for job, role in (("tether-shard-local", "server"), ("tether-worker-local", "worker")):
        targets = [t for sc in jobs[job]["static_configs"] for t in sc["targets"]]
        assert targets == [f"127.0.0.1:{p}" for p in ports[role]], (job, targets)


def test_prometheus_k8s_config_checks(tmp_path: Path) -> None:
    """promtool accepts the shipped Kubernetes file unmodified, where it knows kubernetes_sd."""
    missing = _kubernetes_sd_missing(tmp_path)
    if missing:
        pytest.skip(f"{missing}; prometheus-k8s.yml needs the official Prometheus build")
    out = _run_promtool("check", "config", str(PROM_K8S))
    assert f"SUCCESS: {PROM_K8S} is valid prometheus config file syntax" in out, out
    assert "SUCCESS: 4 rules found" in out, out


def test_prometheus_k8s_config_shape() -> None:
    config = _yaml().safe_load(PROM_K8S.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    assert "static_configs" not in job and "kubernetes_sd_configs" in job
    for r in job["relabel_configs"]:
        if "regex" in r:
            re.compile(r["regex"])


def test_kubernetes_scrape_job_matches_manifests() -> None:
    config = _yaml().safe_load(PROM_K8S.read_text())
    (job,) = [j for j in config["scrape_configs"] if "kubernetes_sd_configs" in j]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod"
    assert sd["namespaces"]["names"] == [NAMESPACE]
    relabels = job["relabel_configs"]
    sources = {src for r in relabels for src in r.get("source_labels", [])}
    for ann in ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"):
        meta = "__meta_kubernetes_pod_annotation_" + re.sub(r"[^A-Za-z0-9_]", "_", ann)
        assert meta in sources, f"{meta} not used by the relabel rules"
    (keep,) = [r for r in relabels if r.get("action") == "keep"]
    # every scraped pod template carries the annotations and a component label -> job tether-<component>
    (job_rule,) = [r for r in relabels if r.get("target_label") == "job"]
    for kind, name in (("StatefulSet", "tether-shard"), ("Job", "tether-worker-async"), ("Job", "tether-worker-sync")):
        meta = _find(kind, name)["spec"]["template"]["metadata"]
        assert re.fullmatch(keep["regex"], meta["annotations"]["prometheus.io/scrape"])
        ports = {p["name"]: p["containerPort"] for p in _find(kind, name)["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert int(meta["annotations"]["prometheus.io/port"]) == ports["metrics"]
        component = meta["labels"]["app.kubernetes.io/component"]
        job_name = re.sub(re.compile(job_rule["regex"]), job_rule["replacement"].replace("$1", r"\1"), component)
        assert job_name in ("tether-shard", "tether-worker"), job_name


def test_alert_rules_check() -> None:
    out = _run_promtool("check", "rules", str(PROM / "alerts.yml"))
    assert "SUCCESS: 4 rules found" in out, out


def test_alert_rules_unit_tests() -> None:
    test_file = PROM / "alerts_test.yml"
    tests = _yaml().safe_load(test_file.read_text())["tests"]
    tested = {t["alertname"] for group in tests for t in group.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert {"TetherWorkerStuck", "TetherRejectedUpdatesRising"} <= tested, tested
    out = _run_promtool("test", "rules", str(test_file))
    assert "SUCCESS" in out, out


def test_alert_rules_shape_and_metric_names() -> None:
    groups = _yaml().safe_load((PROM / "alerts.yml").read_text())["groups"]
    rules = {r["alert"]: r for g in groups for r in g["rules"]}
    assert set(rules) == {"TetherWorkerStuck", "TetherStalenessNearBound", "TetherShardDown", "TetherRejectedUpdatesRising"}
    known = _exposed_names() | {"up"}
    for name, rule in rules.items():
        assert rule.get("for"), f"{name} has no for:"
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        unknown = promql_metric_names(rule["expr"]) - known
        assert not unknown, f"{name} uses metrics nobody exports: {sorted(unknown)}"
    assert "tether_shard_staleness_bound" in rules["TetherStalenessNearBound"]["expr"]
    assert "histogram_quantile(0.99" in rules["TetherStalenessNearBound"]["expr"]
    assert "absent(" in rules["TetherShardDown"]["expr"]


# ---------------------------------------------------------------- grafana


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows nest their panels
    return out


def test_dashboard_parses_and_is_importable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in _panels(dashboard):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


def test_dashboard_queries_use_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    known = _exposed_names()
    used: set[str] = set()
    for p in _panels(dashboard):
        for t in p.get("targets", []):
            names = promql_metric_names(t["expr"])
            assert names, f"panel {p['title']!r}: no metric in {t['expr']!r}"
            unknown = names - known
            assert not unknown, f"panel {p['title']!r} queries metrics nobody exports: {sorted(unknown)}"
            used |= names
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            (metric,) = re.findall(r"label_values\((\w+)", v["definition"])
            assert metric in known, v["name"]
    wanted = {
        "tether_worker_samples_total", "tether_worker_train_loss", "tether_worker_step_phase_seconds_sum",
        "tether_shard_push_staleness_bucket", "tether_shard_rows_pulled_total", "tether_shard_rows_pushed_total",
        "tether_shard_table_rows", "tether_shard_table_memory_bytes", "tether_shard_live_workers",
        "tether_shard_worker_clock_min", "tether_shard_worker_clock_max", "tether_shard_requests_total",
        "tether_shard_request_duration_seconds_bucket", "tether_shard_last_checkpoint_timestamp_seconds",
        "tether_shard_updates_rejected_total", "tether_shard_updates_applied_total",
        "process_resident_memory_bytes", "process_cpu_seconds_total",
    }
    assert not wanted - used, f"dashboard lacks panels for {sorted(wanted - used)}"


# What a dashboard query measures, from the metric it reads (suffixes _total/_sum/_count/_bucket off).
METRIC_QUANTITY = {
    "tether_worker_samples": "samples", "tether_worker_steps": "steps", "tether_worker_train_loss": "loss",
    "tether_worker_clock": "clock ticks", "tether_shard_worker_clock_min": "clock ticks",
    "tether_shard_worker_clock_max": "clock ticks", "tether_shard_staleness_bound": "clock ticks",
    "tether_shard_push_staleness": "clock ticks", "tether_shard_push_update_staleness": "updates",
    "tether_shard_live_workers": "workers", "tether_shard_up": "state",
    "tether_shard_updates_applied": "updates", "tether_shard_updates_rejected": "updates",
    "tether_shard_rows_pulled": "rows", "tether_shard_rows_pushed": "rows", "tether_shard_rows_evicted": "rows",
    "tether_shard_rows_dropped": "rows", "tether_shard_table_rows": "rows",
    "tether_shard_requests": "requests", "tether_worker_rpc_errors": "requests", "tether_worker_retries": "requests",
    "tether_shard_last_checkpoint_timestamp_seconds": "timestamp",
    "tether_worker_rows_moved": "rows", "tether_worker_row_bytes_moved": "bytes", "tether_worker_rows_wanted": "rows",
    "tether_worker_rows_recent": "rows", "tether_worker_cache_rows": "rows", "tether_worker_cache_held_rows": "rows",
    "tether_worker_cache_pending_rows": "rows",
}
# Grafana units each quantity may be drawn in; a quantity not listed is a plain number.
QUANTITY_UNITS = {
    "seconds": {"s"}, "seconds per step": {"s"}, "ratio": {"percentunit"}, "bytes": {"bytes"},
    "bytes/s": {"Bps", "binBps"}, "requests/s": {"reqps"}, "rows/s": {"rps", "short"}, "updates/s": {"ops", "short"},
}
PLAIN_UNITS = {"short", "none", None}


def promql_quantity(expr: str) -> str:
    """The quantity a dashboard query draws: 'seconds', 'bytes/s', 'ratio' (seconds per second)..."""
    names = sorted(promql_metric_names(expr), key=expr.index)
    base_name = re.sub(r"_(total|sum|count|bucket)$", "", names[0])
    if base_name.endswith("_bytes"):
        base = "bytes"
    elif base_name.endswith("_seconds") and not base_name.endswith("_timestamp_seconds"):
        base = "seconds"
    else:
        assert base_name in METRIC_QUANTITY, f"add {base_name} to METRIC_QUANTITY"
        base = METRIC_QUANTITY[base_name]
    if expr.lstrip().startswith("histogram_quantile("):
        return base
    if base == "timestamp" and re.match(r"\s*time\(\)\s*-", expr):
        return "seconds"
    if re.search(r"\b(rate|irate|increase)\(", expr):
        per = re.search(r"/\s*scalar\(.*rate\((\w+)", expr)
        if per:
            return f"{base} per {METRIC_QUANTITY[re.sub(r'_total$', '', per.group(1))].rstrip('s')}"
        return "ratio" if base == "seconds" else f"{base}/s"
    return base


def _target_axes(panel: dict[str, Any]) -> dict[str, tuple[str | None, str]]:
    """refId -> (unit, axis placement) after the panel's byFrameRefID overrides."""
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    out = {}
    for t in panel["targets"]:
        unit, axis = defaults.get("unit"), defaults.get("custom", {}).get("axisPlacement", "auto")
        for o in panel.get("fieldConfig", {}).get("overrides", []):
            if o["matcher"] == {"id": "byFrameRefID", "options": t["refId"]}:
                for prop in o["properties"]:
                    unit = prop["value"] if prop["id"] == "unit" else unit
                    axis = prop["value"] if prop["id"] == "custom.axisPlacement" else axis
        out[t["refId"]] = (unit, "left" if axis == "auto" else axis)
    return out


def test_promql_quantity() -> None:
    assert promql_quantity('histogram_quantile(0.5, sum by (le) (rate(tether_worker_step_duration_seconds_bucket{a="b"}[1m])))') == "seconds"
    assert promql_quantity("sum(rate(tether_worker_staleness_wait_seconds_total[1m]))") == "ratio"
    assert promql_quantity("max(tether_shard_live_workers)") == "workers"
    assert promql_quantity("max(tether_shard_worker_clock_max) - min(tether_shard_worker_clock_min)") == "clock ticks"
    assert promql_quantity("sum by (phase) (rate(tether_worker_step_phase_seconds_sum[1m])) / scalar(sum(rate(tether_worker_steps_total[1m])))") == "seconds per step"
    assert promql_quantity("rate(process_cpu_seconds_total[1m]) and on (job) tether_shard_up") == "ratio"
    assert promql_quantity("sum(rate(tether_shard_sent_bytes_total[1m]))") == "bytes/s"
    assert promql_quantity("time() - tether_shard_last_checkpoint_timestamp_seconds") == "seconds"


def test_dashboard_panels_do_not_mix_units() -> None:
    """Each axis of a panel draws one quantity, in a unit that fits it (a count of live workers
    on the axis of clocks near 900, or seconds beside a fraction of wall time, did not)."""
    dashboard = json.loads(DASHBOARD.read_text())
    for p in _panels(dashboard):
        if p["type"] in ("row", "heatmap"):
            continue
        axes = _target_axes(p)
        on_axis: dict[str, set[str]] = {}
        for t in p["targets"]:
            quantity = promql_quantity(t["expr"])
            unit, axis = axes[t["refId"]]
            allowed = QUANTITY_UNITS.get(quantity, PLAIN_UNITS)
            assert unit in allowed, f"panel {p['title']!r} {t['refId']}: {quantity} drawn in unit {unit!r}, want one of {sorted(map(str, allowed))}"
            on_axis.setdefault(axis, set()).add(quantity)
        for axis, quantities in on_axis.items():
            assert len(quantities) == 1, f"panel {p['title']!r} mixes {sorted(quantities)} on its {axis} axis"
        # Rejections (~0.1/s) are invisible beside thousands of applied updates per second.
        names = [promql_metric_names(t["expr"]) for t in p["targets"]]
        rejected = any("tether_shard_updates_rejected_total" in n for n in names)
        applied = any("tether_shard_updates_applied_total" in n for n in names)
        assert not (rejected and applied) or len(p["targets"]) == 1, f"panel {p['title']!r} draws rejected beside applied updates"


def test_dashboard_process_panels_keep_to_tether_processes() -> None:
    """process_* is exported by every Prometheus target; the panels join it to tether's own series."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", []) if "process_" in t["expr"]]
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total"} <= {n for e in exprs for n in promql_metric_names(e)}
    for expr in exprs:
        assert re.search(r"\band on \(job, instance\) tether_(shard_up|worker_clock)\{", expr), expr


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """Every panel query is valid PromQL once Grafana's variables are substituted."""
    dashboard = json.loads(DASHBOARD.read_text())
    rules = []
    for p in _panels(dashboard):
        for t in p.get("targets", []):
            expr = t["expr"].replace("$__rate_interval", "1m").replace("$__interval", "1m")
            expr = re.sub(r"\$\{?\w+\}?", ".*", expr)
            rules.append({"record": f"tether:dashboard_panel{p['id']}_{t['refId']}:check", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(_yaml().safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _run_promtool("check", "rules", str(path))


# ---------------------------------------------------------------- kubernetes


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    kv = _kubernetes_validate()
    if version == "latest":
        version = kv.latest_version()
    docs = _k8s_docs()
    assert {d["kind"] for _, d in docs} >= {"ConfigMap", "Service", "StatefulSet", "Job"}
    for filename, doc in docs:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{filename}: {doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version} at {path}: {exc.message}")
        except kv.SchemaNotFoundError as exc:
            pytest.fail(f"{filename}: {exc.message}")
        assert doc["metadata"].get("namespace", NAMESPACE) == NAMESPACE or doc["kind"] == "Namespace"


def test_kubernetes_validate_catches_a_typo() -> None:
    kv = _kubernetes_validate()
    sts = _find("StatefulSet", "tether-shard")
    broken = json.loads(json.dumps(sts))
    broken["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, "1.30", strict=True)


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _flag_values(args: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, a in enumerate(args):
        if a.startswith("--") and "=" not in a and i + 1 < len(args):
            out[a] = args[i + 1]
    return out


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_shards_statefulset() -> None:
    config = _find("ConfigMap", "tether-config")["data"]
    svc = _find("Service", "tether-shard")
    sts = _find("StatefulSet", "tether-shard")
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert _selects(sts["spec"]["selector"]["matchLabels"], pod_labels)
    assert _selects(svc["spec"]["selector"], pod_labels)
    replicas = sts["spec"]["replicas"]
    assert replicas == 2 == int(config["TETHER_NUM_SHARDS"])
    expected = ",".join(f"tether-shard-{i}.tether-shard.{NAMESPACE}.svc.cluster.local:50051" for i in range(replicas))
    assert config["TETHER_SHARDS"] == expected

    c = _container(sts)
    assert c["args"][0] == "server"
    flags = _flag_values(c["args"])
    assert set(SERVER_FLAGS) <= set(flags), sorted(set(SERVER_FLAGS) - set(flags))
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "50051" and flags["--metrics-port"] == "9100"
    assert flags["--data-port"] == "50061"
    assert flags["--shard-index"] == "$(TETHER_SHARD_INDEX)"
    env = {e["name"]: e for e in c.get("env", [])}
    assert env["TETHER_SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "data": 50061, "metrics": 9100}
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "data": 50061, "metrics": 9100}
    # The probes ask the plaintext health-only port, which keeps working once TLS is on.
    assert flags["--health-port"] == "50071" and "50071" not in {str(p) for p in ports.values()}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"]["port"] == 50071, probe
    assert c["resources"]["requests"] and c["resources"]["limits"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert mount["mountPath"] == flags["--checkpoint-dir"] == "/var/lib/tether"
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9100"


@pytest.mark.parametrize("name", ["tether-worker-async", "tether-worker-sync"])
def test_worker_jobs(name: str) -> None:
    config = _find("ConfigMap", "tether-config")["data"]
    job = _find("Job", name)
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == 4 == int(config["TETHER_NUM_WORKERS"])
    c = _container(job)
    args = c["args"]
    if name == "tether-worker-async":
        assert "command" not in c and args[0] == "worker"
        assert _flag_values(args)["--mode"] == "$(TETHER_MODE)"
        assert config["TETHER_MODE"] in ("async",) or config["TETHER_MODE"].startswith("ssp:")
    else:
        assert c["command"] == ["torchrun"]
        assert args[args.index("-m") + 1] == "tether.worker"
        torchrun = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args[: args.index("-m")]}
        assert torchrun["--nnodes"] == "$(TETHER_NUM_WORKERS)" and torchrun["--nproc-per-node"] == "1"
        assert torchrun["--rdzv-backend"] == "c10d"
        host, port = torchrun["--rdzv-endpoint"].rsplit(":", 1)
        svc = _find("Service", job["spec"]["template"]["spec"]["subdomain"])
        assert svc["spec"]["clusterIP"] == "None"
        assert host == f"{name}-0.{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
        assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
        assert _selects(svc["spec"]["selector"], {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": name})
        args = args[args.index("-m") + 2 :]
        assert _flag_values(args)["--mode"] == "sync"
    flags = _flag_values(args)
    assert set(WORKER_FLAGS) <= set(flags), sorted(set(WORKER_FLAGS) - set(flags))
    assert flags["--worker-index"] == "$(JOB_COMPLETION_INDEX)"
    assert flags["--shards"] == "$(TETHER_SHARDS)"
    assert flags["--metrics-port"] == "9100"
    # $(VAR) references must resolve from the container's environment or Kubernetes' own.
    env_names = set(config) | {e["name"] for e in c.get("env", [])} | {"JOB_COMPLETION_INDEX"}
    assert any(src["configMapRef"]["name"] == "tether-config" for src in c["envFrom"])
    for ref in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert ref in env_names, ref


# ---------------------------------------------------------------- pod security

# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline + restricted).
RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in a pod spec breaks the Pod Security Standard "restricted" (empty: it passes)."""
    bad: list[str] = []
    psc = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            bad.append(f"{field}: true")
    for sysctl in psc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            bad.append(f"sysctl {sysctl['name']}")
    for v in pod.get("volumes") or []:
        kind = set(v) - {"name"}
        if not kind <= RESTRICTED_VOLUME_TYPES:
            bad.append(f"volume {v['name']}: type {sorted(kind - RESTRICTED_VOLUME_TYPES)}")
    containers = [c for key in ("initContainers", "containers", "ephemeralContainers") for c in pod.get(key) or []]
    for c in containers:
        sc = c.get("securityContext") or {}
        name = c["name"]

        def effective(field: str) -> Any:
            return sc.get(field, psc.get(field))  # noqa: B023 - called in this iteration

        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if (sc.get("windowsOptions") or psc.get("windowsOptions") or {}).get("hostProcess"):
            bad.append(f"{name}: windowsOptions.hostProcess")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount {sc['procMount']}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                bad.append(f"{name}: hostPort {port['hostPort']}")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation must be false")
        if effective("runAsNonRoot") is not True:
            bad.append(f"{name}: runAsNonRoot must be true")
        if effective("runAsUser") == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (effective("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile.type must be RuntimeDefault or Localhost, got {seccomp}")
        apparmor = (effective("appArmorProfile") or {}).get("type", "RuntimeDefault")
        if apparmor not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: appArmorProfile.type {apparmor}")
        selinux = effective("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            bad.append(f"{name}: seLinuxOptions {selinux}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{name}: capabilities.drop must include ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities.add {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
    return bad


def _pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """Every pod spec under deploy/k8s: bare Pods and the templates of workload controllers."""
    out = []
    for filename, doc in _k8s_docs():
        spec = doc.get("spec") or {}
        if doc["kind"] == "Pod":
            pod = spec
        elif doc["kind"] == "CronJob":
            pod = spec["jobTemplate"]["spec"]["template"]["spec"]
        elif "template" in spec:
            pod = spec["template"]["spec"]
        else:
            continue
        out.append((f"{filename}: {doc['kind']}/{doc['metadata']['name']}", pod))
    return out


def test_every_pod_template_meets_pod_security_restricted() -> None:
    templates = _pod_templates()
    assert {n.split(": ", 1)[1] for n, _ in templates} >= {"StatefulSet/tether-shard", "Job/tether-worker-async", "Job/tether-worker-sync"}
    for name, pod in templates:
        assert restricted_violations(pod) == [], name
    ns = _find("Namespace", NAMESPACE)
    labels = ns["metadata"].get("labels", {})
    assert labels.get("pod-security.kubernetes.io/enforce") == "restricted", "the namespace should enforce what the test checks"


@pytest.mark.parametrize(("path", "value", "expected"), [
    ("hostNetwork", True, "hostNetwork"),
    ("volumes", [{"name": "h", "hostPath": {"path": "/"}}], "volume h: type ['hostPath']"),
    ("c.privileged", True, "privileged"),
    ("c.allowPrivilegeEscalation", True, "allowPrivilegeEscalation"),
    ("c.runAsNonRoot", False, "runAsNonRoot"),
    ("c.runAsUser", 0, "runAsUser 0"),
    ("c.seccompProfile", {"type": "Unconfined"}, "seccompProfile"),
    ("c.capabilities", {"drop": ["NET_RAW"]}, "capabilities.drop"),
    ("c.capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}, "capabilities.add ['SYS_ADMIN']"),
    ("port.hostPort", 9100, "hostPort 9100"),
])
def test_restricted_check_catches(path: str, value: Any, expected: str) -> None:
    pod = json.loads(json.dumps(_find("StatefulSet", "tether-shard")["spec"]["template"]["spec"]))
    assert restricted_violations(pod) == []
    c = pod["containers"][0]
    if path.startswith("c."):
        c["securityContext"][path[2:]] = value
        pod["securityContext"].pop(path[2:], None)
    elif path == "port.hostPort":
        c["ports"][0]["hostPort"] = value
    else:
        pod[path] = value
    assert any(expected in v for v in restricted_violations(pod)), restricted_violations(pod)
    # The NET_BIND_SERVICE capability is the one restricted allows.
    c.setdefault("securityContext", {})["capabilities"] = {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}
    assert not any("capabilities" in v for v in restricted_violations(pod))


def test_containers_have_read_only_root_and_writable_tmp() -> None:
    for name, pod in _pod_templates():
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
            assert isinstance(c["securityContext"].get("runAsUser", pod["securityContext"].get("runAsUser")), int), name
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]], name
            # The image user's home (Dockerfile: useradd --home-dir /var/lib/tether) is writable.
            assert "/var/lib/tether" in mounts, name


# Measured on the 2-core dev VM: a 1M x 64 Adagrad table (496 MiB checkpoint) in 3.2-9.7 s, slowest 51 MiB/s.
CHECKPOINT_MIB_PER_S = 51


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity)
    assert m, quantity
    return int(m.group(1)) * units.get(m.group(2), 1)


def test_shard_grace_period_covers_a_final_checkpoint_at_the_memory_limit() -> None:
    pod = _find("StatefulSet", "tether-shard")["spec"]["template"]["spec"]
    c = _container(_find("StatefulSet", "tether-shard"))
    limit = _bytes(c["resources"]["limits"]["memory"])
    drain_s = float(_flag_values(c["args"]).get("--grace-seconds", 5))
    needed = drain_s + limit / (CHECKPOINT_MIB_PER_S * 2**20)
    assert pod["terminationGracePeriodSeconds"] >= needed, f"a final checkpoint of {limit / 2**30:.0f} GiB needs {needed:.0f}s"


def test_shards_have_a_disruption_budget() -> None:
    sts = _find("StatefulSet", "tether-shard")
    pdbs = [d for _, d in _k8s_docs() if d["kind"] == "PodDisruptionBudget"]
    (pdb,) = [d for d in pdbs if _selects(d["spec"]["selector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])]
    assert pdb["apiVersion"] == "policy/v1" and pdb["metadata"]["namespace"] == NAMESPACE
    # One shard at a time; never 0 (drains could not proceed) and not minAvailable (replicas drift).
    assert pdb["spec"] == {**pdb["spec"], "maxUnavailable": 1} and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "shard"


def test_servicemonitor_selects_the_shard_service() -> None:
    docs = _load_all(K8S / "prometheus-operator" / "servicemonitor.yaml")
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    svc = _find("Service", "tether-shard")
    assert _selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "shard"
    assert svc["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    for endpoint in sm["spec"]["endpoints"]:
        assert endpoint["port"] in svc_ports
    pms = [d for d in docs if d["kind"] == "PodMonitor"]
    for pm in pms:
        assert pm["apiVersion"] == "monitoring.coreos.com/v1"
        for job_name in ("tether-worker-async", "tether-worker-sync"):
            job = _find("Job", job_name)
            assert _selects(pm["spec"]["selector"]["matchLabels"], job["spec"]["template"]["metadata"]["labels"])
            names = {p["name"] for p in _container(job)["ports"]}
            assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= names


# ---------------------------------------------------------------- docker


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined, comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for ln in joined.splitlines():
        if ln.strip():
            word, _, rest = ln.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile() -> None:
    ins = _dockerfile_instructions()
    args = dict(re.findall(r"^(\w+)=(\S+)", "\n".join(a for i, a in ins if i == "ARG"), flags=re.M))
    (base,) = [a for i, a in ins if i == "FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert base == "python:3.11-slim"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert ("ENTRYPOINT", '["tether"]') in ins
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^tether = "tether\.deploy\.cli:main"', pyproject, flags=re.M)


def test_dockerfile_installs_dependencies_before_copying_the_code() -> None:
    """A code change must not reinstall torch and the other dependencies."""
    ins = _dockerfile_instructions()
    copies = [(n, a) for n, (i, a) in enumerate(ins) if i == "COPY"]
    (code_copy,) = [n for n, a in copies if re.match(r"(--\S+\s+)*\.\s", a)]
    (manifest_copy,) = [n for n, a in copies if a.split()[0] == "pyproject.toml"]
    assert manifest_copy < code_copy
    runs = [(n, a) for n, (i, a) in enumerate(ins) if i == "RUN" and "pip install" in a]
    torch_layer = [n for n, a in runs if "torch==" in a]
    deps_layer = [n for n, a in runs if "pyproject.toml" in a or "requirements" in a]
    assert torch_layer and torch_layer[0] < code_copy, "torch is installed before the code is copied"
    assert deps_layer and manifest_copy < deps_layer[0] < code_copy, "dependencies install from pyproject.toml alone"
    after = [a for n, a in runs if n > code_copy]
    assert after and all("--no-deps" in a for a in after), f"after COPY . only tether itself installs: {after}"


def test_dockerfile_torch_pin_matches_the_readme() -> None:
    ins = _dockerfile_instructions()
    args = dict(re.findall(r"^(\w+)=(\S+)", "\n".join(a for i, a in ins if i == "ARG"), flags=re.M))
    readme_pins = set(re.findall(r"torch==([\w.+]+)", (ROOT / "README.md").read_text()))
    assert len(readme_pins) == 1, readme_pins
    ci_pins = set(re.findall(r"torch==([\w.+]+)", (ROOT / ".ci" / "run").read_text()))
    assert ci_pins == readme_pins, ci_pins
    assert args.get("TORCH_VERSION") in readme_pins, f"ARG TORCH_VERSION={args.get('TORCH_VERSION')} vs README {readme_pins}"
    assert any(i == "RUN" and '"torch==${TORCH_VERSION}"' in a for i, a in ins)


def test_dockerfile_exposes_the_ports_the_manifests_use() -> None:
    exposed = {int(p.split("/")[0]) for i, a in _dockerfile_instructions() if i == "EXPOSE" for p in a.split()}
    used = {p["containerPort"] for _, pod in _pod_templates() for c in pod["containers"] for p in c.get("ports", [])}
    assert used >= {50051, 50061, 9100}, used
    assert used <= exposed, f"not in EXPOSE: {sorted(used - exposed)}"


def test_dockerfile_runs_as_the_numeric_non_root_user_of_the_manifests() -> None:
    users = [a for i, a in _dockerfile_instructions() if i == "USER"]
    assert users, "run as a non-root user"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: Kubernetes checks runAsNonRoot only on a numeric uid"
    assert not gid or (gid.isdigit() and int(gid) != 0), users[-1]
    for name, pod in _pod_templates():
        for c in pod["containers"]:
            run_as = c.get("securityContext", {}).get("runAsUser", pod.get("securityContext", {}).get("runAsUser"))
            assert run_as == int(uid), f"{name}: runAsUser {run_as} vs the image's {uid}"
