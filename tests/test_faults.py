"""Faults with real processes and sockets: a shard SIGKILLed mid-training and restarted, SIGTERM
drain, a lost acknowledgement, and a network partition through a loopback proxy."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from conftest import make_client
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether.deploy.launch import LocalCluster
from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.errors import DeadlineExceeded, Unavailable
from tether.protos.partition import shard_of_ids
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.checkpoints.restore import choose_restore, list_manifests

SGD = OptimizerConfig("sgd", 1.0)
TABLE = TableConfig("emb", 4, SGD, init_scale=0.0)


class Proxy:
    """A loopback TCP proxy whose link can be cut, in one direction or both.

    A cut direction reads and discards what arrives, as a partition loses packets; ``heal``
    closes the connections that lost bytes (their HTTP/2 streams are broken) and forwards again.
    """

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.up = threading.Event()  # client -> shard
        self.down = threading.Event()  # shard -> client
        self.up.set()
        self.down.set()
        self.discarded = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst, gate in ((client, upstream, self.up), (upstream, client, self.down)):
                t = threading.Thread(target=self._pump, args=(src, dst, gate), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, gate: threading.Event) -> None:
        src.settimeout(0.1)
        while not self._closed.is_set():
            try:
                data = src.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if gate.is_set():
                try:
                    dst.sendall(data)
                except OSError:
                    break
            else:
                self.discarded += len(data)
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _drop_connections(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def partition(self) -> None:
        """Stop forwarding both ways and drop the open connections."""
        self.up.clear()
        self.down.clear()
        self._drop_connections()

    def heal(self) -> None:
        """Drop the connections that lost bytes and forward again."""
        self._drop_connections()
        self.up.set()
        self.down.set()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self._drop_connections()
        for t in self._threads:
            t.join(timeout=2)


@pytest.fixture
def proxy_factory():
    proxies: list[Proxy] = []

    def make(target: str) -> Proxy:
        proxies.append(Proxy(target))
        return proxies[-1]

    yield make
    for p in proxies:
        p.close()


def _stub(address: str) -> pb_grpc.ParameterServerStub:
    return pb_grpc.ParameterServerStub(grpc.insecure_channel(address))


# -- SIGKILL and restart ----------------------------------------------------------------------------


def test_sigkilled_shard_is_restarted_from_its_checkpoint_and_training_goes_on(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    cluster = LocalCluster(log_dir=tmp_path / "logs", grace_s=5, restart=True)
    try:
        addresses = cluster.start_shards(2, extra_args=["--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "0.5"])
        # Retries with backoff cover a shard restart (~2 s here); deadlines keep every call bounded.
        client = make_client(addresses, "trainer", timeout_s=2.0, retries=30, backoff_s=0.05, max_backoff_s=0.5)
        client.declare([TABLE], {"w": torch.zeros(8)}, SGD)
        ids = torch.arange(64, dtype=torch.int64)
        on_1 = torch.from_numpy(shard_of_ids(ids.numpy(), 2) == 1)
        steps, kill_at = 40, 15
        killed_pid = None
        for step in range(steps):
            if step == kill_at:
                deadline = time.monotonic() + 10
                while (plan := choose_restore(ckpt_dir, 1, 2)) is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert plan is not None, "no checkpoint of shard 1 before the kill"
                killed_pid = cluster.signal_shard(1, signal.SIGKILL)
            client.push({"emb": (ids, torch.ones(64, 4))}, {"w": torch.ones(8)}).result(120)
            client.pull({"emb": ids}, ["w"]).result(120)
        assert cluster.restarts == {1: 1}
        assert cluster.shard_process(1).pid != killed_pid
        infos = client.info()
        assert infos[1].restored_checkpoint.startswith("auto-")
        rows = client.pull({"emb": ids}).result(30).rows["emb"]
        # Shard 0 applied all 40 steps; shard 1 lost what came after its last checkpoint, at
        # most the steps between that checkpoint and the kill, and kept going from there.
        assert torch.equal(rows[~on_1], torch.full((int((~on_1).sum()), 4), -float(steps)))
        applied_1 = -rows[on_1]
        assert torch.equal(applied_1, applied_1[0, 0].expand_as(applied_1))
        lost = steps - int(applied_1[0, 0])
        assert 0 <= lost <= kill_at
        assert infos[1].applied_pushes == steps - lost
        print(f"SIGKILL: {steps} steps done, shard 1 restarted from {infos[1].restored_checkpoint}, lost {lost} step(s)")
        client.close()
    finally:
        cluster.stop()


# -- SIGTERM ----------------------------------------------------------------------------------------


def test_sigterm_drains_turns_not_serving_writes_a_final_checkpoint_and_exits_0(tmp_path: Path, cluster: LocalCluster) -> None:
    ckpt_dir = tmp_path / "ckpt"
    (address,) = cluster.start_shards(1, extra_args=["--checkpoint-dir", str(ckpt_dir), "--grace-seconds", "8"])
    client = make_client([address])
    client.declare([TABLE])
    ids = torch.arange(10, dtype=torch.int64)
    for _ in range(3):
        client.push({"emb": (ids, torch.ones(10, 4))}).result(10)
    channel = grpc.insecure_channel(address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    # An in-flight call: worker "a" at clock 5 waits (up to 2 s) for worker "b" at clock 0.
    stub = pb_grpc.ParameterServerStub(channel)
    stub.Clock(pb.ClockRequest(worker_id="b", clock=0), timeout=10)
    in_flight: dict[str, object] = {}

    def wait_call() -> None:
        try:
            in_flight["reply"] = stub.Clock(pb.ClockRequest(worker_id="a", clock=5, wait_bound=0, wait_timeout_ms=2000), timeout=10)
        except grpc.RpcError as exc:
            in_flight["error"] = exc.code()

    waiter = threading.Thread(target=wait_call)
    waiter.start()
    time.sleep(0.3)  # the call is on the shard
    sent = time.monotonic()
    cluster.signal_shard(0, signal.SIGTERM)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()
    waiter.join(15)
    # The in-flight call finished normally: not cancelled by the shutdown.
    assert "error" not in in_flight and in_flight["reply"].ready is False
    assert cluster.shard_process(0).wait(timeout=20) == 0
    assert time.monotonic() - sent < 15
    with pytest.raises(Unavailable):
        make_client([address], retries=0, timeout_s=2).info()
    (final,) = [m for m in list_manifests(ckpt_dir) if m.id.startswith("final-")]
    channel.close()
    client.close()
    cluster.stop()

    # Nothing was lost: the restarted shard comes back from the final checkpoint.
    (address,) = cluster.start_shards(1, extra_args=["--checkpoint-dir", str(ckpt_dir)])
    client = make_client([address])
    assert client.info()[0].restored_checkpoint == final.id
    client.declare([TABLE])
    assert torch.equal(client.pull({"emb": ids}).result(10).rows["emb"], torch.full((10, 4), -3.0))
    client.close()


# -- lost acknowledgement -----------------------------------------------------------------------------


def test_a_push_whose_ack_was_lost_is_retried_and_applied_once(cluster: LocalCluster, proxy_factory) -> None:
    (address,) = cluster.start_shards(1)
    proxy = proxy_factory(address)
    # The proxy stands between the client and the gRPC port only: test that transport here
    # (the data plane's lost acknowledgement is test_data_plane.py's).
    client = make_client([proxy.address], "worker-1", timeout_s=1.0, retries=20, backoff_s=0.05, max_backoff_s=0.2, transport="grpc")
    client.declare([TABLE])  # the connection through the proxy is up
    ids = torch.arange(16, dtype=torch.int64)
    direct = _stub(address)
    proxy.down.clear()  # replies vanish from here on
    handle = client.push({"emb": (ids, torch.ones(16, 4))})
    deadline = time.monotonic() + 10
    while direct.Info(pb.InfoRequest(), timeout=5).applied_pushes == 0:
        assert time.monotonic() < deadline, "the push never reached the shard"
        time.sleep(0.02)
    assert not handle.done()  # applied, but the worker has not heard so
    time.sleep(1.5)  # let at least one attempt time out and be retried into the void
    proxy.heal()
    ack = handle.result(30)
    assert ack.duplicates == 1  # the retry that got through was recognised by (worker id, seq)
    info = direct.Info(pb.InfoRequest(), timeout=5)
    assert (info.applied_pushes, info.tables[0].version) == (1, 1)
    assert info.duplicate_pushes >= 1
    assert torch.equal(client.pull({"emb": ids}).result(10).rows["emb"], -torch.ones(16, 4))
    client.close()


# -- network partition ------------------------------------------------------------------------------


def test_partition_gives_a_clear_error_in_bounded_time_and_heals(cluster: LocalCluster, proxy_factory) -> None:
    (address,) = cluster.start_shards(1)
    proxy = proxy_factory(address)
    timeout_s, retries = 1.0, 2
    client = make_client(
        [proxy.address], timeout_s=timeout_s, retries=retries, backoff_s=0.05, max_backoff_s=0.2, keepalive_s=1.0, transport="grpc"
    )
    client.declare([TABLE])
    ids = torch.arange(8, dtype=torch.int64)
    client.push({"emb": (ids, torch.ones(8, 4))}).result(10)

    proxy.partition()
    start = time.monotonic()
    with pytest.raises((Unavailable, DeadlineExceeded)) as err:
        client.pull({"emb": ids}).result(60)
    elapsed = time.monotonic() - start
    # Each try ends at its deadline; with the backoff between them, the budget is bounded.
    assert elapsed < (retries + 1) * timeout_s + 3.0, elapsed
    assert "failed after 3 tries" in str(err.value)
    print(f"partition: {type(err.value).__name__} after {elapsed:.2f}s: {err.value}")
    assert proxy.discarded > 0 or "UNAVAILABLE" in str(err.value)

    proxy.heal()
    start = time.monotonic()
    failures = 0
    while True:
        # The channel may still be in its reconnect backoff for a moment: calls fail fast then.
        try:
            rows = client.pull({"emb": ids}).result(30).rows["emb"]
            break
        except Unavailable:
            failures += 1
            assert time.monotonic() - start < 10, "the client did not recover after the link healed"
            time.sleep(0.1)
    healed = time.monotonic() - start
    print(f"partition healed: a pull succeeded {healed:.2f}s after the heal ({failures} call(s) failed fast before)")
    assert torch.equal(rows, -torch.ones(8, 4))
    # The partitioned pull changed nothing, and pushes flow again.
    client.push({"emb": (ids, torch.ones(8, 4))}).result(10)
    assert torch.equal(client.pull({"emb": ids}).result(10).rows["emb"], -2 * torch.ones(8, 4))
    client.close()


# -- a shard that stops answering for good ------------------------------------------------------------


@pytest.mark.parametrize("transport, timeout_s", [("auto", 3.0), ("grpc", 30.0)])
def test_a_stopped_shard_is_given_up_on_at_the_call_deadline(
    tmp_path: Path, cluster: LocalCluster, transport: str, timeout_s: float
) -> None:
    """SIGSTOP (the process is there, its sockets accept, nothing answers): every call raises
    Unavailable once its total deadline is spent, whatever the per-attempt timeout, on the data
    plane (with its fallback to gRPC) and over gRPC."""
    call_deadline_s = 1.5
    (address,) = cluster.start_shards(1, extra_args=["--checkpoint-dir", str(tmp_path / "ckpt")])
    ids = torch.arange(16, dtype=torch.int64)
    # The shard's first push waits for its compiled kernels: warm it with a patient client, so
    # that the short deadline below is spent only on the stopped shard.
    warm = make_client([address], "warm-up")
    warm.declare([TABLE])
    warm.push({"emb": (ids, torch.zeros(16, 4))}).result(30)
    warm.close()
    client = make_client([address], timeout_s=timeout_s, retries=8, call_deadline_s=call_deadline_s, transport=transport)
    client.declare([TABLE])
    client.push({"emb": (ids, torch.ones(16, 4))}).result(10)
    client.pull({"emb": ids}).result(10)  # the data connection, where there is one, is up
    calls = {
        "pull": lambda: client.pull({"emb": ids}).result(30),
        "push": lambda: client.push({"emb": (ids, torch.ones(16, 4))}).result(30),
        "push_pull": lambda: client.push_pull({"emb": (ids, torch.ones(16, 4))}, pull_sparse={"emb": ids}).result(30),
        "declare": lambda: client.declare([TABLE]),
        "clock": lambda: client.clock(1),
    }
    pid = cluster.signal_shard(0, signal.SIGSTOP)
    try:
        # kill() returns before the process is stopped: a call made at once can still be answered.
        stopped_by = time.monotonic() + 10
        while "T" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]:
            assert time.monotonic() < stopped_by, "the shard did not stop"
            time.sleep(0.01)
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(Unavailable, match="failed after"):
                call()
            elapsed = time.monotonic() - start
            print(f"{transport}, timeout {timeout_s:g}s, call deadline {call_deadline_s:g}s: {name} gave up after {elapsed:.2f}s")
            # A retry that could not start before the deadline is not waited for: a little early is fine.
            assert call_deadline_s - 0.3 <= elapsed <= call_deadline_s + 2.5, (name, elapsed)
        # An SSP wait has its own limit; a dead coordinator is given up on after the call
        # deadline plus the time one call asked to be held (at most 5 s), not after that limit.
        start = time.monotonic()
        with pytest.raises(Unavailable):
            client.clock(2, wait_bound=0, timeout_s=300.0)
        elapsed = time.monotonic() - start
        print(f"{transport}: SSP wait gave up after {elapsed:.2f}s")
        assert elapsed <= call_deadline_s + min(timeout_s, 5.0) + 2.5, elapsed
        # A checkpoint's timeout_s is its whole limit.
        start = time.monotonic()
        with pytest.raises(Unavailable):
            client.checkpoint("never", timeout_s=2.0)
        assert time.monotonic() - start <= 2.0 + 2.5
    finally:
        # SIGKILL, not SIGCONT and the fixture's SIGTERM: woken, the shard would first answer the
        # calls queued while it was stopped, then drain and exit (3 s of teardown at load 13);
        # SIGTERM's drain has its own test above.
        cluster.signal_shard(0, signal.SIGKILL)
        client.close()
