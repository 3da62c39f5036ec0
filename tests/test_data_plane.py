"""The data plane: Push/Pull/PushPull over framed TCP and shared memory, beside gRPC.

Shards are real processes on 127.0.0.1 (``LocalCluster``) unless a test needs the shard's own
objects; raw sockets play a misbehaving client.
"""

from __future__ import annotations

import random
import signal
import socket
import time

import grpc
import msgpack
import pytest
import torch
from conftest import make_client

from tether.deploy.launch import LocalCluster
from tether.protos import framing as dp
from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.codec import encode_ids
from tether.protos.errors import InvalidArgument, NotFound, Unauthenticated
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig
from tether.server.serving.serve import start_shard
from tether.worker.client import data_channel as worker_dataplane

TABLE = TableConfig("emb", dim=4, optimizer=OptimizerConfig("sgd", lr=1.0), init_scale=0.0)
SGD = OptimizerConfig("sgd", lr=1.0)
TOKEN = "data-plane-token_0123456789"


def _info(address: str) -> pb.InfoResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.ParameterServerStub(ch).Info(pb.InfoRequest(), timeout=10)


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(10)
    return s


def _answer(sock: socket.socket) -> tuple[int, int, bytes]:
    """(method, status, meta) of the next frame."""
    method, _, status, meta_len, payload_len, _ = dp.read_header(sock, bytearray(dp.HEADER.size))
    meta = bytearray(meta_len)
    dp.recv_into(sock, memoryview(meta))
    if payload_len:
        dp.recv_into(sock, memoryview(bytearray(payload_len)))
    return method, status, bytes(meta)


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_every_transport_reads_and_writes_the_same_rows(two_shards: list[str]) -> None:
    ids = torch.tensor([0, 3, 17, 2**40, 123456789], dtype=torch.int64)
    clients = {t: make_client(two_shards, f"w-{t}", transport=t) for t in ("auto", "tcp", "grpc")}
    try:
        for c in clients.values():
            c.declare([TABLE], dense={"w": torch.zeros(3000)}, dense_optimizer=SGD)
        assert clients["auto"].transports() == ["shm", "shm"]
        assert clients["tcp"].transports() == ["tcp", "tcp"]
        assert clients["grpc"].transports() == ["grpc", "grpc"]
        for i, c in enumerate(clients.values(), start=1):
            c.push({"emb": (ids, torch.ones(5, 4))}, dense={"w": torch.full((3000,), 0.5)}).result(10)
            for reader in clients.values():
                got = reader.pull({"emb": ids}, dense=["w"]).result(10)
                assert torch.equal(got.rows["emb"], torch.full((5, 4), -float(i)))
                assert torch.equal(got.dense["w"], torch.full((3000,), -0.5 * i))
        # push_pull: the answer already holds the push's effect.
        got = clients["auto"].push_pull(push_sparse={"emb": (ids, torch.ones(5, 4))}, pull_sparse={"emb": ids}).result(10)
        assert torch.equal(got.rows["emb"], torch.full((5, 4), -4.0))
    finally:
        for c in clients.values():
            c.close()


def _gauge(port: int, mode: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith(f'tether_shard_data_connections{{mode="{mode}"}}'))
    return float(line.split()[-1])


def test_large_tensors_grow_the_shared_region(cluster: LocalCluster) -> None:
    (address,) = cluster.start_shards(1, metrics=True)
    mport = cluster.metrics_ports["shard-0"]
    n = 3 << 20  # 12 MiB each way, past the first 1 MiB region
    client = make_client([address], transport="auto")
    try:
        client.declare(dense={"big": torch.zeros(n)}, dense_optimizer=SGD)
        grad = torch.randn(n)
        client.push(dense={"big": grad}).result(30)
        assert torch.equal(client.pull(dense=["big"]).result(30).dense["big"], -grad)
        assert client.transports() == ["shm"]
        assert (_gauge(mport, "shm"), _gauge(mport, "tcp")) == (1.0, 0.0)
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while _gauge(mport, "shm") != 0.0:  # the shard notices the closed connection
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_bad_input_over_the_data_plane_is_refused_and_changes_nothing(cluster: LocalCluster) -> None:
    (address,) = cluster.start_shards(1)
    client = make_client([address], transport="tcp")
    try:
        client.declare([TABLE])
        ids = torch.arange(4, dtype=torch.int64)
        bad = torch.ones(4, 4)
        bad[2, 1] = float("nan")
        with pytest.raises(InvalidArgument, match=r"finite|NaN|nan"):
            client.push({"emb": (ids, bad)}).result(10)
        client.router.dims["nope"] = 4  # a table this shard never heard of
        with pytest.raises(NotFound):
            client.push({"nope": (ids, torch.ones(4, 4))}).result(10)
        assert torch.equal(client.pull({"emb": ids}).result(10).rows["emb"], torch.zeros(4, 4))
        info = _info(address)
        assert (info.applied_pushes, info.rejected_pushes, info.tables[0].version) == (0, 2, 0)
        assert client.transports() == ["tcp"]  # errors answered on the connection, which stays
    finally:
        client.close()


def test_garbage_and_oversize_frames_are_answered_and_the_shard_keeps_serving(cluster: LocalCluster) -> None:
    (address,) = cluster.start_shards(1, extra_args=["--max-message-mb", "1"])
    port = _info(address).data_port
    assert port > 0
    for garbage in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(100), random.Random(7).randbytes(4096)):
        with _raw(port) as s:
            # Not a frame: answered with INVALID_ARGUMENT (what the README says), then closed.
            s.sendall(garbage)
            method, status, meta = _answer(s)
            assert (method, status) == (0, grpc.StatusCode.INVALID_ARGUMENT.value[0])
            assert meta.startswith(b"not a tether data-plane frame")
            assert _closed(s)
    with _raw(port) as s:
        # A push claiming 2 GiB of payload: refused before a byte of it is read.
        dp.send_frame(s, dp.HELLO, msgpack.packb({}))
        assert _answer(s)[1] == 0
        s.sendall(dp.HEADER.pack(dp.MAGIC, dp.PUSH, 0, 0, 10, 2 << 30, 0))
        method, status, meta = _answer(s)
        assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and method == 0
        assert b"over the shard's limit" in meta
        assert _closed(s)
    with _raw(port) as s:
        # A request that is not the message it claims to be.
        dp.send_frame(s, dp.HELLO, msgpack.packb({}))
        assert _answer(s)[1] == 0
        dp.send_frame(s, dp.PUSH, b"\xff\xff\xff\xff")
        assert _answer(s)[1] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    with _raw(port) as s:
        # A region named by path (the old protocol): never opened, calls go inline.
        dp.send_frame(s, dp.HELLO, msgpack.packb({"shm": "../../etc/passwd", "shm_size": 4096, "nonce": b"x" * 16}))
        assert msgpack.unpackb(_answer(s)[2])["shm"] is False
    client = make_client([address], transport="auto")
    try:
        client.declare([TABLE])
        ids = torch.arange(3, dtype=torch.int64)
        client.push({"emb": (ids, torch.ones(3, 4))}).result(10)
        assert torch.equal(client.pull({"emb": ids}).result(10).rows["emb"], -torch.ones(3, 4))
    finally:
        client.close()


def test_out_of_band_payload_over_grpc_is_invalid_argument(cluster: LocalCluster) -> None:
    (address,) = cluster.start_shards(1)
    client = make_client([address], transport="grpc")
    client.declare([TABLE])
    client.close()
    request = pb.PushRequest(incarnation=1, worker_id="w", seq=1)
    block = request.sparse.add(table="emb", ids=encode_ids(torch.arange(2)))
    block.values.dtype, block.values.payload_offset, block.values.payload_bytes = pb.FLOAT32, 0, 32
    block.values.shape[:] = [2, 4]
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.ParameterServerStub(ch).Push(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "only the data plane carries" in err.value.details()


def test_the_bearer_token_guards_the_data_plane(cluster: LocalCluster) -> None:
    (address,) = cluster.start_shards(1, env={"TETHER_AUTH_TOKEN": TOKEN})
    from tether.common.security import ClientSecurity

    good = make_client([address], security=ClientSecurity(token=TOKEN))
    try:
        good.declare([TABLE])
        assert good.transports() == ["shm"]
    finally:
        good.close()
    with grpc.insecure_channel(address) as ch:
        port = pb_grpc.ParameterServerStub(ch).Info(
            pb.InfoRequest(), timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),)
        ).data_port
    with _raw(port) as s:
        dp.send_frame(s, dp.PULL, pb.PullRequest(worker_id="x").SerializeToString())
        assert _answer(s)[1] == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert _closed(s)
    with _raw(port) as s:
        dp.send_frame(s, dp.HELLO, msgpack.packb({"token": "wrong-token"}))
        assert _answer(s)[1] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    bad = make_client([address], security=ClientSecurity(token="wrong-token"), transport="tcp")
    try:
        with pytest.raises(Unauthenticated):
            bad.declare([TABLE])
    finally:
        bad.close()


def test_a_lost_data_plane_ack_is_retried_and_applied_once(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    (address,) = cluster.start_shards(1)
    client = make_client([address], transport="tcp", retries=5, backoff_s=0.05, max_backoff_s=0.2)
    try:
        client.declare([TABLE])
        ids = torch.arange(8, dtype=torch.int64)
        real = worker_dataplane.DataConnection.receive
        lost = []

        def lose_first_ack(self: worker_dataplane.DataConnection, timeout_s: float) -> object:
            if not lost:
                lost.append(real(self, timeout_s))  # the shard applied it and answered...
                raise ConnectionResetError("ack lost")  # ...and the answer never arrived
            return real(self, timeout_s)

        monkeypatch.setattr(worker_dataplane.DataConnection, "receive", lose_first_ack)
        ack = client.push({"emb": (ids, torch.ones(8, 4))}).result(30)
        monkeypatch.undo()
        assert lost and ack.duplicates == 1  # the retry was recognised by (worker id, seq)
        info = _info(address)
        assert (info.applied_pushes, info.duplicate_pushes, info.tables[0].version) == (1, 1, 1)
        assert torch.equal(client.pull({"emb": ids}).result(10).rows["emb"], -torch.ones(8, 4))
    finally:
        client.close()


def test_a_killed_shard_comes_back_and_the_client_finds_its_new_data_port(tmp_path) -> None:
    with LocalCluster(log_dir=tmp_path / "logs", grace_s=5.0, restart=True) as cluster:
        (address,) = cluster.start_shards(1)
        client = make_client([address], transport="auto", retries=30, backoff_s=0.05, max_backoff_s=0.5)
        try:
            client.declare([TABLE])
            ids = torch.arange(4, dtype=torch.int64)
            client.push({"emb": (ids, torch.ones(4, 4))}).result(10)
            old_port = _info(address).data_port
            pid = cluster.signal_shard(0, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while cluster.shard_process(0).pid == pid:
                assert time.monotonic() < deadline, "the shard was not restarted"
                time.sleep(0.05)
            cluster.wait_shard(0)
            # No checkpoint: the restarted shard is empty; the client re-declares and goes on.
            client.declare([TABLE])
            client.push({"emb": (ids, torch.ones(4, 4))}).result(30)
            deadline = time.monotonic() + 30
            while client.transports() != ["shm"]:  # rediscovery waits out a short pause
                assert time.monotonic() < deadline, client.transports()
                time.sleep(0.1)
            assert torch.equal(client.pull({"emb": ids}).result(10).rows["emb"], -torch.ones(4, 4))
            assert _info(address).data_port not in (0, old_port)  # a fresh free port, found again
        finally:
            client.close()


def test_with_the_data_port_off_everything_goes_over_grpc() -> None:
    running = start_shard(ShardConfig(host="127.0.0.1", port=0, data_port=None))
    try:
        assert running.data_port == 0
        client = make_client([f"127.0.0.1:{running.port}"])
        try:
            client.declare([TABLE])
            assert client.transports() == ["grpc"]
            ids = torch.arange(2, dtype=torch.int64)
            client.push({"emb": (ids, torch.ones(2, 4))}).result(10)
            assert torch.equal(client.pull({"emb": ids}).result(10).rows["emb"], -torch.ones(2, 4))
        finally:
            client.close()
    finally:
        running.stop(1.0)
    with pytest.raises(ValueError, match="data_port"):
        ShardConfig(data_port=70000)


def test_a_tcp_pull_receives_whole_blocks_in_place_and_the_rest_through_the_buffer(monkeypatch) -> None:
    """Over TCP, fp32 dense chunks and a table's rows in request order go from the socket straight
    into the result; rows that must be scattered, and a bfloat16 wire, are copied from the buffer.
    Every way gives what gRPC gives."""
    from tether.worker.client import router as router_module

    placed: list[int] = []
    direct = router_module.PullAnswer.direct

    def spy(self, shard, meta, payload_len):
        out = direct(self, shard, meta, payload_len)
        placed.append(len(out))
        return out

    monkeypatch.setattr(router_module.PullAnswer, "direct", spy)
    running = start_shard(ShardConfig(host="127.0.0.1", port=0))
    try:
        address = [f"127.0.0.1:{running.port}"]
        table = TableConfig("emb", dim=8, optimizer=SGD, init_scale=0.0)
        clients = {name: make_client(address, f"w-{name}", transport=t, chunk_elems=1000, **kw)
                   for name, t, kw in (("tcp", "tcp", {}), ("grpc", "grpc", {}), ("bf16", "tcp", {"wire_dtype": torch.bfloat16}))}
        for c in clients.values():
            c.declare([table], dense={"w": torch.zeros(2500)}, dense_optimizer=SGD)
        ids = torch.tensor([5, 1, 900, 77], dtype=torch.int64)  # unsorted: the shard answers in request order
        grads = torch.arange(32, dtype=torch.float32).reshape(4, 8)
        w = (torch.arange(2500) % 64).float() / 4  # exact in bfloat16 too
        clients["grpc"].push({"emb": (ids, grads)}, dense={"w": -w}).result(10)
        want = clients["grpc"].pull({"emb": ids}, dense=["w"]).result(10)
        assert torch.equal(want.dense["w"], w)
        for name in ("tcp", "bf16"):
            placed.clear()
            got = clients[name].pull({"emb": ids}, dense=["w"]).result(10)
            assert clients[name].transports() == ["tcp"]
            assert torch.equal(got.rows["emb"], want.rows["emb"]) and torch.equal(got.dense["w"], want.dense["w"]), name
            # fp32: the table's rows and the 3 chunks of "w" in place; bfloat16: nothing.
            assert placed == ([4] if name == "tcp" else [0]), name
        # Pulled twice in a row into fresh results: nothing of an earlier answer leaks into the next.
        again = clients["tcp"].pull({"emb": ids[:2]}, dense=["w"]).result(10)
        assert torch.equal(again.rows["emb"], want.rows["emb"][:2]) and torch.equal(again.dense["w"], want.dense["w"])
        for c in clients.values():
            c.close()
    finally:
        running.stop(0)
