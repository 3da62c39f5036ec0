"""How a ``WorkerConfig`` reaches a worker process: the ``tether worker`` flags that reproduce it,
or the ``TETHER_*`` environment a user's program reads it from (both made from the config's
declarations, ``tether.common.settings``)."""

from __future__ import annotations

from tether.common import settings as fields
from tether.worker.config import WorkerConfig

__all__ = ["job_env", "worker_argv"]


def worker_argv(cfg: WorkerConfig) -> list[str]:
    """``tether worker`` flags that reproduce ``cfg``. A token from ``$TETHER_AUTH_TOKEN`` is
    never put on a command line: the child inherits the variable."""
    return fields.to_argv(cfg)


def job_env(cfg: WorkerConfig) -> dict[str, str]:
    """The ``TETHER_*`` variables that describe ``cfg`` to a worker (``TrainingConfig.from_env``
    reads them): the variable of each ``tether worker`` flag, ``1`` for a switch."""
    return fields.to_env(cfg)
