"""Every update rule's row kernel behind one compiled call that takes the rule by its code
(``rows_of_rule``), for a pass over tables of several rules: the worker row cache's hold
(``tether.worker.cache.batch.hold_all``) takes each table's local step inside its own loop, while
the rows are in the CPU's caches, instead of one Python call per table. Each rule's kernel
(``UpdateRule.rows``, compiled by ``tether.rules.row_kernels.rule_kernel`` with its own options)
is called as ``row_update`` calls it, so the rows come out bit for bit the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tether.protos.names import OPTIMIZERS
from tether.protos.specs import OptimizerConfig
from tether.rules.kernel_cache import compiled
from tether.rules.optimizers import rule
from tether.rules.row_kernels import rule_kernel
from tether.rules.update_rules import UpdateRule

__all__ = ["MAX_CONSTANTS", "rows_of_rule", "rule_code", "rule_constants", "rule_states"]

# Module globals, so that a kernel calling them is keyed by their sources (``kernel_cache``).
_SGD_ROWS = rule_kernel(rule("sgd").rows)
_ADAGRAD_ROWS = rule_kernel(rule("adagrad").rows)
_ADAM_ROWS = rule_kernel(rule("adam").rows)
_ROWWISE_ROWS = rule_kernel(rule("rowwise_adagrad").rows)
_FTRL_ROWS = rule_kernel(rule("ftrl").rows)
# A rule's code in ``rows_of_rule``: its index in ``OPTIMIZERS``.
SGD_CODE, ADAGRAD_CODE, ADAM_CODE, ROWWISE_CODE, FTRL_CODE = (
    OPTIMIZERS.index(n) for n in ("sgd", "adagrad", "adam", "rowwise_adagrad", "ftrl"))
if len(OPTIMIZERS) != 5:
    raise ImportError(f"rows_of_rule calls 5 rules' kernels, OPTIMIZERS names {len(OPTIMIZERS)}: {OPTIMIZERS}")
MAX_CONSTANTS = 5  # the most constants a rule's kernel takes (FTRL's)


def rule_code(name: str) -> int:
    """Rule ``name``'s code in ``rows_of_rule`` (ValueError, naming the rules, for no rule)."""
    rule(name)
    return OPTIMIZERS.index(name)


def rule_constants(update_rule: UpdateRule, cfg: OptimizerConfig) -> np.ndarray:
    """``update_rule.kernel_constants(cfg)`` as ``rows_of_rule`` takes them: float64, in order,
    ``MAX_CONSTANTS`` long (a float32 constant goes back to the same float32 in the kernel)."""
    out = np.zeros(MAX_CONSTANTS, np.float64)
    constants = update_rule.kernel_constants(cfg)
    out[: len(constants)] = [float(c) for c in constants]
    return out


def rule_states(update_rule: UpdateRule, state: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """A table's ``state`` arrays (by name) as ``rows_of_rule`` takes them: in the rule's
    ``state_shapes`` order, each a [rows, k] view (a per-row scalar as one column)."""
    return [state[k].reshape(len(state[k]), -1) for k in update_rule.state_shapes(1)]


@compiled()
def rows_of_rule(code: np.int64, w: np.ndarray, slots: np.ndarray, g: np.ndarray, lr: np.ndarray, states: Any, base: np.int64,
                 constants: np.ndarray) -> None:
    """Rule ``OPTIMIZERS[code]``'s row kernel (``UpdateRule.rows``) on rows ``slots`` of ``w``,
    called as ``row_update`` calls it: its state arrays are ``states[base:]`` (a typed list of
    ``rule_states``' views), its constants ``constants`` (``rule_constants``). The kernels keep
    their own compile options, so the rows come out bit for bit as from ``row_update``."""
    scratch = np.empty(w.shape[1], np.float32)
    c = constants
    if code == SGD_CODE:
        _SGD_ROWS(w, slots, g, lr, scratch, np.float32(c[0]))
    elif code == ADAGRAD_CODE:
        _ADAGRAD_ROWS(w, slots, g, lr, scratch, states[base], np.float32(c[0]), np.float32(c[1]))
    elif code == ADAM_CODE:
        _ADAM_ROWS(w, slots, g, lr, scratch, states[base], states[base + 1], states[base + 2].reshape(-1), np.float32(c[0]), c[1], c[2],
                   np.float32(c[3]))
    elif code == ROWWISE_CODE:
        _ROWWISE_ROWS(w, slots, g, lr, scratch, states[base].reshape(-1), np.float32(c[0]), np.float32(c[1]))
    elif code == FTRL_CODE:
        _FTRL_ROWS(w, slots, g, lr, scratch, states[base], states[base + 1], np.float32(c[0]), np.float32(c[1]), np.float32(c[2]),
                   np.float32(c[3]), np.float32(c[4]))
