"""The update rules' base class (``UpdateRule``), the torch optimizer that steps parameters with
any rule (``RuleOptimizer``), and the three rules with a ``torch.optim`` twin: SGD, Adagrad and
Adam. The registry, the hyper-parameters and what each rule computes are described in
``tether.protos.optimizers``; the rules CTR models add (row-wise Adagrad, FTRL-Proximal) are in
``tether.protos.ctr_rules``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from tether.protos.optimizers import OptimizerConfig

__all__ = ["Adagrad", "Adam", "RuleOptimizer", "SGD", "UpdateRule"]


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

    def dense_rule(self) -> UpdateRule:
        """The rule that steps dense values (a shard's dense chunk, a flat parameter: no rows)
        when this one is named for them: the rule itself, except for a rule defined on
        embedding rows only, which names its per-element form (``rowwise_adagrad``: ``adagrad``)."""
        return self

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
        # A rule defined on rows only steps dense values with its dense form.
        self.update_rule, self.cfg = update_rule.dense_rule(), cfg

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
