"""What the row cache could buy at best on this machine (issue 29 item 4): samples/s and CPU per
sample with no cache, with the cache, and with a *free* cache, side by side in one invocation.

The free cache is no cache on data whose batches touch as few distinct rows as the cache moves:
the same model, batch size, compute and calls, only fewer rows pulled and pushed, at no cost of
bookkeeping. The default CTR job's ids are drawn from ``--ceiling-vocab`` ids per field instead of
100,000; the MovieLens-format example's ratings from ``--ceiling-users`` users and
``--ceiling-movies`` movies instead of 943 and 1,682. The defaults make rows moved per sample
match the cache at 20/20 (CTR 5.26, MovieLens 1.42 against 9.57 and 6.36 with no cache; the
script prints them, so a mismatch shows).

Where every process shares the machine's cores (4 workers and 2 shards on 2 cores, loopback),
samples/s is bound by CPU per sample, so the script prints both: each configuration's samples/s
(the issue's measure) and the CPU seconds of the whole job (launcher, shards, workers, start-up
included) per sample, and their ratios against no cache in the same round. If the free cache is no
faster than no cache, rows moved are not what limits the job here, and no cache can make it faster.

    python bench/cache_ceiling.py                       # both jobs, 3 rounds
    python bench/cache_ceiling.py --job ctr --rounds 1 --steps 300
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path.insert(0, str(ROOT / "examples" / "movielens_two_tower"))

from movielens import write_ratings  # noqa: E402

CONFIGS = ("no cache", "cache", "cache all", "free cache")  # "cache": the default admission (recurring); "cache all": --cache-admission all


def _job_args(job: str, config: str, a: argparse.Namespace, data: dict[str, Path]) -> list[str]:
    """``tether launch`` flags of one configuration (steps and --out added by the caller)."""
    args = ["--num-workers", str(a.workers), "--num-shards", str(a.shards), "--log-every", "100000", "--eval-every", "0"]
    if config.startswith("cache"):
        args += ["--cache-rows", str(a.cache_rows), "--cache-bound", str(a.bound)]
        if config == "cache all":
            args += ["--cache-admission", "all"]
    if job == "ctr":
        return args + (["--vocab-size", str(a.ceiling_vocab)] if config == "free cache" else [])
    ratings = data["free" if config == "free cache" else "real"]
    return [*args, "--script", str(ROOT / "examples" / "movielens_two_tower" / "train.py"), "--script-args", f"--data {ratings}"]


def _run(args: list[str], steps: int, out: Path) -> tuple[float, int, float, float]:
    """CPU seconds of the whole job, its samples, samples/s, and worker 0's rows moved per sample."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(["tether", "launch", *args, "--steps", str(steps), "--out", str(out)], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode:
        raise SystemExit(f"tether launch {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    summary = json.loads((out / "summary.json").read_text())
    worker = json.loads((out / "worker-0.json").read_text())
    rows = sum(t["pulled_rows"] + t["pushed_rows"] for t in worker["traffic"].values()) / worker["samples"]
    return cpu, int(summary["total_samples"]), float(summary["samples_per_sec"]), rows


def _round(job: str, order: list[str], a: argparse.Namespace, data: dict[str, Path], tmp: Path) -> dict[str, dict[str, float]]:
    got = {}
    for config in order:
        args = _job_args(job, config, a, data)
        cpu, samples, sps, rows = _run(args, a.steps, tmp / "job")
        got[config] = {"us_per_sample": 1e6 * cpu / samples, "samples_per_sec": sps, "rows_per_sample": rows}
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", action="append", choices=("ctr", "movielens"), help="default: both")
    p.add_argument("--rounds", type=int, default=3, help="rounds (the configurations' order alternates); default 3")
    p.add_argument("--steps", type=int, default=400, help="steps per worker, default 400")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--bound", type=int, default=20, help="the cache's read and write bound, default 20")
    p.add_argument("--cache-rows", type=int, default=100_000, help="rows per table, default 100000")
    p.add_argument("--ceiling-vocab", type=int, default=250, help="CTR free cache: ids per field, default 250")
    p.add_argument("--ceiling-users", type=int, default=48, help="MovieLens free cache: users, default 48")
    p.add_argument("--ceiling-movies", type=int, default=48, help="MovieLens free cache: movies, default 48")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)} (default all; no cache always runs)")
    p.add_argument("--json", help="also write the per-round figures here")
    a = p.parse_args()
    if a.steps < 1 or a.rounds < 1:
        p.error("need --steps >= 1 and --rounds >= 1")
    configs = ["no cache", *(c for c in CONFIGS[1:] if c in [x.strip() for x in a.configs.split(",")])]
    if any(x.strip() not in CONFIGS for x in a.configs.split(",")):
        p.error(f"--configs must be a comma list of {', '.join(CONFIGS)}, got {a.configs!r}")
    results: dict[str, list[dict[str, dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        data = {"real": tmp / "ratings.dat", "free": tmp / "ratings-free.dat"}
        write_ratings(data["real"], 100_000, num_users=943, num_movies=1682, seed=0)
        write_ratings(data["free"], 100_000, num_users=a.ceiling_users, num_movies=a.ceiling_movies, seed=0)
        for job in a.job or ["ctr", "movielens"]:
            results[job] = []
            for r in range(a.rounds):
                order = configs if r % 2 == 0 else configs[::-1]
                got = _round(job, order, a, data, tmp)
                results[job].append(got)
                print(f"{job} round {r + 1}: " + "; ".join(
                    f"{c} {got[c]['samples_per_sec']:.0f} samples/s, {got[c]['us_per_sample']:.1f} CPU-us/sample, "
                    f"{got[c]['rows_per_sample']:.2f} rows/sample" for c in configs), flush=True)
            for c in configs[1:]:
                speed = [g[c]["samples_per_sec"] / g["no cache"]["samples_per_sec"] for g in results[job]]
                cpu = [g["no cache"]["us_per_sample"] / g[c]["us_per_sample"] for g in results[job]]
                print(f"{job}: {c} over no cache: samples/s median {statistics.median(speed):.2f}x "
                      f"({', '.join(f'{x:.2f}' for x in speed)}); CPU per sample median {statistics.median(cpu):.2f}x "
                      f"({', '.join(f'{x:.2f}' for x in cpu)})", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
