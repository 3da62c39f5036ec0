"""Many threads pushing to the same rows at once lose no update (exact sums with SGD)."""

from __future__ import annotations

import threading

import numpy as np
import torch
from conftest import make_client

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.storage.tables import EmbeddingTable

THREADS = 16
PUSHES = 40


def test_table_level_no_lost_update() -> None:
    table = EmbeddingTable(TableConfig("t", 8, OptimizerConfig("sgd", 1.0), init_scale=0.0))
    ids = np.arange(100, dtype=np.int64)

    def hammer(k: int) -> None:
        for _ in range(PUSHES):
            table.push(ids, torch.full((100, 8), float(k + 1)))

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    expected = -PUSHES * sum(range(1, THREADS + 1))
    rows, version = table.pull(ids)
    assert version == THREADS * PUSHES
    assert torch.equal(rows, torch.full((100, 8), float(expected)))


def test_concurrent_pushes_over_grpc_lose_nothing(two_shards: list[str]) -> None:
    setup = make_client(two_shards, "setup")
    sgd = OptimizerConfig("sgd", 1.0)
    setup.declare([TableConfig("hot", 4, sgd, init_scale=0.0)], {"w": torch.zeros(10)}, sgd)
    ids = torch.arange(64, dtype=torch.int64)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        # 16 clients x 8 threads can pass a shard's 64 concurrent calls: the client backs off
        # and retries the calls the shard sheds, given enough tries.
        client = make_client(two_shards, f"w{k}", retries=10)
        try:
            client.declare([TableConfig("hot", 4, sgd, init_scale=0.0)], {"w": torch.zeros(10)}, sgd)
            handles = [
                client.push({"hot": (ids, torch.full((64, 4), float(k + 1)))}, {"w": torch.full((10,), float(k + 1))})
                for _ in range(PUSHES)
            ]
            for h in handles:
                h.result(60)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    expected = -PUSHES * sum(range(1, THREADS + 1))
    pulled = setup.pull({"hot": ids}, ["w"]).result(10)
    assert torch.equal(pulled.rows["hot"], torch.full((64, 4), float(expected)))
    assert torch.equal(pulled.dense["w"], torch.full((10,), float(expected)))
    info = setup.info()
    assert sum(i.applied_pushes for i in info) == THREADS * PUSHES * 2
    setup.close()
