"""Specs of tables and update rules: the contract's dataclasses and their wire form."""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.protos import tether_pb2 as pb

__all__ = ["MAX_MIN_COUNT", "OPTIMIZERS", "OptimizerConfig", "TableConfig"]

OPTIMIZERS = ("sgd", "adagrad", "adam")
# Admission counts live in 16-bit saturating counters.
MAX_MIN_COUNT = 65535


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of one table's or dense chunk's update rule."""

    name: str = "adagrad"
    lr: float = 0.05
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.name!r}")
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

    def to_proto(self) -> pb.OptimizerSpec:
        """Wire form."""
        return pb.OptimizerSpec(
            name=self.name, lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
            weight_decay=self.weight_decay, initial_accumulator=self.initial_accumulator,
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
        )


@dataclass(frozen=True)
class TableConfig:
    """Shape, initialisation and update rule of one embedding table."""

    name: str
    dim: int
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    init_scale: float = 0.01
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
