"""Samples/s of the default CTR model: 1 worker + 1 shard through tether, against the same
model trained in one process with no parameter server (the ceiling), side by side.

    python bench/model_throughput.py [--quick] [--steps N] [--preset default|gpu] [--batch-size B] [--device cpu|cuda]
                                     [--num-shards N|auto] [--push-window K] [--cache R/W [--cache-rows N]]

``--preset gpu`` is the model ``tether worker --preset gpu`` trains (batch 8,192, 26 fields,
128-wide rows): a CUDA step large enough that kernel launches do not bound it, with its push
window (2; ``--push-window`` overrides it). ``--num-shards auto`` starts the shards ``tether
launch`` would start for one worker on this host (``tether.deploy.shard_count``: on a GPU host
one per core the worker leaves, with their kernel threads); the default is 1 shard. ``--cache R/W``
adds a row: the same tether job with the worker row cache at read bound R and write bound W
(``--cache-rows`` rows a table), on the training device as a CUDA worker keeps it
(``tether.worker.cache.device``), with its own share of the step.

Both sides get one intra-op thread per process (as ``tether launch`` gives its children), the
same batches, model, seed and optimizer (Adagrad). The tether side is a real shard process and
a real worker process. Both read their batches the same way, from a generator on a background
thread (``tether.worker.data.synthetic.in_background``, as every tether worker does); the in-process run
with every batch generated before its clock starts (no data loading at all) is shown beside it
for reference.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import cache_bounds, markdown_table

from tether.common.choices import CACHE_ADMISSIONS
from tether.worker.config import MODEL_PRESETS, gpu_push_window

# DESIGN.md: one worker and one shard reach >= 90% of the model trained in one process.
TARGET = 0.90


def in_process(steps: int, size: dict[str, int], device: str, warmup: int = 20, pregenerated: bool = False) -> float:
    """Samples/s of the model trained in this process (local sparse embeddings + Adagrad).

    Batches come from a background thread, as a tether worker reads them; ``pregenerated``:
    all of them are made before the clock starts instead.
    """
    import torch
    import torch.nn.functional as F

    from tether.worker.ctr.model import CTRModel, LocalHashEmbedding
    from tether.worker.data.synthetic import SyntheticClickLog, SyntheticConfig, in_background

    dev = torch.device(device)
    data = SyntheticConfig(num_sparse=size["num_sparse"])
    gen = SyntheticClickLog(data)
    torch.manual_seed(0)
    # One bucket per id, as a shard holds one row per id it has seen.
    model = CTRModel(data.num_dense, data.num_sparse, size["embedding_dim"],
                     embedding_factory=lambda name, dim: LocalHashEmbedding(dim, num_buckets=data.vocab_size)).to(dev)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    batch_size = size["batch_size"]
    stream = gen.batches(batch_size, steps + warmup)
    batches = list(stream) if pregenerated else in_background(stream)
    start = None
    for i, b in enumerate(batches):
        if i == warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(model(b.dense.to(dev), b.sparse.to(dev)), b.labels.to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return steps * batch_size / (time.perf_counter() - start)


def through_tether(steps: int, size: dict[str, int], device: str, shards: int = 1, workers: int = 1, window: int = 1,
                   shard_env: dict[str, str] | None = None, cache: dict[str, int | str] | None = None) -> dict:
    """Samples/s of the same model through a local tether cluster (real processes); ``cache``:
    the row cache's settings (``cache_rows``, ``cache_bound``, ``cache_write_bound``)."""
    from tether.deploy.job import run_job
    from tether.worker.config import WorkerConfig

    cfg = WorkerConfig(shards=("pending:0",), num_workers=workers, steps=steps, eval_samples=2000, device=device, log_every=steps,
                       push_window=window, **size, **(cache or {}))
    with tempfile.TemporaryDirectory() as tmp:
        return run_job(cfg, shards, out=tmp, echo=False, shard_env=shard_env)


def shard_choice(text: str, device: str) -> tuple[int, dict[str, str], str]:
    """``--num-shards``: a count as given, or ``auto``: what ``tether launch`` chooses for one
    worker on ``device`` here; with the shards' environment and a note for the table."""
    if text != "auto":
        return int(text), {}, ""
    from tether.deploy.children import gpu_count
    from tether.deploy.shard_count import choose_shards, host_cores

    count = choose_shards(None, gpus=gpu_count() if device != "cpu" else 0, cores=host_cores(), num_workers=1, device=device)
    return count.num_shards, count.env(), f" (as tether launch chooses: {count.why})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI-sized run")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--preset", choices=tuple(MODEL_PRESETS), default="default", help="model size (tether worker --preset)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per step (default: the preset's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-shards", default="1", help="shards of the tether side: N, or auto (what tether launch chooses here)")
    p.add_argument("--push-window", type=int, default=None, help="the tether worker's push window (default: the preset's)")
    p.add_argument("--cache", default=None, metavar="R/W", help="also run the tether job with the row cache at read/write bounds R/W")
    p.add_argument("--cache-rows", type=int, default=100_000, help="the row cache's rows per table (default 100,000: every id of the synthetic data)")
    p.add_argument("--cache-admission", default=CACHE_ADMISSIONS[0], choices=CACHE_ADMISSIONS,
                   help=f"the row cache's admission (default {CACHE_ADMISSIONS[0]})")
    p.add_argument("--_inprocess", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_pregenerated", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    size = {**MODEL_PRESETS[a.preset], **({"batch_size": a.batch_size} if a.batch_size else {})}
    cache = None
    if a.cache is not None:
        try:
            r, w = cache_bounds(a.cache)
        except ValueError as exc:
            p.error(str(exc))
        cache = {"cache_rows": a.cache_rows, "cache_bound": r, "cache_write_bound": w, "cache_admission": a.cache_admission}
    steps = a.steps or (200 if a.quick else 1500)
    if a._inprocess:
        print(in_process(steps, size, a.device, pregenerated=a._pregenerated))
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

    def ceiling(*extra: str) -> float:
        # The ceiling runs in its own process so both sides get the same thread settings.
        return float(subprocess.run(
            [sys.executable, __file__, "--_inprocess", "--steps", str(steps), "--preset", a.preset, "--batch-size", str(size["batch_size"]),
             "--device", a.device, *extra],
            capture_output=True, text=True, check=True, env=env, timeout=1800,
        ).stdout.split()[-1])

    local = ceiling()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shards, shard_env, chosen = shard_choice(a.num_shards, a.device)
    window = a.push_window or (gpu_push_window({"mode": "async", "prefetch": True}) if a.preset == "gpu" else 1)
    summary = through_tether(steps, size, a.device, shards=shards, window=window, shard_env=shard_env)
    cached = through_tether(steps, size, a.device, shards=shards, window=window, shard_env=shard_env, cache=cache) if cache else None
    pregenerated = ceiling("--_pregenerated")
    ratio = summary["samples_per_sec"] / local
    phases = summary["workers"][0]["phase_seconds"]
    busy = sum(phases.values())
    rows = [
        ["in one process, no parameter server", local, "1.00"],
        [f"tether: 1 worker + {shards} shard(s), push window {window}", summary["samples_per_sec"], f"{ratio:.2f}"],
    ]
    if cached is not None and cache is not None:
        admission = f", admission {cache['cache_admission']}"
        rows.append([f"tether, row cache {cache['cache_bound']}/{cache['cache_write_bound']} ({cache['cache_rows']:,} rows a table{admission})",
                     cached["samples_per_sec"], f"{cached['samples_per_sec'] / local:.2f}"])
    rows.append(["in one process, every batch made before the clock (reference)", pregenerated,
                 f"{summary['samples_per_sec'] / pregenerated:.2f}"])
    print(f"CTR model, preset {a.preset} ({size['num_sparse']} fields, dim {size['embedding_dim']}), batch {size['batch_size']}, "
          f"{steps} steps, device {a.device}{chosen}\n")
    print(markdown_table(["setup", "samples/s", "ratio"], rows))
    print("\nworker step time: " + ", ".join(f"{k} {v / busy:.0%}" for k, v in phases.items() if v))
    # DESIGN.md's GPU target: the parameter server's share of a worker's step (all but compute).
    print(f"parameter server's share of the worker's step: {1 - phases.get('compute', 0.0) / busy:.0%} (GPU target <= 20%)")
    if cached is not None:
        cphases = cached["workers"][0]["phase_seconds"]
        cbusy = sum(cphases.values())
        print("with the row cache: worker step time: " + ", ".join(f"{k} {v / cbusy:.0%}" for k, v in cphases.items() if v)
              + f"; the parameter server's share {1 - cphases.get('compute', 0.0) / cbusy:.0%}")
    print(f"\ntether / in-process = {ratio:.2f} (target >= {TARGET:.2f}: {'met' if ratio >= TARGET else 'NOT met'})")


if __name__ == "__main__":
    main()
