"""The update rules' base class (``UpdateRule``), the torch optimizer that steps parameters with
any rule (``RuleOptimizer``), and the three rules with a ``torch.optim`` twin: SGD, Adagrad and
Adam. The registry, the hyper-parameters and what each rule computes are described in
``tether.rules.optimizers``; the rules CTR models add (row-wise Adagrad, FTRL-Proximal) are in
``tether.rules.ctr_rules``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from tether.rules.kernel_helpers import decayed, kernel_helper, spread_row

if TYPE_CHECKING:
    from tether.protos.schedules import Schedule
    from tether.protos.specs import OptimizerConfig

__all__ = [
    "SGD", "Adagrad", "Adam", "RuleOptimizer", "UpdateRule", "adagrad_row", "adam_factors", "adam_moments", "adam_row", "follow_schedule",
    "spread_squares",
]

@kernel_helper
def adam_factors(beta1: np.float64, beta2: np.float64) -> tuple[np.float32, np.float32, np.float64, np.float32, np.float32, np.float64]:
    """Adam's kernels' constants: the moments' factors in float32, each taken from the float64
    beta as torch takes a Python float (``beta1``, ``1 - beta1``, and for ``beta2`` alike), and
    the logs of the betas for ``adam_moments``' bias corrections."""
    return (np.float32(beta1), np.float32(1.0 - beta1), np.log(beta1), np.float32(beta2), np.float32(1.0 - beta2), np.log(beta2))


@kernel_helper
def adam_moments(m: np.ndarray, v: np.ndarray, t: np.ndarray, s: int, grad: np.ndarray, squares: np.ndarray, square: bool,
                 b1: np.float32, c1: np.float32, log1: np.float64, b2: np.float32, c2: np.float32,
                 log2: np.float64) -> tuple[np.float32, np.float32]:
    """One Adam step's moments of row ``s`` from the gradient ``grad`` and its per-element squares
    (``grad * grad`` where ``square``, else ``squares``), its count ``t[s]`` up by one, and the
    bias corrections 1 - beta**t it then takes (``adam_factors``' constants): in float64 as
    -expm1(t * log(beta)), as fast as float32 pow (float64 pow cost a quarter more per push), and
    rounded to float32 they equal 1 - beta**t for every t up to 1e9 tried, for betas from 0 to
    0.9999."""
    t[s] += 1
    bc1 = np.float32(-np.expm1(np.float64(t[s]) * log1))
    bc2 = np.float32(-np.expm1(np.float64(t[s]) * log2))
    for j in range(len(grad)):
        m[s, j] = b1 * m[s, j] + c1 * grad[j]
    for j in range(len(grad)):
        v[s, j] = b2 * v[s, j] + (c2 * grad[j] * grad[j] if square else c2 * squares[j])
    return bc1, bc2


@kernel_helper
def adagrad_row(w: np.ndarray, acc: np.ndarray, s: int, grad: np.ndarray, step: np.float32, eps: np.float32) -> None:
    """One Adagrad step of row ``s`` from ``grad`` (weight decay added) at rate ``step``: ``rows``'
    arithmetic, which ``combined_rows`` takes for a row of one gradient."""
    row, state = w[s], acc[s]
    for j in range(len(grad)):
        state[j] += grad[j] * grad[j]
    for j in range(len(grad)):
        row[j] -= step * grad[j] / (np.sqrt(state[j]) + eps)


@kernel_helper
def adam_row(w: np.ndarray, m: np.ndarray, v: np.ndarray, t: np.ndarray, s: int, grad: np.ndarray, step: np.float32,
             b1: np.float32, c1: np.float32, log1: np.float64, b2: np.float32, c2: np.float32, log2: np.float64,
             eps: np.float32) -> None:
    """One Adam step of row ``s`` from ``grad`` (weight decay added) at rate ``step``: ``rows``'
    arithmetic, which ``combined_rows`` takes for a row of one gradient."""
    bc1, bc2 = adam_moments(m, v, t, s, grad, grad, True, b1, c1, log1, b2, c2, log2)
    for j in range(len(grad)):
        w[s, j] -= step * (m[s, j] / bc1) / (np.sqrt(v[s, j] / bc2) + eps)


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

    # What a combined push (a worker's row cache summing a row's gradients of several steps into
    # one, ``tether.worker.cache.row_cache``) carries per row beside that sum, for this rule to update
    # its state as if it had taken the steps one by one: the columns of ``combined``'s ``stats``.
    # None: the sum alone is exact (SGD). "square_sum": the sum over the combined gradients of
    # each one's mean(g * g) over the row; "count": how many gradients were summed.
    combined_stats: tuple[str, ...] = ()

    # The compiled form of ``combine`` for the rows of a combined push, in the numba subset as
    # ``rows`` (never called uncompiled), or None where the rule has none (its torch form,
    # ``apply_combined``, is used): ``combined_rows(w, slots, g, lr, stats, scratch, *state,
    # *constants)`` updates rows ``slots[i]`` (unique) of ``w`` and of each state array in place
    # from the summed gradient ``g[i]``, the weight decay added once to it, at rate ``lr[i]``
    # (float32 per row) with ``stats[i]`` its ``combined_stats`` (float32); a row whose first
    # column is -1 holds one gradient and takes ``rows``' step, bit for bit, so a push whose rows
    # are partly sums is one pass; ``scratch`` and ``constants`` as for ``rows``. It agrees with
    # ``combine`` within float rounding (``tests/test_rules_combined_kernels.py``). The shard
    # compiles it (``tether.rules.row_kernels.combined_update``).
    combined_rows: Callable[..., None] | None = None

    def combine(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, stats: torch.Tensor, state: Mapping[str, torch.Tensor],
                lr: float) -> None:
        """One update of rows ``w`` (rows x dim) in place from ``g``, each row the sum of several
        gradients (weight decay already added), with ``stats`` (rows x ``len(combined_stats)``)
        describing them: the rule's steps on them as one (see each rule). The default (a rule
        with no ``combined_stats``) is the ordinary step on the sum."""
        self.step(cfg, w, g, state, lr)

    def apply_combined(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, stats: torch.Tensor,
                       state: Mapping[str, torch.Tensor], lr_scale: float | torch.Tensor = 1.0) -> None:
        """``apply`` for a combined push's rows: rows whose ``stats`` first column is -1 hold one
        gradient and take the ordinary step; the others ``combine``. Weight decay is added once
        to a row's summed gradient (as for any push). ``lr_scale``: one factor, or one per row."""
        if cfg.weight_decay:
            g = g + cfg.weight_decay * w
        if not isinstance(lr_scale, float) and len(lr_scale) and bool((lr_scale == lr_scale[0]).all()):
            lr_scale = float(lr_scale[0])
        one = stats[:, 0] == -1
        for rows, fn in ((one, None), (~one, self.combine)):
            if not bool(rows.any()):
                continue
            idx = torch.nonzero(rows).squeeze(1)
            wr, gr = w.index_select(0, idx), g.index_select(0, idx)
            sr = {k: v.index_select(0, idx) for k, v in state.items()}
            scale = lr_scale if isinstance(lr_scale, float) else lr_scale.index_select(0, idx)
            if isinstance(scale, float):
                (self.step(cfg, wr, gr, sr, cfg.lr * scale) if fn is None else fn(cfg, wr, gr, stats.index_select(0, idx), sr,
                                                                                  cfg.lr * scale))
            else:
                for i in range(len(idx)):  # a factor per row (staleness-aware): one row at a time
                    one_state = {k: v[i:i + 1] for k, v in sr.items()}
                    lr = cfg.lr * float(scale[i])
                    (self.step(cfg, wr[i:i + 1], gr[i:i + 1], one_state, lr) if fn is None else
                     fn(cfg, wr[i:i + 1], gr[i:i + 1], stats.index_select(0, idx)[i:i + 1], one_state, lr))
            w.index_copy_(0, idx, wr)
            for k, v in state.items():
                v.index_copy_(0, idx, sr[k])

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
        for i in range(len(slots)):
            s = slots[i]
            decayed(scratch, g, i, w, s, weight_decay)
            adagrad_row(w, acc, s, scratch, lr[i], eps)

    combined_stats = ("square_sum",)

    def combine(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, stats: torch.Tensor, state: Mapping[str, torch.Tensor],
                lr: float) -> None:
        """k gradients g_i summed into ``g``: the accumulator grows by ``spread_squares`` (the
        per-element sum of g_i * g_i, estimated from the row's one ``square_sum``), and the step
        is ``lr * g * 2 / (sqrt(sum_before) + sqrt(sum_after) + eps)``: the k steps
        ``lr * g_i / sqrt(sum_i)`` with the accumulator rising evenly from before to after,
        summed as an integral (exact for k equal gradients as k grows; one step at the new
        sum, ``g / sqrt(sum_after)``, is up to 2x too small while a row is young)."""
        acc = state["sum"]
        before = acc.sqrt()
        acc.add_(spread_squares(g, stats[:, 0]))
        w.addcdiv_(g, before.add_(acc.sqrt()).add_(cfg.eps), value=-2.0 * lr)

    @staticmethod
    def combined_rows(
        w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, stats: np.ndarray, scratch: np.ndarray, acc: np.ndarray,
        weight_decay: np.float32, eps: np.float32,
    ) -> None:
        # ``combine`` row by row: the decayed sum in ``scratch``, its squares spread to the row's
        # ``square_sum`` added to the accumulator while its square roots before and after make
        # the denominator; a row of one gradient takes ``rows``' step.
        n, d = g.shape
        spread = np.empty(d, np.float32)
        for i in range(n):
            s = slots[i]
            decayed(scratch, g, i, w, s, weight_decay)
            if stats[i, 0] == -1:
                adagrad_row(w, acc, s, scratch, lr[i], eps)
                continue
            spread_row(spread, scratch, np.float32(stats[i, 0]))
            row, state = w[s], acc[s]  # views made after the helpers (see ``decayed``)
            value = np.float32(-2.0) * lr[i]
            for j in range(d):
                before = np.sqrt(state[j])
                state[j] += spread[j]
                row[j] += value * (scratch[j] / (before + np.sqrt(state[j]) + eps))

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
        b1, c1, log1, b2, c2, log2 = adam_factors(beta1, beta2)
        for i in range(len(slots)):
            s = slots[i]
            decayed(scratch, g, i, w, s, weight_decay)
            adam_row(w, m, v, t, s, scratch, lr[i], b1, c1, log1, b2, c2, log2, eps)

    combined_stats = ("count", "square_sum")

    def combine(self, cfg: OptimizerConfig, w: torch.Tensor, g: torch.Tensor, stats: torch.Tensor, state: Mapping[str, torch.Tensor],
                lr: float) -> None:
        """k gradients summed into ``g``: the k steps taken with the gradients taken as equal
        (``g / k`` each, with per-element squares ``spread_squares / k``): the moments decay and
        ``t`` counts k times and the weights move by the k bias-corrected steps. Exact for k
        equal gradients; for unequal ones the moments end where the k steps' would (up to the
        squares' spread and ``m``'s weighting of the order) and the steps differ by their order."""
        m, v, t = state["m"], state["v"], state["t"]
        k = stats[:, 0].to(t.dtype)
        each = g / k.unsqueeze(1).to(g.dtype)
        square = spread_squares(g, stats[:, 1]) / k.unsqueeze(1).to(g.dtype)
        move = torch.zeros_like(w)
        for i in range(1, int(k.max()) + 1):
            on = k >= i
            rows = on.unsqueeze(1)
            m.copy_(torch.where(rows, m * cfg.beta1 + (1 - cfg.beta1) * each, m))
            v.copy_(torch.where(rows, v * cfg.beta2 + (1 - cfg.beta2) * square, v))
            t.add_(on.to(t.dtype))
            tt = t.unsqueeze(-1).double()
            bc1, bc2 = (1 - torch.pow(cfg.beta1, tt)).float(), (1 - torch.pow(cfg.beta2, tt)).float()
            move += torch.where(rows, (m / bc1) / ((v / bc2).sqrt() + cfg.eps), 0.0)
        w.add_(move, alpha=-lr)

    @staticmethod
    def combined_rows(
        w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, stats: np.ndarray, scratch: np.ndarray, m: np.ndarray,
        v: np.ndarray, t: np.ndarray, weight_decay: np.float32, beta1: np.float64, beta2: np.float64, eps: np.float32,
    ) -> None:
        # ``combine`` row by row: the decayed sum over its count k in ``scratch`` (each step's
        # gradient), its spread squares over k in ``square``, and the k steps' bias-corrected
        # moves summed in ``move``; a row of one gradient takes ``rows``' step.
        b1, c1, log1, b2, c2, log2 = adam_factors(beta1, beta2)
        n, d = g.shape
        square, move = np.empty(d, np.float32), np.empty(d, np.float32)
        for i in range(n):
            s = slots[i]
            k = np.float32(stats[i, 0])
            decayed(scratch, g, i, w, s, weight_decay)
            if k == -1:
                adam_row(w, m, v, t, s, scratch, lr[i], b1, c1, log1, b2, c2, log2, eps)
                continue
            spread_row(square, scratch, np.float32(stats[i, 1]))
            for j in range(d):
                scratch[j] = scratch[j] / k
            for j in range(d):
                square[j] = square[j] / k
                move[j] = np.float32(0.0)
            for _ in range(int(k)):
                bc1, bc2 = adam_moments(m, v, t, s, scratch, square, False, b1, c1, log1, b2, c2, log2)
                for j in range(d):
                    move[j] += (m[s, j] / bc1) / (np.sqrt(v[s, j] / bc2) + eps)
            step = lr[i]
            for j in range(d):
                w[s, j] -= step * move[j]

    def torch_optimizer(self, cfg: OptimizerConfig, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)


def spread_squares(g: torch.Tensor, square_sum: torch.Tensor) -> torch.Tensor:
    """The per-element sums of squares of the gradients summed into each row of ``g``,
    estimated from the row's ``square_sum`` (their mean(g_i * g_i) summed): ``g * g`` scaled so
    that its mean is ``square_sum``. Exact when the gradients are parallel (each a multiple of
    one vector: every dim-1 row) and for one gradient; where ``g`` is 0 (they cancelled), the
    square sum spread evenly. One float a row on the wire instead of ``dim``."""
    g2 = g * g
    mean = g2.mean(dim=1, keepdim=True)
    target = square_sum.to(g.dtype).unsqueeze(1)
    return torch.where(mean > 0, g2 * (target / mean.clamp_min(torch.finfo(g.dtype).tiny)), target.expand_as(g2))


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


def follow_schedule(optimizer: torch.optim.Optimizer, lr: float, schedule: Schedule) -> torch.optim.Optimizer:
    """``optimizer`` (returned) with its groups' ``lr`` set to ``schedule.lr_at(lr, k)`` before
    its ``k``-th step (0-based, counted from here), as the shards' rates follow the clock: sync
    mode steps its dense parameters on the workers with it. A step pre-hook, so the optimizer
    stays torch's own."""
    steps = 0

    def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        nonlocal steps
        rate = schedule.lr_at(lr, steps)
        steps += 1
        for group in opt.param_groups:
            group["lr"] = rate

    optimizer.register_step_pre_hook(before_step)
    return optimizer
