"""Update rules of the shards: one object per rule, in one registry (``rule(name)``), with the
hyper-parameters they take (``OptimizerConfig``).

A rule is the one home of everything about its optimizer:

- its state: the tensors it keeps per row or per dense element (``state_shapes``) and what a new
  row's state starts at (``initial_state``);
- its torch form (``apply``): the reference maths, on a dense chunk or on any rows. Dense chunks
  on a shard and every row and dense parameter of local mode (``tether.worker.local``) are
  stepped with it;
- its row kernel (``rows``): the same maths written as plain loops for numba, which updates the
  rows a push names in place. The shard compiles it (``tether.server.kernels``, lazily and
  cached on disk; this module never imports numba, so a worker does not pay for it) and applies
  it to its embedding tables;
- its ``torch_optimizer``: the ``torch.optim`` optimizer that takes the same steps, with which a
  sync worker steps its own dense parameters.

Adding a rule is one subclass here and its entry in the registry (plus, for a constant no rule
took before, a field of ``OptimizerConfig`` and of its wire form); ``tests/test_optimizers.py``
checks every registered rule's kernel against its torch form, and its torch form against its
torch optimizer. Nothing else names a rule.

The rules, with ``g`` the gradient plus ``weight_decay * w`` (L2, added to the gradient as
``torch.optim`` does; not AdamW's decoupled decay) and ``lr`` the configured rate times the
push's factor (1, or less for an unusually stale push under ``--staleness-aware``):

- ``sgd``: ``w -= lr * g``. No state, no momentum.
- ``adagrad``: ``sum += g * g``, then ``w -= lr * g / (sqrt(sum) + eps)``: ``eps`` outside the
  square root, as in ``torch.optim.Adagrad``, but ``eps`` defaults to **1e-8** here where torch's
  default is 1e-10 (pass ``eps=1e-8`` to match); ``sum`` starts at ``initial_accumulator``
  (default 0, torch's ``initial_accumulator_value``); no learning-rate decay.
- ``adam``: ``m = beta1 * m + (1 - beta1) * g``, ``v = beta2 * v + (1 - beta2) * g * g``, ``t += 1``,
  then ``w -= lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)``, with ``beta1`` 0.9,
  ``beta2`` 0.999 and ``eps`` 1e-8 by default (torch's defaults; ``eps`` added after the bias
  correction, as torch does; the corrections are taken in float64, as torch takes them);
  ``m`` and ``v`` start at 0. An embedding row keeps its own ``t``: the number of pushes that
  named it, not the table's, so a rare row's first steps get the full bias correction. A dense
  chunk has one ``t``.

The row kernels compute in float32 as the torch form does, but the compiler may fuse a
multiply-add or divide by a reciprocal, so the two forms agree within float rounding (rows six
pushes on within 1e-6 in ``tests/test_optimizers.py``; a local table and a shard's 40 pushes
on within 1e-5 in ``tests/test_local_mode.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tether.protos import tether_pb2 as pb
from tether.protos.schedules import Schedule

__all__ = ["OPTIMIZERS", "Adagrad", "Adam", "OptimizerConfig", "RuleOptimizer", "SGD", "UpdateRule", "rule"]


class UpdateRule:
    """One optimizer as the shards apply it; a subclass fills in its state, its step in torch,
    its row kernel and the constants that kernel takes, and its torch optimizer."""

    name: str = ""

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        """State tensors the rule keeps per row (or for a flat chunk of ``dim`` elements), as
        name -> trailing shape, in the order the row kernel takes them."""
        return {}

    def initial_state(self, cfg: OptimizerConfig) -> dict[str, float]:
        """What each state tensor of a new row starts at (0 where not named)."""
        return {}

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr: float) -> None:
        """Update ``w`` (rows x dim, or a flat chunk) in place from its gradient ``g`` (weight
        decay already added) with learning rate ``lr``; ``state`` is updated in place."""
        raise NotImplementedError

    def kernel_constants(self, cfg: OptimizerConfig) -> tuple[Any, ...]:
        """The constants ``rows`` takes after the state arrays, as numpy scalars (their types
        are part of the compiled signature: float32 unless the maths needs float64)."""
        return (np.float32(cfg.weight_decay),)

    @staticmethod
    def rows(*args: Any, **kwargs: Any) -> None:
        """The row kernel, in the Python subset numba compiles (never called uncompiled):
        ``rows(w, slots, g, lr, scratch, *state, *constants)`` updates rows ``slots[i]`` of ``w``
        (float32, rows x dim) and of each state array (in ``state_shapes`` order, the rows
        first) in place from ``g[i]`` with learning rate ``lr[i]`` (float32 per row), the
        weight decay included; ``slots`` are unique; ``scratch`` holds ``dim`` float32s to
        spare; ``constants`` are ``kernel_constants(cfg)``.

        Each row's arithmetic runs as separate simple loops over its ``dim`` elements, so that
        LLVM can vectorise them (one loop that writes the weights and the state together is not
        vectorised: it cannot tell that they do not overlap).
        """
        raise NotImplementedError

    def torch_optimizer(self, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        """The torch optimizer that matches the shard's rule: a ``torch.optim`` optimizer over
        ``params`` built with every constant of ``cfg`` (``eps`` included, which is not torch's
        default for Adagrad), whose steps equal ``apply``'s within float rounding. Sync mode
        steps its dense parameters with it. A rule that ``torch.optim`` lacks keeps this
        default: ``RuleOptimizer``, which steps each parameter with ``apply``."""
        return RuleOptimizer(self, cfg, params)

    def apply(
        self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr_scale: float = 1.0
    ) -> None:
        """Apply one update in place: the rule's torch form.

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
    """Plain SGD: ``w -= lr * g``; no state (``torch.optim.SGD`` without momentum)."""

    name = "sgd"

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr: float) -> None:
        w.add_(g, alpha=-lr)

    @staticmethod
    def rows(w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, scratch: np.ndarray, weight_decay: np.float32) -> None:
        n, d = g.shape
        for i in range(n):
            row, grad, step = w[slots[i]], g[i], lr[i]
            if weight_decay != 0:
                for j in range(d):
                    row[j] -= step * (grad[j] + weight_decay * row[j])
            else:
                for j in range(d):
                    row[j] -= step * grad[j]

    def torch_optimizer(self, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


class Adagrad(UpdateRule):
    """Adagrad: a running sum of squared gradients per element, starting at
    ``initial_accumulator``; ``w -= lr * g / (sqrt(sum) + eps)`` (``eps`` outside the sqrt, like
    ``torch.optim.Adagrad``, default 1e-8 where torch's is 1e-10)."""

    name = "adagrad"

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"sum": (dim,)}

    def initial_state(self, cfg: OptimizerConfig) -> dict[str, float]:
        return {"sum": cfg.initial_accumulator}

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr: float) -> None:
        acc = state["sum"]
        acc.addcmul_(g, g)
        w.addcdiv_(g, acc.sqrt().add_(cfg.eps), value=-lr)

    def kernel_constants(self, cfg: OptimizerConfig) -> tuple[Any, ...]:
        return (np.float32(cfg.weight_decay), np.float32(cfg.eps))

    @staticmethod
    def rows(
        w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, scratch: np.ndarray, acc: np.ndarray,
        weight_decay: np.float32, eps: np.float32,
    ) -> None:
        n, d = g.shape
        for i in range(n):
            s = slots[i]
            row, state, step = w[s], acc[s], lr[i]
            for j in range(d):
                scratch[j] = g[i, j] + weight_decay * row[j]
            for j in range(d):
                state[j] += scratch[j] * scratch[j]
            for j in range(d):
                row[j] -= step * scratch[j] / (np.sqrt(state[j]) + eps)

    def torch_optimizer(self, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(
            params, lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay, initial_accumulator_value=cfg.initial_accumulator
        )


class Adam(UpdateRule):
    """Adam: first and second moments per element (from 0), and a step count per row (one scalar
    for a dense chunk); bias-corrected, ``eps`` (1e-8) added to the corrected ``sqrt(v)``, betas
    (0.9, 0.999) by default: ``torch.optim.Adam``'s constants."""

    name = "adam"

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"m": (dim,), "v": (dim,), "t": ()}

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr: float) -> None:
        m, v, t = state["m"], state["v"], state["t"]
        t.add_(1)
        m.mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
        v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        tt = (t.unsqueeze(-1) if w.dim() > 1 else t).double()
        # The bias corrections in float64, as torch.optim.Adam takes them (Python floats): in
        # float32, 1 - 0.999**t loses digits to cancellation (1.3e-5 relative at t = 1) while the
        # moments' 1 - beta2 does not, and v / bc2 is then off by that much.
        bc1 = (1 - torch.pow(cfg.beta1, tt)).float()
        bc2 = (1 - torch.pow(cfg.beta2, tt)).float()
        denom = (v / bc2).sqrt_().add_(cfg.eps)
        w.addcdiv_(m / bc1, denom, value=-lr)

    def kernel_constants(self, cfg: OptimizerConfig) -> tuple[Any, ...]:
        # The betas in float64: the bias corrections are taken in float64 as in ``step``.
        return (np.float32(cfg.weight_decay), np.float64(cfg.beta1), np.float64(cfg.beta2), np.float32(cfg.eps))

    @staticmethod
    def rows(
        w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, scratch: np.ndarray, m: np.ndarray, v: np.ndarray,
        t: np.ndarray, weight_decay: np.float32, beta1: np.float64, beta2: np.float64, eps: np.float32,
    ) -> None:
        # The moments' factors in float32, each taken from the float64 constant as torch takes
        # a Python float. The bias corrections 1 - beta**t in float64 as -expm1(t * log(beta)):
        # as fast as float32 pow (float64 pow cost a quarter more per push), and rounded to
        # float32 they equal 1 - beta**t for every t up to 1e9 tried, for betas from 0 to 0.9999.
        b1, c1, log1 = np.float32(beta1), np.float32(1.0 - beta1), np.log(beta1)
        b2, c2, log2 = np.float32(beta2), np.float32(1.0 - beta2), np.log(beta2)
        n, d = g.shape
        for i in range(n):
            s = slots[i]
            row, mr, vr, step = w[s], m[s], v[s], lr[i]
            t[s] += 1
            bc1 = np.float32(-np.expm1(np.float64(t[s]) * log1))
            bc2 = np.float32(-np.expm1(np.float64(t[s]) * log2))
            for j in range(d):
                scratch[j] = g[i, j] + weight_decay * row[j]
            for j in range(d):
                mr[j] = b1 * mr[j] + c1 * scratch[j]
            for j in range(d):
                vr[j] = b2 * vr[j] + c2 * scratch[j] * scratch[j]
            for j in range(d):
                row[j] -= step * (mr[j] / bc1) / (np.sqrt(vr[j] / bc2) + eps)

    def torch_optimizer(self, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


class RuleOptimizer(torch.optim.Optimizer):
    """A ``torch.optim`` optimizer that steps each parameter, flattened, with a rule's torch form
    (``apply``) as a shard steps a dense chunk; its state per parameter is the rule's, on the
    parameter's device. A group's ``lr`` scales the step by ``lr / cfg.lr``, so learning-rate
    schedulers work on it."""

    def __init__(self, update_rule: UpdateRule, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> None:
        super().__init__(params, {"lr": cfg.lr})
        self.update_rule, self.cfg = update_rule, cfg

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # torch.optim's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    initial = self.update_rule.initial_state(self.cfg)
                    for k, shape in self.update_rule.state_shapes(p.numel()).items():
                        state[k] = torch.full(shape, initial.get(k, 0.0), dtype=p.dtype, device=p.device)
                contiguous = p.is_contiguous()
                flat = p.view(-1) if contiguous else p.reshape(-1).clone()
                self.update_rule.apply(self.cfg, flat, p.grad.reshape(-1), state, group["lr"] / self.cfg.lr)
                if not contiguous:
                    p.copy_(flat.view(p.shape))
        return loss


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
    # Adam's moment decays (torch's defaults).
    beta1: float = 0.9
    beta2: float = 0.999
    # Adagrad's and Adam's denominator term: 1e-8 for both (torch.optim.Adagrad's default is 1e-10).
    eps: float = 1e-8
    # L2 penalty, added to the gradient before the rule (as torch.optim does).
    weight_decay: float = 0.0
    # Adagrad's starting sum of squares (torch's initial_accumulator_value).
    initial_accumulator: float = 0.0
    # The rate over time, by the pushing worker's clock (tether.protos.schedules; default constant).
    schedule: Schedule = Schedule()

    def __post_init__(self) -> None:
        rule(self.name)  # ValueError naming the rules there are
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

    def to_proto(self) -> pb.OptimizerSpec:
        """Wire form."""
        return pb.OptimizerSpec(
            name=self.name, lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
            weight_decay=self.weight_decay, initial_accumulator=self.initial_accumulator,
            schedule=self.schedule.to_proto(),
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
        )
