"""Where a running job's CPU goes, call by call, with the row cache and without (issue 41 item 3):
the worker's and the shard's thread CPU per step in the steady state of one ``tether launch`` job.

Each configuration (``--configs``; the order alternates round by round) runs the default CTR job,
``--workers`` x ``--shards`` on loopback, long enough to reach its steady state. Every process
loads a probe (``bench/_anatomy_probe``, first on ``PYTHONPATH``) that counts the thread CPU
time and calls of a worker's step, cache and client and of a shard's handler, checks, staleness
count and apply, and writes them out once a second. Two snapshots ``--window`` seconds apart,
taken ``--warm`` seconds after the start, give each call's CPU per worker step (the shard's:
per push it applied, which is one worker step's push to that shard), summed over the processes
of a role, and the steps the job made in the window. A call inside another counts in both; time a
thread waits (for a lock, the GIL, a reply) counts in neither.

Prints one table per role: each call's microseconds per step in each configuration and its ratio
to the first, and the steps made in the window (the job's speed, each configuration against the
first). One invocation on a noisy machine is one sample: repeat it (the results' rule: medians
of 3 invocations).

    python bench/job_anatomy.py                       # no cache against cache 20/20, 2 rounds
    python bench/job_anatomy.py --rounds 3 --configs "no cache,cache,cache 5"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
PROBE = _HERE / "_anatomy_probe"
sys.path.insert(0, str(_HERE))

from _common import cache_bounds, markdown_table  # noqa: E402


def _flags(config: str) -> list[str]:
    """``no cache`` or ``cache`` (20/20), ``cache R`` or ``cache R/W`` (read and write bounds), each
    with ``rows N`` after it for N rows a table (default 100,000: every id of the data)."""
    if config == "no cache":
        return []
    config, _, rows = config.partition(" rows ")
    rows = rows.strip() or "100000"
    if config == "cache":
        return ["--cache-rows", rows, "--cache-bound", "20"]
    read, write = cache_bounds(config.removeprefix("cache").strip())
    return ["--cache-rows", rows, "--cache-bound", str(read), "--cache-write-bound", str(write)]


def _snapshot(folder: Path) -> dict[int, dict]:
    out = {}
    for path in folder.glob("probe.*.json"):
        try:
            out[int(path.name.split(".")[1])] = json.loads(path.read_text())
        except (ValueError, OSError):  # being replaced: the next second's is taken
            continue
    return out


def _per_step(a: dict[int, dict], b: dict[int, dict], role: str) -> tuple[int, dict[str, float], float]:
    """Steps (a worker's, or a shard's pushes) between two snapshots, each call's CPU microseconds
    per step, and the processes' own CPU per step, summed over the processes of ``role``."""
    cpu: collections.Counter[str] = collections.Counter()
    steps, process = 0, 0
    step_call = "step.run" if role == "worker" else "shard.push"
    for pid, later in b.items():
        early = a.get(pid)
        if later["role"] != role or early is None:
            continue
        steps += later["calls"].get(step_call, 0) - early["calls"].get(step_call, 0)
        process += later["process_ns"] - early["process_ns"]
        for name, ns in later["cpu"].items():
            cpu[name] += ns - early["cpu"].get(name, 0)
    if not steps:
        raise SystemExit(f"no {role} step in the window: raise --warm or --window, or see the job's log")
    return steps, {k: v / 1e3 / steps for k, v in cpu.items()}, process / 1e3 / steps


def run_one(config: str, a: argparse.Namespace, tmp: Path) -> dict[str, tuple[int, dict[str, float], float]]:
    folder = tmp / config.replace(" ", "_").replace("/", "-")
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TETHER_ANATOMY_OUT=str(folder / "probe"),
               PYTHONPATH=os.pathsep.join([str(PROBE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    args = ["tether", "launch", "--num-workers", str(a.workers), "--num-shards", str(a.shards), "--log-every", "100000",
            "--eval-every", "0", "--steps", "100000", "--out", str(folder / "job"), *_flags(config)]
    with open(folder / "job.log", "w") as log:
        job = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            time.sleep(a.warm)
            first = _snapshot(folder)
            time.sleep(a.window)
            second = _snapshot(folder)
        finally:
            os.killpg(job.pid, 15)
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, 9)
                job.wait(10)
    if job.returncode not in (0, -15, 143, 1) and not second:
        raise SystemExit(f"{' '.join(args)} failed ({job.returncode}): see {folder / 'job.log'}")
    return {role: _per_step(first, second, role) for role in ("worker", "shard")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="no cache,cache",
                   help="comma list: 'no cache', 'cache' (20/20), 'cache R' or 'cache R/W', each with ' rows N' (rows a table)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--warm", type=float, default=16.0, help="seconds from the start to the first snapshot (start-up and compiles)")
    p.add_argument("--window", type=float, default=15.0, help="seconds between the snapshots")
    a = p.parse_args()
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    for c in configs:
        _flags(c)  # refuse a malformed one before any job runs
    got: dict[str, list[dict[str, tuple[int, dict[str, float], float]]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp_dir:
        for r in range(a.rounds):
            for c in configs if r % 2 == 0 else configs[::-1]:
                got[c].append(run_one(c, a, Path(tmp_dir) / f"r{r}"))
                worker_steps = got[c][-1]["worker"][0]
                print(f"round {r + 1}, {c}: {worker_steps} worker steps in {a.window:.0f} s", flush=True)
    base = configs[0]
    for role in ("worker", "shard"):
        names = sorted({n for c in configs for g in got[c] for n in g[role][1]},
                       key=lambda n: -statistics.median(g[role][1].get(n, 0.0) for g in got[base]))
        rows = []
        for n in names:
            med = [statistics.median(g[role][1].get(n, 0.0) for g in got[c]) for c in configs]
            rows.append([n, *(f"{m:.0f}" for m in med), *(f"{m / med[0]:.2f}x" if med[0] else "-" for m in med[1:])])
        proc = [statistics.median(g[role][2] for g in got[c]) for c in configs]
        rows.append(["(process CPU)", *(f"{m:.0f}" for m in proc), *(f"{m / proc[0]:.2f}x" for m in proc[1:])])
        unit = "per worker step" if role == "worker" else "per push applied (a worker step's push to one shard)"
        print(f"\n{role}: thread CPU us {unit}, median of {a.rounds} rounds")
        print(markdown_table(["call", *configs, *(f"{c} / {base}" for c in configs[1:])], rows))
    speed = {c: [g["worker"][0] for g in got[c]] for c in configs}
    print("\nworker steps in the window: " + "; ".join(
        f"{c} {', '.join(map(str, speed[c]))}" + (f" ({statistics.median(s / b for s, b in zip(speed[c], speed[base], strict=True)):.2f}x)"
                                                 if c != base else "") for c in configs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
