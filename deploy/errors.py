"""How a local job ends badly, as the launcher raises it (``tether launch``, ``compare``, ``sweep``
and ``LocalCluster``): light to import, so a command can name them before it loads the job."""

from __future__ import annotations

__all__ = ["ClusterError", "Interrupted"]


class ClusterError(RuntimeError):
    """A local cluster process failed to start or exited with an error."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGINT) stopped a job; ``stopped`` processes were stopped with it."""

    def __init__(self, stopped: int) -> None:
        super().__init__(f"interrupted; stopped {stopped} process{'' if stopped == 1 else 'es'}")
        self.stopped = stopped
