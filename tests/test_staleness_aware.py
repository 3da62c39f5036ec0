"""Staleness-aware learning rates (Zhang et al. 2016) on the shard itself.

Simulated Hogwild: W workers take turns; each reads the dense parameters, and its gradient
is pushed only after the other W-1 workers have pushed theirs, so every push is W-1 updates
stale. With a step size that is stable without staleness, plain SGD then oscillates and
diverges on a stiff quadratic; dividing by the staleness converges.
"""

from __future__ import annotations

from collections import deque

import torch

from tether.protos.specs import OptimizerConfig
from tether.server.shard import DenseDecl, DenseUpdate, Shard

DIM = 20
STALENESS_WORKERS = 16
STEPS = 600


def _run(staleness_aware: bool) -> tuple[float, int]:
    torch.manual_seed(0)
    curvature = torch.linspace(0.5, 3.0, DIM)  # f(w) = 0.5 * sum(c * w^2)
    shard = Shard()
    shard.declare([], [DenseDecl("w", 0, torch.ones(DIM), OptimizerConfig("sgd", lr=0.3))])
    chunk = shard.dense[("w", 0)]
    in_flight: deque[tuple[torch.Tensor, int]] = deque()
    max_seen = 0
    for seq in range(1, STEPS + 1):
        w, version = chunk.pull()
        in_flight.append((curvature * w.clone(), version))
        if len(in_flight) == STALENESS_WORKERS:
            grad, read_version = in_flight.popleft()
            result = shard.push("w", seq, [], [DenseUpdate("w", 0, grad, read_version)], staleness_aware=staleness_aware, incarnation=1)
            max_seen = max(max_seen, result.max_staleness)
        value = float(0.5 * (curvature * chunk.pull()[0] ** 2).sum())
        if not value < 1e6:
            return float("inf"), max_seen
    return value, max_seen


def test_staleness_aware_lr_converges_where_plain_does_worse() -> None:
    plain, plain_staleness = _run(staleness_aware=False)
    aware, aware_staleness = _run(staleness_aware=True)
    start = float(0.5 * torch.linspace(0.5, 3.0, DIM).sum())
    assert plain_staleness == aware_staleness == STALENESS_WORKERS - 1
    assert aware < 1e-3 * start, aware
    assert plain > 10 * start, plain  # diverged (or blew up to inf)


def test_without_staleness_both_rules_are_the_same() -> None:
    shard = Shard()
    shard.declare([], [DenseDecl("w", 0, torch.ones(4), OptimizerConfig("sgd", lr=0.5))])
    chunk = shard.dense[("w", 0)]
    for seq in range(1, 4):
        _, version = chunk.pull()
        shard.push("w", seq, [], [DenseUpdate("w", 0, torch.ones(4), version)], staleness_aware=True, incarnation=1)
    assert chunk.pull()[0].tolist() == [-0.5] * 4
