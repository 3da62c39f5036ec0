"""What a push's update adds to the rule's step on a shard: the learning-rate schedule by the
worker's clock (the maths is ``tether.protos.schedules``'s; local mode applies the same) and the
staleness remedies that need the values a gradient was computed on (``Remedies``: DC-ASGD,
DC-ASGD-a, gap-aware). ``tether.server.storage.shard`` calls ``adjusted`` per block, after the
whole push was checked (``check_read``, ``part_rows``, ``check_remedies``) and just before
the table's or chunk's update, and ``observe_step`` just after it (gap-aware's update size).
A table applies a block's rows with ``apply_rows``: the rule's compiled kernel, and for a
combined push (a worker's row cache summing several steps' gradients) the rule's compiled
``combined_rows`` over the whole block where it has one (it takes the rows of one gradient with the
kernel's step), else the kernel and, for the sums, the rule's torch form (``combine_rows``; local
mode calls it too)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from tether.protos.errors import InvalidArgument
from tether.protos.names import REMEDY_DECAY
from tether.protos.names import check_remedies as _check_remedy_values
from tether.protos.specs import OptimizerConfig
from tether.rules.row_kernels import NO_ROWS, CombinedUpdate, RowUpdate, combined_push_fault, combined_update
from tether.rules.update_rules import UpdateRule

__all__ = [
    "Remedies", "adjusted", "apply_rows", "check_compensation", "check_dense", "check_read", "check_remedies", "check_rows",
    "combine_rows", "dc_adaptive_compensated", "delay_compensated", "finite", "gap_penalized", "gap_penalty", "has_duplicates",
    "observe_step", "part_rows", "raise_fault", "running_mean", "stats_array",
]

# The shard's running means (``EmbeddingTable.running_means``, ``DenseChunk.running_means``):
# DC-ASGD-a's mean square of the gradient, gap-aware's size of one update.
MEAN_SQUARE = "dc_mean_square"
STEP_SIZE = "gap_step"
# DC-ASGD-a's epsilon under the square root (a row whose gradients were all 0 is not compensated).
MS_EPS = 1e-12


@dataclass(frozen=True)
class Remedies:
    """What a push asks the shard to do against staleness with the values its gradient was
    computed on: DC-ASGD's ``lambda`` (``dc``; with ``dc_adaptive``, DC-ASGD-a's ``lambda0``),
    gap-aware (``gap_aware``), and the decay of the running means DC-ASGD-a and gap-aware keep."""

    dc: float = 0.0
    dc_adaptive: bool = False
    gap_aware: bool = False
    decay: float = REMEDY_DECAY

    @property
    def on(self) -> bool:
        """Whether any remedy is asked for (then a block's read values are used)."""
        return self.dc > 0 or self.gap_aware



def has_duplicates(ids: np.ndarray) -> bool:
    """Whether an id appears twice (a sort and a neighbour compare: a third of np.unique's time for
    a few thousand ids)."""
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


def finite(t: torch.Tensor) -> bool:
    """Whether every element is finite: a NaN or Inf anywhere makes the sum non-finite, and summing
    is much cheaper than an element-wise check (which runs only when the sum is not: NaN/Inf or an overflow)."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def check_rows(what: str, ids: np.ndarray, grads: torch.Tensor, dim: int, combined: torch.Tensor | None = None,
               update_rule: UpdateRule | None = None) -> np.ndarray | None:
    """A push's rows of one table, as local mode refuses them (``part_rows``' layout; the ids
    unique; every value finite, in one compiled pass). Returns the
    statistics as ``part_rows`` does (None without). A shard checks a part with its id lookup
    instead (``EmbeddingTable.checked``), in the same order.

    Raises:
        InvalidArgument: naming ``what`` (``table 'x'``) and the fault.
    """
    g, stats, low = part_rows(what, ids, grads, dim, combined, update_rule)
    if ids.size > 1 and has_duplicates(ids):
        raise InvalidArgument(f"{what}: ids in one push must be unique")
    raise_fault(what, combined_push_fault(g, NO_ROWS if stats is None else stats, low), low)
    return stats


def part_rows(what: str, ids: np.ndarray, grads: torch.Tensor, dim: int, combined: torch.Tensor | None = None,
              update_rule: UpdateRule | None = None) -> tuple[np.ndarray, np.ndarray | None, np.float32]:
    """A push part's layout, as a shard and local mode refuse it: one gradient row per id of the
    table's width, floating point; a combined push's statistics (``combined``) one row per
    gradient row with a column per ``combined_stats`` name of the table's ``update_rule``,
    floating point. Returns what the compiled checks of its values take
    (``row_kernels.combined_push_fault``, ``push_part_fault``): the gradients as float32 rows
    (no copy; ``NO_ROWS`` where they are not such an array, and are checked finite here, in
    torch), the statistics as ``stats_array`` (None without) and the least a statistics row's
    first column may be besides -1 (one gradient): 1 where it is a count, else 0.

    Raises:
        InvalidArgument: naming ``what`` and the fault.
    """
    if tuple(grads.shape) != (ids.size, dim):
        raise InvalidArgument(f"{what}: gradient shape {tuple(grads.shape)} does not match ({ids.size}, {dim})")
    if not grads.is_floating_point():
        raise InvalidArgument(f"{what}: gradients must be floating point, got {grads.dtype}")
    stats, low = None, _LOW_ANY
    if combined is not None:
        if update_rule is None:
            raise TypeError("part_rows: a combined push's statistics are checked against the table's update_rule")
        width = len(update_rule.combined_stats)
        if not width:
            raise InvalidArgument(f"{what}: rule {update_rule.name} takes no combined statistics (the summed gradient is its k steps)")
        if tuple(combined.shape) != (ids.size, width):
            raise InvalidArgument(f"{what}: combined statistics of shape {tuple(combined.shape)}, expected ({ids.size}, {width}) "
                                  f"({', '.join(update_rule.combined_stats)})")
        if not combined.is_floating_point():
            raise InvalidArgument(f"{what}: combined statistics must be finite floats")
        stats = stats_array(combined)
        low = _LOW_COUNT if update_rule.combined_stats[0] == "count" else _LOW_ANY
    g = _float32_rows(grads)
    if g is None:
        if not finite(grads):
            raise InvalidArgument(f"{what}: gradients contain NaN or Inf")
        g = NO_ROWS
    return g, stats, low


_LOW_ANY, _LOW_COUNT = np.float32(0), np.float32(1)


def raise_fault(what: str, fault: int, low: np.float32) -> None:
    """Raise the error of ``combined_push_fault``'s code (``fault``; 0: nothing), naming ``what``.

    Raises:
        InvalidArgument: a gradient or statistic not finite, or a statistic out of range.
    """
    if fault == 3:
        raise InvalidArgument(f"{what}: gradients contain NaN or Inf")
    if fault == 1:
        raise InvalidArgument(f"{what}: combined statistics must be finite floats")
    if fault == 2:
        raise InvalidArgument(f"{what}: combined statistics out of range (first column -1 or >= {low:g}, the others >= 0)")


def _float32_rows(grads: torch.Tensor) -> np.ndarray | None:
    """A push part's gradient rows as the array the compiled checks take (no copy), where they
    are one: float32, on the CPU, 2-d and contiguous, not requiring grad; else None."""
    if grads.dtype is torch.float32 and grads.is_cpu and grads.dim() == 2 and grads.is_contiguous() and not grads.requires_grad:
        return grads.numpy()
    return None


def check_dense(what: str, grad: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A push's gradient of a dense parameter (or chunk): its shape, floating point and finite.

    Raises:
        InvalidArgument: naming ``what`` and the fault.
    """
    if tuple(grad.shape) != shape:
        raise InvalidArgument(f"{what}: gradient shape {tuple(grad.shape)} != {shape}")
    if not grad.is_floating_point():
        raise InvalidArgument(f"{what}: gradient must be floating point, got {grad.dtype}")
    if not finite(grad):
        raise InvalidArgument(f"{what}: gradient contains NaN or Inf")


def check_compensation(worker_id: str, lam: float) -> None:
    """A push's ``delay_compensation`` is a finite number >= 0.

    Raises:
        InvalidArgument: anything else.
    """
    if not (lam >= 0 and math.isfinite(lam)):
        raise InvalidArgument(f"push from {worker_id!r}: delay_compensation must be a finite number >= 0, got {lam!r}")


def check_remedies(worker_id: str, remedies: Remedies) -> None:
    """A push's remedies fit together (``tether.protos.names.check_remedies``).

    Raises:
        InvalidArgument: naming the pushing worker and the bad value.
    """
    try:
        _check_remedy_values(remedies.dc, remedies.dc_adaptive, remedies.decay)
    except ValueError as exc:
        raise InvalidArgument(f"push from {worker_id!r}: {exc}") from None


def check_read(what: str, read: torch.Tensor | None, grad: torch.Tensor) -> None:
    """The values a block was read at (DC-ASGD's ``w_read``) match its gradient and are finite.

    Raises:
        InvalidArgument: another shape, not floating point, or NaN/Inf.
    """
    if read is None:
        return
    if tuple(read.shape) != tuple(grad.shape):
        raise InvalidArgument(f"{what}: read values of shape {tuple(read.shape)} do not match the gradient's {tuple(grad.shape)}")
    if not read.is_floating_point() or not bool(torch.isfinite(read).all()):
        raise InvalidArgument(f"{what}: read values must be finite floats")


def adjusted(
    target: object, optimizer: OptimizerConfig, ids: np.ndarray | None, grad: torch.Tensor, read: torch.Tensor | None,
    scale: float | np.ndarray, clock: int, remedies: Remedies | float, acted: dict[str, int] | None = None,
) -> tuple[torch.Tensor, float | np.ndarray, torch.Tensor | None, torch.Tensor | None]:
    """The gradient and learning-rate factor one block's update takes, what ``observe_step``
    needs after it, and a dense chunk's per-element factor on its step: ``scale`` times the
    schedule's factor at ``clock``; with a remedy and the values the worker read, the gradient
    compensated, or the step penalised, against the values now held (``target.pull(ids)`` for a
    table's rows, ``target.value`` for a dense chunk).

    ``remedies``: a ``Remedies``, or DC-ASGD's lambda alone. In that order: DC-ASGD
    (``delay_compensated``) or DC-ASGD-a (``dc_adaptive_compensated``, its running mean square
    updated with this gradient first), then gap-aware (``gap_penalty``): a table's rows' learning
    rates divided by their row's penalty (``scale`` becomes one factor per row), a dense chunk's
    step divided by each element's (the fourth value: ``DenseChunk.push``'s ``step_scale``; else
    None). Returns the values before the update when gap-aware needs them afterwards (else None).

    ``acted``, when given, gets per remedy that changed something (``"dc"``, ``"dc_adaptive"``,
    ``"gap_aware"``) how many of the block's rows (a table's) or elements (a dense chunk's) it
    changed: a row whose compensated gradient differs from the pushed one, a row or element whose
    step gap-aware divided (penalty > 1). One count per block, in torch (the shard's metric)."""
    if not isinstance(remedies, Remedies):
        remedies = Remedies(dc=float(remedies))
    factor = optimizer.schedule.factor(optimizer.lr, clock)
    if factor != 1.0:
        scale = scale * factor
    before = step_scale = None
    if remedies.on and read is not None and grad.numel():
        now = target.pull(ids)[0] if ids is not None else target.value.clone()  # type: ignore[attr-defined]
        g, r = grad.to(torch.float32), read.to(torch.float32)
        if remedies.dc > 0:
            if remedies.dc_adaptive:
                ms = _running_means(target, ids, MEAN_SQUARE, g * g, remedies.decay)
                compensated = dc_adaptive_compensated(g, now, r, remedies.dc, ms)
            else:
                compensated = delay_compensated(g, now, r, remedies.dc)
            if acted is not None:
                # In numpy: torch's boolean compare and any() cost ~4x as much (a 4096 x 64 block, 1 thread).
                changed = compensated.numpy() != g.numpy()
                _count(acted, "dc_adaptive" if remedies.dc_adaptive else "dc", changed.any(axis=1) if ids is not None else changed)
            g = compensated
        grad = g
        if remedies.gap_aware:
            # On the step, not the gradient: under Adagrad (the default rule) or Adam a row's
            # step hardly depends on its gradient's scale (a new row's first step is lr * sign(g)
            # at any scale), so a divided gradient was undone by the rule.
            penalty = gap_penalty(now, r, _running_means(target, ids, STEP_SIZE, None, remedies.decay))
            if acted is not None:
                _count(acted, "gap_aware", penalty.numpy() > 1.0)  # a table's penalty is a column: one per row
            if ids is not None:
                scale = scale / penalty[:, 0].numpy().astype(np.float64)
            else:
                step_scale = 1.0 / penalty
            before = now
    return grad, scale, before, step_scale


def _count(acted: dict[str, int], remedy: str, changed: np.ndarray) -> None:
    """Add ``changed``'s true values to ``acted[remedy]`` (left out while none is)."""
    n = int(np.count_nonzero(changed))
    if n:
        acted[remedy] = acted.get(remedy, 0) + n


def observe_step(target: object, ids: np.ndarray | None, before: torch.Tensor | None, decay: float) -> None:
    """Gap-aware's size of one update: the running mean (decay ``decay``) of ``|after - before|``,
    per row (the mean over its elements) or per element of a dense chunk, taken after the update
    ``adjusted`` returned ``before`` for (None: nothing to do)."""
    if before is None:
        return
    after = target.pull(ids)[0] if ids is not None else target.value  # type: ignore[attr-defined]
    _running_means(target, ids, STEP_SIZE, (after - before).abs(), decay)


def _running_means(target: object, ids: np.ndarray | None, name: str, x: torch.Tensor | None, decay: float) -> torch.Tensor:
    """The target's running mean ``name`` after taking ``x`` (None: as it is): per row of a table
    (``x``'s row means; returned as a column, rows x 1) or per element of a dense chunk."""
    if ids is None:
        return target.running_means(name, x, decay)  # type: ignore[attr-defined]
    per_row = None if x is None else x.mean(dim=1).numpy()
    return torch.from_numpy(target.running_means(name, ids, per_row, decay)).unsqueeze(1)  # type: ignore[attr-defined]


def running_mean(mean: np.ndarray, x: np.ndarray, decay: float) -> np.ndarray:
    """``decay * mean + (1 - decay) * x``, where ``mean`` is -1 (nothing yet): ``x`` (float32).

    Starting at the first value instead of 0 keeps the first steps' means from being ``1 - decay``
    of their size (Adam's bias correction does the same for its moments)."""
    x = np.asarray(x, np.float32)
    return np.where(mean < 0, x, np.float32(decay) * mean + np.float32(1 - decay) * x).astype(np.float32)


def stats_array(stats: torch.Tensor | np.ndarray) -> np.ndarray:
    """A combined push's statistics as a contiguous float32 array (no copy where they are one)."""
    if isinstance(stats, torch.Tensor):
        # A float32 tensor's own array (a push's statistics, decoded off the wire, are): each
        # torch call costs a microsecond or two a table part.
        stats = stats.numpy() if stats.dtype is torch.float32 and not stats.requires_grad else stats.detach().to(torch.float32).numpy()
    if stats.dtype is _F32 and stats.flags.c_contiguous:
        return stats
    return np.ascontiguousarray(stats, np.float32)


_F32 = np.dtype(np.float32)  # compared by identity: ``== np.float32`` costs more than the rest of the check


def apply_rows(update_rule: UpdateRule, cfg: OptimizerConfig, update: RowUpdate, weights: np.ndarray, state: Mapping[str, np.ndarray],
               slots: np.ndarray, grads: np.ndarray, lr: np.ndarray, combined: np.ndarray | torch.Tensor | None) -> None:
    """Rows ``slots`` (unique) of ``weights`` and ``state`` (float32 arrays, a table's rows: a
    tensor's ``numpy()`` shares its memory) updated from ``grads`` at rates ``lr`` (float32 per
    row, all three contiguous): by the rule's compiled kernel ``update``, except,
    with ``combined``, the rows it marks as sums of several gradients (first column not -1),
    which take the rule's combine (weight decay added once to the sum). Where the rule has a
    compiled combine, the whole push is one pass of it (it takes the rows of one gradient with
    ``rows``' step); else those rows take ``update`` and the others ``combine_rows``' torch form."""
    if combined is None:
        update(weights, state, slots, grads, lr)
        return
    stats = stats_array(combined)
    if not len(stats):
        return
    combine = _combined_update(update_rule, cfg, grads.shape[1])
    if combine is not None:
        combine(weights, state, slots, grads, lr, stats)
        return
    # The masks in numpy: torch's compare and boolean index cost 15-20 us more per table part.
    many = stats[:, 0] != -1
    nmany = int(np.count_nonzero(many))
    rows, states = torch.from_numpy(weights), {k: torch.from_numpy(t) for k, t in state.items()}  # the torch form's
    if nmany == len(many):  # every row a sum (a row cache's push at its write bound): no row gathered
        combine_rows(update_rule, cfg, rows, states, slots, grads, lr, stats)
        return
    one = ~many
    update(weights, state, np.ascontiguousarray(slots[one]), np.ascontiguousarray(grads[one]), np.ascontiguousarray(lr[one]))
    if nmany:
        combine_rows(update_rule, cfg, rows, states, slots[many], grads[many], lr[many], stats[many])


def combine_rows(update_rule: UpdateRule, cfg: OptimizerConfig, weights: torch.Tensor, state: Mapping[str, torch.Tensor],
                 slots: np.ndarray, grads: np.ndarray, lr: np.ndarray, stats: np.ndarray | torch.Tensor) -> None:
    """Rows ``slots`` (unique, int64) of ``weights`` and ``state`` (contiguous CPU float32), each
    the sum of several gradients (``stats``' first column not -1), updated in place from
    ``grads`` (rows x dim) at rates ``lr`` (float32 per row) with ``stats`` (rows x
    ``len(combined_stats)``): by the rule's compiled ``combined_rows``
    (``row_kernels.combined_update``) where it has one, else by its torch form (``apply_combined``).
    A shard's push (``apply_rows``) and local mode (``tether.worker.client.local_table``) both call it."""
    slots, grads = np.ascontiguousarray(slots, np.int64), np.ascontiguousarray(grads, np.float32)
    lr, stats_np = np.ascontiguousarray(lr, np.float32), stats_array(stats)
    combine = _combined_update(update_rule, cfg, grads.shape[1])
    if combine is not None:
        combine(weights.numpy(), {k: t.numpy() for k, t in state.items()}, slots, grads, lr, stats_np)
        return
    idx = torch.from_numpy(slots)
    w, g = weights.index_select(0, idx), torch.from_numpy(grads)
    rows = {k: t.index_select(0, idx) for k, t in state.items()}
    update_rule.apply_combined(cfg, w, g, torch.from_numpy(stats_np), rows, torch.from_numpy(lr.astype(np.float64) / cfg.lr))
    weights.index_copy_(0, idx, w)
    for k, t in state.items():
        t.index_copy_(0, idx, rows[k])


# ``row_kernels.combined_update`` bound once per rule, config and width, by the objects'
# identity (hashing an ``OptimizerConfig``, a dataclass of every rule's settings, on every push
# cost more than the lookup): each entry keeps its config, so its id is not reused while cached.
_BOUND: dict[tuple[int, int, int], tuple[OptimizerConfig, CombinedUpdate | None]] = {}
_BOUND_MAX = 256


def _combined_update(update_rule: UpdateRule, cfg: OptimizerConfig, dim: int) -> CombinedUpdate | None:
    key = (id(update_rule), id(cfg), dim)
    got = _BOUND.get(key)
    if got is None or got[0] is not cfg:
        if len(_BOUND) >= _BOUND_MAX:
            _BOUND.clear()
        got = _BOUND[key] = (cfg, combined_update(update_rule, cfg, dim))
    return got[1]


def delay_compensated(g: torch.Tensor, w_now: torch.Tensor, w_read: torch.Tensor, lam: float) -> torch.Tensor:
    """DC-ASGD's gradient (Zheng et al., ICML 2017, eq. 10 with the diagonal approximation):
    ``g + lam * g * g * (w_now - w_read)``, where ``w_read`` are the parameters the gradient
    was computed on and ``w_now`` the shard's current ones (a new tensor; float32)."""
    return torch.addcmul(g, g * g, w_now - w_read, value=lam)


def dc_adaptive_compensated(
    g: torch.Tensor, w_now: torch.Tensor, w_read: torch.Tensor, lam0: float, mean_square: torch.Tensor,
) -> torch.Tensor:
    """DC-ASGD-a's gradient (Zheng et al., ICML 2017, section 4, the adaptive lambda):
    ``g + lam0 / sqrt(mean_square + eps) * g * g * (w_now - w_read)``, ``mean_square`` the running
    mean of ``g * g`` (this gradient included), per row (a column) or per element. Relative to
    ``g`` the term is about ``lam0 * |g| / rms(g) * (w_now - w_read)``: it does not shrink with the
    gradient's scale as DC-ASGD's ``lam * g * g`` does. Per element, with this gradient in the mean
    (decay m), it is at most ``lam0 / sqrt(1 - m) * |g| * |w_now - w_read|`` (a new tensor; float32)."""
    return torch.addcmul(g, g * g * (lam0 / torch.sqrt(mean_square + MS_EPS)), w_now - w_read)


def gap_penalty(w_now: torch.Tensor, w_read: torch.Tensor, step_size: torch.Tensor) -> torch.Tensor:
    """Gap-aware's penalty (Barkai et al., ICLR 2020): the gap in units of one update,
    ``max(1, |w_now - w_read| / C)``, ``C`` the running mean size of one update; what a stale
    push's step is divided by. Per element of a dense chunk (``step_size`` per element); per row of
    a table (``step_size`` a column, the mean over the row's elements), from the row's mean gap
    (a column). ``C`` <= 0: not known yet, no penalty. The paper's penalty is ``1 + |gap| / C``;
    the floor at 1 instead leaves a push whose parameters moved less than one typical update as it
    is (the ``1 +`` form cut every overtaken push, and cost at the default rate in
    bench/RESULTS.md's measurement of it). A new tensor; float32."""
    gap = (w_now - w_read).abs()
    if step_size.dim() == 2 and gap.dim() == 2:
        gap = gap.mean(dim=1, keepdim=True)
    known = step_size > 0
    ratio = gap / torch.where(known, step_size, torch.ones_like(step_size))
    return torch.where(known, ratio.clamp(min=1.0), torch.ones_like(ratio))


def gap_penalized(g: torch.Tensor, w_now: torch.Tensor, w_read: torch.Tensor, step_size: torch.Tensor) -> torch.Tensor:
    """``g`` divided by its ``gap_penalty`` (the step of plain SGD, whose step is the gradient's
    scale; the shard penalises the step itself, see ``adjusted``). A new tensor; float32."""
    return g / gap_penalty(w_now, w_read, step_size)
