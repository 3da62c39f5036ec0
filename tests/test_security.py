"""TLS, mutual TLS and the bearer token; size and concurrency limits; metrics carry no values.

Certificates are made with the ``openssl`` command line in a temporary folder: a CA, a shard
certificate for IP 127.0.0.1, a client certificate, and a second CA with its own client to play
the stranger.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import make_client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from tether.common.metrics_http import serve_metrics
from tether.common.security import ClientSecurity, resolve_token
from tether.common.settings import to_argv as worker_argv
from tether.deploy.launch import LocalCluster
from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.errors import ResourceExhausted, Unauthenticated, Unavailable
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig, load_config
from tether.server.metrics import ShardMetrics
from tether.server.serving.serve import RunningShard, start_shard
from tether.worker.flags import load_config as load_worker_config

TOKEN = "s3cret-token_0123456789abcdef"
SGD = OptimizerConfig("sgd", 1.0)


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"openssl {' '.join(args)} failed:\n{proc.stderr}"


def make_certificates(folder: Path) -> dict[str, Path]:
    """CA, shard (SAN IP:127.0.0.1) and client certificates, plus a stranger CA and client."""
    folder.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2", "-subj", f"/CN=tether test {ca}", cwd=folder)
    for name, ca, ext in (("server", "ca", "server.ext"), ("client", "ca", "client.ext"), ("stranger", "other-ca", "client.ext")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=tether {name}", cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", ext, cwd=folder)
    (folder / "token").write_text(TOKEN + "\n")
    names = ("ca", "other-ca", "server", "client", "stranger")
    return {**{f"{n}.crt": folder / f"{n}.crt" for n in names}, **{f"{n}.key": folder / f"{n}.key" for n in names}, "token": folder / "token"}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed to make test certificates (apt-get install openssl)")
    return make_certificates(tmp_path_factory.mktemp("certs"))


def _shard(**kw: object) -> RunningShard:
    return start_shard(ShardConfig(host="127.0.0.1", port=0, **kw))


@pytest.fixture
def secured(certs: dict[str, Path]) -> Iterator[tuple[RunningShard, str]]:
    """A shard with mutual TLS and a token."""
    running = _shard(
        tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"]), tls_client_ca=str(certs["ca.crt"]), auth_token=TOKEN
    )
    try:
        yield running, f"127.0.0.1:{running.port}"
    finally:
        running.stop(0)


def _client(address: str, certs: dict[str, Path], client: str | None = "client", ca: str = "ca", token: str | None = TOKEN, **kw: object):
    security = ClientSecurity(
        tls_ca=str(certs[f"{ca}.crt"]),
        tls_cert=str(certs[f"{client}.crt"]) if client else None,
        tls_key=str(certs[f"{client}.key"]) if client else None,
        token=token,
    )
    kw.setdefault("retries", 0)
    kw.setdefault("timeout_s", 5.0)
    return make_client([address], security=security, **kw)


def test_mutual_tls_and_token_let_the_right_client_in(secured, certs) -> None:
    _, address = secured
    client = _client(address, certs)
    client.declare([TableConfig("t", 4, SGD, init_scale=0.0)])
    ids = torch.arange(4, dtype=torch.int64)
    client.push({"t": (ids, torch.ones(4, 4))}).result(10)
    assert torch.equal(client.pull({"t": ids}).result(10).rows["t"], -torch.ones(4, 4))
    client.close()


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", TOKEN[:-1]])
def test_a_missing_or_wrong_token_is_unauthenticated(secured, certs, token: str | None) -> None:
    running, address = secured
    client = _client(address, certs, token=token)
    with pytest.raises(Unauthenticated, match="UNAUTHENTICATED"):
        client.info()
    with pytest.raises(Unauthenticated):
        client.declare([TableConfig("t", 4, SGD)])
    assert "t" not in running.shard.tables
    client.close()


def test_a_raw_call_with_a_bad_header_is_unauthenticated_and_changes_nothing(secured, certs) -> None:
    running, address = secured
    creds = ClientSecurity(tls_ca=str(certs["ca.crt"]), tls_cert=str(certs["client.crt"]), tls_key=str(certs["client.key"]))
    with grpc.secure_channel(address, creds.channel_credentials()) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        request = pb.DeclareRequest(tables=[TableConfig("t", 4, SGD).to_proto()])
        for metadata in ((), (("authorization", TOKEN),), (("authorization", f"bearer {TOKEN}"),), (("authorization", f"Bearer  {TOKEN}"),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.Declare(request, timeout=5, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # An unknown method is not told apart from a known one without a token.
        unknown = channel.unary_unary("/tether.v1.ParameterServer/Nope")
        with pytest.raises(grpc.RpcError) as err:
            unknown(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open for probes, with no token.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert running.shard.tables == {}


@pytest.mark.parametrize(
    "client, ca, why",
    [(None, "ca", "no client certificate"), ("stranger", "ca", "certificate from another CA"), ("client", "other-ca", "shard not trusted")],
)
def test_tls_handshake_failures_never_reach_the_shard(secured, certs, client, ca, why) -> None:
    running, address = secured
    c = _client(address, certs, client=client, ca=ca, timeout_s=3.0)
    with pytest.raises(Unavailable, match="UNAVAILABLE"):
        c.info()
    c.close()
    assert running.shard.tables == {}, why


def test_plaintext_client_cannot_talk_to_a_tls_shard(secured) -> None:
    _, address = secured
    client = make_client([address], retries=0, timeout_s=3.0)
    with pytest.raises(Unavailable):
        client.info()
    client.close()


def test_tls_without_client_certificates_and_a_plaintext_health_port(certs) -> None:
    running = _shard(tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"]), health_port=0)
    try:
        client = _client(f"127.0.0.1:{running.port}", certs, client=None, token=None)
        assert client.info()[0].num_shards == 1
        client.close()
        with grpc.insecure_channel(f"127.0.0.1:{running.health_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # The plaintext port serves health only.
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ParameterServerStub(channel).Info(pb.InfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        running.stop(0)


def test_a_secured_cluster_of_processes_with_flags(tmp_path: Path, certs) -> None:
    """Shard processes started with the TLS/token flags; the worker flags reach the client."""
    with LocalCluster(log_dir=tmp_path / "logs", grace_s=5) as cluster:
        addresses = cluster.start_shards(2, extra_args=[
            "--tls-cert", str(certs["server.crt"]), "--tls-key", str(certs["server.key"]),
            "--tls-client-ca", str(certs["ca.crt"]), "--auth-token-file", str(certs["token"]),
        ])
        cfg = load_worker_config([
            "--shards", ",".join(addresses), "--tls-ca", str(certs["ca.crt"]), "--tls-cert", str(certs["client.crt"]),
            "--tls-key", str(certs["client.key"]), "--auth-token-file", str(certs["token"]),
        ])
        assert cfg.security.token == TOKEN and TOKEN not in repr(cfg)
        argv = worker_argv(cfg)
        assert argv[argv.index("--auth-token-file") + 1] == str(certs["token"]) and TOKEN not in argv
        assert load_worker_config(argv).security == cfg.security
        client = make_client(addresses, security=cfg.security, retries=2)
        client.declare([TableConfig("t", 4, SGD)])
        assert [i.shard_index for i in client.info()] == [0, 1]
        client.close()
        stranger = make_client(addresses, security=ClientSecurity(tls_ca=cfg.tls_ca, tls_cert=cfg.tls_cert, tls_key=cfg.tls_key), retries=0)
        with pytest.raises(Unauthenticated):
            stranger.info()
        stranger.close()


# -- TLS on the data plane ----------------------------------------------------------------------


def test_a_tls_shard_serves_its_data_plane_in_tls_to_a_tls_client(secured, certs) -> None:
    """Mutual TLS + token: pushes and pulls go over the data port inside TLS (no shared memory:
    under mutual TLS the unix socket is not offered), with the same results as over gRPC."""
    running, address = secured
    assert running.dataplane is not None and running.dataplane.socket_name == ""
    client = _client(address, certs)
    client.declare([TableConfig("t", 4, SGD, init_scale=0.0)], {"w": torch.zeros(300_000)}, SGD)
    assert client.transports() == ["tcp+tls"]
    ids = torch.arange(4, dtype=torch.int64)
    client.push({"t": (ids, torch.ones(4, 4))}, {"w": torch.full((300_000,), 2.0)}).result(10)
    pulled = client.pull({"t": ids}, ["w"]).result(10)
    assert torch.equal(pulled.rows["t"], -torch.ones(4, 4)) and torch.equal(pulled.dense["w"], torch.full((300_000,), -2.0))
    out = client.push_pull(push_dense={"w": torch.ones(300_000)}, pull_dense=["w"]).result(10)
    assert torch.equal(out.dense["w"], torch.full((300_000,), -3.0))
    assert client.transports() == ["tcp+tls"]  # still: nothing fell back to gRPC
    assert running.dataplane.connections >= 1
    client.close()


def test_server_only_tls_keeps_shared_memory_on_the_same_machine(certs) -> None:
    running = _shard(tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"]))
    try:
        address = f"127.0.0.1:{running.port}"
        auto = _client(address, certs, client=None, token=None)
        tcp = _client(address, certs, client=None, token=None, transport="tcp")
        for c in (auto, tcp):
            c.declare([TableConfig("t", 64, SGD, init_scale=0.0)])
            ids = torch.arange(2048, dtype=torch.int64)
            c.push({"t": (ids, torch.ones(2048, 64))}).result(10)
        assert auto.transports() == ["shm"] and tcp.transports() == ["tcp+tls"]
        assert torch.equal(tcp.pull({"t": torch.arange(2048, dtype=torch.int64)}).result(10).rows["t"], -2 * torch.ones(2048, 64))
        auto.close()
        tcp.close()
    finally:
        running.stop(0)


def _data_connection(running: RunningShard, certs: dict[str, Path], client: str | None = "client", ca: str = "ca",
                     token: str | None = TOKEN):
    from tether.worker.client.data_channel import DataConnection

    security = ClientSecurity(
        tls_ca=str(certs[f"{ca}.crt"]) if ca else None,
        tls_cert=str(certs[f"{client}.crt"]) if client else None,
        tls_key=str(certs[f"{client}.key"]) if client else None,
    )
    return DataConnection("127.0.0.1", running.data_port, token, 5.0, shm=False, ssl_context=security.ssl_context())


@pytest.mark.parametrize(
    "client, ca, why",
    [(None, "ca", "certificate required"), ("stranger", "ca", "unknown ca"), ("client", "other-ca", "certificate verify failed")],
)
def test_the_tls_data_port_refuses_what_the_grpc_port_refuses(secured, certs, client, ca, why) -> None:
    from tether.worker.client.data_channel import DataPlaneStatus

    running, _ = secured
    with pytest.raises(DataPlaneStatus, match=r"TLS with the data plane of 127.0.0.1") as err:
        _data_connection(running, certs, client=client, ca=ca)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and why in err.value.details.lower()
    assert running.shard.tables == {}


def test_the_tls_data_port_checks_the_shard_host_name(certs) -> None:
    """The shard's certificate names 127.0.0.1 and localhost: reached as another name, refused."""
    from tether.worker.client.data_channel import DataConnection, DataPlaneStatus

    running = start_shard(ShardConfig(host="0.0.0.0", port=0, tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"])))
    try:
        ctx = ClientSecurity(tls_ca=str(certs["ca.crt"])).ssl_context()
        DataConnection("127.0.0.1", running.data_port, None, 5.0, shm=False, ssl_context=ctx).close()
        with pytest.raises(DataPlaneStatus, match="IP address mismatch"):
            DataConnection("127.0.0.2", running.data_port, None, 5.0, shm=False, ssl_context=ctx)
    finally:
        running.stop(0)


def test_a_plaintext_client_at_a_tls_data_port_is_told_and_not_left_hanging(secured, certs) -> None:
    import time

    from tether.worker.client.data_channel import DataPlaneStatus

    running, _ = secured
    started = time.monotonic()
    with pytest.raises(DataPlaneStatus, match="serves TLS and the client spoke plaintext") as err:
        _data_connection(running, certs, client=None, ca=None)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.closed
    assert time.monotonic() - started < 3.0


def test_a_wrong_token_is_refused_on_the_tls_data_port(secured, certs) -> None:
    from tether.worker.client.data_channel import DataPlaneStatus

    running, _ = secured
    for token in (None, "wrong-token"):
        with pytest.raises(DataPlaneStatus, match="bearer token") as err:
            _data_connection(running, certs, token=token)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    good = _data_connection(running, certs)
    assert good.tls
    good.close()


def test_a_silent_client_cannot_hold_a_tls_data_port_handshake(certs) -> None:
    """A TCP connection that never starts its TLS handshake is closed at the handshake timeout."""
    import socket
    import time

    running = _shard(tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"]), data_handshake_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", running.data_port), timeout=5) as s:
            started = time.monotonic()
            assert s.recv(1) == b""
            assert time.monotonic() - started < 3.0
    finally:
        running.stop(0)


def test_security_config_validation(tmp_path: Path, certs, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        ShardConfig(tls_cert=str(certs["server.crt"]))
    with pytest.raises(ValueError, match="needs tls_cert"):
        ShardConfig(tls_client_ca=str(certs["ca.crt"]))
    with pytest.raises(ValueError, match="is not a file"):
        ShardConfig(tls_cert=str(tmp_path / "nope.crt"), tls_key=str(certs["server.key"]))
    with pytest.raises(ValueError, match="needs tls_ca"):
        ClientSecurity(tls_cert=str(certs["client.crt"]), tls_key=str(certs["client.key"]))
    with pytest.raises(ValueError, match="printable ASCII"):
        ClientSecurity(token="has space")
    with pytest.raises(ValueError, match="not a PEM file"):
        ClientSecurity(tls_ca=str(certs["token"])).channel_credentials()
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="auth token file"):
        resolve_token(str(empty))
    monkeypatch.setenv("TETHER_AUTH_TOKEN", TOKEN)
    cfg = load_config(["--port", "0"])
    assert cfg.auth_token == TOKEN and TOKEN not in repr(cfg)
    monkeypatch.setenv("TETHER_TLS_CERT", str(certs["server.crt"]))
    monkeypatch.setenv("TETHER_TLS_KEY", str(certs["server.key"]))
    assert load_config([]).tls


# -- limits -----------------------------------------------------------------------------------------


def test_a_message_over_the_size_limit_is_resource_exhausted() -> None:
    running = _shard(max_message_bytes=1 << 20)
    try:
        address = f"127.0.0.1:{running.port}"
        client = make_client([address], retries=0)
        client.declare([TableConfig("t", 64, SGD)])
        ids = torch.arange(8192, dtype=torch.int64)  # 8192 x 64 floats = 2 MiB of gradients
        with pytest.raises(ResourceExhausted, match="RESOURCE_EXHAUSTED"):
            client.push({"t": (ids, torch.ones(8192, 64))}).result(10)
        # A pull whose answer would be too large is refused too, and nothing changed.
        with pytest.raises(ResourceExhausted):
            client.pull({"t": ids}).result(10)
        assert running.shard.tables["t"].version == 0 and running.shard.applied_pushes == 0
        client.close()
    finally:
        running.stop(0)


def test_calls_over_the_concurrency_limit_are_resource_exhausted() -> None:
    running = _shard(max_concurrent_rpcs=2, threads=4)
    address = f"127.0.0.1:{running.port}"
    try:
        stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(address))
        stub.Clock(pb.ClockRequest(worker_id="slow", clock=0), timeout=5)
        # Two calls that hold their slot: each waits (2 s) for the slow worker to catch up.
        holding = [stub.Clock.future(pb.ClockRequest(worker_id=f"w{k}", clock=5, wait_bound=0, wait_timeout_ms=2000), timeout=10)
                   for k in range(2)]
        deadline = threading.Event()
        deadline.wait(0.3)
        with pytest.raises(grpc.RpcError) as err:
            stub.Info(pb.InfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        client = make_client([address], retries=0)
        with pytest.raises(ResourceExhausted, match="Concurrent RPC limit"):
            client.info()
        # With retries, the client backs off until a slot frees up.
        patient = make_client([address], retries=10, backoff_s=0.1, max_backoff_s=0.5)
        assert patient.info()[0].num_shards == 1
        assert all(f.result().ready is False for f in holding)
        client.close()
        patient.close()
    finally:
        running.stop(0)


# -- metrics ----------------------------------------------------------------------------------------


def test_metrics_carry_no_parameter_values() -> None:
    registry = CollectorRegistry()
    metrics = ShardMetrics(registry)
    running = start_shard(ShardConfig(host="127.0.0.1", port=0), metrics=metrics)
    server, port = serve_metrics(registry, 0, host="127.0.0.1")
    try:
        client = make_client([f"127.0.0.1:{running.port}"])
        client.declare([TableConfig("emb", 4, SGD, init_scale=0.0)], {"w": torch.zeros(3)}, SGD)
        ids = torch.tensor([424242, 777], dtype=torch.int64)
        secret = torch.tensor([[-12345.678, 0.3141592, -98.7654, 2.7182818]]).repeat(2, 1)
        client.push({"emb": (ids, secret)}, {"w": torch.tensor([-31337.25, -0.0625, -271.828])}).result(10)
        pulled = client.pull({"emb": ids}, ["w"]).result(10)
        values = np.concatenate([pulled.rows["emb"].flatten().numpy(), pulled.dense["w"].numpy()])
        assert np.isclose(values, 12345.678, rtol=1e-6).any()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "tether_shard_rows_pushed_total" in text
        for v in values.tolist():
            for form in (repr(v), f"{v:.6g}", f"{v:.4e}", f"{v:.3f}", str(np.float32(v))):
                assert form not in text, f"metrics text holds a parameter value: {form}"
        numbers = set(re.findall(r"[-+0-9.eE]+", text))
        for i in ids.tolist():  # nor the ids of rows (as whole numbers, not digits inside a latency)
            assert str(i) not in numbers and f"{float(i)}" not in numbers
        client.close()
    finally:
        server.shutdown()
        server.server_close()
        running.stop(0)
