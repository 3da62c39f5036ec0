"""A shard tells the client's mistakes from its own bugs: a bad request (a typed error or an
explicit check) is INVALID_ARGUMENT with its one line, not logged as a failure and not counted
as one; any other exception inside the shard (a ValueError among them) is INTERNAL, logged once
with its traceback and counted in ``tether_shard_internal_errors_total``; over gRPC and over the
data plane alike (both run through ``RequestHandler.run``)."""

from __future__ import annotations

import logging

import grpc
import pytest
import torch
from conftest import make_client
from prometheus_client import CollectorRegistry

from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.errors import InvalidArgument, TetherError
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig
from tether.server.metrics import ShardMetrics
from tether.server.serving.serve import RunningShard, start_shard

TABLE = TableConfig("emb", dim=4, optimizer=OptimizerConfig("sgd", lr=1.0), init_scale=0.0)
IDS = torch.tensor([1, 2, 3], dtype=torch.int64)


@pytest.fixture
def shard() -> tuple[RunningShard, ShardMetrics]:
    metrics = ShardMetrics(CollectorRegistry())
    running = start_shard(ShardConfig(host="127.0.0.1", port=0), metrics=metrics)
    try:
        yield running, metrics
    finally:
        running.stop(0)


def _count(metrics: ShardMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def _handler_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tether.server.serving.handler" and r.levelno >= logging.ERROR]


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_bad_request_is_invalid_argument_and_no_internal_error(
    shard: tuple[RunningShard, ShardMetrics], transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    running, metrics = shard
    address = f"127.0.0.1:{running.port}"
    client = make_client([address], f"w-{transport}", transport=transport)
    try:
        client.declare([TABLE])
        assert client.transports() == [transport]
        with pytest.raises(InvalidArgument) as err:
            client.push({"emb": (IDS, torch.full((3, 4), float("nan")))}).result(10)
        assert "NaN or Inf" in str(err.value) and "\n" not in str(err.value)
        # A spec the shard's checks refuse (a plain ValueError in protos/specs.py) is the request's fault too.
        with grpc.insecure_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as rpc:
                pb_grpc.ParameterServerStub(ch).Declare(
                    pb.DeclareRequest(tables=[pb.TableSpec(name="x", dim=0)]), timeout=10
                )
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rpc.value.details() == "table 'x': dim must be in [1, 65536], got 0"
    finally:
        client.close()
    assert _count(metrics, "tether_shard_internal_errors_total", rpc="Push") == 0
    assert _count(metrics, "tether_shard_internal_errors_total", rpc="Declare") == 0
    assert _count(metrics, "tether_shard_requests_total", rpc="Push", code="INVALID_ARGUMENT") == 1
    assert _handler_errors(caplog) == []


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
@pytest.mark.parametrize("bug", [ValueError, KeyError, RuntimeError])
def test_a_bug_in_the_shard_is_internal_logged_once_and_counted(
    shard: tuple[RunningShard, ShardMetrics], transport: str, bug: type[Exception], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    running, metrics = shard
    client = make_client([f"127.0.0.1:{running.port}"], f"w-{transport}", transport=transport)
    try:
        client.declare([TABLE])
        assert client.transports() == [transport]

        def broken_push(*args: object, **kwargs: object) -> None:
            raise bug("injected bug")

        monkeypatch.setattr(running.shard, "push", broken_push)
        with caplog.at_level(logging.ERROR, logger="tether.server.serving.handler"):
            with pytest.raises(TetherError) as err:
                client.push({"emb": (IDS, torch.ones(3, 4))}).result(10)
        assert not isinstance(err.value, InvalidArgument)
        assert str(err.value).endswith("internal error in Push; see the shard's log") and str(err.value).startswith("INTERNAL: ")
        # The shard still serves what does not hit the bug.
        assert torch.equal(client.pull({"emb": IDS}).result(10).rows["emb"], torch.zeros(3, 4))
    finally:
        client.close()
    records = _handler_errors(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].getMessage() == "Push failed with an unexpected error"
    assert records[0].exc_info is not None and records[0].exc_info[0] is bug
    assert "injected bug" in str(records[0].exc_info[1])
    assert _count(metrics, "tether_shard_internal_errors_total", rpc="Push") == 1
    assert _count(metrics, "tether_shard_requests_total", rpc="Push", code="INTERNAL") == 1
    assert _count(metrics, "tether_shard_requests_total", rpc="Push", code="INVALID_ARGUMENT") == 0
