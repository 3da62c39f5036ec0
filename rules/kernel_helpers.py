"""The pieces the update rules' numba kernels (``UpdateRule.rows``, ``combined_rows``) share:
plain functions in the numba subset, which a kernel calls as it would a numba function. The
protos never import numba: ``tether.rules.row_kernels`` registers every function in
``KERNEL_HELPERS`` with numba (inlined where it is called) before it compiles a kernel.

numba's disk cache alone keys a kernel by its own file; the kernels are compiled with
``tether.rules.kernel_cache.compiled``, whose cache entry is keyed by the files and bytecode of
the helpers a kernel names (and the constants they name) too, so after editing a helper here a
kernel in another file (``update_rules``, ``ctr_rules``) is compiled again at its next load. A
helper must be named by the kernel (imported into its module, as here) for that to follow it.
A helper takes whole arrays and a row's index, not the row (a view), and a kernel makes its views
of a row after the helpers that branch: a view alive across one cost numba's reference counting
in every row (Adagrad's combine took twice its time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = ["KERNEL_HELPERS", "decayed", "kernel_helper", "spread_row"]

# The smallest normal float32 (a compile-time constant of the kernels that divide by a mean).
_TINY = np.float32(np.finfo(np.float32).tiny)

# Every function marked ``kernel_helper`` (here, and a rule's own beside it: Adam's, FTRL's).
KERNEL_HELPERS: list[Callable[..., Any]] = []
_Helper = TypeVar("_Helper", bound=Callable[..., Any])


def kernel_helper(fn: _Helper) -> _Helper:
    """Add ``fn`` to ``KERNEL_HELPERS`` (a function the rules' kernels call)."""
    KERNEL_HELPERS.append(fn)
    return fn


@kernel_helper
def decayed(out: np.ndarray, g: np.ndarray, i: int, w: np.ndarray, s: int, weight_decay: np.float32) -> None:
    """``out = g[i] + weight_decay * w[s]``: a pushed row's gradient with its weight decay added
    (every kernel's first loop over a row)."""
    for j in range(len(out)):
        out[j] = g[i, j] + weight_decay * w[s, j]


@kernel_helper
def spread_row(out: np.ndarray, g: np.ndarray, square_sum: np.float32) -> None:
    """``spread_squares`` of one row ``g`` into ``out``: ``g * g`` scaled so that its mean is
    ``square_sum`` (``square_sum`` everywhere where ``g`` is 0)."""
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
