"""The row cache's first steps against its steady state (issue 41 item 3), beside no cache: the
client's thread CPU per step of the async loop, chunk by chunk, from a new cache.

Worker 0 of 4's ids of the default CTR job go through a ``CachedClient`` in front of
``bench/push_path.py``'s stand-in client (the real ``Router``, requests serialized, answered at
once), in the async loop's order, ``--steps`` steps; every ``--chunk`` steps the loop's thread CPU
per step is printed for no cache and for the cache at 20/20 (recurring admission, ``--cache-rows``
rows a table), and the ratio of the first chunk to the median of the others. A cache that costs
more at its start than later (rows placed, slot arrays faulted in) shows it in the first chunks;
a job of a few hundred steps (``bench/cache_ceiling.py``'s default) pays that share in full.

    python bench/cache_warmup.py [--steps 1200] [--chunk 100]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import push_path
import traffic

from tether.protos.specs import TableConfig
from tether.worker.cache.client import CachedClient
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.slots import warm_up
from tether.worker.client.traffic import TrafficMeter


def chunks(steps: list[dict[str, torch.Tensor]], dims: dict[str, int], config: RowCacheConfig, chunk: int) -> list[float]:
    """Thread CPU ms per step of the loop, per ``chunk`` steps, from a new client and cache."""
    gen = torch.Generator().manual_seed(0)
    client = CachedClient(push_path.RouterStandIn(dims, hashlib.sha256()), config, dims,  # type: ignore[arg-type]
                          TrafficMeter(dims, 4, reuse=False))
    client.use_tables([TableConfig(name=t, dim=d) for t, d in dims.items()])
    pending = [client.pull(steps[0]), client.pull(steps[1])]
    out: list[float] = []
    start = time.thread_time()
    for t in range(len(steps)):
        pulled = pending.pop(0).result()
        grads = {k: (ids, torch.randn(len(ids), dims[k], generator=gen)) for k, ids in steps[t].items()}
        if t + 2 < len(steps):
            pending.append(client.push_pull(grads, None, steps[t + 2], clock=t + 1, versions=pulled))
        else:
            client.push(grads, None, clock=t + 1, versions=pulled).result()
        if (t + 1) % chunk == 0:
            now = time.thread_time()
            out.append(1e3 * (now - start) / chunk)
            start = now
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--chunk", type=int, default=100)
    p.add_argument("--cache-rows", type=int, default=100_000)
    a = p.parse_args(argv)
    if a.chunk < 1 or a.steps < 2 * a.chunk:
        p.error(f"--steps must hold at least two chunks of --chunk steps, got --steps {a.steps} --chunk {a.chunk}")
    warm_up()
    steps, dims, name = traffic.ctr_steps(a.steps)
    print(f"{name}: the loop's thread CPU ms a step, per {a.chunk} steps, from a new client", flush=True)
    for label, config in (("no cache", RowCacheConfig()),
                          ("cache 20/20", RowCacheConfig(rows=a.cache_rows, bound=20, write_bound=20, admission="recurring"))):
        got = chunks(steps, dims, config, a.chunk)
        later = statistics.median(got[1:])
        print(f"{label:12s} {' '.join(f'{x:.2f}' for x in got)}; first / later {got[0] / later:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
