"""The shard's compiled row loops (numba): the machinery that compiles each update rule's row
kernel and its combined push's kernel and binds them to a table, the gather of pulled rows, and
the initialisation of new rows. The id index's probes are in ``tether.rules.index_kernels``,
whose ``compiled`` compiles these too (cached on disk, the GIL released).

The row updates are not written here: each update rule (``tether.rules.optimizers``) holds its
own kernel (``UpdateRule.rows``) beside its torch form, and this module compiles whichever rule
a table names (``row_kernel``) and binds it to the table's state and constants
(``row_update``; a rule's kernel for a combined push's rows, ``combined_rows``, likewise:
``combined_update``): a kernel applies the rule to the rows ``slots`` of a table in place,
reading each row once and writing it once, instead of gathering rows, updating the copies and
scattering them back. The pieces the rules' kernels share (``tether.rules.kernel_helpers``) are
registered with numba here before a kernel is compiled; a kernel's disk cache entry is keyed by
them too (``tether.rules.kernel_cache``), so an edited helper compiles the kernels again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numba.extending
import numpy as np

from tether.protos.names import OPTIMIZERS
from tether.protos.specs import OptimizerConfig
from tether.rules import index_kernels
from tether.rules.index_kernels import mix64, prefetch
from tether.rules.kernel_cache import compiled, load_kernels
from tether.rules.kernel_helpers import KERNEL_HELPERS
from tether.rules.kernel_threads import PARALLEL_ELEMENTS, in_parts
from tether.rules.optimizers import rule
from tether.rules.update_rules import UpdateRule

__all__ = [
    "NO_ROWS",
    "RULE_USUAL_S",
    "SHARD_USUAL_S",
    "CombinedUpdate",
    "RowUpdate",
    "combined_push_fault",
    "combined_update",
    "gather_rows",
    "init_rows_into",
    "load_rule_in_background",
    "push_part_fault",
    "row_kernel",
    "row_update",
    "rule_kernel",
    "rule_loads",
    "shard_loads",
    "warm_up",
    "warm_up_shard",
]

log = logging.getLogger("tether.server")

_jit = compiled()
# Row arithmetic: the element-wise steps may be vectorised and contracted into fused multiply-adds
# ("contract"), and a division may use a reciprocal ("arcp"); no other IEEE rule is relaxed, so
# NaN and infinite gradients behave as in torch.
_jit_math = compiled(error_model="numpy", fastmath={"contract", "arcp"})


# Each rule's compiled kernels (``rows``, ``combined_rows``), created on first use (and compiled,
# or loaded from the disk cache, on their first call), keyed by the kernel function.
_row_kernels: dict[Callable[..., None], Any] = {}
_row_kernels_lock = threading.Lock()
_helpers: set[Callable[..., Any]] = set()


def rule_kernel(fn: Callable[..., None]) -> Any:
    """The compiled form of a rule's kernel function (one per function for the process), the
    rules' shared pieces (``tether.rules.kernel_helpers``) registered with numba first."""
    with _row_kernels_lock:
        for helper in KERNEL_HELPERS:
            if helper not in _helpers:
                numba.extending.register_jitable(inline="always")(helper)
                _helpers.add(helper)
        kernel = _row_kernels.get(fn)
        if kernel is None:
            kernel = _row_kernels[fn] = _jit_math(fn)
        return kernel


def row_kernel(update_rule: UpdateRule) -> Any:
    """The compiled form of ``update_rule.rows`` (one per rule for the process)."""
    return rule_kernel(update_rule.rows)


# A rule's row update bound to a table's constants: (weights, state, slots, grads, lr) -> None.
RowUpdate = Callable[[np.ndarray, Mapping[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray], None]


def row_update(update_rule: UpdateRule, cfg: OptimizerConfig, dim: int) -> RowUpdate:
    """``update_rule``'s compiled row update with the constants of ``cfg``, for rows of ``dim``
    floats: ``update(weights, state, slots, grads, lr)`` updates rows ``slots`` (unique, int64)
    of ``weights`` and of the ``state`` arrays (by name) in place, row ``i`` from ``grads[i]``
    with learning rate ``lr[i]`` (float32, contiguous); a large call is split across threads
(``tether.rules.kernel_threads``, bit for bit the same). Binding compiles nothing: the kernel is
    compiled, or loaded from the disk cache, on its first call (or by ``warm_up``)."""
    kernel = row_kernel(update_rule)
    names = tuple(update_rule.state_shapes(dim))
    constants = update_rule.kernel_constants(cfg)

    def update(weights: np.ndarray, state: Mapping[str, np.ndarray], slots: np.ndarray, grads: np.ndarray, lr: np.ndarray) -> None:
        states = [state[k] for k in names]
        if len(slots) * dim < PARALLEL_ELEMENTS:
            kernel(weights, slots, grads, lr, np.empty(dim, np.float32), *states, *constants)
            return

        def run(a: int, b: int) -> None:
            # Rows are unique: runs of them on several threads give exactly one run's results.
            kernel(weights, slots[a:b], grads[a:b], lr[a:b], np.empty(dim, np.float32), *states, *constants)

        in_parts(run, len(slots), dim)

    return update


# A rule's combined update bound to a table's constants: (weights, state, slots, grads, lr, stats) -> None.
CombinedUpdate = Callable[[np.ndarray, Mapping[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]


def combined_update(update_rule: UpdateRule, cfg: OptimizerConfig, dim: int) -> CombinedUpdate | None:
    """``update_rule``'s compiled ``combined_rows`` with the constants of ``cfg``, for rows of
    ``dim`` floats, or None where the rule has none (its torch form, ``apply_combined``):
    ``update(weights, state, slots, grads, lr, stats)`` updates rows ``slots`` (unique, int64) in
    place from the summed gradients ``grads`` at rates ``lr`` (float32 per row) with ``stats``
    (float32, rows x ``len(combined_stats)``; a row whose first column is -1 takes ``rows``'
    step), all contiguous; a large call is split across threads as ``row_update``'s. Compiled,
    or loaded from the disk cache, on its first call (or by ``warm_up``), as ``row_update``."""
    if update_rule.combined_rows is None:
        return None
    kernel = rule_kernel(update_rule.combined_rows)
    names = tuple(update_rule.state_shapes(dim))
    constants = update_rule.kernel_constants(cfg)

    def update(weights: np.ndarray, state: Mapping[str, np.ndarray], slots: np.ndarray, grads: np.ndarray, lr: np.ndarray,
               stats: np.ndarray) -> None:
        states = [state[k] for k in names]
        if len(slots) * dim < PARALLEL_ELEMENTS:
            kernel(weights, slots, grads, lr, stats, np.empty(dim, np.float32), *states, *constants)
            return

        def run(a: int, b: int) -> None:
            kernel(weights, slots[a:b], grads[a:b], lr[a:b], stats[a:b], np.empty(dim, np.float32), *states, *constants)

        in_parts(run, len(slots), dim)

    return update


@_jit
def combined_stats_fault(stats: np.ndarray, low: np.float32) -> np.int64:
    """What is wrong with a combined push's statistics (float32, rows x columns): 1 a value not
    finite, 2 a row's first column neither -1 nor >= ``low``, or another column < 0; 0 nothing
    (``push_hooks.check_combined``'s checks in one pass)."""
    fault = 0
    for i in range(stats.shape[0]):
        for j in range(stats.shape[1]):
            x = stats[i, j]
            if not np.isfinite(x):
                return np.int64(1)
            if (x != -1 and x < low) if j == 0 else x < 0:
                fault = 2
    return np.int64(fault)


@_jit
def not_finite(grads: np.ndarray) -> bool:
    """Whether any of ``grads`` (float32, C-contiguous) is NaN or infinite: one pass of integer
    compares over their bits (a float32 is not finite where its exponent bits are all set),
    which the compiler vectorises, as it does not a float sum in order (torch's sum, vectorised,
    costs more in its call than this whole pass on a table part of tens of rows)."""
    bits = grads.reshape(-1).view(np.uint32)
    bad = 0
    for i in range(len(bits)):
        bad += (bits[i] & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    return bad > 0


@_jit
def combined_push_fault(grads: np.ndarray, stats: np.ndarray, low: np.float32) -> np.int64:
    """What is wrong with a push's part, in one call: 3 a gradient not finite (``not_finite``;
    ``grads`` float32 rows x dim, C-contiguous), else ``combined_stats_fault``'s code for its
    statistics (0: nothing; a part without statistics passes a 0 x 0 array)."""
    if not_finite(grads):
        return np.int64(3)
    return combined_stats_fault(stats, low)


@_jit
def push_part_fault(cells: np.ndarray, keys: np.ndarray, bits: int, ids: np.ndarray, grads: np.ndarray, stats: np.ndarray,
                    low: np.float32) -> tuple[np.ndarray, bool, bool, np.int64]:
    """A shard's checks of a push part in one call: the slot of each id in the table's index
    (``index_kernels.slot_lookup``), whether every id is a row, whether (all rows) they are
    unique (a pass where they ascend, as a client sends them, else a sort of the slots), and
    ``combined_push_fault``'s code for its gradients and statistics."""
    slots = index_kernels.slot_lookup(cells, keys, bits, ids)
    found = True
    for i in range(len(slots)):
        if slots[i] < 0:
            found = False
            break
    unique = True
    if found:
        for i in range(1, len(ids)):
            if ids[i] <= ids[i - 1]:
                ordered = np.sort(slots)
                for j in range(1, len(ordered)):
                    if ordered[j] == ordered[j - 1]:
                        unique = False
                        break
                break
    return slots, found, unique, combined_push_fault(grads, stats, low)


# What a first run on a machine compiles, and how long it usually takes on a quiet 2-core
# machine (bench/first_run.py measures it): the kernels every shard calls (the id index's
# lookup and insert, the gather of pulled rows, new rows' initial values), and each rule's.
SHARD_USUAL_S = 4.0
RULE_USUAL_S = {"sgd": 0.5, "adagrad": 0.7, "adam": 2.5, "rowwise_adagrad": 0.6, "ftrl": 2.0}


def _example_ids() -> np.ndarray:
    return np.arange(2, dtype=np.int64)


def _load_gather() -> None:
    gather_rows(np.zeros((2, 4), np.float32), _example_ids(), np.zeros((2, 4), np.float32))


def _load_init() -> None:
    steps = np.ones(4, np.uint64)
    steps.flags.writeable = False  # a table's column steps are read-only (initial.column_steps)
    init_rows_into(_example_ids(), np.uint64(1), steps, np.float32(1), np.float32(1), np.zeros((2, 4), np.float32))


# A part without statistics (or without gradients to check) gives the compiled checks an empty array.
NO_ROWS = np.zeros((0, 0), np.float32)


def _load_part_checks() -> None:
    ids = _example_ids()
    ids.flags.writeable = False  # as every lookup gets them (tether.server.storage.index.lookup_ids)
    cells = np.full(16, index_kernels.EMPTY_SLOT, np.int32)
    push_part_fault(cells, np.zeros(2, np.int64), 4, ids, np.zeros((2, 4), np.float32), NO_ROWS, np.float32(0))
    combined_push_fault(np.zeros((2, 4), np.float32), NO_ROWS, np.float32(0))


def shard_loads() -> list[Callable[[], object]]:
    """Calls that load the kernels every shard uses, whatever its tables' rules (the id index's
    lookup and insert, the gather of pulled rows, a new row's initial values, a push part's
    checks)."""
    return [*index_kernels.shard_loads(), _load_gather, _load_init, _load_part_checks]


def rule_loads(update_rule: UpdateRule, combined: bool = False) -> list[Callable[[], object]]:
    """Calls that load ``update_rule``'s row kernel (and, with ``combined``, its combined push's)."""
    name = update_rule.name

    def examples() -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        state = {k: np.zeros((2, *s), np.float32) for k, s in update_rule.state_shapes(4).items()}
        return np.zeros((2, 4), np.float32), state, _example_ids(), np.zeros((2, 4), np.float32), np.zeros(2, np.float32)

    def load_rows() -> None:
        w, state, ids, g, lr = examples()
        row_update(update_rule, OptimizerConfig(name), 4)(w, state, ids, g, lr)

    def load_combined() -> None:
        combine = combined_update(update_rule, OptimizerConfig(name), 4)
        if combine is not None:
            w, state, ids, g, lr = examples()
            combine(w, state, ids, g, lr, np.ones((2, len(update_rule.combined_stats)), np.float32))

    return [load_rows, load_combined] if combined else [load_rows]


def warm_up_shard() -> float:
    """Load (or compile, the first time on this machine) the kernels every shard uses (not the
    rules': ``load_rule_in_background`` loads a table's when it is made); the seconds it took.
    ``tether server`` runs this in a thread while the shard starts."""
    return load_kernels("the shard's id index and row passes", SHARD_USUAL_S, shard_loads())


_rules_loading: dict[str, threading.Thread] = {}
_rules_loading_lock = threading.Lock()


def load_rule_in_background(update_rule: UpdateRule) -> None:
    """Load (or compile) ``update_rule``'s row kernel in a thread, once per rule and process (a
    table does when it is made, so that its first push finds it loaded); a combined push's
    kernel is loaded at its first use. The thread is not a daemon: a process that ends at once
    waits for it rather than ending inside a compile."""
    with _rules_loading_lock:
        if update_rule.name in _rules_loading:
            return
        thread = threading.Thread(target=_load_rule, args=(update_rule,), name=f"tether-kernels-{update_rule.name}")
        _rules_loading[update_rule.name] = thread
        thread.start()


def _load_rule(update_rule: UpdateRule) -> None:
    try:
        seconds = load_kernels(f"the {update_rule.name} rule's row update", RULE_USUAL_S.get(update_rule.name, 2.0),
                               rule_loads(update_rule))
    except Exception:  # the first push then compiles it, and fails with the same error if it must
        log.exception("the %s rule's row kernel could not be loaded or compiled in advance", update_rule.name)
        return
    log.info("compiled kernels of the %s rule ready in %.2fs", update_rule.name, seconds)


def warm_up() -> None:
    """Load (or compile, the first time) every kernel of the shard (the index's too) and of
    every rule (their combined pushes' too) for the types they use: what CI and the benchmarks
    load before they time anything (a shard loads only its own: ``warm_up_shard``,
    ``load_rule_in_background``)."""
    loads = [index_kernels.warm_up, *shard_loads()]
    for name in OPTIMIZERS:
        loads += rule_loads(rule(name), combined=True)
    load_kernels("every rule's row kernels", SHARD_USUAL_S + sum(RULE_USUAL_S.values()), loads)


# How many rows on ``gather_rows`` asks for.
_ROWS_AHEAD = 4


@_jit
def gather_rows(src: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = src[index[i]]`` for C-contiguous 2-d ``src`` and ``out`` (float32 rows), every
    cache line of the row ``_ROWS_AHEAD`` on asked for first: rows scattered over a large table
    arrive several at a time instead of one after another (about twice ``index_select``'s rate)."""
    n, d = len(index), src.shape[1]
    flat = src.reshape(-1)
    for i in range(n):
        if i + _ROWS_AHEAD < n:
            start = index[i + _ROWS_AHEAD] * d
            for k in range(0, d, 16):
                prefetch(flat, start + k)
        row, dest = src[index[i]], out[i]
        for j in range(d):
            dest[j] = row[j]


@_jit
def init_rows_into(ids: np.ndarray, salt: np.uint64, steps: np.ndarray, step: np.float32, scale: np.float32, out: np.ndarray) -> None:
    """``tether.rules.initial.init_rows`` written into ``out`` [len(ids), dim] in one pass, bit
    for bit (its NumPy form makes a uint64 temporary of every element and passes over it eight
    times): element j of id i is ``mix64(mix64(id ^ salt) + steps[j]) >> 40`` (an integer below
    2**24, exact in float32) times ``step`` (``2 * scale / 2**24`` in float32), minus ``scale``,
    each in float32 with its own rounding (no fastmath here: a fused multiply-add would round once)."""
    for i in range(len(ids)):
        base = mix64(np.uint64(ids[i]) ^ salt)
        row = out[i]
        for j in range(len(steps)):
            h = mix64(base + steps[j]) >> np.uint64(40)
            row[j] = np.float32(h) * step - scale
