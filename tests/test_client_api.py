"""One client contract (tether.worker.client.api): PSClient and LocalClient are ShardClients, the
row cache's CachedClient is a Client in front of either, and the training loop takes any of them."""

from __future__ import annotations

import pytest
import torch

from tether.worker.cache.client import CachedClient
from tether.worker.cache.config import RowCacheConfig
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


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize("rows_exist", [False, True], ids=["new-ids", "rows"])
@pytest.mark.parametrize(("ids", "grads", "stats", "refusal"), [
    ([3, 3], [[1.0, 1.0], [1.0, 1.0]], None, "table 't': ids in one push must be unique"),
    ([3, 4], [[1.0, _NAN], [1.0, 1.0]], None, "table 't': gradients contain NaN or Inf"),
    ([4, 3], [[1.0, 1.0], [_INF, 1.0]], None, "table 't': gradients contain NaN or Inf"),
    ([4, 4], [[1.0, _NAN], [1.0, 1.0]], None, "table 't': ids in one push must be unique"),  # ids before values
    ([3, 4], [[1.0, 1.0], [1.0, 1.0]], [[0.5], [_INF]], "table 't': combined statistics must be finite floats"),
    ([3, 4], [[1.0, 1.0], [1.0, 1.0]], [[-0.5], [0.5]],
     "table 't': combined statistics out of range (first column -1 or >= 0, the others >= 0)"),
    ([3, 4], [[1.0, 1.0], [_NAN, 1.0]], [[-0.5], [0.5]], "table 't': gradients contain NaN or Inf"),  # gradients first
    ([4, 3, 4], [[1.0, 1.0]] * 3, [[0.5]] * 3, "table 't': ids in one push must be unique"),
])
def test_local_mode_refuses_a_push_in_the_shards_own_words(ids: list[int], grads: list[list[float]], stats: list[list[float]] | None,
                                                           refusal: str, rows_exist: bool) -> None:
    """Local mode runs the shard's push checks (tether.rules.push_hooks), not a copy of them: the
    same refusal, whether the shard checks ids that are rows already (in the compiled call that
    finds their slots) or new ones, and nothing of the push applied."""
    import numpy as np

    from tether.protos.errors import InvalidArgument
    from tether.protos.specs import OptimizerConfig, TableConfig
    from tether.server.storage.shard import Shard
    from tether.server.storage.shard_records import SparseUpdate

    spec = TableConfig("t", 2, OptimizerConfig("adagrad", lr=0.5))
    shard = Shard()
    shard.declare([spec], [])
    if rows_exist:
        shard.pull([("t", np.array([3, 4], np.int64))], [])
    before = shard.tables["t"].snapshot()
    combined = None if stats is None else torch.tensor(stats)
    with pytest.raises(InvalidArgument) as at_shard:
        shard.push("w", 1, [SparseUpdate("t", np.array(ids, dtype=np.int64), torch.tensor(grads), combined=combined)], [], incarnation=1)
    after = shard.tables["t"].snapshot()
    assert after["version"] == before["version"] and torch.equal(after["weights"], before["weights"])
    assert torch.equal(after["state"]["sum"], before["state"]["sum"]) and shard.applied_pushes == 0 and shard.rejected_pushes == 1
    local = LocalClient("w")
    local.declare([spec])
    part = (torch.tensor(ids), torch.tensor(grads)) if combined is None else (torch.tensor(ids), torch.tensor(grads), combined)
    with pytest.raises(InvalidArgument) as at_local:
        local.push({"t": part}).result(5)
    assert str(at_shard.value) == str(at_local.value) == refusal
