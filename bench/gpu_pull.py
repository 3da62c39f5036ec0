"""Per-step pull and push of ``--preset gpu`` through one real shard, with a trivial compute,
side by side with the same gathers and updates done in one process with torch (the ceiling).

    python bench/gpu_pull.py [--steps 130] [--warm-from 100] [--preset gpu] [--cache 20/20] [--cache-rows N] [--profile DIR]

The worker side is the real one (``ctr_trainer``: ``PSModel`` over a ``PSClient`` on the CPU,
the row cache off; with ``--cache R/W`` the same run again beside it with the row cache at read
bound R and write bound W, ``--cache-rows`` rows a table, on the host: the CPU stand-in for a
GPU worker's cache) driven as an async worker with prefetching drives it: install the step's
rows (``pull_wait``: the previous step's ``push_pull`` answered and its rows bound), a trivial
compute (the loss is the rows' sum times a constant, so every pulled row gets a gradient of the
real size, 33 MiB a step at ``--preset gpu``), then ``push_pull`` (the gradients and the next
batch's ids in one round trip: ``push``, the time to send). Batches are made before the clock
(the generator's own cost per batch is printed beside). The shard's CPU time per step comes
from ``/proc/<pid>/stat`` (ticks of 10 ms: a median over 10 steps), the worker's is this
process's CPU time over the install and the push_pull (all its threads). Cold: the first 10 steps (most rows new to the shard); warm: the
steps from ``--warm-from`` on.

The ceiling: the same tables' rows (the shard's ``[rows, dim]`` float32 arrays, as many rows
as ids seen) gathered and updated with torch's Adagrad arithmetic in this process, per table
(``index_select`` of the pulled rows, accumulator and row update, ``index_copy_`` back), and a
memcpy of the step's bytes (rows and gradients).

``--profile DIR``: py-spy records the shard process and this process over the warm steps
(collapsed stacks ``DIR/shard.txt`` and ``DIR/worker.txt``, for flamegraph.pl or speedscope).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cache_bounds

torch.set_num_threads(1)

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _ceiling(batches: list, steps: int, dim: int, lr: float = 0.05, eps: float = 1e-10) -> tuple[float, float]:
    """ms per step of the same gathers + Adagrad updates in one process with torch, and of a
    memcpy of the step's bytes (rows out, gradients in)."""
    num_fields = batches[0].sparse.shape[1]
    values = [torch.empty(0, dim) for _ in range(num_fields)]
    accum = [torch.empty(0, dim) for _ in range(num_fields)]
    seen: list[dict[int, int]] = [{} for _ in range(num_fields)]
    # Rows for every id of the run made up front (growth is not what this measures).
    for f in range(num_fields):
        ids = torch.unique(torch.cat([b.sparse[:, f] for b in batches]))
        seen[f] = {int(i): n for n, i in enumerate(ids.tolist())}
        values[f] = torch.randn(len(ids), dim) * 0.01
        accum[f] = torch.zeros(len(ids), dim)
    slots = [[torch.tensor([seen[f][int(i)] for i in torch.unique(b.sparse[:, f]).tolist()]) for f in range(num_fields)] for b in batches]
    times, copies = [], []
    moved = sum(len(i) for i in slots[0]) * dim
    src, dst = torch.ones(moved), torch.zeros(moved)  # written once, so no page is new to the copies
    for s in range(steps):
        t0 = time.perf_counter()
        for f in range(num_fields):
            idx = slots[s][f]
            rows = values[f].index_select(0, idx)  # the pull's gather
            grad = torch.full_like(rows, 1e-3)
            a = accum[f].index_select(0, idx).addcmul_(grad, grad)
            accum[f].index_copy_(0, idx, a)
            values[f].index_copy_(0, idx, rows.addcdiv_(grad, a.sqrt_().add_(eps), value=-lr))
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, statistics.median(copies) * 1e3


def _summary(label: str, xs: list[float]) -> str:
    return f"{label} {statistics.median(xs) * 1e3:7.1f}" if xs else f"{label}     -"


def run(steps: int, warm_from: int, preset: str, profile: str | None, cache: tuple[int, int] | None = None,
        cache_rows: int = 0) -> list[str]:
    """One run (a shard and a worker, ``cache``: the row cache's read/write bounds, None: off):
    its table lines, cold and warm, and the ceiling's line."""
    from tether.deploy.launch import LocalCluster
    from tether.worker.config import MODEL_PRESETS, WorkerConfig
    from tether.worker.ctr.job import ctr_sparse, ctr_trainer, open_dataset
    from tether.worker.data.synthetic import SyntheticClickLog, SyntheticConfig

    size = MODEL_PRESETS[preset]
    gen = SyntheticClickLog(SyntheticConfig(num_sparse=size["num_sparse"]))
    t0 = time.perf_counter()
    batches = list(gen.batches(size["batch_size"], steps + 1))
    gen_ms = (time.perf_counter() - t0) / (steps + 1) * 1e3
    uniques = statistics.mean(sum(len(torch.unique(b.sparse[:, f])) for f in range(b.sparse.shape[1])) for b in batches[:10])
    with LocalCluster(grace_s=5.0) as cluster, tempfile.TemporaryDirectory() as tmp:
        addresses = cluster.start_shards(1, timeout_s=90)
        shard_pid = cluster.shards[0].proc.pid
        caching = {} if cache is None else {"cache_rows": cache_rows, "cache_bound": cache[0], "cache_write_bound": cache[1]}
        cfg = WorkerConfig(shards=tuple(addresses), num_workers=1, steps=steps, eval_samples=100, device="cpu", out=tmp, **size, **caching)
        with ctr_trainer(cfg, open_dataset(cfg), printer=lambda line: None) as trainer:
            ps = trainer.ps
            pending = ps.prefetch(ctr_sparse(batches[0]))
            waits, pushes, computes, shard_cpu, worker_cpu, moved = [], [], [], [], [], []
            spies: list[subprocess.Popen] = []
            for step in range(steps):
                if profile and step == warm_from:
                    Path(profile).mkdir(parents=True, exist_ok=True)
                    spies = [subprocess.Popen(["py-spy", "record", "-o", f"{profile}/{name}.txt", "--format", "raw", "--pid", str(pid), "-r", "200"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                             for name, pid in (("shard", shard_pid), ("worker", os.getpid()))]
                    time.sleep(1.0)
                m0 = sum(ps.meter.pulled_rows.values()) + sum(ps.meter.pushed_rows.values())
                c0, w0 = _cpu_s(shard_pid), time.process_time()
                t0 = time.perf_counter()
                pulled = ps.install(pending, train=True, timeout=120)
                t1, w1 = time.perf_counter(), time.process_time()
                rows = ps._groups[0][0]
                (rows * 1e-3).sum().backward()
                t2, w2 = time.perf_counter(), time.process_time()
                pending = ps.push_pull(clock=step + 1, versions=pulled, sparse=ctr_sparse(batches[step + 1]))
                t3, w3 = time.perf_counter(), time.process_time()
                waits.append(t1 - t0)
                computes.append(t2 - t1)
                pushes.append(t3 - t2)
                shard_cpu.append(_cpu_s(shard_pid) - c0)
                worker_cpu.append(w1 - w0 + w3 - w2)
                moved.append((sum(ps.meter.pulled_rows.values()) + sum(ps.meter.pushed_rows.values()) - m0) * 1e-3)  # thousands
            ps.install(pending, train=False, timeout=120)
            for spy in spies:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(30)
    ceiling_ms, memcpy_ms = _ceiling(batches, min(steps, 30), size["embedding_dim"])
    cold = slice(0, min(10, steps))
    warm = slice(warm_from, steps)
    name = "no cache" if cache is None else f"cache {cache[0]}/{cache[1]}"
    lines = [f"preset {preset}: batch {size['batch_size']}, {size['num_sparse']} tables x {size['embedding_dim']} wide, "
             f"{uniques:,.0f} unique ids a step ({uniques * size['embedding_dim'] * 4 / 2**20:.1f} MiB of rows), {steps} steps",
             f"data generator: {gen_ms:.1f} ms a batch (made before the clock here)"]
    for label, part in (("cold (steps 0-9)", cold), (f"warm (steps {warm_from}-{steps - 1})", warm)):
        cols = [waits[part], pushes[part], computes[part], shard_cpu[part], worker_cpu[part]]
        lines.append(f"{name + ', ' + label:38s} " + "  ".join(_summary("", c) for c in cols)
                     + f"  {statistics.median(moved[part]):10.1f}k")
    lines.append(f"ceiling, one process (torch gathers + Adagrad updates of the same rows): {ceiling_ms:.1f} ms; "
                 f"memcpy of the step's rows + gradients: {memcpy_ms:.1f} ms")
    lines.append(f"{name}: warm round trip (pull_wait + push) {statistics.median(waits[warm]) * 1e3 + statistics.median(pushes[warm]) * 1e3:.1f} ms"
                 f" = {(statistics.median(waits[warm]) + statistics.median(pushes[warm])) * 1e3 / memcpy_ms:.1f}x the memcpy")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=130)
    p.add_argument("--warm-from", type=int, default=100)
    p.add_argument("--preset", default="gpu")
    p.add_argument("--profile", default=None, help="folder for py-spy flame graphs of the warm steps")
    p.add_argument("--cache", default=None, metavar="R/W", help="also run with the row cache at read bound R and write bound W, side by side")
    p.add_argument("--cache-rows", type=int, default=100_000, help="the cache's rows per table (default 100,000: every id of the synthetic data)")
    a = p.parse_args(argv)
    if not 0 < a.warm_from < a.steps:
        sys.exit("--warm-from must be in (0, --steps)")
    cache = None
    if a.cache is not None:
        try:
            cache = cache_bounds(a.cache)
        except ValueError as exc:
            p.error(str(exc))
    lines = run(a.steps, a.warm_from, a.preset, a.profile)
    if cache is not None:
        lines += run(a.steps, a.warm_from, a.preset, None, cache, a.cache_rows)
    header = "ms per step (medians)                  pull_wait   push   compute  shard CPU  worker CPU  rows moved"
    print("\n".join(lines[:2] + [header] + [x for x in lines if x.startswith(("no cache", "cache"))]
                    + [lines[-2]]))


if __name__ == "__main__":
    main()
