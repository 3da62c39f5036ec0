"""The worker row cache's compiled passes, warm against cold (issue 41 item 3): is a cached step's
time the passes' arithmetic or the memory they wait for?

Runs worker 0's CTR id stream through a ``CachedClient`` (``bench/push_path.py``'s loop, cache
20/20), keeps the arguments of the last step's ``plan_all``, ``store_all`` and ``hold_all`` (with the local rule's step), then
calls each pass again on them: **warm**, back to back (the rows stay in the CPU's caches), and
**cold**, with ``--flush-mib`` of other memory written before each call (what the rest of a
training step does to the caches). Thread CPU ms a call, the mean over ``--calls``.

    python bench/cache_passes.py [--steps 400] [--calls 200] [--flush-mib 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import push_path
import traffic

from tether.worker.cache import row_cache
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.slots import warm_up

PASSES = ("plan_all", "store_all", "hold_all")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--flush-mib", type=int, default=64)
    a = p.parse_args(argv)
    warm_up()
    kept: dict[str, tuple[Any, ...]] = {}
    real: dict[str, Callable[..., Any]] = {name: getattr(row_cache, name) for name in PASSES}

    def keeping(name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            kept[name] = args
            return real[name](*args)
        return call

    for name in PASSES:
        setattr(row_cache, name, keeping(name))
    steps, dims, label = traffic.ctr_steps(a.steps)
    push_path.run(steps, dims, RowCacheConfig(rows=100_000, bound=20, write_bound=20))
    for name in PASSES:
        setattr(row_cache, name, real[name])
    junk = np.ones(a.flush_mib << 20, np.uint8)
    print(f"{label}: cache 20/20, the arguments of step {a.steps}'s passes ({len(kept['plan_all'][6])} ids pulled); "
          f"thread CPU ms a call, mean of {a.calls}")
    print("| pass | warm | cold | cold / warm |")
    print("|---|---|---|---|")
    for name in PASSES:
        f, args = real[name], kept[name]
        f(*args)
        t0 = time.thread_time()
        for _ in range(a.calls):
            f(*args)
        warm = (time.thread_time() - t0) / a.calls
        cold = 0.0
        for _ in range(a.calls):
            junk += 1  # the rest of a step's memory traffic
            t0 = time.thread_time()
            f(*args)
            cold += time.thread_time() - t0
        cold /= a.calls
        print(f"| {name} | {warm * 1e3:.3f} | {cold * 1e3:.3f} | {cold / warm:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
