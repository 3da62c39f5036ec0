"""A table at its row limit under load (issue 30 item 4): a bounded table (``capacity``) evicts
its least recently touched rows and the shard's memory stays put; a push that names more rows
than the capacity is refused with RESOURCE_EXHAUSTED naming the table and the limit, which the
worker takes for an answer (it fails at once), never for a transient fault."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tether.protos.errors import ResourceExhausted
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.config import ShardConfig
from tether.server.serving.serve import start_shard
from tether.worker.client.config import ClientConfig
from tether.worker.client.ps_client import PSClient
from tether.worker.metrics import NullWorkerMetrics


class _Retries(NullWorkerMetrics):
    def __init__(self) -> None:
        self.count = 0

    def retried(self, rpc: str) -> None:
        self.count += 1


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_a_push_of_more_rows_than_the_capacity_is_refused_at_once_with_one_line(transport: str) -> None:
    running = start_shard(ShardConfig(host="127.0.0.1", port=0))
    retries = _Retries()
    client = PSClient(ClientConfig(addresses=(f"127.0.0.1:{running.port}",), worker_id="w", timeout_s=5.0, call_deadline_s=30.0,
                                   transport=transport), retries)
    try:
        client.declare([TableConfig("emb", 4, OptimizerConfig("sgd", 1.0), init_scale=0.0, capacity=100)])
        start = time.monotonic()
        with pytest.raises(ResourceExhausted) as err:
            client.push({"emb": (torch.arange(150), torch.ones(150, 4))}).result(60)
        elapsed = time.monotonic() - start
        message = str(err.value)
        print(f"{transport}: refused in {elapsed:.2f}s: {message}")
        assert elapsed < 5.0 and retries.count == 0
        assert "\n" not in message
        assert "table 'emb': a push of 150 rows, more than the table's capacity of 100 rows per shard" in message
        table = running.shard.tables["emb"]
        assert (table.rows, table.version, running.shard.applied_pushes) == (0, 0, 0)  # nothing applied
        # Up to the capacity is a push like any other.
        client.push({"emb": (torch.arange(100), torch.ones(100, 4))}).result(10)
        assert (table.rows, table.version) == (100, 1)
    finally:
        client.close()
        running.stop(0)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_bounded_table_under_load_past_its_capacity_keeps_the_shards_memory_bounded(cluster) -> None:
    """A shard process, a table of 10,000 rows x 64 (Adagrad), and 120,000 fresh ids pulled and
    pushed in batches of 2,000: twelve times the capacity. Unbounded, the rows and their state
    would take 50 MiB more; bounded, the RSS stays where it was once the table was full."""
    capacity, dim, batch = 10_000, 64, 2_000
    (address,) = cluster.start_shards(1)
    pid = cluster.shard_process(0).pid
    client = PSClient(ClientConfig(addresses=(address,), worker_id="w", timeout_s=10.0))
    client.declare([TableConfig("emb", dim, OptimizerConfig("adagrad", 0.1), capacity=capacity)])

    def steps(first: int, count: int) -> None:
        for k in range(first, first + count):
            ids = torch.arange(k * batch, (k + 1) * batch)
            client.pull({"emb": ids}).result(30)
            client.push({"emb": (ids, torch.ones(batch, dim))}).result(30)

    steps(0, 10)  # 20,000 ids: the table is full and has evicted
    full = _rss_mib(pid)
    steps(10, 50)  # 100,000 more
    after = _rss_mib(pid)
    (info,) = client.info()
    (table,) = [t for t in info.tables if t.name == "emb"]
    print(f"shard RSS {full:.0f} MiB with the table full, {after:.0f} MiB after 10x its capacity more; "
          f"{table.rows} rows, {table.evicted_rows} evicted")
    assert table.rows <= capacity
    assert table.evicted_rows >= 120_000 - capacity
    assert after - full < 16.0, (full, after)
    client.close()
