"""The rules' compiled combine of a combined push's rows (``UpdateRule.combined_rows``, compiled
and bound by ``tether.server.kernels.combined_update``, for the row cache's pushes) against their
torch form (``UpdateRule.apply_combined``), for every registered rule that has one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tether.protos.optimizers import OPTIMIZERS, OptimizerConfig, rule
from tether.server.kernels import combined_update

WITH_KERNEL = [name for name in OPTIMIZERS if rule(name).combined_rows is not None]


def test_the_rules_with_a_compiled_combine() -> None:
    assert WITH_KERNEL == ["adagrad", "rowwise_adagrad"]


@pytest.mark.parametrize("name", WITH_KERNEL)
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_compiled_combine_is_the_torch_form(name: str, weight_decay: float) -> None:
    r, cfg, dim = rule(name), OptimizerConfig(name=name, lr=0.05, weight_decay=weight_decay), 16
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(50, dim, generator=gen)
    state = {k: torch.rand((50, *shape), generator=gen) + 0.1 for k, shape in r.state_shapes(dim).items()}
    slots = np.array([3, 7, 8, 20, 41], np.int64)
    grads = torch.randn(len(slots), dim, generator=gen)
    grads[2] = 0.0  # the gradients cancelled: the square sum spread evenly
    stats = torch.rand(len(slots), len(r.combined_stats), generator=gen) * 4
    lr = np.array([0.05, 0.05, 0.025, 0.05, 0.01], np.float32)
    start, start_state = weights.clone(), {k: v.clone() for k, v in state.items()}
    want_w, want_state = weights.clone(), {k: v.clone() for k, v in state.items()}
    idx = torch.from_numpy(slots)
    w, rows = want_w.index_select(0, idx), {k: v.index_select(0, idx) for k, v in want_state.items()}
    r.apply_combined(cfg, w, grads.clone(), stats, rows, torch.from_numpy(lr.astype(np.float64) / cfg.lr))
    want_w.index_copy_(0, idx, w)
    for k, v in want_state.items():
        v.index_copy_(0, idx, rows[k])
    update = combined_update(r, cfg, dim)
    assert update is not None
    update(weights.numpy(), {k: v.numpy() for k, v in state.items()}, slots, grads.numpy(), lr, stats.numpy())
    assert int((weights[idx] != start[idx]).any(1).sum()) >= 4  # the rows moved (all but, without decay, the cancelled one)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    for k in state:
        torch.testing.assert_close(state[k], want_state[k], rtol=1e-5, atol=1e-6)
        assert bool((state[k][idx] > start_state[k][idx]).all()), k  # every row's sum grew
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(weights[untouched], want_w[untouched])


def test_rules_without_a_compiled_combine_get_none() -> None:
    without = [name for name in OPTIMIZERS if name not in WITH_KERNEL]
    assert without == ["sgd", "adam", "ftrl"]
    for name in without:
        assert combined_update(rule(name), OptimizerConfig(name=name, lr=0.1), 4) is None
