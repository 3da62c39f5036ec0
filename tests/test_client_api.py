"""One client contract (tether.worker.client.api): PSClient and LocalClient are ShardClients, the
row cache's CachedClient is a Client in front of either, and the training loop takes any of them."""

from __future__ import annotations

import torch

from tether.worker.cache.row_cache import CachedClient, RowCacheConfig
from tether.worker.client.api import Client, ShardClient
from tether.worker.client.config import ClientConfig
from tether.worker.client.local import LocalClient
from tether.worker.client.ps_client import PSClient
from tether.worker.client.traffic import TrafficMeter


def test_the_shards_client_and_the_local_one_answer_the_same_contract() -> None:
    remote = PSClient(ClientConfig(addresses=("127.0.0.1:1",), worker_id="w"))
    try:
        local = LocalClient("w")
        for client in (remote, local):
            assert isinstance(client, ShardClient) and isinstance(client, Client)
        assert not isinstance(local, PSClient)  # local mode is its own client, not a PSClient without shards
    finally:
        remote.close()


def test_the_row_cache_is_a_client_in_front_of_a_shard_client() -> None:
    local = LocalClient("w")
    cached = CachedClient(local, RowCacheConfig(rows=8, bound=1), {"t": 2}, TrafficMeter({"t": 2}, 4, None))
    assert isinstance(cached, Client) and not isinstance(cached, ShardClient)
    assert cached.config is local.config


def test_a_local_client_trains_through_the_cache_as_through_itself() -> None:
    from tether.protos.specs import OptimizerConfig, TableConfig

    ids = torch.tensor([3, 7])
    results = []
    for make in (lambda c: c, lambda c: CachedClient(c, RowCacheConfig(rows=8, bound=0), {"t": 2}, TrafficMeter({"t": 2}, 4, None))):
        local = LocalClient("w")
        local.declare([TableConfig("t", 2, OptimizerConfig("sgd", lr=0.5))])
        client: Client = make(local)
        before = client.pull({"t": ids}).result(5).rows["t"].clone()
        client.push({"t": (ids, torch.ones(2, 2))}, clock=1).result(5)
        after = client.pull({"t": ids}).result(5).rows["t"]
        results.append((before, after))
    (b0, a0), (b1, a1) = results
    assert torch.equal(b0, b1) and torch.equal(a0, a1) and torch.allclose(a0, b0 - 0.5)
