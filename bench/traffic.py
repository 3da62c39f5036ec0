"""Rows and bytes a worker moves per sample, the share of a step's rows it wanted within the last
S steps (the ceiling of a row cache), and what the row cache moves at each bound (issue 29).

These figures depend on the data and the model's shapes, not on the machine: the id stream of
worker 0 of 4 goes through the worker's own ``CachedClient`` (tether.worker.cache.row_cache) in the
order an async worker's steps make their calls (the first two batches pulled at clock 0, then
one push_pull per step carrying its gradients and the pull of the batch after next), against a
stand-in client that answers at once. No shard, no training: the rows moved are exactly what the
worker would send; held-out loss and samples/s need real runs (bench/RESULTS.md). The one
machine-dependent column, worker-side ms/step, is the CPU time those calls take in this process (the
cache's bookkeeping; the meter without its reuse counting, as in a worker without metrics; the
median of 3 runs): what the cache costs a step before any wire time it saves. CPU time, not
wall time: on a shared machine the other processes' load changes wall time far more.

    python bench/traffic.py                      # default CTR job, MovieLens-format, Criteo-format
    python bench/traffic.py --steps 200 --bounds 1,5,20 --source ctr
    python bench/traffic.py --preset gpu --steps 150 --bounds 1,5,20 --no-timing   # the CTR job at --preset gpu's sizes
    python bench/traffic.py --source ctr --bounds 20 --admission recurring --passes  # and the cache's compiled passes one by one

``--passes`` adds, under the table, each timed bound's compiled passes (``tether.worker.cache.batch``,
``split.pack_push``, ``slots.coalesce``): thread CPU ms a step of each, the median of the same 3 runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tether.common.choices import CACHE_ADMISSIONS
from tether.protos.specs import TableConfig
from tether.worker.cache import device as device_cache
from tether.worker.cache import row_cache
from tether.worker.cache.client import CachedClient
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.slots import warm_up
from tether.worker.client.results import Handle, PullResult, PushAck
from tether.worker.client.reuse import REUSE_WINDOWS
from tether.worker.client.traffic import TrafficMeter
from tether.worker.config import MODEL_PRESETS
from tether.worker.data.criteo import CRITEO_SPARSE, CriteoStream, write_criteo_sample
from tether.worker.data.synthetic import SyntheticClickLog, SyntheticConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "movielens_two_tower"))
from movielens import rating_batches, read_ratings, write_ratings

WORKERS, RANK, BATCH, SHARDS = 4, 0, 256, 2
CPU = torch.device("cpu")


class _Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class _Config:
    call_deadline_s, timeout_s, wire_dtype = 60.0, 30.0, torch.float32


class StandIn:
    """A client that answers every call at once (rows of zeros, table versions 0)."""

    num_shards = SHARDS
    config = _Config()

    def __init__(self, dims: Mapping[str, int]) -> None:
        self.dims = dims

    def _rows(self, sparse: Mapping[str, torch.Tensor] | None) -> PullResult:
        sparse = sparse or {}
        versions = {(s, t): 0 for t in sparse for s in range(SHARDS)}
        return PullResult({t: torch.zeros(len(ids), self.dims[t]) for t, ids in sparse.items()}, {}, versions, {})

    def pull(self, sparse: Mapping[str, torch.Tensor] | None = None, dense: Sequence[str] = (), splits: Any = None) -> Handle[PullResult]:
        return Handle([_Done(self._rows(sparse))], lambda a: a[0])

    def push(self, sparse: Any = None, dense: Any = None, clock: int = 0, versions: Any = None) -> Handle[PushAck]:
        return Handle([_Done(PushAck(0, 0, 0))], lambda a: a[0])

    def push_pull(self, push_sparse: Any = None, push_dense: Any = None, pull_sparse: Mapping[str, torch.Tensor] | None = None,
                  pull_dense: Sequence[str] = (), clock: int = 0, versions: Any = None, pull_splits: Any = None) -> Handle[PullResult]:
        return self.pull(pull_sparse)


def run(steps: list[dict[str, torch.Tensor]], dims: Mapping[str, int], cache: RowCacheConfig, reuse: bool = True,
        device: torch.device = CPU) -> TrafficMeter:
    """The async loop's calls for these steps (table -> unique ids each) through a CachedClient
    (``reuse``: the meter counts the rows wanted within S steps, as a worker with metrics does),
    the gradients on ``device`` (the training device: with ``on_device`` the cache's rows live
    there too, ``tether.worker.cache.device``)."""
    meter = TrafficMeter(dims, 4, reuse=reuse)
    client = CachedClient(StandIn(dims), cache, dims, meter, device=device)  # type: ignore[arg-type]
    client.use_tables([TableConfig(name=t, dim=d) for t, d in dims.items()])  # the cache's local updates (default rule: adagrad)
    pending = [client.pull(steps[0]), client.pull(steps[1])] if len(steps) > 1 else [client.pull(steps[0])]
    for t in range(len(steps)):
        pulled = pending.pop(0).result()
        grads = {table: (ids, torch.zeros(len(ids), dims[table], device=device)) for table, ids in steps[t].items()}
        if t + 2 < len(steps):
            pending.append(client.push_pull(grads, None, steps[t + 2], clock=t + 1, versions=pulled))
        else:
            client.push(grads, None, clock=t + 1, versions=pulled).result()
    client.flush()
    return meter


# The cache's compiled passes (``--passes``), by the module that calls each.
PASSES = {row_cache: ("plan_all", "store_all", "hold_all", "take_all", "with_unheld", "later_all", "pack_push", "group_ids", "coalesce"),
          device_cache: ("store_all", "hold_all", "later_all", "coalesce")}


@contextlib.contextmanager
def _timing_passes(spent: collections.Counter[str]) -> Iterator[None]:
    """The cache's passes timed (thread CPU seconds into ``spent`` by name) inside the block."""
    real = {(mod, name): getattr(mod, name) for mod, names in PASSES.items() for name in names}

    def timed(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                spent[name] += time.thread_time() - t0
        return call

    for (mod, name), fn in real.items():
        setattr(mod, name, timed(name, fn))
    try:
        yield
    finally:
        for (mod, name), fn in real.items():
            setattr(mod, name, fn)


def _ms(steps: list[dict[str, torch.Tensor]], dims: Mapping[str, int], cache: RowCacheConfig,
        passes: dict[str, float] | None = None, device: torch.device = CPU) -> float:
    """Worker-side ms per step of these steps' calls (no reuse counting, as a worker without
    metrics): the median of 3 runs; with ``passes``, each compiled pass's thread CPU ms a step
    (the median of the same runs) put there."""
    times, per_pass = [], collections.defaultdict(list)
    for _ in range(3):
        spent: collections.Counter[str] = collections.Counter()
        with _timing_passes(spent) if passes is not None else contextlib.nullcontext():
            t0 = time.process_time()
            run(steps, dims, cache, reuse=False, device=device)
            times.append((time.process_time() - t0) / len(steps) * 1e3)
        for name, seconds in spent.items():
            per_pass[name].append(seconds / len(steps) * 1e3)
    if passes is not None:
        passes.update({name: statistics.median(v) for name, v in per_pass.items()})
    return statistics.median(times)


def _unique(sparse: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {t: torch.unique(ids.reshape(-1)) for t, ids in sparse.items()}


# ``--preset``: the built-in model's sizes (``tether.worker.config.MODEL_PRESETS``) for the CTR job.
PRESETS = {name: (v["batch_size"], v["num_sparse"], v["embedding_dim"]) for name, v in MODEL_PRESETS.items()}


def ctr_steps(n: int, preset: str = "default") -> tuple[list[dict[str, torch.Tensor]], dict[str, int], str]:
    batch, fields, dim = PRESETS[preset]
    gen = SyntheticClickLog(SyntheticConfig(num_sparse=fields))
    out = [_unique({f"cat_{j}": b.sparse[:, j] for j in range(b.sparse.shape[1])}) for b in gen.batches(batch, n, RANK, WORKERS)]
    label = "default CTR job" if preset == "default" else f"CTR job at --preset {preset} (batch {batch})"
    return out, {f"cat_{j}": dim for j in range(fields)}, f"{label} (synthetic Zipf 1.1, 100k ids x {fields} fields, dim {dim})"


def movielens_steps(n: int, folder: Path) -> tuple[list[dict[str, torch.Tensor]], dict[str, int], str]:
    path = folder / "ratings.dat"
    write_ratings(path, 100_000, num_users=943, num_movies=1682, seed=0)
    train, _ = read_ratings(path, RANK, WORKERS)
    batches: Iterator[dict[str, torch.Tensor]] = rating_batches(train, BATCH, seed=RANK)
    out = []
    for _ in range(n):
        b = next(batches)
        out.append(_unique({"user": b["user"], "movie": b["movie"], "user_bias": b["user"], "movie_bias": b["movie"]}))
    dims = {"user": 16, "movie": 16, "user_bias": 1, "movie_bias": 1}
    return out, dims, "MovieLens-format example (943 users, 1682 movies, 100k ratings, generated; dims 16/16/1/1)"


def criteo_steps(n: int, folder: Path) -> tuple[list[dict[str, torch.Tensor]], dict[str, int], str]:
    path = folder / "criteo.tsv"
    write_criteo_sample(path, n * BATCH * WORKERS + BATCH * WORKERS, seed=0)
    stream = CriteoStream(str(path), BATCH, rank=RANK, world_size=WORKERS, drop_last=True)
    out = []
    for b in stream:
        out.append(_unique({f"cat_{j}": b.sparse[:, j] for j in range(b.sparse.shape[1])}))
        if len(out) == n:
            break
    return out, {f"cat_{j}": 16 for j in range(CRITEO_SPARSE)}, "Criteo-format file (generated, 26 fields x 2000 ids, dim 16)"


def report(name: str, steps: list[dict[str, torch.Tensor]], dims: Mapping[str, int], bounds: Sequence[tuple[int, int]], rows: int,
           policy: str, batch: int = BATCH, timed: bool = True, on_device: bool = False,
           admissions: Sequence[str] = ("all",), show_passes: bool = False, device: torch.device = CPU) -> list[str]:
    samples = len(steps) * batch
    base = run(steps, dims, RowCacheConfig(), device=device)
    ms0 = _ms(steps, dims, RowCacheConfig(), device=device) if timed else float("nan")
    tot = base.totals()
    lines = [f"## {name}", f"worker {RANK} of {WORKERS}, batch {batch}, {len(steps)} steps, float32 wire", "",
             "| table | dim | rows pulled/sample | rows pushed/sample | bytes pulled/sample | bytes pushed/sample | "
             + " | ".join(f"wanted within {w}" for w in REUSE_WINDOWS) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(REUSE_WINDOWS)]
    for t, v in tot.items():
        share = " | ".join(f"{v['recent'][w] / max(v['wanted_rows'], 1):.0%}" for w in REUSE_WINDOWS)
        lines.append(f"| {t} | {dims[t]} | {v['pulled_rows'] / samples:.3f} | {v['pushed_rows'] / samples:.3f} | "
                     f"{v['pulled_bytes'] / samples:.1f} | {v['pushed_bytes'] / samples:.1f} | {share} |")
    wanted = sum(v["wanted_rows"] for v in tot.values())
    ceiling = {w: sum(v["recent"][w] for v in tot.values()) / max(wanted, 1) for w in REUSE_WINDOWS}
    moved0 = sum(v["pulled_rows"] + v["pushed_rows"] for v in tot.values())
    bytes0 = sum(v["pulled_bytes"] + v["pushed_bytes"] for v in tot.values())
    lines += ["", "all tables: ceiling (rows wanted within S steps) " + ", ".join(f"S={w} {c:.0%}" for w, c in ceiling.items()),
              "", f"| bound R/W (read/write) | rows moved/sample (pull + push) | saved | bytes/sample | saved | cache rows/table {rows}, {policy}"
              f"{f' (on the device: {device.type} tensors)' if on_device else ''}: "
              "worker-side CPU ms/step (the client's calls, no shard, no reuse counting; process CPU, median of 3) |",
              "|---|---|---|---|---|---|",
              f"| no cache | {moved0 / samples:.3f} | - | {bytes0 / samples:.0f} | - | {ms0:.2f} |"]
    passes: list[str] = []
    for (r, w), admission in ((b, adm) for b in bounds for adm in admissions):
        config = RowCacheConfig(rows=rows, bound=r, write_bound=w, policy=policy, on_device=on_device or None, admission=admission)
        m = run(steps, dims, config, reuse=False, device=device).totals()
        times: dict[str, float] | None = {} if show_passes and timed else None
        ms = _ms(steps, dims, config, times, device) if timed else float("nan")
        moved = sum(v["pulled_rows"] + v["pushed_rows"] for v in m.values())
        nbytes = sum(v["pulled_bytes"] + v["pushed_bytes"] for v in m.values())
        label = f"{r}/{w}" + ("" if admission == "all" else f", admission {admission}")
        lines.append(f"| {label} | {moved / samples:.3f} | {1 - moved / moved0:.0%} | {nbytes / samples:.0f} | {1 - nbytes / bytes0:.0%} | {ms:.2f} |")
        if times is not None:
            ranked = sorted(times.items(), key=lambda kv: -kv[1])
            passes.append(f"- {label}: the compiled passes {sum(times.values()):.3f} ms a step (thread CPU, median of 3): "
                          + ", ".join(f"{name} {v:.3f}" for name, v in ranked))
    return [*lines, *(["", *passes] if passes else []), ""]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="steps of worker 0 (default 300)")
    p.add_argument("--bounds", default="1,2,5,10,20,20/2,20/5", help="cache bounds to run: R (read = write bound) or R/W, comma list")
    p.add_argument("--cache-rows", type=int, default=100_000, help="cache capacity per table (default 100000)")
    p.add_argument("--cache-policy", default="lru", choices=("lru", "lfu"))
    p.add_argument("--on-device", action="store_true",
                   help="the cache a GPU worker uses (rows in device tensors: tether.worker.cache.device), on --device")
    p.add_argument("--device", default="cpu", help="the training device: the gradients' (and with --on-device the cache's rows'); "
                   "default cpu (the CPU's tensors stand in for a GPU's)")
    p.add_argument("--source", action="append", choices=("ctr", "movielens", "criteo"), help="repeatable; default all three")
    p.add_argument("--admission", default="all,recurring",
                   help="the cache's admission (--cache-admission) at each bound: all and/or recurring, comma list (default both)")
    p.add_argument("--no-timing", action="store_true", help="leave out the ms/step column (3 more runs per bound)")
    p.add_argument("--passes", action="store_true", help="also time the cache's compiled passes one by one (with the ms/step column)")
    p.add_argument("--preset", choices=tuple(PRESETS), default="default",
                   help="the CTR job's sizes (tether worker --preset): gpu is batch 8,192, 26 fields, 128-wide rows (implies --source ctr)")
    a = p.parse_args(argv)
    if a.steps < 3:
        p.error("--steps must be >= 3")
    try:
        parsed = [[int(x) for x in b.split("/")] for b in a.bounds.split(",") if b.strip()]
    except ValueError:
        p.error(f"--bounds must be a comma list of R or R/W integers, got {a.bounds!r}")
    if any(len(b) > 2 or min(b) < 0 for b in parsed):
        p.error(f"--bounds must be a comma list of R or R/W integers >= 0, got {a.bounds!r}")
    bounds = [(b[0], b[-1]) for b in parsed]
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False here)")
    if a.passes and a.no_timing:
        p.error("--passes times the passes in the timed runs: drop --no-timing")
    admissions = [x.strip() for x in a.admission.split(",") if x.strip()]
    if not admissions or any(x not in CACHE_ADMISSIONS for x in admissions):
        p.error(f"--admission must be a comma list of {', '.join(CACHE_ADMISSIONS)}, got {a.admission!r}")
    warm_up()  # the cache's compiled kernels loaded once, outside the timed runs (a worker loads them when its cache is made)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        makers = {"ctr": lambda: ctr_steps(a.steps, a.preset), "movielens": lambda: movielens_steps(a.steps, folder),
                  "criteo": lambda: criteo_steps(a.steps, folder)}
        sources = a.source or (["ctr"] if a.preset != "default" else list(makers))
        for source in sources:
            steps, dims, name = makers[source]()
            batch = PRESETS[a.preset][0] if source == "ctr" else BATCH
            print("\n".join(report(name, steps, dims, bounds, a.cache_rows, a.cache_policy, batch, not a.no_timing, a.on_device,
                                    admissions, a.passes, device)),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
