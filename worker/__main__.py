"""``tether worker`` / ``python -m tether.worker``: train one worker of a job."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from tether.common.allocator import tune_malloc
from tether.protos.codec import quiet_readonly_warning
from tether.common.exits import DONE, FAILED, exit_process, run_command, usage_checks
from tether.protos.errors import TetherError, UsageError
from tether.worker.config import WorkerConfig
from tether.worker.flags import load_config
from tether.worker.ctr_job import train

__all__ = ["main", "run"]

log = logging.getLogger("tether.worker")


def run(config: WorkerConfig) -> int:
    """Train with optional metrics; exit code ``DONE``, or ``FAILED`` when a shard call failed.

    Raises:
        UsageError: the metrics port is taken, sync mode outside torchrun, a bad data file.
    """
    # Steps free and allocate tensors of MiBs: keep them in the heap (tether.common.allocator).
    tune_malloc()
    quiet_readonly_warning()
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
        try:
            _, port = serve_metrics(registry, port)
        except OSError as exc:
            raise UsageError(f"--metrics-port {port}: {exc.strerror or exc}") from None
        log.info("metrics on port %d", port)
    try:
        train(config, metrics=metrics, printer=lambda line: print(line, flush=True))
    except TetherError as exc:
        print(f"tether worker {config.worker_index}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return FAILED
    return DONE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tether worker``."""
    logging.basicConfig(level=os.environ.get("TETHER_LOG_LEVEL", "WARNING"), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def body() -> int:
        with usage_checks():  # every flag is validated here
            config = load_config(argv)
        # A UsageError from here on is found running (a port in use, a malformed data line).
        return run(config)

    # Ctrl-C (the launcher's too): stop quietly, with the shell's code for SIGINT.
    return run_command("tether worker", body)


if __name__ == "__main__":
    # A worker process ends without the interpreter's teardown (about a second of CPU collecting
    # the torch heap): its record, TensorBoard events and connections are closed by then.
    exit_process(main())
