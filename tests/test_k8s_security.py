"""deploy/k8s is locked by default: every shard and worker container takes the bearer token from a
Secret it cannot start without, NetworkPolicies admit only the job's workers and Prometheus, and
mutual TLS is one step (mtls/). The containers' argv and environment are parsed by the real
``tether server`` and ``tether worker`` parsers, so the manifests cannot drift from the code."""

from __future__ import annotations

import json
import os
import re
import secrets
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pytest

from tether.common import settings as fields
from tether.server import config as shard_config
from tether.worker import flags as worker_flags
from tether.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
MTLS = K8S / "mtls"
DOC = ROOT / "docs" / "kubernetes.md"
NAMESPACE = "tether"
TOKEN_SECRET, TOKEN_KEY = "tether-token", "token"
TLS_SECRETS = {"shard": "tether-shard-tls", "worker": "tether-worker-tls"}
TLS_FILES = ("tls.crt", "tls.key", "ca.crt")  # what cert-manager writes, and the doc's kubectl create secret
WORKLOADS = ("StatefulSet", "Deployment", "DaemonSet", "Job", "CronJob")
SHARD_LABELS = {"app.kubernetes.io/name": "tether", "app.kubernetes.io/component": "shard"}
WORKER_LABELS = {"app.kubernetes.io/name": "tether", "app.kubernetes.io/component": "worker"}


def _load(path: Path) -> list[dict[str, Any]]:
    import yaml

    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _docs(folder: Path = K8S) -> list[dict[str, Any]]:
    return [d for p in sorted(folder.glob("*.yaml")) for d in _load(p)]


def _one(kind: str, name: str, folder: Path = K8S) -> dict[str, Any]:
    hits = [d for d in _docs(folder) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name} in {folder}, found {len(hits)}"
    return hits[0]


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else doc["spec"]
    return spec["template"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _tether_argv(c: dict[str, Any]) -> tuple[str, list[str]]:
    """(``server`` or ``worker``, the argv that command's parser gets) of one container."""
    args = list(c.get("args") or [])
    if c.get("command") == ["torchrun"]:
        assert args[args.index("-m") + 1] == "tether.worker", args
        return "worker", args[args.index("-m") + 2 :]
    assert "command" not in c, f"{c['name']}: the image's entrypoint is tether"
    assert args and args[0] in ("server", "worker"), f"{c['name']}: not a tether server/worker container: {args[:1]}"
    return args[0], args[1:]


def _containers() -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(workload, role, pod template, container) of every container of every workload."""
    out = []
    for doc in _docs():
        if doc["kind"] in WORKLOADS:
            pod = _pod(doc)
            for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
                out.append((f"{doc['kind']}/{doc['metadata']['name']}", _tether_argv(c)[0], pod, c))
    return out


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] for i, a in enumerate(argv) if a.startswith("--") and i + 1 < len(argv)}


def _mount_of(pod: dict[str, Any], c: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The volume that holds ``path`` in container ``c``, and the path inside it."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    for m in c.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/") + "/"
        if path.startswith(root):
            return volumes[m["name"]], path[len(root) :]
    raise AssertionError(f"{c['name']}: {path} is on no mounted volume")


# ---------------------------------------------------------------- the token


def test_every_shard_and_worker_container_reads_the_token_from_the_secret() -> None:
    seen = {(workload, role) for workload, role, _, _ in _containers()}
    assert seen >= {("StatefulSet/tether-shard", "server"), ("Job/tether-worker-async", "worker"), ("Job/tether-worker-sync", "worker")}
    for workload, role, pod, c in _containers():
        path = _flags(_tether_argv(c)[1]).get("--auth-token-file")
        assert path, f"{workload}: {role} without --auth-token-file"
        volume, inside = _mount_of(pod, c, path)
        secret = volume.get("secret")
        assert secret and secret["secretName"] == TOKEN_SECRET, f"{workload}: {path} is not on Secret {TOKEN_SECRET}"
        # Not optional: the kubelet does not start the pod without the Secret and its key.
        assert secret.get("optional", False) is False, workload
        assert {i["key"]: i["path"] for i in secret["items"]} == {TOKEN_KEY: inside}, workload
        mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
        assert mount.get("readOnly") is True, workload
        # No other source of a token that could stand in for it.
        assert "TETHER_AUTH_TOKEN" not in {e["name"] for e in c.get("env", [])}, workload


def test_the_real_commands_refuse_to_start_without_the_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    missing = str(tmp_path / "absent")
    with pytest.raises(ValueError, match="cannot read auth token file"):
        shard_config.load_config(["--auth-token-file", missing])
    with pytest.raises(ValueError, match="cannot read auth token file"):
        worker_flags.load_config(["--shards", "127.0.0.1:1", "--auth-token-file", missing])
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="auth token must be"):
        shard_config.load_config(["--auth-token-file", str(tmp_path / "empty")])


# ---------------------------------------------------------------- the real parsers


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TETHER_") or name in ("JOB_COMPLETION_INDEX", "LOCAL_RANK"):
            monkeypatch.delenv(name)


def _container_env(c: dict[str, Any], tls: bool) -> dict[str, str]:
    """What the container's environment holds: its ConfigMaps (tether-tls only once applied),
    its own env, and what Kubernetes sets (the StatefulSet's pod index, the Job's completion index)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        ref = src["configMapRef"]
        if ref["name"] == "tether-tls":
            assert ref.get("optional") is True, "tether-tls is applied only for mutual TLS"
            if tls:
                env.update(_one("ConfigMap", "tether-tls", MTLS)["data"])
        else:
            env.update(_one("ConfigMap", ref["name"])["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']", e
            env[e["name"]] = "1"
    env.setdefault("JOB_COMPLETION_INDEX", "3")
    return env


def _mount_secrets(pod: dict[str, Any], c: dict[str, Any], tmp_path: Path, token: str, tls: bool) -> dict[str, str]:
    """A folder per Secret volume, holding what the Secret would (the token; the TLS files when
    mutual TLS is on), keyed by the container's mount path."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    out = {}
    for m in c.get("volumeMounts", []):
        secret = volumes.get(m["name"], {}).get("secret")  # a StatefulSet's claims are not in volumes
        if not secret:
            continue
        folder = tmp_path / m["name"]
        folder.mkdir(parents=True)
        if secret["secretName"] == TOKEN_SECRET:
            (folder / TOKEN_KEY).write_text(token)
        elif tls:
            for name in TLS_FILES:
                (folder / name).write_text(f"-----BEGIN {name}-----\n")
        out[m["mountPath"].rstrip("/")] = str(folder)
    return out


def _localize(text: str, env: dict[str, str], mounts: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion, then mount paths moved to the test's folders."""
    text = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)
    for mount, folder in mounts.items():
        if text == mount or text.startswith(mount + "/"):
            return folder + text[len(mount) :]
    return text


@pytest.mark.parametrize("tls", [False, True], ids=["token", "token+mtls"])
def test_containers_parse_with_the_real_parsers(tls: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each container's args and environment, as Kubernetes would give them, load into a valid
    ShardConfig or WorkerConfig carrying the Secret's token (and, with mtls/tls-config.yaml
    applied, the mounted TLS files)."""
    token = secrets.token_urlsafe(32)
    for n, (workload, role, pod, c) in enumerate(_containers()):
        _clean_env(monkeypatch)
        env = _container_env(c, tls)
        mounts = _mount_secrets(pod, c, tmp_path / str(n), token, tls)
        for name, value in env.items():
            monkeypatch.setenv(name, _localize(value, env, mounts))
        argv = [_localize(a, env, mounts) for a in _tether_argv(c)[1]]
        module = shard_config if role == "server" else worker_flags
        parser = module.build_parser()  # after the environment is set: flags default to their variables
        _, unknown = parser.parse_known_args(argv)
        assert unknown == [], f"{workload}: not flags of tether {role}: {unknown}"
        tls_dir = mounts["/etc/tether/tls"]
        if role == "server":
            sc = shard_config.load_config(argv)
            assert sc.auth_token == token, workload
            assert (sc.host, sc.port, sc.data_port, sc.metrics_port, sc.health_port) == ("0.0.0.0", 50051, 50061, 9100, 50071)
            assert (sc.shard_index, sc.num_shards, sc.checkpoint_dir) == (1, 2, "/var/lib/tether")
            want = (f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key", f"{tls_dir}/ca.crt") if tls else (None, None, None)
            assert (sc.tls_cert, sc.tls_key, sc.tls_client_ca) == want, workload
        else:
            wc = worker_flags.load_config(argv)
            assert wc.auth_token == token, workload
            assert wc.shards == tuple(env["TETHER_SHARDS"].split(",")) and wc.worker_index == 3, workload
            assert (wc.num_workers, wc.metrics_port) == (4, 9100), workload
            sec = wc.security
            want = (f"{tls_dir}/ca.crt", f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key") if tls else (None, None, None)
            assert (sec.tls_ca, sec.tls_cert, sec.tls_key) == want, workload


def test_tls_config_names_real_flags_and_the_mounted_files() -> None:
    tls = _one("ConfigMap", "tether-tls", MTLS)
    assert tls["metadata"]["namespace"] == NAMESPACE
    variables = {d.env: d.flag for cls in (shard_config.ShardConfig, WorkerConfig) for _, d in fields.declared(cls)}
    for name, path in tls["data"].items():
        assert variables.get(name) in ("--tls-cert", "--tls-key", "--tls-client-ca", "--tls-ca"), name
        _folder, _, file = path.rpartition("/")
        assert file in TLS_FILES, path
        for workload, role, pod, c in _containers():
            volume, inside = _mount_of(pod, c, path)
            role_secret = TLS_SECRETS["shard" if role == "server" else "worker"]
            assert volume["secret"] == {"secretName": role_secret, "optional": True}, workload
            assert inside == file, workload


# ---------------------------------------------------------------- network policies


def _policy_for(labels: dict[str, str]) -> dict[str, Any]:
    (policy,) = [d for d in _docs() if d["kind"] == "NetworkPolicy" and _selects(d["spec"]["podSelector"]["matchLabels"], labels)]
    assert policy["metadata"]["namespace"] == NAMESPACE and policy["spec"]["policyTypes"] == ["Ingress"]
    return policy


def _ports(rule: dict[str, Any]) -> set[int]:
    assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"]), rule
    return {p["port"] for p in rule["ports"]}


def _prometheus_rule(policy: dict[str, Any]) -> dict[str, Any]:
    (rule,) = [r for r in policy["spec"]["ingress"] if any("namespaceSelector" in f for f in r["from"])]
    # One "from" entry with both selectors: Prometheus pods in the monitoring namespace (two
    # entries would admit every pod of that namespace, and every pod labelled prometheus).
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}, peer
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}, peer
    return rule


def test_shard_policy_admits_only_workers_and_prometheus_on_the_flag_ports() -> None:
    sts = _one("StatefulSet", "tether-shard")
    shard_pod = _pod(sts)["metadata"]["labels"]
    policy = _policy_for(SHARD_LABELS)
    assert _selects(policy["spec"]["podSelector"]["matchLabels"], shard_pod)
    worker_pods = [_pod(_one("Job", n))["metadata"]["labels"] for n in ("tether-worker-async", "tether-worker-sync")]
    assert not any(_selects(policy["spec"]["podSelector"]["matchLabels"], w) for w in worker_pods)
    (c,) = _pod(sts)["spec"]["containers"]
    declared = {p["name"]: p["containerPort"] for p in c["ports"]}
    flags = _flags(_tether_argv(c)[1])
    assert declared == {"grpc": int(flags["--port"]), "data": int(flags["--data-port"]), "metrics": int(flags["--metrics-port"])}
    rules = policy["spec"]["ingress"]
    assert len(rules) == 2, rules
    (workers,) = [r for r in rules if r is not _prometheus_rule(policy)]
    (peer,) = workers["from"]
    assert set(peer) == {"podSelector"}, "the workers of this namespace only"
    selector = peer["podSelector"]["matchLabels"]
    assert all(_selects(selector, w) for w in worker_pods) and not _selects(selector, shard_pod)
    assert _ports(workers) == {declared["grpc"], declared["data"]}
    assert _ports(_prometheus_rule(policy)) == {declared["metrics"]}
    # The probes' plaintext health port is left to the kubelet (node traffic is not filtered).
    health = int(flags["--health-port"])
    assert all(health not in _ports(r) for r in rules)
    assert {p["grpc"]["port"] for p in (c["startupProbe"], c["readinessProbe"], c["livenessProbe"])} == {health}


def test_worker_policy_admits_the_other_workers_and_prometheus_on_metrics() -> None:
    policy = _policy_for(WORKER_LABELS)
    assert not _selects(policy["spec"]["podSelector"]["matchLabels"], SHARD_LABELS)
    for name in ("tether-worker-async", "tether-worker-sync"):
        job = _one("Job", name)
        assert _selects(policy["spec"]["podSelector"]["matchLabels"], _pod(job)["metadata"]["labels"])
        (c,) = _pod(job)["spec"]["containers"]
        metrics = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
        assert metrics == int(_flags(_tether_argv(c)[1])["--metrics-port"])
        assert _ports(_prometheus_rule(policy)) == {metrics}
    (peers,) = [r for r in policy["spec"]["ingress"] if r is not _prometheus_rule(policy)]
    # torchrun's rendezvous and gloo pick ports of their own: any port, from workers only.
    assert "ports" not in peers and peers["from"] == [{"podSelector": {"matchLabels": WORKER_LABELS}}]


def test_a_wider_policy_is_caught() -> None:
    policy = _policy_for(SHARD_LABELS)
    wide = json.loads(json.dumps(policy))
    rule = _prometheus_rule(wide)
    rule["from"] = [{"namespaceSelector": rule["from"][0]["namespaceSelector"]}, {"podSelector": rule["from"][0]["podSelector"]}]
    with pytest.raises(ValueError):
        _prometheus_rule(wide)


# ---------------------------------------------------------------- mutual TLS


@pytest.mark.parametrize("version", ["1.30", "latest"])
def test_mtls_core_manifests_validate(version: str) -> None:
    import kubernetes_validate as kv

    version = kv.latest_version() if version == "latest" else version
    core = [d for d in _docs(MTLS) if not d["apiVersion"].startswith("cert-manager.io/")]
    assert {d["kind"] for d in core} == {"ConfigMap"}
    for doc in core:
        kv.validate(doc, version, strict=True)


def test_cert_manager_issues_the_secrets_the_pods_mount() -> None:
    docs = _load(MTLS / "cert-manager.yaml")
    assert all(d["apiVersion"] == "cert-manager.io/v1" and d["metadata"]["namespace"] == NAMESPACE for d in docs)
    assert {d["kind"] for d in docs} == {"Issuer", "Certificate"}
    issuers = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Issuer"}
    certs = {d["spec"]["secretName"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    for spec in certs.values():
        assert spec["issuerRef"]["kind"] == "Issuer" and spec["issuerRef"]["name"] in issuers, spec
    (ca_secret,) = [s for s, spec in certs.items() if spec.get("isCA")]
    assert issuers[certs[ca_secret]["issuerRef"]["name"]] == {"selfSigned": {}}
    (ca_issuer,) = [n for n, spec in issuers.items() if spec.get("ca", {}).get("secretName") == ca_secret]
    shard, worker = certs[TLS_SECRETS["shard"]], certs[TLS_SECRETS["worker"]]
    assert shard["issuerRef"]["name"] == worker["issuerRef"]["name"] == ca_issuer
    assert "server auth" in shard["usages"] and "client auth" in worker["usages"]
    # Workers check the name they dial against the shards' certificate.
    hosts = [a.rsplit(":", 1)[0] for a in _one("ConfigMap", "tether-config")["data"]["TETHER_SHARDS"].split(",")]
    for host in hosts:
        assert any(_dns_match(name, host) for name in shard["dnsNames"]), host
    assert not _dns_match(shard["dnsNames"][0], "evil.other.tether.svc.cluster.local")


def _dns_match(pattern: str, host: str) -> bool:
    """A certificate name against a host: ``*`` stands for exactly one leftmost label."""
    if not pattern.startswith("*."):
        return pattern == host
    label, _, rest = host.partition(".")
    return bool(label) and fnmatchcase(rest, pattern[2:]) and "*" not in rest


# ---------------------------------------------------------------- the page


def test_kubernetes_doc_names_every_manifest_and_the_secrets() -> None:
    page = DOC.read_text()
    manifests = sorted(str(p.relative_to(ROOT)) for p in [*K8S.glob("*.yaml"), *MTLS.glob("*.yaml")])
    missing = [m for m in manifests if m not in page]
    assert not missing, f"docs/kubernetes.md does not say how to apply {missing}"
    token_cmds = [ln for ln in page.splitlines() if f"kubectl create secret generic {TOKEN_SECRET} " in ln]
    assert token_cmds and all(f"--from-literal={TOKEN_KEY}=" in ln and f"-n {NAMESPACE}" in ln for ln in token_cmds), token_cmds
    for _role, secret in TLS_SECRETS.items():
        (cmd,) = [ln for ln in page.replace("\\\n", " ").splitlines() if f"kubectl create secret generic {secret} " in ln]
        assert sorted(re.findall(r"--from-file=([\w.]+)=", cmd)) == sorted(TLS_FILES), cmd
    for label in ("kubernetes.io/metadata.name", "monitoring", "app.kubernetes.io/name: prometheus"):
        assert label in page, label


# ---------------------------------------------------------------- restarts and the API token


def test_no_pod_mounts_a_service_account_token_it_never_uses() -> None:
    """No tether process calls the Kubernetes API (checkov CKV_K8S_38)."""
    pods = {f"{d['kind']}/{d['metadata']['name']}": _pod(d)["spec"] for d in _docs() if d["kind"] in WORKLOADS}
    assert pods and all(spec.get("automountServiceAccountToken") is False for spec in pods.values()), pods.keys()


def test_a_worker_pod_restarted_in_place_joins_the_job_under_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker container Kubernetes restarts (restartPolicy OnFailure: the same pod, its emptyDirs
    kept) gets what a worker tether launch restarts gets: a restart count, so it does not wait at
    the start barrier for every worker again (they may all have finished and left). The async
    Job's own argv and environment, the file on the volume the manifest mounts."""
    from types import SimpleNamespace

    from tether.protos.errors import DeadlineExceeded
    from tether.worker.client.results import ClockReply
    from tether.worker.training.policies import AsyncPolicy, restart_count

    (workload, _, pod, c), = [w for w in _containers() if w[0] == "Job/tether-worker-async"]
    assert pod["spec"]["restartPolicy"] == "OnFailure", "restarts happen in place, keeping the pod's emptyDirs"
    env = _container_env(c, tls=False)
    path = env.get("TETHER_RESTART_FILE")
    assert path, f"{workload}: no TETHER_RESTART_FILE"
    volume, inside = _mount_of(pod, c, path)
    assert "emptyDir" in volume, f"{workload}: {path} must be on an emptyDir (it outlives a container restart)"
    volume_dir = tmp_path / "volume"
    volume_dir.mkdir()
    mounts = {**_mount_secrets(pod, c, tmp_path / "secrets", secrets.token_urlsafe(32), False),
              path[: len(path) - len(inside)].rstrip("/"): str(volume_dir)}
    _clean_env(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, _localize(value, env, mounts))
    loaded = worker_flags.load_config([_localize(a, env, mounts) for a in _tether_argv(c)[1]])
    config = SimpleNamespace(num_workers=loaded.num_workers, wait_timeout_s=0.3)

    # The other workers are all done and gone: no live clock is left to show the job under way.
    gone = SimpleNamespace(clock=lambda clock: ClockReply(0, 0, 0, False, min_other_clock=0, finished_workers=0))
    under_way = SimpleNamespace(clock=lambda clock: ClockReply(0, 5, 3, False, min_other_clock=5))
    assert restart_count() == 0  # the pod's first start: a fresh job
    assert AsyncPolicy().start(SimpleNamespace(config=config, client=under_way)) == 5  # it got past the start barrier
    # Killed after that; Kubernetes restarts the container in the same pod.
    assert restart_count() == 1
    assert AsyncPolicy().start(SimpleNamespace(config=config, client=gone)) == 0  # no wait for workers that left
    assert restart_count() == 2
    # A fresh pod (a new emptyDir) of a fresh job still waits for every worker, and says so when they do not come.
    (volume_dir / inside).unlink()
    with pytest.raises(DeadlineExceeded, match="only 0 of 4 workers joined"):
        AsyncPolicy().start(SimpleNamespace(config=config, client=gone))

