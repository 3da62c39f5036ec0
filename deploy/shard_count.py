"""How many shards ``tether launch`` starts when ``--num-shards`` is not given (``choose_shards``).

On a host whose workers train on the CPU the default is 2, as it always was: the workers need
the cores themselves. On a host whose workers train on GPUs, a worker's step is bound by the
shards: one shard moves a ``--preset gpu`` step's ~68k unique 128-wide rows each way in ~90 ms of
its CPU while the GPU computes the step in ~10 ms (bench/RESULTS.md, 'GPU'), and every shard
serves every worker its share of the rows. So the shards get the host's cores: each GPU worker
keeps ``CORES_PER_GPU_WORKER`` (its main thread, which queues the step's kernels, and its
transfer thread, which receives rows and sends gradients; the gRPC pool and the data thread
mostly wait), and every core left is one shard (a shard process is one core's worth of work:
decode, the id index, the rule's apply and the gather), at least ``MIN_SHARDS`` and at most
``MAX_SHARDS`` (past that a pull is cut into requests so small that their fixed costs grow
faster than the work per shard shrinks, and every worker keeps a connection to every shard).
Cores left over beyond one per shard go to the shards' kernel threads
(``TETHER_KERNEL_THREADS``, at most 4, the shard's own cap); where the shards already have a
core each, or fewer, each shard is told 1, so no shard splits a large call over cores that
other shards are using. A ``TETHER_KERNEL_THREADS`` of the user's own is left as it is.

``--num-shards N`` always wins, and then nothing else is changed either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CORES_PER_GPU_WORKER", "CPU_SHARDS", "MAX_SHARDS", "MIN_SHARDS", "ShardCount", "choose_shards", "gpu_workers", "host_cores"]

# The default on a host without GPU workers (tether launch's default before this rule).
CPU_SHARDS = 2
# Cores a GPU worker keeps: its main thread and its transfer thread.
CORES_PER_GPU_WORKER = 2
MIN_SHARDS = 2
MAX_SHARDS = 16
# rules/kernel_threads.py's own cap on a shard's kernel threads.
_MAX_KERNEL_THREADS = 4
_KERNEL_THREADS_ENV = "TETHER_KERNEL_THREADS"


@dataclass(frozen=True)
class ShardCount:
    """How many shards to start, each one's kernel threads, and the launcher's line saying why."""

    num_shards: int
    # TETHER_KERNEL_THREADS for every shard (None: the shard's own default).
    kernel_threads: int | None
    why: str

    @property
    def for_gpus(self) -> bool:
        """Whether the count was chosen from the host's cores for GPU workers (the start line says how)."""
        return self.kernel_threads is not None

    def env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables every shard is started with (none where the user set them)."""
        environ = os.environ if environ is None else environ
        if self.kernel_threads is None or _KERNEL_THREADS_ENV in environ:
            return {}
        return {_KERNEL_THREADS_ENV: str(self.kernel_threads)}

    def line(self) -> str:
        """``tether: 14 shards: ...`` (what the launcher prints before it starts them)."""
        return f"tether: {self.num_shards} shard(s): {self.why}"


def host_cores() -> int:
    """The cores this process may run on (its affinity; the whole machine where there is none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def gpu_workers(device: str, num_workers: int, gpus: int) -> int:
    """How many of ``num_workers`` train on a GPU: every one where torch sees a GPU and
    ``--device`` is not ``cpu`` (``auto`` and ``cuda`` deal them over the GPUs, ``cuda:N``
    puts them all on GPU N; sync's ranks take one GPU each), else none."""
    return num_workers if gpus > 0 and device != "cpu" else 0


def choose_shards(given: int | None, *, gpus: int, cores: int, num_workers: int, device: str) -> ShardCount:
    """The shard count of ``tether launch`` (the module's rule): ``given`` (``--num-shards``)
    when there is one; else 2 without GPU workers; else one shard per core the GPU workers leave
    (``cores - CORES_PER_GPU_WORKER * workers``), clamped to [``MIN_SHARDS``, ``MAX_SHARDS``].

    Args:
        gpus: the GPUs torch sees on this host (0 without CUDA).
        cores: the cores the launcher may run on (``host_cores``).
        device: the job's ``--device``.
    """
    if given is not None:
        return ShardCount(given, None, "as --num-shards says")
    on_gpu = gpu_workers(device, num_workers, gpus)
    if not on_gpu:
        return ShardCount(CPU_SHARDS, None, "the default where the workers train on the CPU (--num-shards N to choose)")
    left = cores - CORES_PER_GPU_WORKER * on_gpu
    shards = max(MIN_SHARDS, min(MAX_SHARDS, left))
    threads = max(1, min(_MAX_KERNEL_THREADS, left // shards))
    why = (f"one per core that {on_gpu} GPU worker(s) leave of {cores} ({CORES_PER_GPU_WORKER} each: main and transfer "
           f"threads; {max(left, 0)} left), at least {MIN_SHARDS}, at most {MAX_SHARDS}; {threads} kernel thread(s) each "
           "(--num-shards N to choose)")
    return ShardCount(shards, threads, why)
