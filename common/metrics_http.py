"""Serve a private Prometheus registry over HTTP; shared by shards and workers."""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["ProcessMetrics", "register_process_metrics", "serve_metrics"]


class ProcessMetrics(Collector):
    """This process's memory, CPU, open fds and start time (``process_*``) and ``python_info``.

    prometheus_client's own collectors have no ``describe``, so a registry cannot tell that it
    holds them twice; this one describes itself, and a second registration raises.
    """

    def __init__(self) -> None:
        self._collectors = (ProcessCollector(registry=None), PlatformCollector(registry=None))

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        for collector in self._collectors:
            yield from collector.collect()


def register_process_metrics(registry: CollectorRegistry) -> bool:
    """Add :class:`ProcessMetrics` to ``registry`` unless it already exports them.

    Shard and worker metrics may share one registry (tests, one process hosting both), and a
    registry may carry prometheus_client's own process collector (the global default).

    Returns:
        Whether this call added them.
    """
    try:
        registry.register(ProcessMetrics())
    except ValueError:  # prometheus_client's DuplicateTimeseries: they are already there
        return False
    return True


def serve_metrics(registry: Collector, port: int, host: str = "0.0.0.0") -> tuple[WSGIServer, int]:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread.

    Args:
        registry: the collector registry to expose (never the global default implicitly).
        port: TCP port; 0 lets the OS pick a free one.
        host: address to bind.

    Returns:
        The running server (stop it with ``shutdown()`` then ``server_close()``) and the port it
        actually bound.

    Raises:
        ValueError: ``port`` is outside [0, 65535] or ``registry`` is missing.
    """
    if registry is None:
        raise ValueError("registry must be a CollectorRegistry, got None")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, int(server.server_port)
