"""Fuzzing a real shard with Hypothesis: malformed requests never change a parameter, never crash
the shard, and get a status code from the table (never INTERNAL for a well-formed message).

The shard is shard 0 of 2 (so requests can also be routed to the wrong shard), served over gRPC
in this process, with a checkpoint directory (so checkpoint ids are fuzzed too).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.codec import encode_ids, encode_tensor
from tether.protos.partition import dense_shard, shard_of_ids
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig
from tether.server.serving.serve import RunningShard, start_shard

DIM = 4
SGD = OptimizerConfig("sgd", 1.0)
# Both signs: a negative id is an id like any other (owned by one shard, foreign to the rest).
CANDIDATES = np.stack([np.arange(1, 400), -np.arange(1, 400)], 1).reshape(-1).astype(np.int64)
OWNED = CANDIDATES[shard_of_ids(CANDIDATES, 2) == 0][:16]
FOREIGN = CANDIDATES[shard_of_ids(CANDIDATES, 2) == 1][:16]
DENSE = ("w", 0)  # owned by shard 0 of 2
assert dense_shard(*DENSE, 2) == 0
# Codes a malformed but well-formed message may get; INTERNAL would mean the shard tripped.
EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
}
METHODS = ("Declare", "Pull", "Push", "PushPull", "Info", "Checkpoint")
STATS: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningShard, grpc.Channel, Path]]:
    ckpt = tmp_path_factory.mktemp("fuzz-ckpt")
    running = start_shard(ShardConfig(host="127.0.0.1", port=0, shard_index=0, num_shards=2, max_message_bytes=1 << 20,
                                      checkpoint_dir=str(ckpt)))
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    stub = pb_grpc.ParameterServerStub(channel)
    stub.Declare(pb.DeclareRequest(
        tables=[TableConfig("emb", DIM, SGD, init_scale=0.5, seed=3).to_proto()],
        dense=[pb.DenseSpec(name=DENSE[0], index=DENSE[1], optimizer=SGD.to_proto(), init=encode_tensor(torch.linspace(-1, 1, 6)))],
    ), timeout=10)
    stub.Pull(pb.PullRequest(sparse=[pb.SparseBlock(table="emb", ids=encode_ids(OWNED))]), timeout=10)
    try:
        yield running, channel, ckpt
    finally:
        channel.close()
        running.stop(0)
        print(f"\nfuzz: {sum(v for k, v in STATS.items() if k.startswith('kind:'))} requests; " + ", ".join(f"{k}={v}" for k, v in sorted(STATS.items())))


def _parameters(running: RunningShard) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    table = running.shard.tables["emb"]
    rows, _ = table.pull(OWNED)
    chunk = running.shard.dense[DENSE]
    return rows, chunk.value.clone(), table.version, chunk.version


# -- strategies ---------------------------------------------------------------------------------------

int64s = st.integers(-(2**63), 2**63 - 1)
any_ids = st.one_of(
    st.binary(max_size=64),  # not a whole number of int64s, or any bit pattern
    st.lists(int64s, max_size=12).map(lambda v: encode_ids(np.array(v, dtype=np.int64))),
    st.lists(st.sampled_from(OWNED.tolist()), min_size=1, max_size=8).map(lambda v: encode_ids(np.array(v, dtype=np.int64))),
)
dtypes = st.one_of(st.sampled_from([pb.DTYPE_UNSPECIFIED, pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16, pb.INT64]), st.integers(-3, 40))
shapes = st.lists(st.one_of(st.integers(-3, 9), st.integers(2**31, 2**62)), max_size=5)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def tensors(draw: st.DrawFn) -> pb.Tensor:
    """A Tensor message that may or may not hold what it claims."""
    shape = draw(shapes)
    dtype = draw(dtypes)
    if draw(st.booleans()):
        data = draw(st.binary(max_size=256))
    else:
        n = math.prod(shape) if all(0 <= d < 64 for d in shape) else 0
        data = np.array(draw(st.lists(floats, min_size=n, max_size=n)), dtype=np.float32).tobytes()
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


DEFECTS = (
    # (Negative ids are ids like any other: tests/test_any_ids.py.)
    "ragged ids", "duplicate ids", "foreign id", "rows", "dim",
    "int dtype", "unknown dtype", "payload", "nan", "inf", "table", "shape overflow", "many dims",
)


def _bad_block(draw: st.DrawFn, defect: str) -> pb.SparseBlock:
    """A sparse push block with the given defect (and random everything else)."""
    n = draw(st.integers(1, 6))
    ids = np.array(draw(st.permutations(OWNED.tolist()))[:n], dtype=np.int64)
    grads = torch.from_numpy(np.array(draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=n * DIM, max_size=n * DIM)),
                                      dtype=np.float32)).reshape(n, DIM)
    table = "emb"
    ids_bytes = None
    if defect == "ragged ids":
        ids_bytes = encode_ids(ids)[: 8 * n - draw(st.integers(1, 7))]
    elif defect == "duplicate ids":
        ids = np.concatenate([ids, ids[:1]])
        grads = torch.ones(n + 1, DIM)
    elif defect == "foreign id":
        ids[draw(st.integers(0, n - 1))] = draw(st.sampled_from(FOREIGN.tolist()))
    elif defect == "rows":
        grads = torch.ones(draw(st.integers(0, 12).filter(lambda r: r != n)), DIM)
    elif defect == "dim":
        grads = torch.ones(n, draw(st.integers(0, 70).filter(lambda d: d != DIM)))
    elif defect == "nan":
        grads[draw(st.integers(0, n - 1)), draw(st.integers(0, DIM - 1))] = float("nan")
    elif defect == "inf":
        grads[draw(st.integers(0, n - 1)), 0] = draw(st.sampled_from([float("inf"), float("-inf")]))
    elif defect == "table":
        table = draw(st.text(max_size=8).filter(lambda t: t != "emb"))
    values = encode_tensor(grads.to(torch.float32))
    if defect == "int dtype":
        values = encode_tensor(torch.ones(n, DIM, dtype=torch.int64))
    elif defect == "unknown dtype":
        values.dtype = draw(st.sampled_from([pb.DTYPE_UNSPECIFIED, 5, 17, -1, 2**31 - 1]))
    elif defect == "payload":
        cut = draw(st.integers(1, len(values.data)))
        values.data = values.data[:-cut] if draw(st.booleans()) else values.data + draw(st.binary(min_size=1, max_size=9))
    elif defect == "shape overflow":
        values.shape[:] = draw(st.sampled_from([[2**62, 2**62, 0], [2**40, 2**40, 0], [0, 2**63 - 1], [n, 2**40]]))
        values.data = b""
    elif defect == "many dims":
        values.shape[:] = [1] * draw(st.integers(9, 200))
    return pb.SparseBlock(table=table, ids=ids_bytes if ids_bytes is not None else encode_ids(ids), values=values,
                          read_version=draw(st.integers(0, 2**64 - 1)))


@st.composite
def bad_pushes(draw: st.DrawFn, defect: str) -> pb.PushRequest:
    """A push that must be refused as a whole: a bad block, maybe next to good ones."""
    request = pb.PushRequest(incarnation=1, worker_id=draw(st.text(min_size=1, max_size=12)), seq=draw(st.integers(0, 2**64 - 1)),
                             clock=draw(st.integers(0, 2**64 - 1)), staleness_aware=draw(st.booleans()))
    if defect == "dense":
        value = draw(st.one_of(tensors(), st.just(encode_tensor(torch.ones(7))), st.just(encode_tensor(torch.full((6,), float("nan"))))))
        if value.dtype in (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16) and list(value.shape) == [6]:
            value.shape[:] = [7]  # a well-formed 6-element gradient would be valid: break it
        name, index = draw(st.sampled_from([DENSE, ("w", 1), ("nope", 0)]))
        request.dense.append(pb.DenseBlock(name=name, index=index, value=value))
    elif defect == "no worker":
        request.worker_id = ""
    else:
        request.sparse.append(_bad_block(draw, defect))
    # Valid blocks next to the bad one: none of them may be applied either.
    for _ in range(draw(st.integers(0, 2))):
        good = pb.SparseBlock(table="emb", ids=encode_ids(OWNED[8:10]), values=encode_tensor(torch.ones(2, DIM)))
        request.sparse.insert(draw(st.integers(0, len(request.sparse))), good)
    if draw(st.booleans()):
        request.dense.append(pb.DenseBlock(name=DENSE[0], index=DENSE[1], value=encode_tensor(torch.ones(6))))
    return request


@st.composite
def pulls(draw: st.DrawFn) -> pb.PullRequest:
    request = pb.PullRequest(worker_id=draw(st.text(max_size=8)), wire_dtype=draw(dtypes))
    for _ in range(draw(st.integers(0, 3))):
        request.sparse.append(pb.SparseBlock(table=draw(st.sampled_from(["emb", "", "nope"])), ids=draw(any_ids)))
    for _ in range(draw(st.integers(0, 2))):
        request.dense.append(pb.DenseBlock(name=draw(st.sampled_from(["w", "b", ""])), index=draw(st.integers(0, 2**32 - 1))))
    return request


@st.composite
def declares(draw: st.DrawFn) -> pb.DeclareRequest:
    request = pb.DeclareRequest()
    for _ in range(draw(st.integers(0, 2))):
        request.tables.append(pb.TableSpec(
            name=draw(st.sampled_from(["emb", "x", ""]) | st.text(max_size=3)),
            dim=draw(st.sampled_from([0, 1, DIM, 3, 65537, 2**32 - 1])),
            optimizer=pb.OptimizerSpec(name=draw(st.sampled_from(["sgd", "adam", "adagrad", "magic", ""])), lr=draw(floats),
                                       beta1=draw(floats), eps=draw(floats)),
            init_scale=draw(floats), seed=draw(st.integers(0, 2**64 - 1)),
            capacity=draw(st.sampled_from([0, 1, 2**40, 2**64 - 1])), min_count=draw(st.sampled_from([0, 1, 3, 2**32 - 1])),
        ))
    for _ in range(draw(st.integers(0, 2))):
        request.dense.append(pb.DenseSpec(name=draw(st.sampled_from(["w", "b", ""])), index=draw(st.integers(0, 3)),
                                          optimizer=pb.OptimizerSpec(name=draw(st.sampled_from(["sgd", "adam", "x"]))),
                                          init=draw(tensors())))
    return request


checkpoint_ids = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["..", ".", "../x", "/abs", "a/b", "a\\b", ".hidden", "x" * 129, "ok-1", "ok.2"]),
)


# -- the tests -------------------------------------------------------------------------------------


def _check(running: RunningShard, ckpt: Path, call, well_formed: bool = True, must_fail: bool = False) -> None:
    """Make one call; check its status, that no parameter moved, and that nothing left the checkpoint dir."""
    before = _parameters(running)
    try:
        call()
        STATS["answered:OK"] += 1
        assert not must_fail, "a bad push was accepted"
    except grpc.RpcError as exc:
        code = exc.code()
        STATS[f"answered:{code.name}"] += 1
        assert code in EXPECTED, (code, exc.details())
        if not well_formed and code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in (exc.details() or ""):
            STATS["unparsable"] += 1
    after = _parameters(running)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert before[2:] == after[2:]
    assert all(p.parent == ckpt for p in ckpt.iterdir())


FUZZ = settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("kind", ["raw", "pull", "declare", "checkpoint"])
@FUZZ
@given(data=st.data())
def test_malformed_messages_change_nothing(shard, kind: str, data: st.DataObject) -> None:
    running, channel, ckpt = shard
    stub = pb_grpc.ParameterServerStub(channel)
    STATS[f"kind:{kind}"] += 1
    if kind == "raw":
        raw = channel.unary_unary(f"/tether.v1.ParameterServer/{data.draw(st.sampled_from(METHODS))}")
        payload = data.draw(st.binary(max_size=512))
        _check(running, ckpt, lambda: raw(payload, timeout=10), well_formed=False)
    elif kind == "pull":
        request = data.draw(pulls())
        _check(running, ckpt, lambda: stub.Pull(request, timeout=10))
    elif kind == "declare":
        request = data.draw(declares())
        _check(running, ckpt, lambda: stub.Declare(request, timeout=10))
    else:
        ckpt_id = data.draw(checkpoint_ids)
        _check(running, ckpt, lambda: stub.Checkpoint(pb.CheckpointRequest(id=ckpt_id), timeout=30))


@pytest.mark.parametrize("defect", [*DEFECTS, "dense", "no worker"])
@settings(FUZZ, max_examples=10)
@given(data=st.data())
def test_bad_pushes_change_nothing(shard, defect: str, data: st.DataObject) -> None:
    running, channel, ckpt = shard
    stub = pb_grpc.ParameterServerStub(channel)
    push = data.draw(bad_pushes(defect))
    STATS[f"defect:{defect}"] += 1
    if data.draw(st.booleans()):
        STATS["kind:push"] += 1
        _check(running, ckpt, lambda: stub.Push(push, timeout=10), must_fail=True)
    else:
        STATS["kind:push_pull"] += 1
        request = pb.PushPullRequest(push=push, pull=data.draw(pulls()))
        _check(running, ckpt, lambda: stub.PushPull(request, timeout=10), must_fail=True)


def test_the_shard_still_serves_after_the_fuzzing(shard) -> None:
    running, channel, _ = shard
    stub = pb_grpc.ParameterServerStub(channel)
    info = stub.Info(pb.InfoRequest(), timeout=10)
    assert info.applied_pushes == 0 and info.rejected_pushes > 0
    ids = encode_ids(OWNED[:2])
    reply = stub.Push(pb.PushRequest(incarnation=1, worker_id="good", seq=1, sparse=[pb.SparseBlock(table="emb", ids=ids, values=encode_tensor(torch.ones(2, DIM)))]), timeout=10)
    assert reply.applied
    assert running.shard.tables["emb"].version == 1
