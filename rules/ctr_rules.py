"""The update rules of large CTR models: row-wise Adagrad and FTRL-Proximal. Like every rule (see
``tether.rules.optimizers``, which registers them), each holds its state layout, its torch form
and its numba row kernel; they have no ``torch.optim`` twin.

``rowwise_adagrad`` (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, TorchRec's default for large tables;
PERSIA's ``vectorwise_shared``): one accumulator per embedding row instead of one per element,
so its state costs 1 float per row, not ``dim``. With ``g`` a row's gradient (weight decay
added) and ``dim`` its width::

    sum += mean(g * g)             # over the row's dim elements
    w   -= lr * g / (sqrt(sum) + eps)

``sum`` starts at ``initial_accumulator`` (default 0, as FBGEMM's momentum starts) and ``eps``
defaults to 1e-8 (FBGEMM's and TorchRec's default). **Duplicate ids**: FBGEMM sorts a batch's
ids, sums the gradients of each id and applies the rule once per id (so ``sum`` grows by
``mean((g1 + g2)**2)``, not by ``mean(g1**2) + mean(g2**2)``). Tether does the same: a shard
refuses a push that names an id twice (``InvalidArgument``), and a worker pulls each batch's
unique ids, so autograd sums the gradients of every lookup of an id into its one row, which is
pushed and stepped once (``tests/test_update_rules.py`` checks both). **Dense parameters** have
no rows (a shard holds them as flat chunks of a concatenated vector, so a parameter's rows are
not visible there): ``rowwise_adagrad`` steps them with its per-element form, which is Adagrad
(each element a row of one: ``mean(g * g)`` over one element is ``g * g``), as TorchRec's
``RowWiseAdagrad`` steps 1-D parameters. ``dense_rule()`` names it; a flat value passed to the
row form is refused with a ``ValueError``.

``ftrl`` (FTRL-Proximal, McMahan et al. 2013, "Ad Click Prediction: a View from the Trenches",
Algorithm 1, per coordinate, with ``alpha`` = ``lr``)::

    n_new = n + g * g
    sigma = (n_new**(-lr_power) - n**(-lr_power)) / lr      # (sqrt(n_new) - sqrt(n)) / alpha
    z    += g - sigma * w
    n     = n_new
    w     = 0                                                if |z| <= l1
          = -(z - sign(z) * l1) / ((beta + n**(-lr_power)) / lr + l2)   otherwise

State ``z`` and ``n`` per element (2 floats per element: 3x a row's bytes with its values).
Defaults: ``beta`` 1 (the paper: "beta = 1 is usually good enough"), ``initial_accumulator`` 0
(``n`` starts at 0 in Algorithm 1), ``l1`` 0 and ``l2`` 0 and ``lr_power`` -0.5 (the paper's
square root) as ``tf.keras.optimizers.Ftrl`` (``learning_rate_power=-0.5``,
``l1_regularization_strength=0.0``, ``l2_regularization_strength=0.0``). TensorFlow's other
defaults differ: ``initial_accumulator_value=0.1`` and ``beta=0.0``; and its update adds
``2 * l2_regularization_strength`` to the denominator, so its ``l2`` is half the paper's: for
TensorFlow's steps pass ``initial_accumulator=0.1, beta=0, l2=2 * tf_l2``. ``l2`` is the paper's
per-coordinate proximal term, not ``weight_decay`` (which, as for every rule, is added to the
gradient first). A weight is stored after each step (a pull reads it, never recomputes it from
``z`` and ``n``), and a new row starts at the table's initial value as a TensorFlow variable
does (``init_scale=0`` gives the paper's ``w = 0``); from its first step on, ``w`` is the
function of ``z`` and ``n`` above. With ``lr_power`` -0.5, ``sqrt(n_new) - sqrt(n)`` is taken as
``g * g / (sqrt(n_new) + sqrt(n))``: the same number without float32's cancellation. The
learning rate of the push (a staleness factor or a schedule) is used in both ``sigma`` and the
denominator, as TensorFlow uses its current rate; a push at rate 0 (a cosine schedule's default
floor) takes no step: weights, ``z`` and ``n`` stay as they are (both divide by the rate).
``dense_rule()`` is the rule itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from tether.rules.kernel_helpers import decayed, kernel_helper, spread_row
from tether.rules.update_rules import Adagrad, UpdateRule, spread_squares

if TYPE_CHECKING:
    from tether.protos.specs import OptimizerConfig

__all__ = ["Ftrl", "RowwiseAdagrad"]

_ADAGRAD = Adagrad()


class RowwiseAdagrad(UpdateRule):
    """Row-wise Adagrad: one accumulator per row, ``sum += mean(g * g)``, then
    ``w -= lr * g / (sqrt(sum) + eps)`` (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``); dense values are
    stepped with Adagrad, its per-element form (see the module doc)."""

    name = "rowwise_adagrad"

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"sum": ()}

    def initial_state(self, cfg: OptimizerConfig) -> dict[str, float]:
        return {"sum": cfg.initial_accumulator}

    def dense_rule(self) -> UpdateRule:
        return _ADAGRAD

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr: float) -> None:
        if w.dim() != 2:
            raise ValueError(
                f"rowwise_adagrad steps embedding rows (rows x dim), got a value of shape {tuple(w.shape)}: "
                "step dense values with its dense form, rule('rowwise_adagrad').dense_rule() (adagrad)"
            )
        acc = state["sum"]
        acc.add_(g.square().mean(dim=1))
        w.addcdiv_(g, acc.sqrt().add_(cfg.eps).unsqueeze(1), value=-lr)

    combined_stats = ("square_sum",)

    def combine(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, stats: torch.Tensor, state: Mapping[str, torch.Tensor],
                lr: float) -> None:
        """k gradients summed into ``g``: ``sum`` grows by their ``square_sum`` (exactly what the k
        steps add), and the step is ``lr * g * 2 / (sqrt(sum_before) + sqrt(sum_after) + eps)``
        (Adagrad's: the k steps with the accumulator rising evenly, summed as an integral)."""
        acc = state["sum"]
        before = acc.sqrt()
        acc.add_(stats[:, 0].to(acc.dtype))
        w.addcdiv_(g, before.add_(acc.sqrt()).add_(cfg.eps).unsqueeze(1), value=-2.0 * lr)

    @staticmethod
    def combined_rows(
        w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, stats: np.ndarray, scratch: np.ndarray, acc: np.ndarray,
        weight_decay: np.float32, eps: np.float32,
    ) -> None:
        # ``combine`` row by row: the row's accumulator grows by its ``square_sum``; a row of one
        # gradient takes ``rows``' step.
        n, d = g.shape
        for i in range(n):
            s = slots[i]
            decayed(scratch, g, i, w, s, weight_decay)
            if stats[i, 0] == -1:
                rowwise_adagrad_row(w, acc, s, scratch, lr[i], eps)
                continue
            row = w[s]
            before = np.sqrt(acc[s])
            acc[s] += np.float32(stats[i, 0])
            denom = before + np.sqrt(acc[s]) + eps
            value = np.float32(-2.0) * lr[i]
            for j in range(d):
                row[j] += value * (scratch[j] / denom)

    kernel_constants = _ADAGRAD.kernel_constants  # (weight_decay, eps), as Adagrad's

    @staticmethod
    def rows(
        w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, scratch: np.ndarray, acc: np.ndarray,
        weight_decay: np.float32, eps: np.float32,
    ) -> None:
        for i in range(len(slots)):
            s = slots[i]
            decayed(scratch, g, i, w, s, weight_decay)
            rowwise_adagrad_row(w, acc, s, scratch, lr[i], eps)

    def torch_optimizer(self, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        return _ADAGRAD.torch_optimizer(cfg, params)


class Ftrl(UpdateRule):
    """FTRL-Proximal (McMahan et al. 2013, Algorithm 1) per element, with ``beta``, ``l1``, ``l2``
    and ``lr_power`` (see the module doc); state ``z`` and ``n`` per element."""

    name = "ftrl"

    def state_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        return {"z": (dim,), "n": (dim,)}

    def initial_state(self, cfg: OptimizerConfig) -> dict[str, float]:
        return {"n": cfg.initial_accumulator}

    combined_stats = ("square_sum",)

    def combine(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, stats: torch.Tensor, state: Mapping[str, torch.Tensor],
                lr: float) -> None:
        """k gradients summed into ``g``: one step of Algorithm 1 on the sum, with ``n`` grown by
        ``spread_squares`` (the per-element sum of the k squares, estimated from the row's
        ``square_sum``) instead of ``g * g``: ``z`` gains every gradient and ``n`` every square as
        in the k steps; what differs is that ``sigma * w`` is taken once, at the weights before
        (the k steps take it at each step's weights)."""
        self._step(cfg, w, g, spread_squares(g, stats[:, 0]), state, lr)

    def step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, state: Mapping[str, torch.Tensor], lr: float) -> None:
        self._step(cfg, w, g, g * g, state, lr)

    def _step(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, g2: torch.Tensor, state: Mapping[str, torch.Tensor],
              lr: float) -> None:
        if not lr > 0:
            return  # a rate of 0 (a schedule's floor) takes no step: sigma and the denominator divide by it
        z, n = state["z"], state["n"]
        n_new = n + g2
        if cfg.lr_power == -0.5:
            power = n_new.sqrt()
            # sqrt(n_new) - sqrt(n) without cancellation; 0 where the gradient is (n_new may be 0).
            rise = torch.where(g2 > 0, g2 / (power + n.sqrt()), 0.0)
        else:
            power = n_new.pow(-cfg.lr_power)
            rise = power - n.pow(-cfg.lr_power)
        z.add_(g - rise / lr * w)
        n.copy_(n_new)
        denom = (power + cfg.beta) / lr + cfg.l2
        w.copy_(torch.where(z.abs() > cfg.l1, (torch.sign(z) * cfg.l1 - z) / denom, 0.0))

    def kernel_constants(self, cfg: OptimizerConfig) -> tuple[Any, ...]:
        return (np.float32(cfg.weight_decay), np.float32(cfg.beta), np.float32(cfg.l1), np.float32(cfg.l2), np.float32(cfg.lr_power))

    @staticmethod
    def rows(
        w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, scratch: np.ndarray, z: np.ndarray, n: np.ndarray,
        weight_decay: np.float32, beta: np.float32, l1: np.float32, l2: np.float32, lr_power: np.float32,
    ) -> None:
        for i in range(len(slots)):
            s = slots[i]
            step = lr[i]
            if not step > 0:
                continue  # a rate of 0 takes no step (as in the torch form)
            decayed(scratch, g, i, w, s, weight_decay)
            ftrl_row(w, z, n, s, scratch, scratch, True, step, beta, l1, l2, lr_power)

    @staticmethod
    def combined_rows(
        w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, stats: np.ndarray, scratch: np.ndarray, z: np.ndarray,
        n: np.ndarray, weight_decay: np.float32, beta: np.float32, l1: np.float32, l2: np.float32, lr_power: np.float32,
    ) -> None:
        # ``combine`` row by row: ``rows``' step on the decayed sum with its squares spread to the
        # row's ``square_sum`` (a row of one gradient: ``rows``' step on it).
        rows, d = g.shape
        squares = np.empty(d, np.float32)
        for i in range(rows):
            s = slots[i]
            step = lr[i]
            if not step > 0:
                continue
            decayed(scratch, g, i, w, s, weight_decay)
            one = stats[i, 0] == -1
            if not one:
                spread_row(squares, scratch, np.float32(stats[i, 0]))
            ftrl_row(w, z, n, s, scratch, squares, one, step, beta, l1, l2, lr_power)


@kernel_helper
def rowwise_adagrad_row(w: np.ndarray, acc: np.ndarray, s: int, grad: np.ndarray, step: np.float32, eps: np.float32) -> None:
    """One row-wise Adagrad step of row ``s`` from ``grad`` (weight decay added) at rate ``step``:
    ``rows``' arithmetic, which ``combined_rows`` takes for a row of one gradient."""
    d = len(grad)
    row = w[s]
    total = np.float32(0.0)
    for j in range(d):
        total += grad[j] * grad[j]
    acc[s] += total * (np.float32(1.0) / np.float32(d))
    scale = step / (np.sqrt(acc[s]) + eps)
    for j in range(d):
        row[j] -= scale * grad[j]


@kernel_helper
def ftrl_row(w: np.ndarray, z: np.ndarray, n: np.ndarray, s: int, grad: np.ndarray, squares: np.ndarray, square: bool,
             step: np.float32, beta: np.float32, l1: np.float32, l2: np.float32, lr_power: np.float32) -> None:
    """Algorithm 1 on row ``s`` (``Ftrl._step``'s arithmetic) in the numba subset, for the kernels:
    ``z`` and ``n`` from the gradient ``grad`` (weight decay added) and its per-element squares
    (``grad * grad`` where ``square``, else ``squares``: a combined push's spread squares), then
    the weights; ``grad`` is overwritten with ``n``'s new power, which their denominators take.
    ``step`` > 0."""
    square_root = lr_power == np.float32(-0.5)
    p = -lr_power
    for j in range(len(grad)):
        gj, old = grad[j], n[s, j]
        g2 = gj * gj if square else squares[j]
        new = old + g2
        if square_root:
            power = np.sqrt(new)
            rise = g2 / (power + np.sqrt(old)) if g2 > 0 else np.float32(0.0)
        else:
            power = new ** p
            rise = power - old ** p
        z[s, j] += gj - rise / step * w[s, j]
        n[s, j] = new
        grad[j] = power
    for j in range(len(grad)):
        zj = z[s, j]
        if abs(zj) > l1:
            w[s, j] = (np.sign(zj) * l1 - zj) / ((grad[j] + beta) / step + l2)
        else:
            w[s, j] = np.float32(0.0)
