"""The peer tether is compared against: a ``torch.distributed.rpc`` (TensorPipe) parameter server.

One trainer process and ``num_servers`` server processes form an rpc world on loopback. Each
server process hosts one :class:`ParameterServer`; the trainer calls it with ``rpc.rpc_sync`` /
``rpc.rpc_async`` (parallel across servers). Dense MB/s counts bytes pushed plus bytes
pulled, in MiB/s (2**20). Every process runs with ``torch.set_num_threads(1)`` unless told
otherwise: on a 2-core box intra-op threads only oversubscribe the cores, and it made this peer
up to 1.5x faster on sparse rows; give tether's processes the same setting when comparing.

Run: ``python bench/rpc_peer.py [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import queue
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    QUICK_SIZES,
    SIZES,
    ChildProcess,
    call_stats,
    fmt_size,
    free_port,
    markdown_table,
    mib_per_s,
    start_process,
    time_op,
    unique_ids,
)

__all__ = [
    "ParameterServer",
    "main",
    "rpc_dense_mbps",
    "rpc_small_calls",
    "rpc_sparse_rows_per_s",
    "run_rpc_world",
]

LR = 0.01
_RPC_TIMEOUT = 60.0
_STARTUP_ALLOWANCE = 90.0  # spawning + importing torch + rendezvous, on a loaded 2-core box


class ParameterServer:
    """Dense tensors and one embedding table, updated in place with SGD (Hogwild)."""

    def __init__(self, lr: float = LR, num_rows: int = 1, dim: int = 1) -> None:
        self.lr = lr
        self.dense: dict[str, torch.Tensor] = {}
        # Sparse rows live in one preallocated table indexed by ``id % num_rows``.
        self.table = torch.randn(num_rows, dim).mul_(0.01)

    def create(self, name: str, numel: int) -> None:
        """Allocate a zero dense fp32 tensor ``name`` of ``numel`` elements."""
        self.dense[name] = torch.zeros(numel)

    def push(self, name: str, grad: torch.Tensor) -> None:
        """Apply ``param -= lr * grad``."""
        self.dense[name].add_(grad, alpha=-self.lr)

    def pull(self, name: str) -> torch.Tensor:
        """Return the current value of ``name``."""
        return self.dense[name]

    def push_pull(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Push ``grad`` and return the updated value in the same call."""
        return self.dense[name].add_(grad, alpha=-self.lr)

    def pull_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Return the rows of ``ids`` as a ``[len(ids), dim]`` tensor."""
        return self.table.index_select(0, ids % self.table.shape[0])

    def push_rows(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply ``row -= lr * grad`` for each id (duplicates accumulate)."""
        self.table.index_add_(0, ids % self.table.shape[0], grads, alpha=-self.lr)

    def push_pull_rows(self, ids: torch.Tensor, grads: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """``push_rows(ids, grads)``, then return the rows of ``next_ids`` (one round trip)."""
        self.push_rows(ids, grads)
        return self.pull_rows(next_ids)


# --------------------------------------------------------------------------- rpc world

# The ParameterServer hosted by this process (servers only), reached by ``_on_server``. Plain
# functions against a per-process instance beat RRef proxies (``rref.rpc_sync().push``) by
# 1.3-1.7x here, since every proxied call pickles the RRef; the peer should be its fast self.
_HOSTED: dict[str, ParameterServer] = {}


def _on_server(method: str, *args: Any) -> Any:
    """Run ``method(*args)`` on the ParameterServer hosted by the called process."""
    return getattr(_HOSTED["ps"], method)(*args)


def _options(port: int) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=_RPC_TIMEOUT, num_worker_threads=8
    )


def _quiet(torch_threads: int | None) -> None:
    # rpc.shutdown() gathers over gloo and warns about it on every call.
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)


def _serve(
    rank: int,
    world_size: int,
    port: int,
    server_kwargs: dict[str, Any],
    torch_threads: int | None,
) -> None:
    """Child: host a ParameterServer as ``ps{rank-1}`` until the trainer shuts down."""
    _quiet(torch_threads)
    _HOSTED["ps"] = ParameterServer(**server_kwargs)
    rpc.init_rpc(
        f"ps{rank - 1}", rank=rank, world_size=world_size, rpc_backend_options=_options(port)
    )
    rpc.shutdown()


def _train(
    world_size: int,
    port: int,
    job: Callable[..., Any],
    kwargs: dict[str, Any],
    results: Any,
    torch_threads: int | None,
) -> None:
    """Child: join the world as ``trainer`` (rank 0), run ``job(**kwargs)``, report, shut down."""
    _quiet(torch_threads)
    try:
        rpc.init_rpc("trainer", rank=0, world_size=world_size, rpc_backend_options=_options(port))
    except Exception:
        results.put(("error", traceback.format_exc()))
        return
    try:
        results.put(("ok", job(**kwargs)))
    except Exception:
        results.put(("error", traceback.format_exc()))
    finally:
        rpc.shutdown()


def run_rpc_world(
    job: Callable[..., Any],
    kwargs: dict[str, Any],
    num_servers: int,
    timeout: float,
    server_kwargs: dict[str, Any] | None = None,
    torch_threads: int | None = 1,
) -> Any:
    """Start a trainer and ``num_servers`` servers, run ``job(**kwargs)`` on the trainer.

    Args:
        job: module-level function run in the trainer once the world is up; it reaches
            server ``ps{i}`` with ``rpc.rpc_sync(f"ps{i}", _on_server, args=(method, ...))``.
        kwargs: keyword arguments for ``job``.
        num_servers: server processes, named ``ps0``, ``ps1``, ...
        timeout: seconds to wait for the job's result, start-up included.
        server_kwargs: arguments for each server's ParameterServer.
        torch_threads: ``torch.set_num_threads`` in every process (None keeps torch's
            default); one thread each avoids oversubscribing a small machine.

    Raises:
        ValueError: if ``num_servers`` < 1.
        TimeoutError: if the job has not reported within ``timeout`` seconds.
        RuntimeError: if the job raised (the message holds the trainer's traceback) or a
            process died first.
    """
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world_size, port = num_servers + 1, free_port()
    children: list[ChildProcess] = []
    grace = 1.0  # seconds each process gets to exit by itself; long only after a clean run
    try:
        children.append(
            start_process(
                _train, (world_size, port, job, kwargs, results, torch_threads), "trainer", ctx
            )
        )
        for rank in range(1, world_size):
            args = (rank, world_size, port, server_kwargs or {}, torch_threads)
            children.append(start_process(_serve, args, f"ps{rank - 1}", ctx))
        status, value = _wait_result(results, children, timeout, job.__name__)
        if status != "ok":
            raise RuntimeError(f"rpc job {job.__name__} failed on the trainer:\n{value}")
        grace = 30.0
        return value
    finally:
        for child in children:  # trainer first: its shutdown releases the servers
            child.stop(timeout=grace)


def _wait_result(
    results: Any, children: list[ChildProcess], timeout: float, name: str
) -> tuple[str, Any]:
    """Wait for the trainer's report, failing early if any process has died."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            return results.get(timeout=min(left, 0.5))
        except queue.Empty:
            dead = [c.process.name for c in children if c.process.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"rpc job {name}: process(es) {dead} died") from None
    raise TimeoutError(f"rpc job {name} did not finish in {timeout} s")


# --------------------------------------------------------------------------- jobs (trainer side)


def _call(server: str, method: str, *args: Any) -> Any:
    return rpc.rpc_sync(server, _on_server, args=(method, *args))


def _call_async(server: str, method: str, *args: Any) -> torch.futures.Future:
    return rpc.rpc_async(server, _on_server, args=(method, *args))


def _dense_job(sizes: list[int], seconds: float) -> dict[int, float]:
    out: dict[int, float] = {}
    for size in sizes:
        name = f"dense{size}"
        _call("ps0", "create", name, size // 4)
        grad = torch.randn(size // 4)

        def step(name: str = name, grad: torch.Tensor = grad) -> None:
            _call("ps0", "push", name, grad)
            _call("ps0", "pull", name)

        out[size] = mib_per_s(
            2 * size, time_op(step, seconds, min_iters=3, warmup_seconds=seconds / 2)
        )
    return out


def _small_job(seconds: float) -> dict[str, float]:
    _call("ps0", "create", "tiny", 2)
    grad = torch.zeros(2)  # 8 bytes each way
    lat = time_op(
        lambda: _call("ps0", "push_pull", "tiny", grad),
        min_seconds=seconds,
        min_iters=100,
        warmup=20,
    )
    return call_stats(lat)



def _sparse_job(num_servers: int, num_ids: int, seconds: float, fused: bool = False) -> float:
    servers = [f"ps{s}" for s in range(num_servers)]
    gen = torch.Generator().manual_seed(0)
    cycle = itertools.cycle([unique_ids(num_ids, gen) for _ in range(8)])

    def split(ids: torch.Tensor) -> list[torch.Tensor]:
        shard = ids % num_servers
        # Boolean indexing makes fresh tensors; rpc would ship a view's whole storage.
        return [ids[shard == s] for s in range(num_servers)] if num_servers > 1 else [ids]

    def step() -> None:
        parts = split(next(cycle))
        pulls = [_call_async(s, "pull_rows", part) for s, part in zip(servers, parts, strict=True)]
        rows = [f.wait() for f in pulls]
        pushes = [
            _call_async(s, "push_rows", part, r.mul(0.01))
            for s, part, r in zip(servers, parts, rows, strict=True)
        ]
        for f in pushes:
            f.wait()

    # One round trip per step: the gradients of the last step's rows travel with the pull of
    # this step's (the server applies them first), as tether's push_pull does.
    last: list[tuple[torch.Tensor, torch.Tensor]] = []

    def fused_step() -> None:
        parts = split(next(cycle))
        if last:
            calls = [
                _call_async(s, "push_pull_rows", ids, grads, part)
                for s, (ids, grads), part in zip(servers, last, parts, strict=True)
            ]
        else:
            calls = [_call_async(s, "pull_rows", part) for s, part in zip(servers, parts, strict=True)]
        last[:] = [(part, f.wait().mul(0.01)) for part, f in zip(parts, calls, strict=True)]

    lat = time_op(fused_step if fused else step, seconds, min_iters=3, warmup=2, warmup_seconds=seconds / 2)
    return num_ids * len(lat) / sum(lat)


# --------------------------------------------------------------------------- public API


def rpc_dense_mbps(
    sizes: list[int], seconds: float, torch_threads: int | None = 1
) -> dict[int, float]:
    """Dense push then pull MiB/s of fp32 tensors, per size in bytes (one server, one world).

    Raises:
        ValueError: if a size is not a positive multiple of 4.
    """
    bad = [s for s in sizes if s <= 0 or s % 4]
    if bad:
        raise ValueError(f"sizes must be positive multiples of 4 bytes, got {bad}")
    return run_rpc_world(
        _dense_job,
        {"sizes": list(sizes), "seconds": seconds},
        num_servers=1,
        timeout=_STARTUP_ALLOWANCE + len(sizes) * (3 * seconds + 30),
        torch_threads=torch_threads,
    )


def rpc_small_calls(seconds: float, torch_threads: int | None = 1) -> dict[str, float]:
    """Sequential push_pull calls of a 2-float tensor: calls_per_s, p50_us, p99_us."""
    return run_rpc_world(
        _small_job,
        {"seconds": seconds},
        num_servers=1,
        timeout=_STARTUP_ALLOWANCE + 3 * seconds + 30,
        torch_threads=torch_threads,
    )


def rpc_sparse_rows_per_s(
    num_servers: int,
    num_ids: int = 4096,
    dim: int = 64,
    seconds: float = 2.0,
    num_rows: int = 2**18,
    torch_threads: int | None = 1,
    fused: bool = False,
) -> float:
    """Embedding rows/s for pull + push of ``num_ids`` unique ids, split by ``id % num_servers``.

    Each step pulls the rows from all servers in parallel (``rpc_async``), then pushes one
    gradient per row in parallel; a row counts once per step. Each server's table holds
    ``num_rows`` rows of ``dim`` fp32. ``fused``: one round trip per step instead, the push of
    the last step's gradients and the pull of this step's rows in one call per server.

    Raises:
        ValueError: if ``num_ids``, ``dim`` or ``num_rows`` is < 1.
    """
    if min(num_ids, dim, num_rows) < 1:
        raise ValueError(f"need num_ids, dim, num_rows >= 1; got {num_ids=}, {dim=}, {num_rows=}")
    return run_rpc_world(
        _sparse_job,
        {"num_servers": num_servers, "num_ids": num_ids, "seconds": seconds, "fused": fused},
        num_servers=num_servers,
        timeout=_STARTUP_ALLOWANCE + 3 * seconds + 30,
        server_kwargs={"lr": LR, "num_rows": num_rows, "dim": dim},
        torch_threads=torch_threads,
    )


def main(argv: list[str] | None = None) -> None:
    """Print the rpc parameter-server figures as Markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run (~30 s)")
    parser.add_argument(
        "--seconds", type=float, help="time per measurement (default 1.0, quick 0.3)"
    )
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch threads per process (0: torch default)"
    )
    args = parser.parse_args(argv)
    threads = args.torch_threads or None
    sizes = QUICK_SIZES if args.quick else SIZES
    seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 1.0)

    dense = rpc_dense_mbps(sizes, seconds, threads)
    small = rpc_small_calls(2 * seconds, threads)
    sparse = {
        (n, fused): rpc_sparse_rows_per_s(n, seconds=2 * seconds, torch_threads=threads, fused=fused)
        for n in (1, 2)
        for fused in (False, True)
    }

    print("## torch.distributed.rpc PS: dense push + pull (fp32, MiB/s pushed + pulled)\n")
    print(markdown_table(["size", "MiB/s"], [[fmt_size(s), dense[s]] for s in sizes]))
    print("\n## torch.distributed.rpc PS: small calls (push_pull of 8 bytes, sequential)\n")
    print(
        markdown_table(
            ["calls/s", "p50 us", "p99 us"],
            [[small["calls_per_s"], small["p50_us"], small["p99_us"]]],
        )
    )
    print("\n## torch.distributed.rpc PS: sparse rows (4096 unique ids x 64 dims, pull + push)\n")
    print(markdown_table(
        ["servers", "pull, then push: rows/s", "one push_pull per step: rows/s"],
        [[n, sparse[(n, False)], sparse[(n, True)]] for n in (1, 2)],
    ))


if __name__ == "__main__":
    main()
