"""Bad requests get a clear status code, change no parameter, and the shard keeps serving.

Runs against a real shard process.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from conftest import make_client

from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.codec import encode_ids, encode_tensor
from tether.protos.partition import shard_of_ids
from tether.protos.specs import OptimizerConfig, TableConfig

IDS = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int64)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    from tether.deploy.launch import LocalCluster

    cluster = LocalCluster(log_dir=tmp_path_factory.mktemp("logs"), grace_s=5)
    try:
        # A 1 MiB message limit so "oversized" is cheap to build.
        addresses = cluster.start_shards(2, extra_args=["--max-message-mb", "1"])
        client = make_client(addresses)
        client.declare([TableConfig("emb", 4, OptimizerConfig("sgd", 1.0))], {"w": torch.zeros(6)}, OptimizerConfig("sgd", 1.0))
        yield addresses, client
        client.close()
    finally:
        cluster.stop()


def _stub(address: str) -> pb_grpc.ParameterServerStub:
    return pb_grpc.ParameterServerStub(grpc.insecure_channel(address))


def _owned(shard_index: int, n: int = 2) -> np.ndarray:
    ids = np.arange(1, 200, dtype=np.int64)
    return ids[shard_of_ids(ids, 2) == shard_index][:n]


def _state(client) -> tuple[torch.Tensor, torch.Tensor, list]:
    pulled = client.pull({"emb": torch.from_numpy(IDS)}, ["w"]).result(10)
    versions = [(t.name, t.version) for info in client.info() for t in info.tables]
    return pulled.rows["emb"].clone(), pulled.dense["w"].clone(), versions


def _push(ids: bytes, values: pb.Tensor, table: str = "emb", seq: int = 1) -> pb.PushRequest:
    return pb.PushRequest(incarnation=1, worker_id="bad", seq=seq, sparse=[pb.SparseBlock(table=table, ids=ids, values=values)])


def _grads(n: int, value: float = 1.0, dtype=torch.float32, dim: int = 4) -> pb.Tensor:
    return encode_tensor(torch.full((n, dim), value).to(dtype))


CASES = {
    "unknown table": (lambda s: _push(encode_ids(_owned(s)), _grads(2), table="nope"), grpc.StatusCode.NOT_FOUND, "unknown table 'nope'"),
    "ids not whole int64": (lambda s: _push(b"\x01\x02\x03", _grads(2)), grpc.StatusCode.INVALID_ARGUMENT, "not a whole number of int64"),
    "duplicate ids": (lambda s: _push(encode_ids(np.repeat(_owned(s, 1), 2)), _grads(2)), grpc.StatusCode.INVALID_ARGUMENT, "unique"),
    "wrong shard": (lambda s: _push(encode_ids(_owned(1 - s)), _grads(2)), grpc.StatusCode.FAILED_PRECONDITION, "belongs to shard"),
    "wrong shape": (lambda s: _push(encode_ids(_owned(s)), _grads(2, dim=3)), grpc.StatusCode.INVALID_ARGUMENT, "gradient shape (2, 3)"),
    "wrong dtype": (lambda s: _push(encode_ids(_owned(s)), _grads(2, dtype=torch.int64)), grpc.StatusCode.INVALID_ARGUMENT, "expected a torch.float32"),
    "payload length": (
        lambda s: _push(encode_ids(_owned(s)), pb.Tensor(dtype=pb.FLOAT32, shape=[2, 4], data=b"\0" * 31)),
        grpc.StatusCode.INVALID_ARGUMENT, "31 bytes",
    ),
    "NaN gradient": (lambda s: _push(encode_ids(_owned(s)), _grads(2, float("nan"))), grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
    "Inf gradient": (lambda s: _push(encode_ids(_owned(s)), _grads(2, float("inf"))), grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
    "no worker id": (
        lambda s: pb.PushRequest(seq=1, sparse=[pb.SparseBlock(table="emb", ids=encode_ids(_owned(s)), values=_grads(2))]),
        grpc.StatusCode.INVALID_ARGUMENT, "worker_id",
    ),
    "no incarnation": (
        lambda s: pb.PushRequest(worker_id="bad", seq=1, sparse=[pb.SparseBlock(table="emb", ids=encode_ids(_owned(s)), values=_grads(2))]),
        grpc.StatusCode.INVALID_ARGUMENT, "incarnation must be a non-zero",
    ),
    "dense wrong length": (
        lambda s: pb.PushRequest(incarnation=1, worker_id="bad", seq=1, dense=[pb.DenseBlock(name="w", index=0, value=encode_tensor(torch.ones(5)))]),
        None, "gradient shape",
    ),
    "unknown dense": (
        lambda s: pb.PushRequest(incarnation=1, worker_id="bad", seq=1, dense=[pb.DenseBlock(name="zz", index=0, value=encode_tensor(torch.ones(6)))]),
        grpc.StatusCode.NOT_FOUND, "unknown dense chunk zz[0]",
    ),
    "oversized": (lambda s: _push(encode_ids(_owned(s)), _grads(70_000)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_push_is_rejected_and_changes_nothing(shard, case: str) -> None:
    addresses, client = shard
    build, code, message = CASES[case]
    before = _state(client)
    for s, address in enumerate(addresses):
        if case.startswith("dense") and s != 0:
            continue
        with pytest.raises(grpc.RpcError) as err:
            _stub(address).Push(build(s), timeout=10)
        if code is not None:
            assert err.value.code() == code, err.value.details()
        elif case == "dense wrong length":
            # Only the owner knows the chunk; another shard answers NOT_FOUND.
            assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        assert message in (err.value.details() or "")
    after = _state(client)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert before[2] == after[2]


def test_mixed_push_applies_nothing_when_one_block_is_bad(shard) -> None:
    addresses, client = shard
    before = _state(client)
    good = pb.SparseBlock(table="emb", ids=encode_ids(_owned(0)), values=_grads(2))
    bad = pb.SparseBlock(table="emb", ids=encode_ids(_owned(0)), values=_grads(2, float("nan")))
    with pytest.raises(grpc.RpcError) as err:
        _stub(addresses[0]).Push(pb.PushRequest(incarnation=1, worker_id="bad", seq=9, sparse=[good, bad]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = _state(client)
    assert torch.equal(before[0], after[0]) and before[2] == after[2]


def test_bad_pull_and_declare(shard) -> None:
    addresses, _client = shard
    stub = _stub(addresses[0])
    with pytest.raises(grpc.RpcError) as err:
        stub.Pull(pb.PullRequest(sparse=[pb.SparseBlock(table="emb", ids=b"\0" * 9)]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.Pull(pb.PullRequest(wire_dtype=pb.INT64), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A conflicting spec for an existing table.
    with pytest.raises(grpc.RpcError) as err:
        stub.Declare(pb.DeclareRequest(tables=[pb.TableSpec(name="emb", dim=8)]), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # An invalid spec.
    with pytest.raises(grpc.RpcError) as err:
        stub.Declare(pb.DeclareRequest(tables=[pb.TableSpec(name="x", dim=4, optimizer=pb.OptimizerSpec(name="magic"))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "magic" in err.value.details()
    assert [t.name for t in stub.Info(pb.InfoRequest(), timeout=10).tables] == ["emb"]


def test_shard_still_serves_and_counts_rejections(shard) -> None:
    _addresses, client = shard
    ids = torch.from_numpy(IDS)
    before = client.pull({"emb": ids}).result(10).rows["emb"]
    client.push({"emb": (ids, torch.ones(len(IDS), 4))}).result(10)
    after = client.pull({"emb": ids}).result(10).rows["emb"]
    assert torch.allclose(after, before - 1.0)
    assert sum(i.rejected_pushes for i in client.info()) > 0
