"""Update rules of the shards: one rule object per optimizer (its state, the state of a new row,
its step, and the torch optimizer that matches it), in one registry, with the hyper-parameters
they take (``OptimizerConfig``).

A shard's tables and dense chunks apply the rule their config names (``rule(cfg.name)``); a sync
worker steps its own dense parameters with the rule's torch equivalent. Each step updates a
block of parameters in place from its gradient: for embedding tables the gathered rows of one
push (the table scatters them back), for dense chunks the chunk itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tether.protos import tether_pb2 as pb

__all__ = ["OPTIMIZERS", "Adagrad", "Adam", "OptimizerConfig", "SGD", "UpdateRule", "rule"]


class UpdateRule:
    """One optimizer as the shards apply it; subclasses fill in the state and the step."""

    name: str = ""

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        """State tensors the rule keeps per row (or for a flat chunk of ``dim`` elements), as
        name -> trailing shape."""
        return {}

    def initial_state(self, cfg: OptimizerConfig) -> dict[str, float]:
        """What each state tensor of a new row starts at (0 where not named)."""
        return {}

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr: float) -> None:
        """Update ``w`` (rows x dim, or a flat chunk) in place from its gradient ``g`` (weight
        decay already added) with learning rate ``lr``; ``state`` is updated in place."""
        raise NotImplementedError

    def torch_optimizer(self, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer that takes the same steps on ``params``."""
        raise NotImplementedError

    def apply(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr_scale: float = 1.0) -> None:
        """Apply one update in place.

        Args:
            cfg: the hyper-parameters.
            w: parameters, updated in place (rows x dim, or a flat chunk).
            g: gradient, same shape as ``w``.
            state: the rule's state for these parameters, updated in place; Adam's ``t`` holds
                one step count per row (a scalar for a dense chunk).
            lr_scale: multiplier on the learning rate (staleness-aware learning rates).
        """
        if cfg.weight_decay:
            g = g + cfg.weight_decay * w
        self.step(cfg, w, g, state, cfg.lr * lr_scale)


class SGD(UpdateRule):
    """Plain SGD: no state."""

    name = "sgd"

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr: float) -> None:
        w.add_(g, alpha=-lr)

    def torch_optimizer(self, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


class Adagrad(UpdateRule):
    """Adagrad: a running sum of squared gradients per element (``eps`` outside the sqrt, like
    ``torch.optim.Adagrad``)."""

    name = "adagrad"

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"sum": (dim,)}

    def initial_state(self, cfg: OptimizerConfig) -> dict[str, float]:
        return {"sum": cfg.initial_accumulator}

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr: float) -> None:
        acc = state["sum"]
        acc.addcmul_(g, g)
        w.addcdiv_(g, acc.sqrt().add_(cfg.eps), value=-lr)

    def torch_optimizer(self, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(
            params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay, initial_accumulator_value=cfg.initial_accumulator
        )


class Adam(UpdateRule):
    """Adam: first and second moments per element, and a step count per row (one scalar for a
    dense chunk)."""

    name = "adam"

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"m": (dim,), "v": (dim,), "t": ()}

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr: float) -> None:
        m, v, t = state["m"], state["v"], state["t"]
        t.add_(1)
        m.mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
        v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        tt = t.unsqueeze(-1) if w.dim() > 1 else t
        bc1 = 1 - torch.pow(cfg.beta1, tt)
        bc2 = 1 - torch.pow(cfg.beta2, tt)
        denom = (v / bc2).sqrt_().add_(cfg.eps)
        w.addcdiv_(m / bc1, denom, value=-lr)

    def torch_optimizer(self, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


_RULES: dict[str, UpdateRule] = {r.name: r for r in (SGD(), Adagrad(), Adam())}
# The names ``OptimizerConfig.name`` (and ``--optimizer``) may take.
OPTIMIZERS: tuple[str, ...] = tuple(_RULES)


def rule(name: str) -> UpdateRule:
    """The update rule called ``name``.

    Raises:
        ValueError: no rule has that name.
    """
    try:
        return _RULES[name]
    except KeyError:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}") from None


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
        rule(self.name)  # ValueError naming the rules there are
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
