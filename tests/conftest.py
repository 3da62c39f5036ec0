"""Shared fixtures: real shard processes on 127.0.0.1 and in-process shards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tether.deploy.launch import LocalCluster
from tether.server.config import ShardConfig
from tether.server.serve import RunningShard, start_shard
from tether.worker.client import ClientConfig, PSClient


@pytest.fixture
def cluster(tmp_path) -> Iterator[LocalCluster]:
    """A local cluster whose processes are stopped at the end of the test."""
    c = LocalCluster(log_dir=tmp_path / "logs", grace_s=5.0)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def two_shards(cluster: LocalCluster) -> list[str]:
    """Two shard processes; their addresses."""
    return cluster.start_shards(2, timeout_s=60)


@pytest.fixture
def inproc_shard() -> Iterator[RunningShard]:
    """One shard served in this process (real gRPC on loopback)."""
    running = start_shard(ShardConfig(host="127.0.0.1", port=0, max_message_bytes=4 * 1024 * 1024))
    try:
        yield running
    finally:
        running.stop(0)


def make_client(addresses: list[str], worker_id: str = "test", **kw: object) -> PSClient:
    """A client with short deadlines for tests."""
    kw.setdefault("timeout_s", 10.0)
    kw.setdefault("retries", 2)
    return PSClient(ClientConfig(addresses=tuple(addresses), worker_id=worker_id, **kw))
