"""``tether worker`` / ``python -m tether.worker``: train one worker of a job."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from tether.common.allocator import tune_malloc
from tether.common.exits import DONE, FAILED, exit_process, run_command, usage_checks
from tether.protos.errors import TetherError
from tether.worker.config import WorkerConfig
from tether.worker.flags import load_config

__all__ = ["main", "run"]

def run(config: WorkerConfig) -> int:
    """Train; exit code ``DONE``, or ``FAILED`` when a shard call failed. The Trainer serves
    ``--metrics-port`` (``TrainingConfig.metrics_port``).

    Raises:
        UsageError: the metrics port is taken, sync mode outside torchrun, a bad data file.
    """
    # The job, with torch, imported here: --help and a bad flag end before it is needed.
    from tether.worker.ctr.job import train
    from tether.worker.training.trainer import print_line

    # Steps free and allocate tensors of MiBs: keep them in the heap (tether.common.allocator);
    # before the data is opened (the Trainer tunes it too, once per process).
    tune_malloc()
    try:
        train(config, printer=print_line)
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
