"""The row cache in real jobs (issue 29 item 4): held-out loss and samples/s with and without the
cache, side by side in one invocation, for the default CTR job and the MovieLens-format example
(4 workers x 2 shards, async, on this machine). The rows and bytes moved at each bound do not
depend on the machine: bench/traffic.py gives them for the same id streams.

    python bench/row_cache.py                    # both jobs, bound 20 beside no cache, 300 steps, 1 round
    python bench/row_cache.py --job ctr --bounds 5,20,20/2 --steps 200 --rounds 3

Each round runs both configurations (the order alternates between rounds) in fresh clusters.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from tether.deploy.job import run_job
from tether.deploy.launch import Program
from tether.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "movielens_two_tower"))
from movielens import write_ratings  # noqa: E402

WORKERS, SHARDS = 4, 2


def _job(kind: str, template: WorkerConfig, folder: Path, ratings: Path, shards: int = SHARDS) -> tuple[float, float]:
    """(held-out loss, samples/s) of one job."""
    program = Program.script(str(ROOT / "examples" / "movielens_two_tower" / "train.py"), ["--data", str(ratings)]) \
        if kind == "movielens" else None
    summary: dict[str, Any] = run_job(template, shards, out=folder, timeout_s=1800, echo=False, program=program)
    loss = summary["final_eval"]["eval_mse"] if kind == "movielens" else summary["eval_loss"]
    return float(loss), float(summary["samples_per_sec"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", action="append", choices=("ctr", "movielens"), help="repeatable; default both")
    p.add_argument("--bounds", default="20", help="cache bounds to run beside no cache: R (read = write bound) or R/W, "
                   "comma list; default 20")
    p.add_argument("--cache-rows", type=int, default=100_000, help="rows per table, default 100000")
    p.add_argument("--steps", type=int, default=300, help="steps per worker, default 300")
    p.add_argument("--rounds", type=int, default=1, help="rounds of both configurations, default 1")
    p.add_argument("--workers", type=int, default=WORKERS, help=f"workers, default {WORKERS}")
    p.add_argument("--shards", type=int, default=SHARDS, help=f"shards, default {SHARDS}")
    a = p.parse_args(argv)
    try:
        bounds = [tuple(int(x) for x in b.split("/")) for b in a.bounds.split(",") if b.strip()]
    except ValueError:
        p.error(f"--bounds: R or R/W integers, comma list; got {a.bounds!r}")
    if any(len(b) > 2 or min(b) < 0 for b in bounds) or a.steps < 2 or a.rounds < 1 or min(a.workers, a.shards) < 1:
        p.error("--bounds R or R/W >= 0, --steps >= 2, --rounds, --workers and --shards >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        ratings = Path(tmp) / "ratings.dat"
        write_ratings(ratings, 100_000, num_users=943, num_movies=1682, seed=0)
        for kind in a.job or ["ctr", "movielens"]:
            base = WorkerConfig(shards=("127.0.0.1:1",), num_workers=a.workers, mode="async", steps=a.steps, log_every=10**6,
                                eval_every=0, seed=0)
            configs = {"no cache": base}
            for b in bounds:
                configs["cache " + "/".join(map(str, b))] = replace(base, cache_rows=a.cache_rows, cache_bound=b[0],
                                                                   cache_write_bound=b[-1])
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
            for r in range(a.rounds):
                names = list(configs) if r % 2 == 0 else list(reversed(list(configs)))
                for name in names:
                    results[name].append(_job(kind, configs[name], Path(tmp) / f"{kind}-{r}-{name.replace(' ', '-').replace('/', '-')}", ratings, a.shards))
                    loss, sps = results[name][-1]
                    print(f"{kind} round {r + 1} {name}: held-out loss {loss:.5f}, {sps:,.0f} samples/s", flush=True)
            l0, s0 = (statistics.median(x for x, _ in results["no cache"]), statistics.median(y for _, y in results["no cache"]))
            for name, v in results.items():
                l1, s1 = statistics.median(x for x, _ in v), statistics.median(y for _, y in v)
                print(f"{kind} ({a.workers} workers x {a.shards} shards, async, {a.steps} steps, median of {a.rounds}) {name}: "
                      f"loss {l1:.5f} ({(l1 / l0 - 1):+.2%} vs no cache), {s1:,.0f} samples/s ({s1 / s0:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
