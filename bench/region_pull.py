"""A ``--preset gpu`` step's pull from one shard on this host onto the GPU, two ways side by side
(issue 41 item 4): straight from the connection's shared region, registered as pinned memory
(what a CUDA worker does where the platform allows), and with one copy into pinned memory first
(what it does where registration is refused, and what every CUDA worker did before).

    python bench/region_pull.py [--steps 40] [--rows 68800] [--dim 128] [--tables 26]

Each step pulls the same ``--rows`` distinct ids of ``--tables`` tables of ``--dim`` floats (the preset's
~68.8k unique rows, 33.6 MiB) as a CUDA worker's transfer thread does, then waits until its rows
are on the GPU. Printed per way, medians over the steps after 5 warm-up ones: ms per pull (sent
until the rows are on the GPU) and this process's CPU ms per pull (all its threads: the copy out
of the region is the worker's CPU), and whether the region was registered (or why not). Needs
CUDA; the shard is a separate process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def run(steps: int, rows: int, dim: int, tables: int) -> list[str]:
    from tether.deploy.launch import LocalCluster
    from tether.protos.specs import OptimizerConfig, TableConfig
    from tether.worker.client import region_pins
    from tether.worker.client.config import ClientConfig
    from tether.worker.client.device_pull import DeviceRows
    from tether.worker.client.ps_client import PSClient
    from tether.worker.training.transfer import pinned

    device = torch.device("cuda", 0)
    stream = torch.cuda.Stream(device=device)
    names = [f"t{i}" for i in range(tables)]
    per = rows // tables
    ids = {n: torch.arange(per, dtype=torch.int64) * 7 + i for i, n in enumerate(names)}
    lines = []
    with LocalCluster(grace_s=5.0) as cluster:
        address = cluster.start_shards(1, timeout_s=90)[0]
        with PSClient(ClientConfig(addresses=(address,), worker_id="bench", timeout_s=60.0)) as client:
            client.router.pin_memory = True
            client.declare([TableConfig(n, dim, OptimizerConfig("adagrad", 0.05)) for n in names])
            for way in ("region", "pinned copy"):
                wall, cpu = [], []
                for step in range(steps + 5):
                    t0, c0 = time.perf_counter(), _cpu_s()
                    if way == "region":
                        with client.router.rows_to(DeviceRows(device, stream)):
                            pulled = client.pull(ids).result(60)
                        on_gpu = [pulled.rows[n] for n in names]
                    else:
                        pulled = client.pull(ids).result(60)
                        with torch.cuda.stream(stream):
                            on_gpu = [pinned([pulled.rows[n] for n in names]).to(device, non_blocking=True)]
                    stream.synchronize()
                    if step >= 5:
                        wall.append((time.perf_counter() - t0) * 1e3)
                        cpu.append((_cpu_s() - c0) * 1e3)
                    assert all(t.device.type == "cuda" for t in on_gpu)
                lines.append(f"| {way} | {statistics.median(wall):.1f} | {statistics.median(cpu):.1f} |")
            transports, registered = client.transports(), region_pins.registered()
    why = region_pins.refused()
    lines.append(f"transport {transports[0]}; regions registered as pinned memory: {registered}" + ("" if why is None else f" (refused: {why})"))
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rows", type=int, default=68_800)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tables", type=int, default=26)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/region_pull.py needs CUDA")
    print(f"{a.rows} rows x {a.dim} floats ({a.rows * a.dim * 4 / 2**20:.1f} MiB) a pull, {a.tables} tables, one shard on this host")
    print("| way | ms per pull to the GPU | worker CPU ms per pull |")
    print("|---|---|---|")
    for line in run(a.steps, a.rows, a.dim, a.tables):
        print(line)


if __name__ == "__main__":
    main()
