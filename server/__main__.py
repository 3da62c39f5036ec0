"""``tether server`` / ``python -m tether.server``: run one shard until SIGTERM or Ctrl-C."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from tether.common.allocator import tune_malloc
from tether.common.exits import DONE, FAILED, exit_process, run_command, usage_checks
from tether.common.metrics_http import serve_metrics
from tether.protos.errors import TetherError, UsageError
from tether.rules import row_kernels
from tether.server.config import ShardConfig, load_config
from tether.server.metrics import NullShardMetrics, ShardMetrics, ShardRecorder
from tether.server.serving.serve import start_shard

__all__ = ["main", "run"]

log = logging.getLogger("tether.server")


def _write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _warm_up_kernels() -> None:
    try:
        seconds = row_kernels.warm_up_shard()
    except Exception:  # a request then compiles what it needs, and fails with the same error if it must
        log.exception("compiled kernels could not be loaded or compiled in advance")
        return
    log.info("compiled kernels ready in %.2fs", seconds)


def run(config: ShardConfig) -> int:
    """Serve until SIGTERM/SIGINT, then drain; the exit code (``tether.common.exits``).

    Raises:
        UsageError: the metrics port is taken.
    """
    # Steps free and allocate tensors of MiBs: keep them in the heap (tether.common.allocator).
    tune_malloc()
    # Load the shard's compiled loops from the on-disk cache (or compile them, the first time on
    # this machine) while the shard starts: a request that needs one before then waits for it.
    # A table's rule is loaded when the table is made (row_kernels.load_rule_in_background).
    threading.Thread(target=_warm_up_kernels, name="tether-kernels", daemon=True).start()
    metrics: ShardRecorder = NullShardMetrics()
    if config.metrics_port is not None:
        registry = CollectorRegistry()
        metrics = ShardMetrics(registry)
        try:
            _, mport = serve_metrics(registry, config.metrics_port, host=config.host)
        except OSError as exc:
            raise UsageError(f"--metrics-port {config.metrics_port}: {exc.strerror or exc}") from None
        log.info("metrics on http://%s:%d/metrics", config.host, mport)
    try:
        running = start_shard(config, metrics=metrics)
    except (RuntimeError, ValueError) as exc:
        log.error("shard %d cannot start: %s", config.shard_index, exc)
        return FAILED
    metrics.set_serving(True)
    log.info(
        "shard %d/%d serving on %s:%d (%s%s), data plane %s", config.shard_index, config.num_shards, config.host, running.port,
        "mutual TLS" if config.tls_client_ca else "TLS" if config.tls else "plaintext",
        ", bearer token required" if config.auth_token else "",
        f"on port {running.data_port}" if running.data_port else "off",
    )
    if config.port_file:
        _write_port_file(config.port_file, running.port)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, draining for up to %.1fs", signal.Signals(signum).name, config.grace_seconds)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    stop.wait()
    metrics.set_serving(False)
    try:
        final = running.shutdown(config.grace_seconds)
    except TetherError as exc:
        log.error("shard %d stopped, but its final checkpoint failed: %s", config.shard_index, exc)
        return FAILED
    if final is not None:
        log.info("final checkpoint %s written (%d bytes in %.2fs)", final.id, final.bytes, final.seconds)
    log.info("shard %d stopped", config.shard_index)
    return DONE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tether server``. Ctrl-C before the signal handlers are installed exits
    ``INTERRUPTED`` (after, it drains and exits 0)."""
    logging.basicConfig(level=os.environ.get("TETHER_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def body() -> int:
        with usage_checks():  # every flag is validated here
            config = load_config(argv)
        return run(config)

    return run_command("tether server", body)


if __name__ == "__main__":
    # A shard started as a process (as tether launch starts them) ends without the interpreter's
    # teardown: its final checkpoint is written and its ports closed by then.
    exit_process(main())
