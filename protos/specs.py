"""Specs of tables and their update rules: the contract's dataclasses and their wire form.

``OptimizerConfig`` (an update rule's hyper-parameters) lives here rather than beside the rules
(``tether.rules.optimizers``) so that a config can be made and checked without the rules' torch
code."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass

from tether.protos import tether_pb2 as pb
from tether.protos.names import INIT_SCALE, OPTIMIZER, OPTIMIZER_LR, check_optimizer
from tether.protos.schedules import Schedule

__all__ = ["MAX_MIN_COUNT", "OptimizerConfig", "TableConfig", "optimizer_conflict", "table_conflict"]

# Admission counts live in 16-bit saturating counters.
MAX_MIN_COUNT = 65535


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of one table's or dense chunk's update rule."""

    name: str = OPTIMIZER
    lr: float = OPTIMIZER_LR
    # Adam's moment decays (torch's defaults).
    beta1: float = 0.9
    beta2: float = 0.999
    # Adagrad's and Adam's denominator term: 1e-8 for both (torch.optim.Adagrad's default is 1e-10).
    eps: float = 1e-8
    # L2 penalty, added to the gradient before the rule (as torch.optim does).
    weight_decay: float = 0.0
    # Adagrad's and row-wise Adagrad's starting sum of squares (torch's initial_accumulator_value),
    # FTRL's starting n (the paper's 0; TensorFlow's Ftrl starts at 0.1).
    initial_accumulator: float = 0.0
    # FTRL-Proximal (tether.rules.ctr_rules): the paper's beta, L1 and L2 (its lambda_1, lambda_2;
    # TensorFlow's l2_regularization_strength is half of l2), and the accumulator's power in the
    # per-coordinate rate (TensorFlow's learning_rate_power; -0.5 is the paper's square root).
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    lr_power: float = -0.5
    # The rate over time, by the pushing worker's clock (tether.protos.schedules; default constant).
    schedule: Schedule = Schedule()

    def __post_init__(self) -> None:
        check_optimizer(self.name)  # ValueError naming the rules there are
        # A checkpoint's JSON gives the schedule as a mapping (an old one gives none).
        object.__setattr__(self, "schedule", Schedule.coerce(self.schedule))
        if not (self.lr > 0 and self.lr < float("inf")):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1:
            raise ValueError(f"betas must be in [0, 1), got ({self.beta1!r}, {self.beta2!r})")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        if self.weight_decay < 0 or self.initial_accumulator < 0:
            raise ValueError(
                f"weight_decay and initial_accumulator must be >= 0, got {self.weight_decay!r}, {self.initial_accumulator!r}"
            )
        self._check_ftrl()

    def _check_ftrl(self) -> None:
        for key in ("beta", "l1", "l2"):
            value = getattr(self, key)
            if not (0 <= value < math.inf):
                raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
        if not (-math.inf < self.lr_power <= 0):
            raise ValueError(f"lr_power must be a finite number <= 0 (TensorFlow's learning_rate_power), got {self.lr_power!r}")
        if self.name == "ftrl" and self.lr_power != 0 and not (self.beta > 0 or self.l2 > 0 or self.initial_accumulator > 0):
            # Else a coordinate whose squared gradients are all 0 in float32 but whose z is not
            # would divide by zero.
            raise ValueError("ftrl needs beta > 0, l2 > 0 or initial_accumulator > 0 (all three are 0)")

    def to_proto(self) -> pb.OptimizerSpec:
        """Wire form."""
        return pb.OptimizerSpec(
            name=self.name, lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
            weight_decay=self.weight_decay, initial_accumulator=self.initial_accumulator,
            schedule=self.schedule.to_proto(), beta=self.beta, l1=self.l1, l2=self.l2, lr_power=self.lr_power,
        )

    @classmethod
    def from_proto(cls, spec: pb.OptimizerSpec) -> OptimizerConfig:
        """Validated config from the wire form (unset fields take the defaults).

        Raises:
            ValueError: a field out of range.
        """
        d = cls()
        return cls(
            name=spec.name or d.name, lr=spec.lr or d.lr, beta1=spec.beta1 or d.beta1, beta2=spec.beta2 or d.beta2,
            eps=spec.eps or d.eps, weight_decay=spec.weight_decay, initial_accumulator=spec.initial_accumulator,
            schedule=Schedule.from_proto(spec.schedule),
            # beta and lr_power are optional on the wire: 0 is a value, unset is the default.
            beta=spec.beta if spec.HasField("beta") else d.beta, l1=spec.l1, l2=spec.l2,
            lr_power=spec.lr_power if spec.HasField("lr_power") else d.lr_power,
        )


@dataclass(frozen=True)
class TableConfig:
    """Shape, initialisation and update rule of one embedding table."""

    name: str
    dim: int
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # New rows start uniform in [-init_scale, init_scale]; TrainingConfig.init_scale (--init-scale)
    # takes this default, so a job's rows start the same with or without its own ``tables=``.
    init_scale: float = INIT_SCALE
    seed: int = 0
    # Most rows one shard keeps (0: unbounded); the least recently touched are evicted.
    capacity: int = 0
    # Touches (pulls or pushes naming the id) before an id becomes a row.
    min_count: int = 1

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 128:
            raise ValueError(f"table name must be 1..128 characters, got {self.name!r}")
        if not 1 <= self.dim <= 65536:
            raise ValueError(f"table {self.name!r}: dim must be in [1, 65536], got {self.dim!r}")
        if not 0 <= self.init_scale < float("inf"):
            raise ValueError(f"table {self.name!r}: init_scale must be finite and >= 0, got {self.init_scale!r}")
        if not 0 <= self.capacity < 2**40:
            raise ValueError(f"table {self.name!r}: capacity must be in [0, 2**40) (0: unbounded), got {self.capacity!r}")
        if not 1 <= self.min_count <= MAX_MIN_COUNT:
            raise ValueError(f"table {self.name!r}: min_count must be in [1, {MAX_MIN_COUNT}], got {self.min_count!r}")

    def to_proto(self) -> pb.TableSpec:
        """Wire form."""
        return pb.TableSpec(
            name=self.name, dim=self.dim, optimizer=self.optimizer.to_proto(), init_scale=self.init_scale, seed=self.seed,
            capacity=self.capacity, min_count=self.min_count,
        )

    @classmethod
    def from_proto(cls, spec: pb.TableSpec) -> TableConfig:
        """Validated config from the wire form.

        Raises:
            ValueError: a field out of range.
        """
        return cls(
            name=spec.name, dim=spec.dim, optimizer=OptimizerConfig.from_proto(spec.optimizer),
            init_scale=spec.init_scale, seed=spec.seed, capacity=spec.capacity, min_count=spec.min_count or 1,
        )


def _differences(have: object, want: object, prefix: str = "") -> list[str]:
    """``field: old != new`` for each field of two dataclasses that differs (nested ones by field)."""
    out = []
    for f in fields(have):  # type: ignore[arg-type]
        a, b = getattr(have, f.name), getattr(want, f.name)
        if a == b:
            continue
        if is_dataclass(a) and is_dataclass(b):
            out += _differences(a, b, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name} {a!r} != {b!r}")
    return out


def optimizer_conflict(what: str, have: OptimizerConfig, want: OptimizerConfig) -> str:
    """One line saying why ``want`` cannot replace ``have``'s rule for ``what`` (a table or a
    dense chunk): both rules named when they differ, else the hyper-parameters that do."""
    if have.name != want.name:
        return (f"{what} exists with rule {have.name}; this declaration asks for {want.name}: one table or chunk keeps one rule "
                "(declare it with the same rule, or under another name)")
    return f"{what} exists with rule {have.name} and other hyper-parameters: {', '.join(_differences(have, want))}"


def table_conflict(have: TableConfig, want: TableConfig) -> str:
    """One line saying how ``want`` differs from the declared ``have`` (``optimizer_conflict``
    when the rule is what differs)."""
    what = f"table {have.name!r}"
    if have.optimizer != want.optimizer:
        return optimizer_conflict(what, have.optimizer, want.optimizer)
    return f"{what} exists with another spec: {', '.join(_differences(have, want))}"
