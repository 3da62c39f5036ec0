"""The row cache's flags where they would do nothing (outsider trial 2): the bounds and policy
without --cache-rows, and a cache in sync, are refused with one line; compare runs its sync
baseline without the cache and says so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tether.deploy import compare as compare_module
from tether.worker.config import TrainingConfig, WorkerConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cache-bound", "3"], "--cache-bound without --cache-rows"),
        (["--cache-write-bound", "2", "--cache-policy", "lfu"], "--cache-write-bound, --cache-policy without --cache-rows"),
        (["--mode", "sync", "--cache-rows", "100"], "--cache-rows is for async and ssp:S"),
        (["--cache-rows", "100"], "--cache-rows without --cache-bound would cache nothing"),
    ],
)
def test_launch_refuses_cache_flags_that_would_do_nothing(tmp_path: Path, args: list[str], says: str) -> None:
    out = tmp_path / "job"
    proc = subprocess.run([sys.executable, "-m", "tether.deploy.cli", "launch", "--steps", "2", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and says in proc.stderr, proc.stderr
    assert not out.exists()  # refused before anything started


def test_the_defaults_and_a_cache_with_its_flags_are_accepted() -> None:
    assert not WorkerConfig(shards=("h:1",)).row_cache.active
    config = WorkerConfig(shards=("h:1",), mode="ssp:2", cache_rows=10, cache_bound=2, cache_write_bound=1, cache_policy="lfu")
    assert (config.row_cache.rows, config.row_cache.bound, config.row_cache.writes) == (10, 2, 1)
    # A write bound alone holds gradients and reads every row fresh; a read bound of 0 given on
    # purpose is the baseline of a series of bounds (exactly no cache, tests/test_row_cache.py).
    assert (lambda c: (c.bound, c.writes))(WorkerConfig(shards=("h:1",), cache_rows=10, cache_write_bound=3).row_cache) == (0, 3)
    assert (lambda c: (c.bound, c.writes))(WorkerConfig(shards=("h:1",), cache_rows=10, cache_bound=0).row_cache) == (0, 0)


def test_a_cache_without_a_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tether launch --cache-rows 1000` (no bound) trained with a cache that pulled and pushed
    every row every step, at ~1 ms of the worker's CPU a step, and said so only in its last line
    ("0% of the rows ... not moved")."""
    with pytest.raises(ValueError, match="--cache-rows without --cache-bound"):
        TrainingConfig(local=True, cache_rows=1000)
    for name, value in {"TETHER_LOCAL": "1", "TETHER_CACHE_ROWS": "1000", "TETHER_CACHE_BOUND": ""}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="--cache-rows without --cache-bound"):
        TrainingConfig.from_env()
    monkeypatch.setenv("TETHER_CACHE_BOUND", "0")  # given on purpose: accepted
    assert TrainingConfig.from_env().row_cache.bound == 0


class _Stop(Exception):
    pass


def test_compare_runs_sync_without_the_cache_and_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ran: list[WorkerConfig] = []

    def fake_run_job(cfg: WorkerConfig, *args: Any, **kwargs: Any) -> dict[str, Any]:
        ran.append(cfg)
        raise _Stop

    monkeypatch.setattr(compare_module, "run_job", fake_run_job)
    # Every cache setting given: `tether compare --modes async,sync ... --cache-admission all` (or
    # --cache-hot K) crashed at the sync run with "--cache-admission without --cache-rows", after
    # the async run, when the baseline reset only the rows, bounds and policy.
    template = WorkerConfig(shards=("pending:0",), steps=10, cache_rows=100, cache_bound=3, cache_write_bound=4, cache_policy="lfu",
                            cache_hot=2, cache_admission="all")
    lines: list[str] = []
    for mode in ("sync", "async"):
        with pytest.raises(_Stop):
            compare_module.compare(template, [mode], 1, tmp_path / mode, printer=lines.append)
    sync, async_ = ran
    cache = ("cache_rows", "cache_bound", "cache_write_bound", "cache_policy", "cache_hot", "cache_admission")
    assert sync.mode.kind == "sync" and [getattr(sync, k) for k in cache] == [0, None, None, "lru", 0, "recurring"]
    assert async_.mode.kind == "async" and [getattr(async_, k) for k in cache] == [100, 3, 4, "lfu", 2, "all"]
    assert "no row cache" in lines[0] and "no row cache" not in lines[1], lines


@pytest.mark.parametrize("fields", [{"cache_bound": 3}, {"cache_write_bound": 2}, {"cache_bound": 2, "cache_policy": "lfu"}])
def test_cache_bounds_without_cache_rows_are_refused(fields: dict) -> None:
    """`tether launch --script s.py --cache-bound 5` trained with no cache (wanted rows ==
    pulled rows in the record) and said nothing: a bound asked for with no cache to bound."""
    with pytest.raises(ValueError, match=r"cache.rows"):
        TrainingConfig(shards=("127.0.0.1:1",), **fields)


def test_a_row_cache_in_sync_is_refused_like_delay_compensation() -> None:
    """`tether launch --mode sync --cache-rows 1000 --cache-bound 2` ran without a cache (same loss
    as without, every row pulled) and exited 0; `tether compare --modes sync,async --cache-rows ...`
    printed sync's B/sample beside async's with nothing saying sync had no cache."""
    with pytest.raises(ValueError, match="sync"):
        TrainingConfig(shards=("127.0.0.1:1",), mode="sync", cache_rows=1000, cache_bound=2)
