"""Pulled rows go to the GPU straight from a shard's shared region (issue 41 item 4), checked on
CPU-only machines against the fake ``cuda:0`` of tests/fake_cuda.py, which stands in for
``cudaHostRegister`` and notes every copy between host and device.

- Where the region can be registered as pinned memory, the copy to the device reads the rows
  from the region itself (one copy per shard's answer) and no row is copied on the host; the
  rows the model gets are the shards' rows, scattered where several shards share a table and
  widened on the GPU from a bfloat16 wire; blocks that came another way are copied up after.
- Where registration is refused, rows go through pinned memory with one copy as before, and the
  log says so once.
- The region is not written again (the connection's next call) before the copy that reads it
  has finished: without the wait for its event the fake device sees the bytes change under it.
- A CPU worker registers nothing and places every row on the host, as before.

A real GPU runs the same paths in tests/test_gpu.py and ``bench/gpu_check.sh``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_client
from fake_cuda import FakeCuda, on_fake_cuda
from torch import nn

from tether.protos import framing as dp
from tether.protos import tether_pb2 as pb
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig
from tether.server.serving.serve import start_shard
from tether.worker.client import region_pins
from tether.worker.client.config import ClientConfig
from tether.worker.client.device_pull import DeviceRows
from tether.worker.client.router import PullAnswer, Router
from tether.worker.training.embedding import PSModel
from tether.worker.training.embedding_bag import ShardedEmbeddingBag

SGD = OptimizerConfig("sgd", 1.0)
CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no region registered and registration not yet refused."""
    monkeypatch.setattr(region_pins, "_regions", {})
    monkeypatch.setattr(region_pins, "_refused", None)


# -- the router on its own: answers built here, one of them in a real shared region -----------------


def _value(ids: np.ndarray, dim: int) -> torch.Tensor:
    """The rows a shard answers for ``ids`` in these tests: id * 100 + column."""
    return torch.from_numpy(ids).double().mul(100).unsqueeze(1).add(torch.arange(dim)).float()


def _answer(router: Router, plan: Any, shard: int, asked: dict[str, np.ndarray], wire: torch.dtype) -> tuple[pb.PullResponse, dp.PayloadWriter]:
    response = pb.PullResponse()
    out = dp.PayloadWriter()
    for table, ids in asked.items():
        pos = plan.positions.get((shard, table), 0)
        if isinstance(pos, int):
            continue
        part = ids if pos is None else ids[pos]
        block = response.sparse.add(table=table, read_version=7)
        out.add(_value(part, router.dims[table]), block.values, wire)
    return response, out


def _router(shards: int, wire: torch.dtype = torch.float32) -> Router:
    router = Router(ClientConfig(addresses=tuple(f"x:{i}" for i in range(shards)), worker_id="w", wire_dtype=wire), 1)
    router.dims.update({"a": 8, "b": 8, "c": 4})
    router.pin_memory = True
    return router


ASKED = {"a": np.arange(0, 300, 3, dtype=np.int64), "b": np.arange(5, 90, dtype=np.int64), "c": np.array([11, -4, 2**40], dtype=np.int64)}


@pytest.fixture
def region() -> Iterator[dp.SharedRegion]:
    shared, fd = dp.SharedRegion.create(1 << 20)
    os.close(fd)
    try:
        yield shared
    finally:
        shared.close()


def _pull_through(router: Router, region: dp.SharedRegion, socket_shards: set[int], wire: torch.dtype = torch.float32) -> tuple[Any, list]:
    """Pull ``ASKED`` on the fake GPU: shards in ``socket_shards`` answer through a socket buffer,
    the others through ``region`` (one after another, as one connection would)."""
    stream = torch.cuda.Stream()
    with router.rows_to(DeviceRows(CUDA, stream)):
        _, plan = router.pull_requests({t: torch.from_numpy(ids) for t, ids in ASKED.items()}, [])
    answer = PullAnswer(router, plan)
    host_buffers = {t: plan.rows[t] for t in ASKED}
    for t in ASKED:
        host_buffers[t].fill_(float("nan"))  # any row copied on the host would show
    for shard in range(router.num_shards):
        response, out = _answer(router, plan, shard, ASKED, wire)
        if shard in socket_shards:
            payload = memoryview(b"".join(bytes(b) for b in out.buffers()))
        else:
            region_pins.settle(region.view)  # what the connection does before it writes the region again
            out.copy_into(region.view[64:])
            payload = region.view[64 : 64 + out.nbytes]
        answer(shard, response, payload)
    return plan.result(), [host_buffers[t] for t in ASKED]


@pytest.mark.parametrize("shards", [1, 3])
def test_rows_in_a_registered_region_reach_the_gpu_from_the_region_and_are_never_copied_on_the_host(
        region: dp.SharedRegion, shards: int) -> None:
    with FakeCuda() as fake:
        pulled, host_buffers = _pull_through(_router(shards), region, set())
        (base, size), = fake.registered.items()
        assert (base, size) == (np.frombuffer(region.view, np.uint8, count=1).ctypes.data, region.size)
        to_gpu = [c for c in fake.copies if c.direction == "h2d" and c.dtype == torch.uint8]
        # One copy per shard's answer, from the region, not blocking, on the pull's stream.
        assert len(to_gpu) == shards and all(base <= c.host_ptr < base + size and c.pinned and c.non_blocking for c in to_gpu)
        assert not any(c.direction == "h2d" and c.dtype == torch.float32 for c in fake.copies)
        assert fake.pin_calls == 0
        for t, ids in ASKED.items():
            assert pulled.rows[t].device.type == "cuda"
            assert torch.equal(pulled.rows[t].cpu(), _value(ids, _router(1).dims[t])), t
        assert all(torch.isnan(h).all() for h in host_buffers)  # nothing landed in the pinned buffers
        assert set(pulled.table_versions.values()) == {7}
        # a, b (width 8) back to back in one device buffer, as _stage joins them.
        assert pulled.rows["b"].data_ptr() == pulled.rows["a"].data_ptr() + pulled.rows["a"].nbytes


def test_a_bfloat16_wire_is_widened_on_the_gpu(region: dp.SharedRegion) -> None:
    with FakeCuda() as fake:
        pulled, _ = _pull_through(_router(2, torch.bfloat16), region, set(), torch.bfloat16)
        assert {c.dtype for c in fake.copies if c.direction == "h2d"} <= {torch.uint8, torch.int64}
        for t, ids in ASKED.items():
            want = _value(ids, _router(1).dims[t]).to(torch.bfloat16).float()
            assert pulled.rows[t].dtype == torch.float32 and torch.equal(pulled.rows[t].cpu(), want), t


def test_blocks_that_came_over_the_socket_are_copied_up_to_the_same_device_rows(region: dp.SharedRegion) -> None:
    with FakeCuda() as fake:
        pulled, _ = _pull_through(_router(3), region, {1})
        from_region = [c for c in fake.copies if c.direction == "h2d" and c.dtype == torch.uint8]
        from_pinned = [c for c in fake.copies if c.direction == "h2d" and c.dtype == torch.float32]
        shard_1 = [t for t in ASKED if (1, t) in pulled.table_versions]
        assert len(from_region) == 2 and len(from_pinned) == len(shard_1) >= 2  # shard 1's share of each of its tables
        assert all(c.pinned and c.non_blocking for c in from_pinned)
        for t, ids in ASKED.items():
            assert torch.equal(pulled.rows[t].cpu(), _value(ids, _router(1).dims[t])), t


def test_a_refused_registration_falls_back_to_one_copy_into_pinned_memory_said_once(
        region: dp.SharedRegion, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=region_pins.__name__)
    with FakeCuda(refuse_register=True) as fake:
        for _ in range(2):
            pulled, _ = _pull_through(_router(2), region, set())
            for t, ids in ASKED.items():
                assert pulled.rows[t].device.type == "cpu" and pulled.rows[t].is_pinned()
                assert torch.equal(pulled.rows[t], _value(ids, _router(1).dims[t])), t
        assert not fake.registered and [c[0] for c in fake.register_calls] == ["register"]  # tried once
        assert not [c for c in fake.copies if c.direction == "h2d"]  # _stage's copies, not the pull's
    said = [r.getMessage() for r in caplog.records if "pinned memory" in r.getMessage()]
    assert len(said) == 1 and "copied once into pinned memory" in said[0] and "operation not supported" in said[0], said


def test_without_rows_to_the_rows_stay_on_the_host_and_nothing_is_registered(region: dp.SharedRegion) -> None:
    router = _router(2)
    router.pin_memory = False
    _, plan = router.pull_requests({t: torch.from_numpy(ids) for t, ids in ASKED.items()}, [])
    assert plan.device is None
    answer = PullAnswer(router, plan)
    for shard in range(2):
        response, out = _answer(router, plan, shard, ASKED, torch.float32)
        out.copy_into(region.view[64:])
        answer(shard, response, region.view[64 : 64 + out.nbytes])
    rows = plan.result().rows
    assert not region_pins._regions and region_pins.refused() is None
    for t, ids in ASKED.items():
        assert rows[t].device.type == "cpu" and torch.equal(rows[t], _value(ids, router.dims[t])), t


# -- through a real shard on this host: the connection's region, its reuse, the training step ----------


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = ShardedEmbeddingBag("a", 32)
        self.b = ShardedEmbeddingBag("b", 16)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.a(a).sum() + self.b(b).sum() * 2


def _batch(start: int) -> dict[str, torch.Tensor]:
    # 70 KiB of rows: over SHM_MIN_BYTES, so the answer comes through the region.
    return {"a": torch.arange(start, start + 450), "b": torch.arange(start, start + 300) * 7}


@pytest.fixture
def local_shard() -> Iterator[str]:
    running = start_shard(ShardConfig(host="127.0.0.1", port=0, max_message_bytes=16 * 1024 * 1024))
    try:
        yield f"127.0.0.1:{running.port}"
    finally:
        running.stop(0)


def _declare(client: Any) -> None:
    client.declare([TableConfig("a", 32, SGD, init_scale=0.5), TableConfig("b", 16, SGD, init_scale=0.5)])


def _expected(address: str, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    with make_client([address]) as client:
        _declare(client)
        return [client.pull(b).result(10).rows for b in batches]


def test_a_cuda_worker_gets_its_rows_from_the_region_and_its_push_pull_too(local_shard: str) -> None:
    batches = [_batch(0), _batch(1000)]
    expected = _expected(local_shard, batches)
    with FakeCuda() as fake, make_client([local_shard]) as client:
        model = Two()
        ps = PSModel(on_fake_cuda(model), client, torch.device("cuda"))
        _declare(client)
        before = len(fake.copies)
        pulled = ps.install(ps.prefetch(batches[0]))
        assert client.transports() == ["shm"] and len(fake.registered) == 1
        base, size = next(iter(fake.registered.items()))
        rows_up = [c for c in fake.copies[before:] if c.direction == "h2d" and c.dtype != torch.int64]  # all but the ids
        assert len(rows_up) == 1 and base <= rows_up[0].host_ptr < base + size and rows_up[0].thread.startswith("tether-transfer")
        assert rows_up[0].nbytes == 450 * 32 * 4 + 300 * 16 * 4
        for t, bag in (("a", model.a), ("b", model.b)):
            assert pulled.rows[t].device.type == "cuda"
            assert bag._rows is not None and torch.equal(bag._rows.cpu(), expected[0][t]), t
        model(batches[0]["a"].cuda(), batches[0]["b"].cuda()).backward()
        # async's push_pull: the next batch's rows come back in the same region, the same way.
        before = len(fake.copies)
        nxt = ps.push_pull(1, pulled, batches[1])
        again = ps.install(nxt)
        rows_up = [c for c in fake.copies[before:] if c.direction == "h2d" and c.dtype != torch.int64]
        assert len(rows_up) == 1 and base <= rows_up[0].host_ptr < base + size
        for t, bag in (("a", model.a), ("b", model.b)):
            assert again.rows[t].device.type == "cuda" and torch.equal(bag._rows.cpu(), expected[1][t]), t  # type: ignore[union-attr]
    assert not fake.registered  # unregistered when the connection closed


@pytest.mark.parametrize("wait", [True, False])
def test_the_region_is_not_written_again_before_the_copy_that_reads_it_is_over(
        local_shard: str, wait: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    batches = [_batch(0), _batch(2000)]
    expected = _expected(local_shard, batches)
    if not wait:  # the control: without the wait, the fake device sees the next answer under the copy
        monkeypatch.setattr(region_pins, "settle", lambda view: None)
    with FakeCuda(late_reads=True) as fake, make_client([local_shard]) as client:
        _declare(client)
        stream = torch.cuda.Stream()
        results = []
        for b in batches:
            with client.router.rows_to(DeviceRows(CUDA, stream)):
                results.append(client.pull(b).result(10))
        torch.cuda.synchronize()  # every copy lands
        assert client.transports() == ["shm"] and len(fake.registered) == 1
        if wait:
            assert fake.overwritten == [] and fake.syncs.count("Event.synchronize") == 1
            for got, want in zip(results, expected, strict=True):
                assert all(torch.equal(got.rows[t].cpu(), want[t]) for t in want)
        else:
            assert len(fake.overwritten) == 1 and fake.overwritten[0].dtype == torch.uint8


def test_a_cpu_worker_registers_nothing_and_keeps_its_rows_on_the_host(local_shard: str) -> None:
    with make_client([local_shard]) as client:
        ps = PSModel(Two(), client, torch.device("cpu"))
        _declare(client)
        pulled = ps.install(ps.prefetch(_batch(0)))
        assert client.transports() == ["shm"] and ps._pull_to is None
        assert all(r.device.type == "cpu" and not r.is_pinned() for r in pulled.rows.values())
        assert not region_pins._regions and region_pins.refused() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_real_gpu_the_rows_from_the_region_are_the_shards_rows(local_shard: str) -> None:
    """Where the platform registers the region, the rows come from it; where it refuses, through
    pinned memory; right either way (bench/gpu_check.sh prints which in bench/region_pull.py's line)."""
    batches = [_batch(0), _batch(3000), _batch(0)]
    expected = _expected(local_shard, batches)
    device = torch.device("cuda", 0)
    with make_client([local_shard]) as client:
        client.router.pin_memory = True
        _declare(client)
        stream = torch.cuda.Stream(device=device)
        for b, want in zip(batches, expected, strict=True):
            with client.router.rows_to(DeviceRows(device, stream)):
                got = client.pull(b).result(10)
            stream.synchronize()
            on = "cpu" if region_pins.refused() else "cuda"
            for t in want:
                assert got.rows[t].device.type == on and torch.equal(got.rows[t].cpu(), want[t]), t
        assert client.transports() == ["shm"]
        assert region_pins.registered() == (0 if region_pins.refused() else 1)
    assert region_pins.registered() == 0


def test_a_region_that_grows_is_unregistered_after_its_copy_and_the_new_one_registered(local_shard: str) -> None:
    small, big = _batch(0), {"a": torch.arange(10_000, 19_000), "b": torch.arange(0, 10) * 7}  # 0.07 and 1.15 MiB
    expected = _expected(local_shard, [small, big])
    with FakeCuda(late_reads=True) as fake, make_client([local_shard]) as client:
        _declare(client)
        stream = torch.cuda.Stream()
        results = []
        for b in (small, big):
            with client.router.rows_to(DeviceRows(CUDA, stream)):
                results.append(client.pull(b).result(10))
        # The 1 MiB region was registered, then waited for and unregistered when the connection
        # offered a larger one for the big answer, which was registered in turn.
        (r1, first, _), (u1, gone, _), (r2, second, size) = fake.register_calls
        assert (r1, u1, r2) == ("register", "unregister", "register") and first == gone != second and size > 2 * (1 << 20)
        assert fake.registered == {second: size} and fake.syncs.count("Event.synchronize") == 1
        torch.cuda.synchronize()
        assert fake.overwritten == []
        for got, want in zip(results, expected, strict=True):
            assert all(torch.equal(got.rows[t].cpu(), want[t]) for t in want)
    assert not fake.registered
