"""Learning-rate schedules the shards follow by the worker's clock, as the contract states them:
the maths of a rate at a step in one place, used by the shard (``tether.server.storage.shard``), local
mode (``tether.worker.client.local``) and sync's worker-side dense optimizer
(``tether.rules.update_rules.follow_schedule``).

A schedule is part of an update rule's hyper-parameters (``OptimizerConfig.schedule``): the
rate of the push a worker sends after step ``k`` (0-based; the push carries clock ``k + 1``) is
``lr_at(lr, k)``, in every mode. Its shape, with ``W = warmup_steps``:

- warm-up: for ``k < W``, ``lr * (f + (1 - f) * k / W)`` with ``f = warmup_factor`` (linear from
  ``f * lr`` to ``lr``; ``torch.optim.lr_scheduler.LinearLR(start_factor=f, total_iters=W)``);
- then, with ``j = k - W`` (the steps since the warm-up ended), the decay:

  - ``constant``: ``lr``;
  - ``step``: ``lr * gamma ** (j // decay_steps)`` (``StepLR(step_size=decay_steps, gamma)``);
  - ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * j / decay_steps)) / 2`` for
    ``j <= decay_steps``, then ``min_lr`` (``CosineAnnealingLR(T_max=decay_steps, eta_min=min_lr)``,
    which would rise again after ``T_max``: here the floor holds).

A warm-up followed by a decay is ``SequentialLR([LinearLR, decay], milestones=[W])``. A push
without a clock (0: a client outside a training loop) takes step 0's rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tether.protos import tether_pb2 as pb

__all__ = ["DECAYS", "SCHEDULE_KEYS", "Schedule", "step_of_clock"]

# The decays after the warm-up.
DECAYS: tuple[str, ...] = ("constant", "step", "cosine")


def step_of_clock(clock: int) -> int:
    """The 0-based step whose push carries ``clock`` (the worker's clock once the step is done;
    0, no clock, is step 0)."""
    return max(int(clock) - 1, 0)


@dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule: a linear warm-up, then a constant rate, step decay or cosine
    decay (the module's docstring has the formulas). The default is a constant rate."""

    # Steps of linear warm-up (0: none), starting at warmup_factor * lr (LinearLR's start_factor default).
    warmup_steps: int = 0
    warmup_factor: float = 1.0 / 3.0
    # What follows the warm-up: "constant", "step" or "cosine".
    decay: str = "constant"
    # step: decay every decay_steps steps; cosine: reach min_lr after decay_steps steps.
    decay_steps: int = 0
    # step: the factor at each decay (StepLR's default).
    gamma: float = 0.1
    # cosine: the floor (an absolute rate, CosineAnnealingLR's eta_min).
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not 0 < self.warmup_factor <= 1:
            raise ValueError(f"warmup_factor must be in (0, 1], got {self.warmup_factor!r}")
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {', '.join(DECAYS)}, got {self.decay!r}")
        if not isinstance(self.decay_steps, int) or self.decay_steps < 0:
            raise ValueError(f"decay_steps must be an integer >= 0, got {self.decay_steps!r}")
        if self.decay != "constant" and self.decay_steps < 1:
            raise ValueError(f"decay={self.decay} needs decay_steps >= 1, got {self.decay_steps!r}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma!r}")
        if not 0 <= self.min_lr < math.inf:
            raise ValueError(f"min_lr must be a finite number >= 0, got {self.min_lr!r}")

    @property
    def constant(self) -> bool:
        """Whether the rate never changes (no warm-up, no decay)."""
        return self.warmup_steps == 0 and self.decay == "constant"

    def lr_at(self, lr: float, step: int) -> float:
        """The rate of 0-based step ``step`` for a base rate ``lr``."""
        w = self.warmup_steps
        if step < w:
            return lr * (self.warmup_factor + (1.0 - self.warmup_factor) * step / w)
        j = step - w
        if self.decay == "step":
            return lr * self.gamma ** (j // self.decay_steps)
        if self.decay == "cosine":
            if j >= self.decay_steps:
                return self.min_lr
            return self.min_lr + (lr - self.min_lr) * (1.0 + math.cos(math.pi * j / self.decay_steps)) / 2.0
        return lr

    def factor(self, lr: float, clock: int) -> float:
        """The multiplier on ``lr`` for a push carrying ``clock`` (1.0 for a constant rate)."""
        return 1.0 if self.constant else self.lr_at(lr, step_of_clock(clock)) / lr

    def to_proto(self) -> pb.LRSchedule:
        """Wire form."""
        return pb.LRSchedule(
            warmup_steps=self.warmup_steps, warmup_factor=self.warmup_factor, decay=self.decay, decay_steps=self.decay_steps,
            gamma=self.gamma, min_lr=self.min_lr,
        )

    @classmethod
    def from_proto(cls, spec: pb.LRSchedule) -> Schedule:
        """Validated schedule from the wire form (unset fields take the defaults: an old
        client's spec, which has none, is a constant rate).

        Raises:
            ValueError: a field out of range.
        """
        d = cls()
        return cls(
            warmup_steps=spec.warmup_steps, warmup_factor=spec.warmup_factor or d.warmup_factor, decay=spec.decay or d.decay,
            decay_steps=spec.decay_steps, gamma=spec.gamma or d.gamma, min_lr=spec.min_lr,
        )

    @classmethod
    def coerce(cls, value: Schedule | Mapping[str, Any] | None) -> Schedule:
        """A schedule from itself, a mapping of its fields (a checkpoint's JSON) or None.

        Raises:
            ValueError: an unknown field, or one out of range.
        """
        if value is None:
            return cls()
        if isinstance(value, Schedule):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(SCHEDULE_KEYS))
            if unknown:
                raise ValueError(f"unknown schedule key {unknown[0]!r} (keys: {', '.join(SCHEDULE_KEYS)})")
            return cls(**value)
        raise ValueError(f"schedule must be a Schedule or a mapping, got {type(value).__name__}")


# The fields a schedule takes, as ``--table-optimizer`` and config files name them.
SCHEDULE_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Schedule))
