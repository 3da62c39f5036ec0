from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch
from conftest import make_client

from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.codec import encode_ids, encode_tensor
from tether.protos.errors import InvalidArgument, NotFound, Unavailable
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.client.config import ClientConfig

SGD = OptimizerConfig("sgd", 1.0)


def test_pull_push_round_trip_across_shards(two_shards: list[str]) -> None:
    client = make_client(two_shards, chunk_elems=7)
    client.declare([TableConfig("e", 3, SGD, init_scale=0.0)], {"w": torch.arange(20.0).view(4, 5)}, SGD)
    ids = torch.tensor([9, 1, 2**50, 4], dtype=torch.int64)
    pulled = client.pull({"e": ids}, ["w"]).result(10)
    assert torch.equal(pulled.rows["e"], torch.zeros(4, 3))
    assert torch.equal(pulled.dense["w"], torch.arange(20.0).view(4, 5))
    grads = torch.arange(12.0).view(4, 3)
    ack = client.push({"e": (ids, grads)}, {"w": torch.ones(4, 5)}, versions=pulled).result(10)
    assert (ack.staleness, ack.duplicates) == (0, 0)
    after = client.push_pull(pull_sparse={"e": ids[[3, 0]]}, pull_dense=["w"]).result(10)
    assert torch.equal(after.rows["e"], -grads[[3, 0]])
    assert torch.equal(after.dense["w"], torch.arange(20.0).view(4, 5) - 1)
    infos = client.info()
    assert {d.index for i in infos for d in i.dense} == {0, 1, 2}
    assert sum(t.rows for i in infos for t in i.tables) == 4
    client.close()


def test_staleness_counts_updates_since_the_read(two_shards: list[str]) -> None:
    a, b = make_client(two_shards, "a"), make_client(two_shards, "b")
    for c in (a, b):
        c.declare([TableConfig("e", 2, SGD)], {"w": torch.zeros(3)}, SGD)
    ids = torch.arange(10, dtype=torch.int64)
    read = a.pull({"e": ids}, ["w"]).result(10)
    for _ in range(3):
        b.push({"e": (ids, torch.ones(10, 2))}, {"w": torch.ones(3)}).result(10)
    assert a.push({"e": (ids, torch.ones(10, 2))}, {"w": torch.ones(3)}, versions=read).result(10).staleness == 3
    a.close()
    b.close()


def test_retried_push_is_applied_once(two_shards: list[str]) -> None:
    client = make_client(two_shards)
    client.declare([TableConfig("e", 2, SGD, init_scale=0.0)])
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(two_shards[0]))
    info = stub.Info(pb.InfoRequest(), timeout=5)
    ids = torch.tensor([0, 1, 2, 3, 5, 8, 13, 21], dtype=torch.int64)
    from tether.protos.partition import shard_of_ids

    mine = ids[torch.from_numpy(shard_of_ids(ids.numpy(), 2) == info.shard_index)]
    request = pb.PushRequest(incarnation=1, worker_id="w", seq=77, sparse=[pb.SparseBlock(table="e", ids=encode_ids(mine), values=encode_tensor(torch.ones(len(mine), 2)))])
    first = stub.Push(request, timeout=5)
    second = stub.Push(request, timeout=5)  # as if the first ack was lost
    assert first.applied and not second.applied
    rows = client.pull({"e": mine}).result(10).rows["e"]
    assert torch.equal(rows, -torch.ones(len(mine), 2))
    assert stub.Info(pb.InfoRequest(), timeout=5).duplicate_pushes == 1
    client.close()


def test_unreachable_shard_fails_clearly_and_in_bounded_time() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    client = make_client([f"127.0.0.1:{port}"], timeout_s=0.5, retries=2)
    client.router.dims["e"] = 2  # skip the declare, which would fail the same way
    start = time.monotonic()
    with pytest.raises(Unavailable, match=r"failed after 3 tries"):
        client.pull({"e": torch.tensor([1])}).result(30)
    assert time.monotonic() - start < 15
    client.close()


def test_client_side_validation(two_shards: list[str]) -> None:
    client = make_client(two_shards)
    with pytest.raises(InvalidArgument, match="was not declared"):
        client.pull({"nope": torch.tensor([1])})
    client.declare([TableConfig("e", 2, SGD)])
    with pytest.raises(InvalidArgument, match=r"ids must be integers, got a torch.float32 tensor"):
        client.pull({"e": torch.tensor([1.0])})
    with pytest.raises(InvalidArgument, match=r"gradient shape \(1, 3\)"):
        client.push({"e": (torch.tensor([1]), torch.ones(1, 3))})
    client.router.dims["ghost"] = 2  # declared here but not on the shards
    with pytest.raises(NotFound, match="unknown table 'ghost'"):
        client.pull({"ghost": torch.arange(10)}).result(10)
    client.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"addresses": ()}, "at least one shard"),
        ({"addresses": ("localhost",)}, "host:port"),
        ({"worker_id": ""}, "worker_id"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"wire_dtype": torch.float64}, "wire_dtype"),
        ({"call_deadline_s": 0}, r"call_deadline_s must be a finite number of seconds > 0, got 0$"),
        ({"call_deadline_s": -1.5}, r"got -1\.5$"),
        ({"call_deadline_s": float("nan")}, r"call_deadline_s .* got nan$"),
        ({"call_deadline_s": float("inf")}, r"call_deadline_s .* got inf$"),
    ],
)
def test_client_config_validation(kwargs: dict, message: str) -> None:
    base = {"addresses": ("127.0.0.1:1",), "worker_id": "w"}
    with pytest.raises(ValueError, match=message):
        ClientConfig(**{**base, **kwargs})


def test_call_deadline_flag_env_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tether worker --call-deadline`` (env TETHER_CALL_DEADLINE) reaches the client's config."""
    from tether.worker.flags import build_parser, load_config

    assert ClientConfig(addresses=("127.0.0.1:1",), worker_id="w").call_deadline_s == 60.0
    assert load_config(["--shards", "127.0.0.1:1"]).call_deadline_s == 60.0
    assert load_config(["--shards", "127.0.0.1:1", "--call-deadline", "7.5"]).call_deadline_s == 7.5
    monkeypatch.setenv("TETHER_CALL_DEADLINE", "12")
    assert load_config(["--shards", "127.0.0.1:1"]).call_deadline_s == 12.0
    with pytest.raises(ValueError, match=r"call_deadline_s \(--call-deadline\) must be .* got 0\.0$"):
        load_config(["--shards", "127.0.0.1:1", "--call-deadline", "0"])
    assert "--call-deadline" in build_parser().format_help() and "TETHER_CALL_DEADLINE" in build_parser().format_help()


def test_a_closed_client_reads_again_on_every_transport(two_shards: list[str]) -> None:
    """Reading the trained model after the Trainer block (which closes the client) works the
    same over shm, tcp and gRPC: the next call opens channels and the pool again, pushes stay
    numbered on (a push after the reopen is applied, not taken for a duplicate), and a second
    close closes those."""
    ids = torch.arange(16, dtype=torch.int64)
    for step, transport in enumerate(("auto", "tcp", "grpc"), start=1):
        client = make_client(two_shards, f"w-{transport}", transport=transport)
        client.declare([TableConfig("closed", 2, SGD, init_scale=0.0)], {"w": torch.zeros(3)}, SGD)
        client.push({"closed": (ids, torch.ones(16, 2))}, {"w": torch.ones(3)}).result(10)
        client.close()
        client.close()  # twice is fine
        pulled = client.pull({"closed": ids}, ["w"]).result(10)
        assert torch.equal(pulled.rows["closed"], torch.full((16, 2), -2.0 * step + 1.0))
        assert torch.equal(pulled.dense["w"], torch.full((3,), -2.0 * step + 1.0))
        ack = client.push({"closed": (ids, torch.ones(16, 2))}, {"w": torch.ones(3)}).result(10)
        assert ack.duplicates == 0
        assert client.transports() == {"auto": ["shm", "shm"], "tcp": ["tcp", "tcp"], "grpc": ["grpc", "grpc"]}[transport]
        client.close()
        assert torch.equal(client.pull({"closed": ids}).result(10).rows["closed"], torch.full((16, 2), -2.0 * step))
        client.close()
