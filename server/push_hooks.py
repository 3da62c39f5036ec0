"""What a push's update adds to the rule's step on a shard: the learning-rate schedule by the
worker's clock and DC-ASGD's delay compensation (the maths is ``tether.protos.schedules``'s;
local mode applies the same). ``tether.server.shard`` calls ``adjusted`` per block, after the
whole push was checked (``check_read``) and just before the table's or chunk's update."""

from __future__ import annotations

import math

import numpy as np
import torch

from tether.protos.errors import InvalidArgument
from tether.protos.optimizers import OptimizerConfig
from tether.protos.schedules import delay_compensated

__all__ = ["adjusted", "check_compensation", "check_read"]


def check_compensation(worker_id: str, lam: float) -> None:
    """A push's ``delay_compensation`` is a finite number >= 0.

    Raises:
        InvalidArgument: anything else.
    """
    if not (lam >= 0 and math.isfinite(lam)):
        raise InvalidArgument(f"push from {worker_id!r}: delay_compensation must be a finite number >= 0, got {lam!r}")


def check_read(what: str, read: torch.Tensor | None, grad: torch.Tensor) -> None:
    """The values a block was read at (DC-ASGD's ``w_read``) match its gradient and are finite.

    Raises:
        InvalidArgument: another shape, not floating point, or NaN/Inf.
    """
    if read is None:
        return
    if tuple(read.shape) != tuple(grad.shape):
        raise InvalidArgument(f"{what}: read values of shape {tuple(read.shape)} do not match the gradient's {tuple(grad.shape)}")
    if not read.is_floating_point() or not bool(torch.isfinite(read).all()):
        raise InvalidArgument(f"{what}: read values must be finite floats")


def adjusted(
    target: object, optimizer: OptimizerConfig, ids: np.ndarray | None, grad: torch.Tensor, read: torch.Tensor | None,
    scale: float | np.ndarray, clock: int, lam: float,
) -> tuple[torch.Tensor, float | np.ndarray]:
    """The gradient and learning-rate factor one block's update takes: ``scale`` times the
    schedule's factor at ``clock``; with ``lam`` > 0 and the values the worker read, the
    gradient compensated against the values now held (``target.pull(ids)`` for a table's rows,
    ``target.value`` for a dense chunk)."""
    factor = optimizer.schedule.factor(optimizer.lr, clock)
    if factor != 1.0:
        scale = scale * factor
    if lam > 0 and read is not None and grad.numel():
        now = target.pull(ids)[0] if ids is not None else target.value  # type: ignore[attr-defined]
        grad = delay_compensated(grad.to(torch.float32), now, read.to(torch.float32), lam)
    return grad, scale
