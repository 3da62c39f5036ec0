"""Serve a private Prometheus registry over HTTP; shared by shards and workers."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.registry import Collector

__all__ = ["serve_metrics"]


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
