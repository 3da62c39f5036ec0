"""What the public training API costs: the default CTR model trained by today's code (the CTR job
is a user of ``tether.worker.training.trainer.Trainer``) against the same job at a baseline commit from
before the API existed (the loop was written for CTRModel alone), side by side.

    python bench/api_overhead.py [--baseline 10c279e] [--rounds 3] [--steps 1500]

The baseline is checked out into a temporary git worktree and imported from there (its shard
and worker processes too); the two sides alternate, one real 1-shard + 1-worker job per run,
and the median of each side's samples/s gives the ratio. Target: the API path costs no more
than 5% (ratio >= 0.95).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import markdown_table

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.95
PACKAGES = ("server", "worker", "protos", "deploy")

_JOB = """
import sys, tempfile
from tether.deploy.job import run_job
from tether.worker.config import WorkerConfig
cfg = WorkerConfig(shards=("pending:0",), num_workers=1, steps=int(sys.argv[1]), batch_size=int(sys.argv[2]),
                   eval_samples=2000, device="cpu", log_every=int(sys.argv[1]))
with tempfile.TemporaryDirectory() as tmp:
    print(run_job(cfg, 1, out=tmp, echo=False)["samples_per_sec"])
"""


def _package_root(tree: Path, into: Path) -> Path:
    """A folder whose ``tether/`` maps the four packages of ``tree`` (what pip's package-dir does)."""
    pkg = into / "tether"
    pkg.mkdir(parents=True)
    for name in PACKAGES:
        (pkg / name).symlink_to(tree / name)
    return into


def _samples_per_sec(python_path: Path, steps: int, batch_size: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(python_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _JOB, str(steps), str(batch_size)], capture_output=True, text=True,
                         env=env, cwd=python_path, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="10c279e", help="git ref of the code before the training API")
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=256)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        tree = tmp_path / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), a.baseline], check=True)
        try:
            sides = {"API (this tree)": _package_root(ROOT, tmp_path / "now"), f"loop before the API ({a.baseline})": _package_root(tree, tmp_path / "then")}
            runs: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(a.rounds):
                for name, path in (sides.items() if r % 2 == 0 else reversed(list(sides.items()))):
                    runs[name].append(_samples_per_sec(path, a.steps, a.batch_size))
                    print(f"round {r + 1}: {name}: {runs[name][-1]:,.0f} samples/s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    now, then = (statistics.median(v) for v in runs.values())
    rows = [[name, f"{min(v):,.0f}", f"{statistics.median(v):,.0f}", f"{max(v):,.0f}"] for name, v in runs.items()]
    print(f"\ndefault CTR model, 1 worker + 1 shard, batch {a.batch_size}, {a.steps} steps, {a.rounds} runs each\n")
    print(markdown_table(["code", "min samples/s", "median", "max"], rows))
    ratio = now / then
    print(f"\nAPI / before = {ratio:.3f} (target >= {TARGET:.2f}: {'met' if ratio >= TARGET else 'NOT met'})")


if __name__ == "__main__":
    main()
