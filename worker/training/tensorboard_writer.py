"""Training curves for TensorBoard: one worker's scalars per logged step (``--tensorboard DIR``).

The ``tensorboard`` package is an optional extra (``pip install 'tether[tensorboard]'``); the
writer is torch's ``torch.utils.tensorboard.SummaryWriter``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tether.protos.errors import UsageError
from tether.worker.training.run_record import POINT_KEYS

__all__ = ["MISSING", "RECORD_KEYS", "TensorBoardRecorder", "require_tensorboard", "tensorboard_available"]

# Keys of a ``Trainer.fit`` history point that are not held-out metrics (``evaluate``'s must not reuse them): ``Point``'s fields.
RECORD_KEYS = POINT_KEYS

MISSING = "--tensorboard needs the tensorboard package: pip install 'tether[tensorboard]'"


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package can be imported (looked up, not imported)."""
    return importlib.util.find_spec("tensorboard") is not None


def require_tensorboard() -> None:
    """Raises:
    UsageError: the ``tensorboard`` package is not installed (one line saying how to get it).
    """
    if not tensorboard_available():
        raise UsageError(MISSING)


class TensorBoardRecorder:
    """Writes a worker's progress records as TensorBoard scalars under ``log_dir``.

    Tags: ``train/loss`` (mean over the steps since the last record), ``train/samples_per_sec``
    (over the same steps), ``staleness/clock`` (clock staleness of the last acknowledged push),
    ``staleness/clock_mean`` and ``staleness/clock_max`` (over the pushes since the last record,
    when the record has them) and ``eval/<name>`` for every ``eval_<name>`` metric of the record
    (the step-0 record of the initial model has only these); the x axis is the step.

    Raises:
        UsageError: the ``tensorboard`` package is missing.
    """

    def __init__(self, log_dir: str | Path, flush_secs: int = 10) -> None:
        require_tensorboard()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # installed but unusable (a version torch does not take)
            raise UsageError(f"{MISSING} ({exc})") from None
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)
        self._samples = 0
        self._wall = 0.0

    def write(self, record: Mapping[str, Any], clock_staleness: int | None = None) -> None:
        """One logged step: ``record`` is a history entry of ``Trainer.fit`` (``step``,
        ``samples``, ``wall_s``, ``train_loss``, maybe ``staleness_mean``/``staleness_max`` and
        the held-out metrics)."""
        step = int(record["step"])
        samples, wall = int(record.get("samples", 0)), float(record.get("wall_s", 0.0))
        w = self._writer
        if "train_loss" in record:
            w.add_scalar("train/loss", float(record["train_loss"]), step)
        if wall > self._wall:
            w.add_scalar("train/samples_per_sec", (samples - self._samples) / (wall - self._wall), step)
            self._samples, self._wall = samples, wall
        if clock_staleness is not None:
            w.add_scalar("staleness/clock", clock_staleness, step)
        for key, tag in (("staleness_mean", "staleness/clock_mean"), ("staleness_max", "staleness/clock_max")):
            if isinstance(record.get(key), (int, float)):
                w.add_scalar(tag, float(record[key]), step)
        for key, value in record.items():
            # Every other number is a held-out metric, under the name the user's evaluate gave it.
            if key not in RECORD_KEYS and isinstance(value, (int, float)):
                w.add_scalar(f"eval/{key.removeprefix('eval_')}", float(value), step)

    def flush(self) -> None:
        """Write what is buffered to disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
