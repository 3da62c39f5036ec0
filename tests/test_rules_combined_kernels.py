"""The rules' compiled combine of a combined push's rows (``UpdateRule.combined_rows``, compiled
and bound by ``tether.rules.row_kernels.combined_update``, for the row cache's pushes) against
their torch form (``UpdateRule.apply_combined``), for every registered rule that has one: alone,
and in a push whose rows are partly combined (``push_hooks.apply_rows``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tether.protos.names import OPTIMIZERS
from tether.protos.specs import OptimizerConfig
from tether.rules.optimizers import rule
from tether.rules.push_hooks import apply_rows
from tether.rules.row_kernels import combined_update, row_update
from tether.rules.update_rules import UpdateRule

WITH_KERNEL = [name for name in OPTIMIZERS if rule(name).combined_rows is not None]
ROWS, DIM = 50, 16
# Constants other than the defaults, for the rules that take them (FTRL's general power).
OTHER = {"adam": {"beta1": 0.5, "beta2": 0.8, "eps": 1e-3}, "ftrl": {"beta": 0.5, "l1": 0.05, "l2": 0.1, "lr_power": -0.6},
         "adagrad": {"eps": 1e-3}, "rowwise_adagrad": {"eps": 1e-3}}



def _arrays(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A table's state as ``apply_rows`` takes it (arrays sharing the tensors' memory)."""
    return {k: t.numpy() for k, t in state.items()}

def test_the_rules_with_a_compiled_combine() -> None:
    assert WITH_KERNEL == ["adagrad", "adam", "rowwise_adagrad", "ftrl"]


def _state(r: UpdateRule, gen: torch.Generator) -> dict[str, torch.Tensor]:
    state = {k: torch.rand((ROWS, *shape), generator=gen) + 0.1 for k, shape in r.state_shapes(DIM).items()}
    if "t" in state:  # Adam's step count: whole steps
        state["t"] = torch.randint(0, 30, (ROWS,), generator=gen).float()
    return state


def _stats(r: UpdateRule, rows: int, gen: torch.Generator) -> torch.Tensor:
    stats = torch.rand(rows, len(r.combined_stats), generator=gen) * 4
    if r.combined_stats[0] == "count":  # Adam: how many gradients were summed (2 to 5)
        stats[:, 0] = torch.randint(2, 6, (rows,), generator=gen).float()
    return stats


def _torch_form(r: UpdateRule, cfg: OptimizerConfig, weights: torch.Tensor, state: dict[str, torch.Tensor], slots: np.ndarray,
                grads: torch.Tensor, stats: torch.Tensor, lr: np.ndarray) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``apply_combined`` on rows ``slots`` of copies of ``weights`` and ``state``, as
    ``push_hooks.combine_rows`` calls it."""
    want_w, want_state = weights.clone(), {k: v.clone() for k, v in state.items()}
    idx = torch.from_numpy(slots)
    w, rows = want_w.index_select(0, idx), {k: v.index_select(0, idx) for k, v in want_state.items()}
    r.apply_combined(cfg, w, grads.clone(), stats, rows, torch.from_numpy(lr.astype(np.float64) / cfg.lr))
    want_w.index_copy_(0, idx, w)
    for k, v in want_state.items():
        v.index_copy_(0, idx, rows[k])
    return want_w, want_state


def _assert_same(weights: torch.Tensor, state: dict[str, torch.Tensor], want_w: torch.Tensor, want_state: dict[str, torch.Tensor],
                 slots: np.ndarray) -> None:
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    for k in state:
        torch.testing.assert_close(state[k], want_state[k], rtol=1e-5, atol=1e-6)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[torch.from_numpy(slots)] = False
    assert torch.equal(weights[untouched], want_w[untouched])


@pytest.mark.parametrize("constants", ["defaults", "other"])
@pytest.mark.parametrize("name", WITH_KERNEL)
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_compiled_combine_is_the_torch_form(name: str, weight_decay: float, constants: str) -> None:
    extra: dict[str, Any] = OTHER[name] if constants == "other" else {}
    r, cfg = rule(name), OptimizerConfig(name=name, lr=0.05, weight_decay=weight_decay, **extra)
    gen = torch.Generator().manual_seed(3)
    weights, state = torch.randn(ROWS, DIM, generator=gen), _state(r, gen)
    slots = np.array([3, 7, 8, 20, 41], np.int64)
    grads = torch.randn(len(slots), DIM, generator=gen)
    grads[2] = 0.0  # the gradients cancelled: the square sum spread evenly
    stats = _stats(r, len(slots), gen)
    lr = np.array([0.05, 0.05, 0.025, 0.05, 0.01], np.float32)
    start, start_state = weights.clone(), {k: v.clone() for k, v in state.items()}
    want_w, want_state = _torch_form(r, cfg, weights, state, slots, grads, stats, lr)
    update = combined_update(r, cfg, DIM)
    assert update is not None
    update(weights.numpy(), {k: v.numpy() for k, v in state.items()}, slots, grads.numpy(), lr, stats.numpy())
    idx = torch.from_numpy(slots)
    assert int((weights[idx] != start[idx]).any(1).sum()) >= 4  # the rows moved (all but, without decay, the cancelled one)
    _assert_same(weights, state, want_w, want_state, slots)
    for k in state:
        changed = state[k][idx] != start_state[k][idx]
        assert bool((changed.any(1) if changed.dim() > 1 else changed).all()), k  # every row's state moved
    if name == "adam":  # t counted each row's k steps
        assert torch.equal(state["t"][idx] - start_state["t"][idx], stats[:, 0])


@pytest.mark.parametrize("name", WITH_KERNEL)
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_a_push_of_combined_and_single_rows_is_the_torch_form(name: str, weight_decay: float) -> None:
    """A push whose rows are partly sums (``stats`` first column not -1) and partly single
    gradients (-1), at rates that differ per row (one of them 0): the single rows take the
    rule's row kernel, the others its compiled combine, and together they are the torch form's
    ``apply_combined`` over the whole push."""
    r, cfg = rule(name), OptimizerConfig(name=name, lr=0.05, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(11)
    weights, state = torch.randn(ROWS, DIM, generator=gen), _state(r, gen)
    slots = np.array([0, 2, 5, 9, 13, 17, 30, 31, 44, 49], np.int64)
    grads = torch.randn(len(slots), DIM, generator=gen)
    stats = _stats(r, len(slots), gen)
    stats[::2, 0] = -1  # half the rows hold one gradient
    lr = np.array([0.05, 0.04, 0.05, 0.0, 0.05, 0.02, 0.05, 0.05, 0.01, 0.05], np.float32)
    want_w, want_state = _torch_form(r, cfg, weights, state, slots, grads, stats, lr)
    start = weights.clone()
    apply_rows(r, cfg, row_update(r, cfg, DIM), weights.numpy(), _arrays(state), slots, grads.numpy(), lr, stats)
    _assert_same(weights, state, want_w, want_state, slots)
    moved = (weights != start).any(1)[torch.from_numpy(slots)]
    assert int(moved.sum()) >= 9  # every row but (FTRL) the one at rate 0


@pytest.mark.parametrize("name", WITH_KERNEL)
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_single_rows_of_a_mixed_push_take_the_row_kernel_bit_for_bit(name: str, weight_decay: float) -> None:
    """A push whose rows are partly sums is one pass of the compiled combine (``apply_rows``):
    its rows of one gradient (-1) end exactly where the rule's row kernel puts them alone, and
    its sums exactly where the compiled combine puts them alone."""
    r, cfg = rule(name), OptimizerConfig(name=name, lr=0.05, weight_decay=weight_decay, **OTHER[name])
    gen = torch.Generator().manual_seed(12)
    weights, state = torch.randn(ROWS, DIM, generator=gen), _state(r, gen)
    slots = np.array([1, 3, 4, 8, 13, 20, 21, 33, 40, 47, 48], np.int64)
    grads = torch.randn(len(slots), DIM, generator=gen).numpy()
    stats = _stats(r, len(slots), gen).numpy()
    one = np.zeros(len(slots), bool)
    one[[0, 2, 3, 7, 10]] = True
    stats[one, 0] = -1
    lr = np.linspace(0.01, 0.05, len(slots), dtype=np.float32)
    want_w, want_state = weights.clone(), {k: v.clone() for k, v in state.items()}
    row_update(r, cfg, DIM)(want_w.numpy(), {k: v.numpy() for k, v in want_state.items()}, slots[one], grads[one], lr[one])
    many = ~one
    combined_update(r, cfg, DIM)(want_w.numpy(), {k: v.numpy() for k, v in want_state.items()},  # type: ignore[misc]
                                 slots[many], np.ascontiguousarray(grads[many]), lr[many], np.ascontiguousarray(stats[many]))
    apply_rows(r, cfg, row_update(r, cfg, DIM), weights.numpy(), _arrays(state), slots, grads, lr, stats)
    assert torch.equal(weights, want_w) and all(torch.equal(state[k], want_state[k]) for k in state)
    assert bool((weights[torch.from_numpy(slots)] != torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(12))[
        torch.from_numpy(slots)]).any(1).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_statistics_of_another_float_type_are_taken_as_float32(dtype: torch.dtype) -> None:
    r, cfg = rule("adam"), OptimizerConfig(name="adam", lr=0.05)
    gen = torch.Generator().manual_seed(5)
    weights, state = torch.randn(ROWS, DIM, generator=gen), _state(r, gen)
    slots, grads = np.array([1, 4, 6, 9], np.int64), torch.randn(4, DIM, generator=gen).numpy()
    stats = _stats(r, 4, gen).to(dtype)
    stats[0, 0] = -1
    lr = np.full(4, 0.05, np.float32)
    want_w, want_state = weights.clone(), {k: v.clone() for k, v in state.items()}
    apply_rows(r, cfg, row_update(r, cfg, DIM), want_w.numpy(), _arrays(want_state), slots, grads, lr, stats.to(torch.float32))
    apply_rows(r, cfg, row_update(r, cfg, DIM), weights.numpy(), _arrays(state), slots, grads, lr, stats)
    assert torch.equal(weights, want_w) and not torch.equal(weights[1], torch.zeros(DIM))
    assert all(torch.equal(state[k], want_state[k]) for k in state)


def test_rules_without_a_compiled_combine_get_none() -> None:
    without = [name for name in OPTIMIZERS if name not in WITH_KERNEL]
    assert without == ["sgd"]  # the sum alone is its k steps: it takes no statistics
    assert rule("sgd").combined_stats == ()
    assert combined_update(rule("sgd"), OptimizerConfig(name="sgd", lr=0.1), 4) is None
