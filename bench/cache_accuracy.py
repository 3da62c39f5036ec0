"""The row cache's accuracy with several workers (issue 41 item 3): the MovieLens-format example's
held-out MSE and RMSE (the final model as the shards hold it once every worker finished) with no
cache and with the cache at each bound, over several seeds (each seed: the model's initial rows and
every worker's data order), and the bytes each cache saves against no cache (every worker's
traffic record: rows and combined-push statistics pulled and pushed).

The ratings are the real MovieLens 100K where ``--ratings`` names its ``u.data`` (GroupLens
publishes it at https://grouplens.org/datasets/movielens/100k/; its licence allows no copy here),
else the example's synthetic MovieLens-format data at its shape (100,000 ratings, 943 users,
1,682 movies; `movielens.write_ratings`). Every 10th line is held out either way.

    python bench/cache_accuracy.py --seeds 0,1,2 --bounds 20,20/0,5 --steps 300
    python bench/cache_accuracy.py --ratings ml-100k/u.data --seeds 0,1,2 --bounds 20,5
    python bench/cache_accuracy.py --seeds 0,1,2 --bounds 20 --extra 'hot 8={"cache_bound": 20, "cache_hot": 8}' --json out.json

Each (seed, configuration) is one `tether launch`-equivalent job (4 workers x 2 shards, async, the
default Adagrad unless ``--optimizer``); the configurations' order alternates between seeds. The
report gives, per configuration, the mean and spread (min..max) of the held-out RMSE, and of its
change against no cache of the same seed (paired), and the bytes saved.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "examples" / "movielens_two_tower"))

from movielens import write_ratings  # noqa: E402
from row_cache import _job  # noqa: E402

from tether.worker.config import WorkerConfig  # noqa: E402


def _bytes(folder: Path, workers: int) -> int:
    """Bytes every worker pulled and pushed (its run record's traffic)."""
    total = 0
    for i in range(workers):
        record = json.loads((folder / f"worker-{i}.json").read_text())
        total += sum(t["pulled_bytes"] + t["pushed_bytes"] for t in record["traffic"].values())
    return total


def _configs(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    configs: dict[str, dict[str, Any]] = {"no cache": {}}
    for b in a.bounds.split(","):
        if b.strip():
            r, *w = (int(x) for x in b.split("/"))
            configs[f"cache {r}/{w[0] if w else r}"] = {"cache_rows": a.cache_rows, "cache_bound": r, "cache_write_bound": w[0] if w else r}
    for extra in a.extra or []:
        name, _, fields = extra.partition("=")
        kw = json.loads(fields)
        configs[name.strip()] = {"cache_rows": a.cache_rows, **kw}
    return configs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma list, default 0,1,2")
    p.add_argument("--bounds", default="20,20/0,5", help="R or R/W, comma list; default 20,20/0,5")
    p.add_argument("--extra", action="append", help='NAME={"worker_config_field": value, ...}: another cached configuration')
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--cache-rows", type=int, default=100_000)
    p.add_argument("--optimizer", default="adagrad")
    p.add_argument("--json", metavar="FILE", help="also write every run here")
    p.add_argument("--ratings", type=Path, metavar="FILE",
                   help="a real ratings file (MovieLens 100K's u.data, or any format movielens.read_ratings takes); default: synthetic")
    a = p.parse_args(argv)
    if a.ratings is not None and not a.ratings.is_file():
        p.error(f"--ratings {a.ratings}: no such file")
    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    configs = _configs(a)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        ratings = a.ratings.resolve() if a.ratings is not None else Path(tmp) / "ratings.dat"
        if a.ratings is None:
            write_ratings(ratings, 100_000, num_users=943, num_movies=1682, seed=0)
        for n, seed in enumerate(seeds):
            names = list(configs) if n % 2 == 0 else list(reversed(list(configs)))
            for name in names:
                folder = Path(tmp) / f"s{seed}-{name.replace(' ', '-').replace('/', '-')}"
                kw = {"num_workers": a.workers, "mode": "async", "steps": a.steps, "log_every": 10**6, "eval_every": 0, "seed": seed,
                      "optimizer": a.optimizer, **configs[name]}
                mse, sps, _ = _job("movielens", WorkerConfig(shards=("127.0.0.1:1",), **kw), folder, ratings, a.shards)
                got = {"seed": seed, "mse": mse, "rmse": math.sqrt(mse), "bytes": _bytes(folder, a.workers), "samples_per_sec": sps}
                runs[name].append(got)
                print(f"seed {seed} {name}: held-out RMSE {got['rmse']:.5f} (MSE {mse:.5f}), {got['bytes'] / 2**20:.1f} MiB moved",
                      flush=True)
    base = {r["seed"]: r for r in runs["no cache"]}
    for name, rs in runs.items():
        rmse = [r["rmse"] for r in rs]
        rel = [r["rmse"] / base[r["seed"]]["rmse"] - 1 for r in rs]
        saved = [1 - r["bytes"] / base[r["seed"]]["bytes"] for r in rs]
        print(f"{name} ({a.ratings or 'synthetic ratings'}, {a.workers} workers x {a.shards} shards, async, {a.optimizer}, {a.steps} steps, "
              f"seeds {a.seeds}): "
              f"RMSE mean {statistics.mean(rmse):.5f} ({min(rmse):.5f}..{max(rmse):.5f}); vs no cache, paired by seed, "
              f"mean {statistics.mean(rel):+.2%} ({min(rel):+.2%}..{max(rel):+.2%}); bytes saved {statistics.mean(saved):.1%}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
