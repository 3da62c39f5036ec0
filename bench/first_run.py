"""A fresh install's first ``tether launch`` against its second: the README's quick start
(``tether launch --out DIR``: 2 shards, 2 workers, the built-in CTR job) run twice in a row
from an empty numba disk cache, and its wall times side by side with their ratio (the target:
the first at most 1.3x the second on a quiet 2-core machine).

"Fresh" is what a new clone has: no compiled kernels (``NUMBA_CACHE_DIR`` is pointed at a new,
empty folder for the pair, so the cache next to the sources is neither used nor touched) and no
Python bytecode for tether (its ``__pycache__/*.pyc`` files are deleted before the first run;
the installed dependencies keep theirs, as after ``pip install``). The second run reuses both. Each
run's console lines that say something is compiled (``tether.common.kernel_notice``) are
printed, and the load average (``/proc/loadavg``) before and after each run, since a busy
machine moves these figures more than anything here does. Beside the wall times, the CPU
seconds of the launcher and all its children (``RUSAGE_CHILDREN``) and their ratio: a figure
that other users of a shared machine move much less.

``--pythonpath DIR`` times another build of tether side by side (a plain install of another
commit, ``pip install --no-deps --target DIR CHECKOUT``): its pair runs first, under the same
protocol. ``--cache-rows N`` adds ``--cache-rows N`` to both runs (the worker row cache's
passes then compile too). ``--groups`` also times each kernel group's compile alone (one
process each, from an empty cache: the shard's, each rule's, the row cache's).

Run it 3 times (separate invocations) and take the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tether.common.kernel_notice import COMPILE_NOTICE

_GROUPS = {
    "shard (index, gather, initial rows)": "from tether.rules import row_kernels as k; k.warm_up_shard()",
    **{f"rule {name}": f"from tether.rules import row_kernels as k; from tether.rules.optimizers import rule; "
                       f"from tether.rules.kernel_cache import load_kernels; load_kernels('x', 0, k.rule_loads(rule({name!r})))"
       for name in ("sgd", "adagrad", "adam", "rowwise_adagrad", "ftrl")},
    "worker row cache (index, passes)": "from tether.worker.cache import slots; slots.warm_up()",
}


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ", 3)[0]
    except OSError:
        return "?"


def _env(cache: Path, pythonpath: str | None) -> dict[str, str]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache / "numba")}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _launch(cache: Path, out: Path, pythonpath: str | None, extra: list[str]) -> dict[str, object]:
    """One ``tether launch --out OUT`` (as the README runs it); its wall time and notices."""
    load = _load()
    argv = [sys.executable, "-m", "tether.deploy.cli", "launch", "--out", str(out), *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    run = subprocess.run(argv, env=_env(cache, pythonpath), cwd=out.parent, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The CPU seconds of the launcher and every process it waited for (shards, workers).
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if run.returncode != 0:
        raise SystemExit(f"tether launch failed ({run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    notices = [line for line in run.stdout.splitlines() if COMPILE_NOTICE in line]
    summary = json.loads((out / "summary.json").read_text())
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load": load, "load_after": _load(), "notices": notices,
            "eval_loss": summary.get("eval_loss")}


def _forget_bytecode(pythonpath: str | None) -> int:
    """Delete the ``.pyc`` files of the tether that ``pythonpath`` imports (as a fresh clone has
    none); how many."""
    code = ("import importlib, json, os; names = ['tether', 'tether.common', 'tether.rules', 'tether.protos', 'tether.server', "
            "'tether.worker', 'tether.deploy']; print(json.dumps([os.path.dirname(importlib.import_module(n).__file__) for n in names]))")
    run = subprocess.run([sys.executable, "-c", code], env=_env(Path(tempfile.gettempdir()), pythonpath), cwd=tempfile.gettempdir(),
                         capture_output=True, text=True,
                         timeout=120, check=True)
    gone = 0
    for folder in json.loads(run.stdout.strip().splitlines()[-1]):
        for pyc in Path(folder).rglob("__pycache__/*.pyc"):
            pyc.unlink(missing_ok=True)
            gone += 1
    return gone


def _pair(label: str, pythonpath: str | None, extra: list[str], keep: Path) -> dict[str, object]:
    cache = Path(tempfile.mkdtemp(prefix="first-run-cache-", dir=keep))
    _forget_bytecode(pythonpath)
    try:
        first = _launch(cache, keep / f"{label}-first", pythonpath, extra)
        second = _launch(cache, keep / f"{label}-second", pythonpath, extra)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    ratio = first["wall_s"] / second["wall_s"]  # type: ignore[operator]
    cpu_ratio = first["cpu_s"] / second["cpu_s"]  # type: ignore[operator]
    print(f"{label}: first {first['wall_s']:.1f} s (load {first['load']} -> {first['load_after']}), second {second['wall_s']:.1f} s "
          f"(load {second['load']} -> {second['load_after']}): ratio {ratio:.2f}; CPU {first['cpu_s']:.0f} s vs {second['cpu_s']:.0f} s: "
          f"ratio {cpu_ratio:.2f}", flush=True)
    for line in first["notices"]:  # type: ignore[attr-defined]
        print(f"    first run said: {line}")
    for line in second["notices"]:  # type: ignore[attr-defined]
        print(f"    second run said: {line}")
    return {"first": first, "second": second, "ratio": round(ratio, 3), "cpu_ratio": round(cpu_ratio, 3)}


def _groups(pythonpath: str | None, keep: Path) -> dict[str, float]:
    """Each kernel group compiled alone from an empty cache, one process each (import time out)."""
    out = {}
    for label, code in _GROUPS.items():
        cache = Path(tempfile.mkdtemp(prefix="first-run-group-", dir=keep))
        timed = f"import time, logging; logging.disable(); {code.split(';')[0]}; t = time.perf_counter(); " \
                f"{';'.join(code.split(';')[1:])}; print(time.perf_counter() - t)"
        load = _load()
        run = subprocess.run([sys.executable, "-c", timed], env=_env(cache, pythonpath), cwd=keep, capture_output=True, text=True,
                             timeout=900)
        shutil.rmtree(cache, ignore_errors=True)
        if run.returncode != 0:
            raise SystemExit(f"{label}: {run.stderr[-2000:]}")
        out[label] = round(float(run.stdout.strip().splitlines()[-1]), 2)
        print(f"  compile alone: {label}: {out[label]:.2f} s (load {load})", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pythonpath", help="another build of tether (pip install --no-deps --target DIR), timed first as the baseline")
    p.add_argument("--cache-rows", type=int, default=None, help="pass --cache-rows N --cache-bound 20 to both runs")
    p.add_argument("--groups", action="store_true", help="also time each kernel group's compile alone")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    extra = [] if args.cache_rows is None else ["--cache-rows", str(args.cache_rows), "--cache-bound", "20"]
    keep = Path(tempfile.mkdtemp(prefix="tether-first-run-"))
    result: dict[str, object] = {"cpus": os.cpu_count(), "extra": extra}
    try:
        if args.pythonpath:
            result["baseline"] = _pair("baseline", args.pythonpath, extra, keep)
        result["this"] = _pair("this tree", None, extra, keep)
        if args.groups:
            result["groups"] = _groups(None, keep)
    finally:
        shutil.rmtree(keep, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
