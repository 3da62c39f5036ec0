"""``tether worker`` / ``python -m tether.worker``: train one worker of a job."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from tether.protos.errors import TetherError
from tether.worker.config import WorkerConfig, load_config
from tether.worker.trainer import train

__all__ = ["main", "run"]

log = logging.getLogger("tether.worker")


def run(config: WorkerConfig) -> int:
    """Train with optional metrics; exit code 0 on success, 1 when a shard call failed."""
    metrics = None
    if config.metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from tether.worker.metrics import WorkerMetrics, serve_metrics

        registry = CollectorRegistry()
        metrics = WorkerMetrics(registry)
        port = config.metrics_port
        if port and "LOCAL_RANK" in os.environ:
            # torchrun ranks on one machine share the flag; each takes base + local rank.
            port += int(os.environ["LOCAL_RANK"])
        _, port = serve_metrics(registry, port)
        log.info("metrics on port %d", port)
    try:
        train(config, metrics=metrics, printer=lambda line: print(line, flush=True))
    except TetherError as exc:
        print(f"tether worker {config.worker_index}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tether worker``."""
    logging.basicConfig(level=os.environ.get("TETHER_LOG_LEVEL", "WARNING"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = load_config(argv)
    except ValueError as exc:
        print(f"tether worker: {exc}", file=sys.stderr)
        return 2
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
