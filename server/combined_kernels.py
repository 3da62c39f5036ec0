"""Compiled forms of the rules' ``combine`` (a combined push's rows: a worker's row cache summing
a row's gradients of several steps into one, ``tether.worker.row_cache``), for the rules whose
statistics are one float a row: Adagrad and row-wise Adagrad (``protos.update_rules``,
``protos.ctr_rules``). The torch form (``UpdateRule.apply_combined``) runs about 40 small torch
calls per table part: 0.4-0.5 ms for 130 rows of 16 floats where the compiled row kernel of
the same rows takes 20-25 us, so a push of combined rows cost a shard 20x an ordinary one.

``combined_update(rule, cfg, dim)`` binds a table's constants as ``kernels.row_update`` does;
``update(weights, state, slots, grads, lr, stats)`` updates rows ``slots`` (unique) from the
summed gradients ``grads`` (weight decay added once to each sum, as ``apply_combined``) at rates
``lr`` (float32 per row) with ``stats[:, 0]`` their ``square_sum``. Rules without one here
(SGD needs no statistics; Adam, FTRL) get None: their torch form. The arithmetic is the torch
form's in float32, element by element; the sums of squares are summed in order, so results
agree with torch's to rounding (not bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tether.protos.optimizers import OptimizerConfig, UpdateRule
from tether.server.kernels import _compiled

__all__ = ["CombinedUpdate", "combined_update", "warm_up"]

_jit_math = _compiled(error_model="numpy", fastmath={"contract", "arcp"})
_TINY = np.float32(np.finfo(np.float32).tiny)


@_jit_math
def _spread(g: np.ndarray, square_sum: np.float32, out: np.ndarray) -> None:
    """``protos.update_rules.spread_squares`` for one row: ``g * g`` scaled so that its mean is
    ``square_sum`` (the square sum spread evenly where ``g`` is 0)."""
    d = len(g)
    total = np.float32(0.0)
    for j in range(d):
        out[j] = g[j] * g[j]
        total += out[j]
    mean = total / np.float32(d)
    if mean > 0:
        scale = square_sum / max(mean, _TINY)
        for j in range(d):
            out[j] = out[j] * scale
    else:
        for j in range(d):
            out[j] = square_sum


@_jit_math
def adagrad_combined(w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, stats: np.ndarray, scratch: np.ndarray,
                     acc: np.ndarray, weight_decay: np.float32, eps: np.float32) -> None:
    """``Adagrad.combine``: the accumulator grows by the spread square sum, the step is
    ``lr * g * 2 / (sqrt(sum_before) + sqrt(sum_after) + eps)``."""
    n, d = g.shape
    spread = np.empty(d, np.float32)
    for i in range(n):
        s = slots[i]
        row, state = w[s], acc[s]
        for j in range(d):
            scratch[j] = g[i, j] + weight_decay * row[j]
        _spread(scratch, np.float32(stats[i, 0]), spread)
        value = np.float32(-2.0) * lr[i]
        for j in range(d):
            before = np.sqrt(state[j])
            state[j] += spread[j]
            row[j] += value * (scratch[j] / (before + np.sqrt(state[j]) + eps))


@_jit_math
def rowwise_adagrad_combined(w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, stats: np.ndarray,
                             scratch: np.ndarray, acc: np.ndarray, weight_decay: np.float32, eps: np.float32) -> None:
    """``RowwiseAdagrad.combine``: the row's accumulator grows by the square sum, the step is
    ``lr * g * 2 / (sqrt(sum_before) + sqrt(sum_after) + eps)``."""
    n, d = g.shape
    for i in range(n):
        s = slots[i]
        row = w[s]
        for j in range(d):
            scratch[j] = g[i, j] + weight_decay * row[j]
        before = np.sqrt(acc[s])
        acc[s] += np.float32(stats[i, 0])
        denom = before + np.sqrt(acc[s]) + eps
        value = np.float32(-2.0) * lr[i]
        for j in range(d):
            row[j] += value * (scratch[j] / denom)


_KERNELS: dict[str, Any] = {"adagrad": adagrad_combined, "rowwise_adagrad": rowwise_adagrad_combined}

# (weights, state by name, slots, grads, lr, stats) -> None
CombinedUpdate = Callable[[np.ndarray, Mapping[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]


def combined_update(update_rule: UpdateRule, cfg: OptimizerConfig, dim: int) -> CombinedUpdate | None:
    """``update_rule``'s compiled combine bound to ``cfg``'s constants for rows of ``dim`` floats,
    or None where it has none here (see the module doc). ``slots`` int64, ``grads`` (rows x dim),
    ``lr`` and ``stats`` (rows x 1 or more) float32, all contiguous."""
    kernel = _KERNELS.get(update_rule.name)
    if kernel is None:
        return None
    names = tuple(update_rule.state_shapes(dim))
    constants = update_rule.kernel_constants(cfg)

    def update(weights: np.ndarray, state: Mapping[str, np.ndarray], slots: np.ndarray, grads: np.ndarray, lr: np.ndarray,
               stats: np.ndarray) -> None:
        kernel(weights, slots, grads, lr, stats, np.empty(dim, np.float32), *[state[k] for k in names], *constants)

    return update


def warm_up() -> None:
    """Load (or compile, the first time) the kernels for the types a shard passes."""
    w, slots = np.zeros((1, 2), np.float32), np.zeros(1, np.int64)
    g, lr, stats = np.zeros((1, 2), np.float32), np.zeros(1, np.float32), np.ones((1, 1), np.float32)
    consts = (np.float32(0.0), np.float32(1e-8))
    adagrad_combined(w, slots, g, lr, stats, np.empty(2, np.float32), np.zeros((1, 2), np.float32), *consts)
    rowwise_adagrad_combined(w, slots, g, lr, stats, np.empty(2, np.float32), np.zeros(1, np.float32), *consts)
