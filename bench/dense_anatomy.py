"""Where a dense 4 MiB push + pull step's time goes, on both sides: wall, CPU, page faults, switches.

Why it exists: the same-host dense figure moved 3.3x between two days on the same VM type. This
runs the step (one shard process, one client in this process, ``transport`` as asked) and reads,
per step and for each side, what the kernel counted:

- CPU time (user + system, ``/proc/<pid>/stat``) against wall time: a step whose wall time grows
  while its CPU time does not waited (for a core, for a wake-up), it did not work harder;
- minor and major page faults (``minflt``/``majflt``): fresh, unfaulted buffers on the path;
- voluntary and involuntary context switches (``/proc/<pid>/status``): sleeps and preemptions;
- the machine around it: CPU steal during the run (``/proc/stat``), numpy's memory-copy bandwidth,
  the load average, transparent huge pages.

It also runs the step after pauses longer than the shard's idle release (1 s), where the shard
maps its receive buffer afresh. Run: ``python bench/dense_anatomy.py [--transport auto|tcp]
[--steps 300] [--mib 4]``; prints one JSON line and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_all import copy_gb_per_s, cpu_times

__all__ = ["main", "sample"]


def sample(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds, page faults and context switches of a process so far."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    out = {"minflt": float(stat[7]), "majflt": float(stat[9]), "cpu_s": (float(stat[11]) + float(stat[12])) / tick,
           "sys_s": float(stat[12]) / tick}
    out["vcsw"] = out["ivcsw"] = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():  # every thread's switches (the process's status has the main thread's)
        try:
            text = (task / "status").read_text()
        except OSError:
            continue  # a thread that just ended
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out["vcsw"] += float(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                out["ivcsw"] += float(line.split()[1])
    return out


def _per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    return {k: (after[k] - before[k]) / steps for k in before}


def main(argv: list[str] | None = None) -> int:
    """Measure and print one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=("auto", "tcp"), default="auto", help="auto: shared memory (same host); tcp: the socket")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--mib", type=int, default=4)
    a = p.parse_args(argv)
    from tether.common.allocator import tune_malloc
    from tether.deploy.launch import LocalCluster
    from tether.protos.specs import OptimizerConfig
    from tether.worker.client.config import ClientConfig
    from tether.worker.client.ps_client import PSClient

    tune_malloc()  # what tether's own worker processes do at start-up

    torch.set_num_threads(1)
    n = a.mib * 2**18
    with LocalCluster(grace_s=5) as cluster:
        addresses = cluster.start_shards(1)
        shard = cluster.shards[0].proc.pid
        client = PSClient(ClientConfig(addresses=tuple(addresses), worker_id="anatomy", transport=a.transport))
        client.declare(dense={"w": torch.zeros(n)}, dense_optimizer=OptimizerConfig("sgd", lr=0.01))
        grad = torch.randn(n)

        def step() -> None:
            client.push(dense={"w": grad}).result()
            client.pull(dense=["w"]).result()

        for _ in range(20):
            step()
        copy = copy_gb_per_s()
        c0, s0, (tot0, steal0) = sample(), sample(shard), cpu_times()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        wall = (time.perf_counter() - t0) / a.steps
        c1, s1, (tot1, steal1) = sample(), sample(shard), cpu_times()
        idle_c0, idle_s0 = sample(), sample(shard)
        for _ in range(3):
            time.sleep(1.2)
            step()
        idle = {"client": _per_step(idle_c0, sample(), 3), "shard": _per_step(idle_s0, sample(shard), 3)}
        out = {
            "transport": client.transports()[0], "mib": a.mib, "steps": a.steps, "wall_ms": wall * 1e3,
            "mib_per_s": 2 * a.mib / wall, "client": _per_step(c0, c1, a.steps), "shard": _per_step(s0, s1, a.steps),
            "after_idle": idle, "steal": (steal1 - steal0) / max(tot1 - tot0, 1.0), "copy_gb_s": copy,
            "load": os.getloadavg()[0], "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
        }
        client.close()
    print(json.dumps(out))
    c, s = out["client"], out["shard"]
    print(
        f"{out['transport']}: {out['mib_per_s']:,.0f} MiB/s, {out['wall_ms']:.2f} ms/step wall; CPU per step client "
        f"{c['cpu_s'] * 1e3:.2f} ms (system {c['sys_s'] * 1e3:.2f}) + shard {s['cpu_s'] * 1e3:.2f} ms (system "
        f"{s['sys_s'] * 1e3:.2f}); page faults per step client {c['minflt']:.2f} shard "
        f"{s['minflt']:.2f} (after a 1.2 s pause: {idle['client']['minflt']:.0f} / {idle['shard']['minflt']:.0f}); "
        f"context switches per step client {c['vcsw']:.1f}+{c['ivcsw']:.1f} shard {s['vcsw']:.1f}+{s['ivcsw']:.1f} "
        f"(voluntary+involuntary); steal {out['steal']:.1%}, copy {copy:.1f} GB/s, load {out['load']:.1f}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
