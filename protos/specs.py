"""Specs of tables and their update rules: the contract's dataclasses and their wire form."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

from tether.protos import tether_pb2 as pb
from tether.protos.optimizers import OPTIMIZERS, OptimizerConfig

# A table's spec names its update rule: the contract's page shows the rules' config and names too
# (they live in tether.protos.optimizers).
__all__ = ["MAX_MIN_COUNT", "OPTIMIZERS", "OptimizerConfig", "TableConfig", "optimizer_conflict", "table_conflict"]

# Admission counts live in 16-bit saturating counters.
MAX_MIN_COUNT = 65535


@dataclass(frozen=True)
class TableConfig:
    """Shape, initialisation and update rule of one embedding table."""

    name: str
    dim: int
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # New rows start uniform in [-init_scale, init_scale]; TrainingConfig.init_scale (--init-scale)
    # takes this default, so a job's rows start the same with or without its own ``tables=``.
    init_scale: float = 0.05
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
