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

from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.slots import warm_up


def chunks(steps: list[dict[str, torch.Tensor]], dims: dict[str, int], config: RowCacheConfig, chunk: int) -> list[float]:
    """Thread CPU ms per step of the loop, per ``chunk`` steps, from a new client and cache."""
    client = push_path.stand_in_client(dims, config, hashlib.sha256())
    out: list[float] = []
    start = time.thread_time()
    for t in push_path.async_loop(client, steps, dims):
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
