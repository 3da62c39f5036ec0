"""A shard's update of one table part of a combined push (issue 29's row cache), with each rule's
compiled combine (``UpdateRule.combined_rows``, ``tether.rules.row_kernels.combined_update``)
beside its torch form (``UpdateRule.apply_combined``), side by side in one process.

A part is ``--rows`` rows of ``--dim`` floats out of a 10,000-row table, half of them sums of
several gradients (Adam's counts 2 to 5) and half single gradients (the rule's row kernel either
way), weight decay 0.01, applied by ``tether.rules.push_hooks.apply_rows``: the compiled path as a
shard runs it, and the same call for a copy of the rule without its compiled combine (the torch
form). The two
alternate, ``--rounds`` rounds of ``--calls`` calls each; prints each side's median time per
part and the ratio torch / compiled for every rule with a compiled combine.

Run: ``python bench/combine_rows.py [--rows 130] [--dim 16] [--rounds 40] [--calls 200]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from tether.protos.names import OPTIMIZERS
from tether.protos.specs import OptimizerConfig
from tether.rules.optimizers import rule
from tether.rules.push_hooks import apply_rows
from tether.rules.row_kernels import row_update
from tether.rules.update_rules import UpdateRule


def per_call(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=130)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in OPTIMIZERS:
        r, cfg = rule(name), OptimizerConfig(name=name, lr=0.05, weight_decay=0.01)
        if r.combined_rows is None:
            continue
        gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
        w = torch.randn(10_000, args.dim, generator=gen)
        state = {k: torch.rand((10_000, *s), generator=gen) + 0.1 for k, s in r.state_shapes(args.dim).items()}
        arrays = {k: t.numpy() for k, t in state.items()}  # as a table keeps them
        slots = np.sort(rng.choice(10_000, args.rows, replace=False)).astype(np.int64)
        grads = (rng.standard_normal((args.rows, args.dim)) * 0.01).astype(np.float32)
        stats = torch.rand(args.rows, len(r.combined_stats), generator=gen)
        if r.combined_stats[0] == "count":
            stats[:, 0] = torch.randint(2, 6, (args.rows,), generator=gen).float()
        stats[::2, 0] = -1  # half the rows hold one gradient
        lr, update = np.full(args.rows, 0.05, np.float32), row_update(r, cfg, args.dim)
        as_torch = copy.copy(r)  # the same rule with no compiled combine: apply_rows takes its torch form
        as_torch.combined_rows = None

        def part(the_rule: UpdateRule) -> Callable[[], None]:
            return lambda: apply_rows(the_rule, cfg, update, w.numpy(), arrays, slots, grads, lr, stats)  # noqa: B023 - called in this iteration

        sides: dict[str, list[float]] = {"compiled": [], "torch": []}
        for _ in range(args.rounds):
            sides["compiled"].append(per_call(part(r), args.calls))
            sides["torch"].append(per_call(part(as_torch), args.calls))
        c, t = statistics.median(sides["compiled"]) * 1e6, statistics.median(sides["torch"]) * 1e6
        print(f"{name:>16}: compiled {c:7.1f} us, torch form {t:7.1f} us per {args.rows} x {args.dim} part "
              f"({args.rows // 2} combined), torch/compiled {t / c:.1f}x "
              f"(medians of {args.rounds} alternating rounds of {args.calls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
