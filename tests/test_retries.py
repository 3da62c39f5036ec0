"""Retries until the call's deadline (issue 30): a shard away longer than any fixed count of
backoffs is waited for, one that never comes back is given up on at the deadline with one line,
a draining shard's CANCELLED is retried, and a refusal is never retried."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch

from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.errors import OVERLOADED, ResourceExhausted, Unavailable, retryable
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig
from tether.server.serving.serve import RunningShard, start_shard
from tether.worker.client.config import ClientConfig
from tether.worker.client.ps_client import PSClient
from tether.worker.metrics import NullWorkerMetrics

TABLE = TableConfig("emb", 4, OptimizerConfig("sgd", 1.0), init_scale=0.0)
IDS = torch.arange(16, dtype=torch.int64)
# Backoff scaled down: 8 retries (the old fixed count) last about 0.3 s here, so a shard away
# for 1.2 s outlasts them several times over, cheaply.
FAST = {"timeout_s": 1.0, "backoff_s": 0.01, "max_backoff_s": 0.05}


class _Retries(NullWorkerMetrics):
    """Counts the retries a client made, by method."""

    def __init__(self) -> None:
        self.by_rpc: dict[str, int] = {}

    def retried(self, rpc: str) -> None:
        self.by_rpc[rpc] = self.by_rpc.get(rpc, 0) + 1


def _client(address: str, metrics: _Retries | None = None, **kw: object) -> PSClient:
    return PSClient(ClientConfig(addresses=(address,), worker_id="w", **{**FAST, **kw}), metrics)  # type: ignore[arg-type]


@pytest.fixture
def shard() -> Iterator[list[RunningShard]]:
    """One in-process shard, in a list so that a test can replace it with a restarted one."""
    running = [start_shard(ShardConfig(host="127.0.0.1", port=0))]
    yield running
    for r in running:
        r.stop(0)


def _restart_later(shard: list[RunningShard], after_s: float) -> threading.Thread:
    """Stop the shard now and serve the same state on the same port ``after_s`` seconds later
    (a new data port, as a restarted process gets)."""
    old = shard[0]
    old.stop(0)

    def serve_again() -> None:
        time.sleep(after_s)
        shard.append(start_shard(ShardConfig(host="127.0.0.1", port=old.port), shard=old.shard))

    thread = threading.Thread(target=serve_again, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_a_shard_away_longer_than_the_old_retry_count_is_waited_for_until_the_deadline(shard, transport: str) -> None:
    address = f"127.0.0.1:{shard[0].port}"
    metrics = _Retries()
    client = _client(address, metrics, call_deadline_s=20.0, transport=transport)
    client.declare([TABLE])
    client.push({"emb": (IDS, torch.ones(16, 4))}).result(10)
    if transport == "auto":
        assert client.transports() != ["grpc"]  # the data plane is in use, and will break
    thread = _restart_later(shard, 1.2)
    start = time.monotonic()
    client.push({"emb": (IDS, torch.ones(16, 4))}).result(30)
    elapsed = time.monotonic() - start
    thread.join(10)
    retries = metrics.by_rpc.get("Push", 0)
    print(f"{transport}: the push went through after {elapsed:.2f}s and {retries:.0f} retries")
    assert elapsed >= 1.0, elapsed
    assert retries > 8  # more than the old fixed count, and the call still succeeded
    # Applied once: the rows took both pushes, no more.
    assert torch.equal(client.pull({"emb": IDS}).result(10).rows["emb"], torch.full((16, 4), -2.0))
    client.close()


def test_an_explicit_retry_count_still_ends_the_call_sooner(shard) -> None:
    address = f"127.0.0.1:{shard[0].port}"
    client = _client(address, retries=8, call_deadline_s=20.0, transport="grpc")
    client.declare([TABLE])
    thread = _restart_later(shard, 1.5)
    start = time.monotonic()
    with pytest.raises(Unavailable, match=r"failed after 9 tries: UNAVAILABLE"):
        client.push({"emb": (IDS, torch.ones(16, 4))}).result(30)
    assert time.monotonic() - start < 1.5  # before the shard came back
    thread.join(10)
    client.close()


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_a_shard_that_never_comes_back_fails_the_call_at_its_deadline_with_one_line(shard, transport: str) -> None:
    running = shard[0]
    address = f"127.0.0.1:{running.port}"
    client = _client(address, call_deadline_s=1.5, transport=transport)
    client.declare([TABLE])
    client.push({"emb": (IDS, torch.ones(16, 4))}).result(10)
    running.stop(0)
    start = time.monotonic()
    with pytest.raises(Unavailable) as err:
        client.push({"emb": (IDS, torch.ones(16, 4))}).result(30)
    elapsed = time.monotonic() - start
    message = str(err.value)
    print(f"{transport}: gave up after {elapsed:.2f}s: {message}")
    assert 1.2 <= elapsed <= 3.0, elapsed
    assert "\n" not in message
    assert message.startswith(f"shard 0 ({address}) Push failed after ") and "the call's deadline spent (--call-deadline 1.5 s): UNAVAILABLE" in message
    client.close()


# -- what is transient ------------------------------------------------------------------------


def test_the_retryability_table() -> None:
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        assert retryable(code, "")
    assert retryable(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{OVERLOADED}: 64 calls")
    for code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL):
        assert not retryable(code, "table 'emb': the request is 300 MiB, over the limit of 256 MiB"), code


class _Draining(pb_grpc.ParameterServerServicer):
    """A coordinator whose first Clock waits are cancelled, as a shard draining at SIGTERM
    cancels the calls it still holds, then one that answers."""

    def __init__(self, cancelled: int) -> None:
        self.cancelled = cancelled
        self.calls = 0

    def Clock(self, request: pb.ClockRequest, context: grpc.ServicerContext) -> pb.ClockResponse:
        self.calls += 1
        if self.calls <= self.cancelled:
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        return pb.ClockResponse(ready=True, min_clock=request.clock, max_clock=request.clock, live_workers=1)


def test_a_clock_wait_cancelled_by_a_draining_shard_is_retried() -> None:
    servicer = _Draining(cancelled=3)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ParameterServerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = _client(f"127.0.0.1:{port}", call_deadline_s=10.0, transport="grpc")
        reply = client.clock(4, wait_bound=0, timeout_s=10.0)
        assert reply.ready and reply.min_clock == 4
        assert servicer.calls == 4
        client.close()
    finally:
        server.stop(0)


# -- a refusal is not retried -----------------------------------------------------------------


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_a_size_refusal_fails_at_once_and_is_never_retried(transport: str) -> None:
    running = start_shard(ShardConfig(host="127.0.0.1", port=0, max_message_bytes=1 << 20, data_buffer_bytes=1 << 20))
    try:
        metrics = _Retries()
        client = _client(f"127.0.0.1:{running.port}", metrics, call_deadline_s=30.0, transport=transport)
        client.declare([TABLE])
        ids = torch.arange(100_000, dtype=torch.int64)  # 1.6 MB of gradients: over the 1 MiB limit
        start = time.monotonic()
        with pytest.raises(ResourceExhausted) as err:
            client.push({"emb": (ids, torch.ones(100_000, 4))}).result(30)
        assert time.monotonic() - start < 5.0
        assert "\n" not in str(err.value) and "RESOURCE_EXHAUSTED" in str(err.value)
        assert metrics.by_rpc == {}
        assert running.shard.tables["emb"].version == 0  # nothing applied
        client.close()
    finally:
        running.stop(0)


def test_help_and_docs_say_call_deadline_bounds_the_wait_for_a_shard_that_is_down() -> None:
    """--timeout alone does not bound how long a down shard is waited for; --help and
    docs/errors.md say which flag does."""
    import re
    from pathlib import Path

    from tether.worker import flags as worker_flags

    # argparse wraps at hyphens too ("--call- deadline"): joined again here.
    text = " ".join(worker_flags.build_parser().format_help().split()).replace("- ", "-")
    timeout_help = re.search(r"--timeout SECONDS (.*?) --call-deadline SECONDS", text)
    assert timeout_help and "one attempt" in timeout_help.group(1), text
    assert "--call-deadline, not this, bounds how long a shard that is down is waited for" in timeout_help.group(1)
    deadline_help = text.rsplit("--call-deadline SECONDS", 1)[1]
    assert "the whole wait for a shard that is down" in deadline_help.split(" --")[0]
    errors = " ".join((Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text().split())
    assert "`--call-deadline` (`TETHER_CALL_DEADLINE`) bounds that whole wait, `--timeout` only each attempt" in errors
