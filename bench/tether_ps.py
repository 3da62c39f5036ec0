"""tether measured exactly like the ``torch.distributed.rpc`` peer, side by side in one run.

Every tether figure comes from real shard processes (``tether.deploy.launch.LocalCluster``)
and a client in its own spawned process, each with one torch thread, as the peer's processes
have (``bench/rpc_peer.py``). What is measured mirrors the peer step for step:

- dense: declare one fp32 tensor of each size (4 KiB .. 64 MiB) with SGD on one shard; a step
  pushes its gradient, then pulls its value; MiB/s counts bytes pushed plus bytes pulled.
- small calls: a 2-float dense tensor, one ``push_pull`` round trip per call, sequential.
- sparse: 4096 unique random int64 ids x 64 dims, pull then push (SGD), 1 and 2 shards; a row
  counts once per step.
- apply: the shard's own ``EmbeddingTable.push`` in this process (no RPC), SGD and Adagrad,
  beside the same update done with raw torch on a preallocated table (no id index).
- scaling: samples/s of the default CTR model with 1, 2 workers x 1, 2 shards (``run_job``),
  beside the same model trained in one process with no parameter server.

Each comparison runs ``--repeats`` times back to back, alternating which side goes first, and
reports the median of each side and the ratio of the medians (large payloads are noisy).

Run: ``python bench/tether_ps.py [--quick] [--repeats N] [--wire-dtype bfloat16]``.
``--tls``: instead, tether's data plane inside TLS against plain TCP (``--only dense,model``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing as mp
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Same setting as the peer and as ``tether launch``: one intra-op thread per process. Set
# before torch is imported so this process and every child (shards, client) inherit it.
os.environ["OMP_NUM_THREADS"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    QUICK_SIZES,
    SIZES,
    ChildProcess,
    call_stats,
    fmt_size,
    make_certificates,
    markdown_table,
    mib_per_s,
    start_process,
    time_op,
    unique_ids,
)

__all__ = [
    "Comparison",
    "apply_rows_per_s",
    "compare_apply",
    "compare_dense",
    "compare_model",
    "compare_small",
    "compare_sparse",
    "in_process_samples_per_s",
    "main",
    "raw_apply_rows_per_s",
    "repeat_tether",
    "run_tether_client",
    "tether_dense_mbps",
    "tether_job_samples_per_s",
    "tether_small_calls",
    "tether_sparse_rows_per_s",
]

LR = 0.01  # the peer's learning rate
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_STARTUP_ALLOWANCE = 90.0  # spawn + import torch + shard start, on a loaded 2-core box
_RPC_TIMEOUT = 60.0
_HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- client process


def _client_main(
    job: Callable[..., Any], addresses: list[str], kwargs: dict[str, Any], results: Any, threads: int
) -> None:
    """Child: run ``job(addresses, **kwargs)`` with ``threads`` torch threads and report."""
    torch.set_num_threads(threads)
    try:
        results.put(("ok", job(addresses, **kwargs)))
    except Exception:
        results.put(("error", traceback.format_exc()))


def run_tether_client(
    job: Callable[..., Any],
    kwargs: dict[str, Any],
    num_shards: int,
    timeout: float,
    shard_args: Sequence[str] = (),
    threads: int = 1,
) -> Any:
    """Start ``num_shards`` shard processes, run ``job(addresses, **kwargs)`` in a client process.

    Args:
        job: module-level function; gets the shard addresses and ``kwargs``.
        num_shards: shard processes (``tether server``), each with ``OMP_NUM_THREADS=1``.
        timeout: seconds for the job's result, start-up included.
        shard_args: extra ``tether server`` flags.
        threads: ``torch.set_num_threads`` in the client process.

    Raises:
        TimeoutError: no result within ``timeout``.
        RuntimeError: the job raised (the message holds its traceback) or the client died.
    """
    from tether.deploy.launch import LocalCluster

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child: ChildProcess | None = None
    with LocalCluster(grace_s=5.0) as cluster:
        addresses = cluster.start_shards(num_shards, extra_args=list(shard_args), timeout_s=_STARTUP_ALLOWANCE)
        try:
            child = start_process(_client_main, (job, list(addresses), kwargs, results, threads), "tether-client", ctx)
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                try:
                    status, value = results.get(timeout=min(left, 0.5))
                    break
                except queue.Empty:
                    if child.process.exitcode is not None:
                        raise RuntimeError(f"tether client for {job.__name__} died (exit {child.process.exitcode})") from None
            else:
                raise TimeoutError(f"tether job {job.__name__} did not finish in {timeout:.0f} s")
        finally:
            if child is not None:
                child.stop(timeout=10.0)
    if status != "ok":
        raise RuntimeError(f"tether job {job.__name__} failed in the client:\n{value}")
    return value


def _client(addresses: list[str], wire: str = "float32", chunk_elems: int | None = None, conn: dict[str, Any] | None = None) -> Any:
    """A bench client; ``conn``: ``transport`` ("auto", "tcp", "grpc"), ``tls_ca`` (a CA file: TLS) and
    ``expect`` (how every shard must be reached, checked after the measurement)."""
    from tether.common.allocator import tune_malloc
    from tether.common.security import ClientSecurity
    from tether.worker.client.config import ClientConfig
    from tether.worker.client.ps_client import PSClient

    tune_malloc()  # what tether's own worker processes do at start-up
    conn = conn or {}
    extra: dict[str, Any] = {} if chunk_elems is None else {"chunk_elems": chunk_elems}
    if conn.get("tls_ca"):
        extra["security"] = ClientSecurity(tls_ca=conn["tls_ca"])
    client = PSClient(
        ClientConfig(addresses=tuple(addresses), worker_id="bench", timeout_s=_RPC_TIMEOUT, wire_dtype=WIRE_DTYPES[wire],
                     transport=conn.get("transport", "auto"), **extra)
    )
    return client


def _check_transport(client: Any, conn: dict[str, Any] | None) -> None:
    """Fail the run when a shard is not reached as ``conn["expect"]`` says ("tcp+tls", ...): no silent gRPC fallback."""
    expect = (conn or {}).get("expect")
    if expect and set(client.transports()) != {expect}:
        raise RuntimeError(f"expected every shard over {expect}, got {client.transports()}")


# --------------------------------------------------------------------------- jobs (client side)


def _dense_job(
    addresses: list[str], sizes: list[int], seconds: float, wire: str, chunk_elems: int | None, conn: dict[str, Any] | None = None
) -> dict[int, float]:
    from tether.protos.specs import OptimizerConfig

    out: dict[int, float] = {}
    with _client(addresses, wire, chunk_elems, conn) as client:
        sgd = OptimizerConfig("sgd", lr=LR)
        for size in sizes:
            name = f"dense{size}"
            client.declare(dense={name: torch.zeros(size // 4)}, dense_optimizer=sgd)
            grad = torch.randn(size // 4)

            def step(name: str = name, grad: torch.Tensor = grad) -> None:
                client.push(dense={name: grad}).result()
                client.pull(dense=[name]).result()

            # Bytes as the user sees them (fp32), whatever the wire carries.
            out[size] = mib_per_s(2 * size, time_op(step, seconds, min_iters=3, warmup_seconds=seconds / 2))
            _check_transport(client, conn)
    return out


def _small_job(addresses: list[str], seconds: float, conn: dict[str, Any] | None = None) -> dict[str, float]:
    from tether.protos.specs import OptimizerConfig

    with _client(addresses, conn=conn) as client:
        client.declare(dense={"tiny": torch.zeros(2)}, dense_optimizer=OptimizerConfig("sgd", lr=LR))
        grad = torch.zeros(2)  # 8 bytes each way
        lat = time_op(
            lambda: client.push_pull(push_dense={"tiny": grad}, pull_dense=["tiny"]).result(),
            min_seconds=seconds,
            min_iters=100,
            warmup=20,
        )
        _check_transport(client, conn)
    return call_stats(lat)



def _sparse_job(
    addresses: list[str], num_ids: int, dim: int, seconds: float, wire: str, fused: bool = False, conn: dict[str, Any] | None = None
) -> float:
    from tether.protos.specs import OptimizerConfig, TableConfig

    with _client(addresses, wire, conn=conn) as client:
        client.declare([TableConfig("emb", dim=dim, optimizer=OptimizerConfig("sgd", lr=LR))])
        gen = torch.Generator().manual_seed(0)
        id_sets = [unique_ids(num_ids, gen) for _ in range(8)]
        it = iter(range(1 << 62))

        # Each push names the pull its gradients came from, as tether's workers do (the shard
        # counts staleness from that read; a push without it counts from version 0).
        def step() -> None:
            ids = id_sets[next(it) % len(id_sets)]
            pulled = client.pull({"emb": ids}).result()
            client.push({"emb": (ids, pulled.rows["emb"].mul(0.01))}, versions=pulled).result()

        # One round trip per step: the last step's gradients go with this step's pull.
        last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        read: list[Any] = [None]

        def fused_step() -> None:
            ids = id_sets[next(it) % len(id_sets)]
            read[0] = pulled = client.push_pull(push_sparse=last, pull_sparse={"emb": ids}, versions=read[0]).result()
            last["emb"] = (ids, pulled.rows["emb"].mul(0.01))

        lat = time_op(fused_step if fused else step, seconds, min_iters=3, warmup=2, warmup_seconds=seconds / 2)
        _check_transport(client, conn)
    return num_ids * len(lat) / sum(lat)


# --------------------------------------------------------------------------- public measurements


def tether_dense_mbps(
    sizes: Sequence[int], seconds: float, wire: str = "float32", chunk_elems: int | None = None,
    conn: dict[str, Any] | None = None, shard_args: Sequence[str] = (),
) -> dict[int, float]:
    """Dense push then pull MiB/s (fp32 bytes pushed + pulled) per size, one shard.

    ``conn``: how the client connects (see ``_client``); ``shard_args``: extra ``tether server`` flags.

    Raises:
        ValueError: a size that is not a positive multiple of 4, or an unknown wire dtype.
    """
    bad = [s for s in sizes if s <= 0 or s % 4]
    if bad:
        raise ValueError(f"sizes must be positive multiples of 4 bytes, got {bad}")
    if wire not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {sorted(WIRE_DTYPES)}, got {wire!r}")
    return run_tether_client(
        _dense_job,
        {"sizes": list(sizes), "seconds": seconds, "wire": wire, "chunk_elems": chunk_elems, "conn": conn},
        num_shards=1,
        timeout=_STARTUP_ALLOWANCE + len(sizes) * (3 * seconds + 30),
        shard_args=shard_args,
    )


def tether_small_calls(seconds: float) -> dict[str, float]:
    """Sequential ``push_pull`` of a 2-float dense tensor: calls_per_s, p50_us, p99_us."""
    return run_tether_client(_small_job, {"seconds": seconds}, num_shards=1, timeout=_STARTUP_ALLOWANCE + 3 * seconds + 30)


def tether_sparse_rows_per_s(
    num_shards: int, num_ids: int = 4096, dim: int = 64, seconds: float = 2.0, wire: str = "float32", fused: bool = False
) -> float:
    """Embedding rows/s for pull + push of ``num_ids`` unique ids over ``num_shards`` shards (SGD).

    ``fused``: one ``push_pull`` round trip per step (the last step's gradients with this
    step's pull) instead of a pull, then a push.

    Raises:
        ValueError: if ``num_shards``, ``num_ids`` or ``dim`` is < 1.
    """
    if min(num_shards, num_ids, dim) < 1:
        raise ValueError(f"need num_shards, num_ids, dim >= 1; got {num_shards=}, {num_ids=}, {dim=}")
    return run_tether_client(
        _sparse_job,
        {"num_ids": num_ids, "dim": dim, "seconds": seconds, "wire": wire, "fused": fused},
        num_shards=num_shards,
        timeout=_STARTUP_ALLOWANCE + 3 * seconds + 30,
    )


def apply_rows_per_s(optimizer: str, num_ids: int = 4096, dim: int = 64, seconds: float = 1.0) -> dict[str, float]:
    """Rows/s of the shard's own ``EmbeddingTable.push`` in this process (no RPC).

    Returns:
        ``push`` (rows/s of whole pushes) and ``lookup`` (rows/s of the id -> slot lookup
        alone, the part a raw table indexed by ``id % rows`` does not pay).
    """
    from tether.protos.specs import OptimizerConfig, TableConfig
    from tether.server.storage.tables import EmbeddingTable

    table = EmbeddingTable(TableConfig("emb", dim=dim, optimizer=OptimizerConfig(optimizer, lr=LR)))
    gen = torch.Generator().manual_seed(0)
    id_sets = [unique_ids(num_ids, gen).numpy() for _ in range(8)]
    grads = torch.randn(num_ids, dim).mul_(0.01)
    for ids in id_sets:  # create the rows first: this is the steady state, not first touch
        table.pull(ids)
    it = iter(range(1 << 62))
    push = time_op(lambda: table.push(id_sets[next(it) % 8], grads), seconds, min_iters=5, warmup=3)
    lookup = time_op(lambda: table.slots(id_sets[next(it) % 8]), seconds / 2, min_iters=5, warmup=3)
    return {"push": num_ids * len(push) / sum(push), "lookup": num_ids * len(lookup) / sum(lookup)}


def raw_apply_rows_per_s(optimizer: str, num_ids: int = 4096, dim: int = 64, seconds: float = 1.0, id_sets: int = 8) -> float:
    """Rows/s of the same update in raw torch, with the row slots known in advance.

    The table has exactly the rows tether's holds in :func:`apply_rows_per_s` (``id_sets``
    batches of ``num_ids``), so both touch the same amount of memory; what this side skips is
    the id -> slot index and the Python around it. SGD is the peer's ``push_rows``
    (``index_add_``); Adagrad gathers rows and state, updates them and scatters them back.
    """
    num_rows = id_sets * num_ids
    w = torch.randn(num_rows, dim).mul_(0.01)
    acc = torch.zeros(num_rows, dim)
    gen = torch.Generator().manual_seed(0)
    slot_sets = list(torch.randperm(num_rows, generator=gen).split(num_ids))
    grads = torch.randn(num_ids, dim).mul_(0.01)
    it = iter(range(1 << 62))

    def sgd() -> None:
        w.index_add_(0, slot_sets[next(it) % id_sets], grads, alpha=-LR)

    def adagrad() -> None:
        idx = slot_sets[next(it) % id_sets]
        rows, a = w.index_select(0, idx), acc.index_select(0, idx)
        a.addcmul_(grads, grads)
        rows.addcdiv_(grads, a.sqrt().add_(1e-8), value=-LR)
        w.index_copy_(0, idx, rows)
        acc.index_copy_(0, idx, a)

    lat = time_op(sgd if optimizer == "sgd" else adagrad, seconds, min_iters=5, warmup=3)
    return num_ids * len(lat) / sum(lat)


def in_process_samples_per_s(steps: int, batch_size: int = 256, timeout: float = 1800.0, pregenerated: bool = False) -> float:
    """Samples/s of the default model in one process, no parameter server (``model_throughput``);
    ``pregenerated``: every batch made before the clock starts, not read from a background thread."""
    out = subprocess.run(
        [sys.executable, str(_HERE / "model_throughput.py"), "--_inprocess", "--steps", str(steps), "--batch-size", str(batch_size), "--device", "cpu",
         *(["--_pregenerated"] if pregenerated else [])],
        capture_output=True, text=True, check=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return float(out.stdout.split()[-1])


def tether_job_samples_per_s(
    workers: int, shards: int, steps: int, batch_size: int = 256, wire: str = "float32", tls: dict[str, Path] | None = None,
    mutual: bool = False, transport: str = "auto",
) -> dict[str, Any]:
    """Samples/s of the default model through a local cluster (``run_job``) and the step split.

    ``tls``: certificates (``make_certificates``): shards serve TLS and workers connect with it;
    ``mutual``: the shards also require the workers' client certificate (no shared memory then);
    ``transport``: the workers' ``--transport``.

    Returns:
        ``samples_per_sec`` (all workers) and ``phases`` (fraction of worker step time per
        phase, summed over workers).
    """
    from tether.deploy.job import run_job
    from tether.server.config import load_config as load_shard_config
    from tether.worker.config import WorkerConfig

    cfg = WorkerConfig(
        shards=("pending:0",), num_workers=workers, steps=steps, batch_size=batch_size,
        eval_samples=2000, device="cpu", log_every=steps, wire_dtype=wire, transport=transport, tls_ca=str(tls["ca.crt"]) if tls else None,
        tls_cert=str(tls["client.crt"]) if tls and mutual else None, tls_key=str(tls["client.key"]) if tls and mutual else None,
    )
    shard = load_shard_config(tls_shard_args(tls, mutual)) if tls else None
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp, contextlib.redirect_stdout(io.StringIO()):
        summary = run_job(cfg, shards, out=tmp, echo=False, timeout_s=max(600.0, steps * workers), shard=shard)
    phases: dict[str, float] = {}
    for w in summary["workers"]:
        for k, v in w["phase_seconds"].items():
            phases[k] = phases.get(k, 0.0) + float(v)
    busy = sum(phases.values()) or 1.0
    return {"samples_per_sec": float(summary["samples_per_sec"]), "phases": {k: v / busy for k, v in phases.items()}}


# --------------------------------------------------------------------------- side by side


@dataclass
class Comparison:
    """One metric, both sides, every repeat."""

    label: str
    tether: list[float] = field(default_factory=list)
    other: list[float] = field(default_factory=list)

    @property
    def tether_median(self) -> float:
        """Median of tether's repeats."""
        return statistics.median(self.tether)

    @property
    def other_median(self) -> float:
        """Median of the peer's (or ceiling's) repeats."""
        return statistics.median(self.other)

    @property
    def ratio(self) -> float:
        """tether median / other median."""
        return self.tether_median / self.other_median

    @property
    def ratio_range(self) -> tuple[float, float]:
        """Smallest and largest per-repeat ratio (how noisy the figure is)."""
        rs = [t / o for t, o in zip(self.tether, self.other, strict=True)]
        return min(rs), max(rs)


def _side_by_side(
    repeats: int, tether: Callable[[], Any], other: Callable[[], Any], log: Callable[[str], None], what: str
) -> tuple[list[Any], list[Any]]:
    """Run both sides ``repeats`` times back to back, alternating which goes first."""
    t_runs, o_runs = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        if r % 2 == 0:
            o_runs.append(other())
            t_runs.append(tether())
        else:
            t_runs.append(tether())
            o_runs.append(other())
        log(f"{what}: repeat {r + 1}/{repeats} done in {time.perf_counter() - t0:.0f}s")
    return t_runs, o_runs


def log_stderr(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def compare_dense(
    sizes: Sequence[int], seconds: float, repeats: int, wire: str = "float32", with_ceiling: bool = True,
    log: Callable[[str], None] = log_stderr,
) -> dict[str, dict[int, Comparison]]:
    """Dense MiB/s per size: tether against the rpc peer and (optionally) the ceilings.

    Returns:
        ``{"peer": {size: Comparison}, "grpc": ..., "socket": ...}``: tether against the peer,
        a raw grpc identity echo and a raw socket echo of the same bytes (the ceilings only
        with ``with_ceiling``; all are measured in the same repeats).
    """
    from ceilings import GrpcEchoPeer, SocketEchoPeer
    from rpc_peer import rpc_dense_mbps

    def other() -> dict[str, dict[int, float]]:
        res = {"peer": rpc_dense_mbps(list(sizes), seconds)}
        if with_ceiling:
            with GrpcEchoPeer() as g:
                res["grpc"] = {s: g.echo_mbps(s, seconds) for s in sizes}
            with SocketEchoPeer(max_size=max(sizes)) as sock:
                res["socket"] = {s: sock.roundtrip_mbps(s, seconds) for s in sizes}
        return res

    t_runs, o_runs = _side_by_side(repeats, lambda: tether_dense_mbps(sizes, seconds, wire), other, log, f"dense ({wire} wire)")
    out: dict[str, dict[int, Comparison]] = {}
    for key in o_runs[0]:
        out[key] = {s: Comparison(fmt_size(s), [t[s] for t in t_runs], [o[key][s] for o in o_runs]) for s in sizes}
    return out


def compare_small(seconds: float, repeats: int, log: Callable[[str], None] = log_stderr) -> dict[str, dict[str, Comparison]]:
    """Small-call rate and latency: tether ``push_pull`` against the peer and raw grpc echo."""
    from ceilings import grpc_small_calls
    from rpc_peer import rpc_small_calls

    t_runs, o_runs = _side_by_side(
        repeats, lambda: tether_small_calls(seconds),
        lambda: {"peer": rpc_small_calls(seconds), "grpc": grpc_small_calls(seconds)}, log, "small calls",
    )
    return {
        key: {m: Comparison(m, [t[m] for t in t_runs], [o[key][m] for o in o_runs]) for m in ("calls_per_s", "p50_us", "p99_us")}
        for key in ("peer", "grpc")
    }


def compare_sparse(
    shard_counts: Sequence[int], seconds: float, repeats: int, wire: str = "float32", log: Callable[[str], None] = log_stderr,
    fused: bool = False,
) -> dict[int, Comparison]:
    """Sparse rows/s (4096 ids x 64, pull + push) per shard count: tether against the peer
    (``fused``: both sides make one push + pull round trip per step)."""
    from rpc_peer import rpc_sparse_rows_per_s

    out = {}
    what = "push_pull" if fused else "pull, push"
    for n in shard_counts:
        t, o = _side_by_side(
            repeats, lambda n=n: tether_sparse_rows_per_s(n, seconds=seconds, wire=wire, fused=fused),
            lambda n=n: rpc_sparse_rows_per_s(n, seconds=seconds, fused=fused), log, f"sparse {n} shard(s) {what} ({wire} wire)",
        )
        out[n] = Comparison(f"{n} shard(s)", t, o)
    return out


def compare_apply(seconds: float, repeats: int, log: Callable[[str], None] = log_stderr) -> dict[str, dict[str, Any]]:
    """Shard apply rows/s (in process): ``EmbeddingTable.push`` against raw torch, per optimizer."""
    torch.set_num_threads(1)
    out: dict[str, dict[str, Any]] = {}
    for opt in ("sgd", "adagrad"):
        t, o = _side_by_side(repeats, lambda opt=opt: apply_rows_per_s(opt, seconds=seconds),
                             lambda opt=opt: raw_apply_rows_per_s(opt, seconds=seconds), log, f"apply {opt}")
        out[opt] = {
            "cmp": Comparison(opt, [x["push"] for x in t], o),
            "lookup": statistics.median(x["lookup"] for x in t),
        }
    return out


def compare_model(
    steps: int,
    repeats: int,
    configs: Sequence[tuple[int, int, str]] = ((1, 1, "float32"), (1, 2, "float32"), (2, 1, "float32"), (2, 2, "float32")),
    batch_size: int = 256,
    log: Callable[[str], None] = log_stderr,
) -> dict[str, Any]:
    """Samples/s of the default model: in one process, and through tether per configuration.

    Args:
        configs: ``(workers, shards, wire dtype)`` per tether run.

    Returns:
        ``in_process`` (samples/s per repeat; batches read as a worker reads them),
        ``in_process_pregenerated`` (the same with every batch made before the clock), ``tether`` ({config: [samples/s per repeat]}),
        ``phases`` ({config: median fraction of worker step time per phase}).
    """
    local: list[float] = []
    pregenerated: list[float] = []
    runs: dict[tuple[int, int, str], list[dict[str, Any]]] = {tuple(c): [] for c in configs}
    for r in range(repeats):
        t0 = time.perf_counter()
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        if r % 2 == 0:
            local.append(in_process_samples_per_s(steps, batch_size))
        for w, s, wire in order:
            runs[(w, s, wire)].append(tether_job_samples_per_s(w, s, steps, batch_size, wire))
        if r % 2 == 1:
            local.append(in_process_samples_per_s(steps, batch_size))
        pregenerated.append(in_process_samples_per_s(steps, batch_size, pregenerated=True))
        log(f"model: repeat {r + 1}/{repeats} done in {time.perf_counter() - t0:.0f}s")
    return {
        "in_process": local,
        "in_process_pregenerated": pregenerated,
        "tether": {c: [x["samples_per_sec"] for x in v] for c, v in runs.items()},
        "phases": {c: _median_phases([x["phases"] for x in v]) for c, v in runs.items()},
    }


def tls_shard_args(certs: dict[str, Path], mutual: bool = False) -> list[str]:
    """``tether server`` flags that serve TLS with ``certs`` (``make_certificates``); ``mutual``: require client certificates."""
    return ["--tls-cert", str(certs["server.crt"]), "--tls-key", str(certs["server.key"])] + (
        ["--tls-client-ca", str(certs["ca.crt"])] if mutual else [])


def compare_tls(
    sizes: Sequence[int], seconds: float, repeats: int, model_steps: int = 0, log: Callable[[str], None] = log_stderr
) -> dict[str, Any]:
    """tether's data plane over TCP inside TLS against plain TCP (both ``transport="tcp"``), and,
    with ``model_steps``, the default model's samples/s through a mutual-TLS cluster (its data plane
    TCP inside TLS: no shared memory under mutual TLS) against a plaintext one (shared memory),
    1 worker x 1 shard.

    Returns:
        ``{"dense": {size: Comparison(tls, plain)}, "model": Comparison(mutual TLS, plaintext) or None,
        "model_tcp": [samples/s of the plaintext cluster with its workers on TCP, per repeat] or None}``
        (the last tells the cost of TLS from the cost of leaving shared memory).
    """
    with tempfile.TemporaryDirectory(prefix="tether-bench-tls-") as tmp:
        certs = make_certificates(Path(tmp))
        tls_conn = {"transport": "tcp", "tls_ca": str(certs["ca.crt"]), "expect": "tcp+tls"}
        t, o = _side_by_side(
            repeats, lambda: tether_dense_mbps(sizes, seconds, conn=tls_conn, shard_args=tls_shard_args(certs)),
            lambda: tether_dense_mbps(sizes, seconds, conn={"transport": "tcp", "expect": "tcp"}), log, "dense, TLS vs TCP",
        )
        out: dict[str, Any] = {"dense": {s: Comparison(fmt_size(s), [x[s] for x in t], [x[s] for x in o]) for s in sizes}, "model": None,
                               "model_tcp": None}
        if model_steps:
            mt, mo = _side_by_side(
                repeats, lambda: tether_job_samples_per_s(1, 1, model_steps, tls=certs, mutual=True)["samples_per_sec"],
                lambda: tether_job_samples_per_s(1, 1, model_steps)["samples_per_sec"], log, "model, TLS vs plaintext",
            )
            out["model"] = Comparison("model 1 worker x 1 shard", mt, mo)
            out["model_tcp"] = [tether_job_samples_per_s(1, 1, model_steps, transport="tcp")["samples_per_sec"] for _ in range(repeats)]
    return out


def repeat_tether(repeats: int, fn: Callable[[], Any], log: Callable[[str], None] = log_stderr, what: str = "") -> list[Any]:
    """Run a tether-only measurement ``repeats`` times (for extra rows beside a peer already measured)."""
    out = []
    for r in range(repeats):
        out.append(fn())
        log(f"{what}: repeat {r + 1}/{repeats} done")
    return out


def _median_phases(all_phases: list[dict[str, float]]) -> dict[str, float]:
    keys = all_phases[0].keys()
    return {k: statistics.median(p.get(k, 0.0) for p in all_phases) for k in keys}


# --------------------------------------------------------------------------- main


def _cmp_rows(cmps: Sequence[Comparison]) -> list[list[object]]:
    rows = []
    for c in cmps:
        lo, hi = c.ratio_range
        rows.append([c.label, c.tether_median, c.other_median, f"{c.ratio:.2f}", f"{lo:.2f}-{hi:.2f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print tether beside the rpc peer and the ceilings as Markdown tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI-sized run")
    p.add_argument("--repeats", type=int, default=3, help="back-to-back repeats; medians are reported (default 3)")
    p.add_argument("--seconds", type=float, help="time per measurement (default 1.0, quick 0.3)")
    p.add_argument("--wire-dtype", choices=sorted(WIRE_DTYPES), default="float32", help="also measure tether with this wire dtype")
    p.add_argument("--only", default="dense,small,sparse,apply,model", help="comma-separated subset")
    p.add_argument("--tls", action="store_true",
                   help="instead: tether's data plane inside TLS vs plain TCP (dense sizes; with 'model' in --only, the model too)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    torch.set_num_threads(1)
    sizes = QUICK_SIZES if a.quick else SIZES
    seconds = a.seconds if a.seconds is not None else (0.3 if a.quick else 1.0)
    only = set(a.only.split(","))
    wires = ["float32"] + ([a.wire_dtype] if a.wire_dtype != "float32" else [])
    headers = ["", "tether", "other", "ratio", "ratio range"]
    if a.tls:
        sizes = [4 * 2**20] if a.quick else sizes
        res = compare_tls(sizes, seconds, a.repeats, (200 if a.quick else 1000) if "model" in a.only.split(",") else 0)
        print("\n## dense push + pull, MiB/s, tether's data plane: TCP inside TLS (tether) vs plain TCP (other)\n")
        print(markdown_table(headers, _cmp_rows(list(res["dense"].values()))))
        if res["model"] is not None:
            print("\n## default model samples/s, 1 worker x 1 shard: mutual-TLS cluster (tether) vs plaintext cluster (other)\n")
            print(markdown_table(headers, _cmp_rows([res["model"]])))
        return
    if "dense" in only:
        for wire in wires:
            d = compare_dense(sizes, seconds, a.repeats, wire, with_ceiling=wire == "float32")
            for key, what in (("peer", "rpc peer"), ("grpc", "grpc echo"), ("socket", "socket echo")):
                if key in d:
                    print(f"\n## dense push + pull, MiB/s, tether ({wire} wire) vs {what}\n")
                    print(markdown_table(headers, _cmp_rows(list(d[key].values()))))
    if "small" in only:
        s = compare_small(2 * seconds, a.repeats)
        for key in ("peer", "grpc"):
            print(f"\n## small calls, tether push_pull vs {key} (ratio = tether / other: for latencies, lower is better)\n")
            print(markdown_table(headers, _cmp_rows(list(s[key].values()))))
    if "sparse" in only:
        for wire in wires:
            for fused in (False, True):
                sp = compare_sparse((1, 2), 2 * seconds, a.repeats, wire, fused=fused)
                how = "one push_pull round trip per step" if fused else "pull, then push"
                print(f"\n## sparse rows/s (4096 x 64, {how}), tether ({wire} wire) vs rpc peer\n")
                print(markdown_table(headers, _cmp_rows(list(sp.values()))))
    if "apply" in only:
        ap = compare_apply(seconds, a.repeats)
        print("\n## shard apply rows/s in process, EmbeddingTable.push vs raw torch\n")
        print(markdown_table(headers, _cmp_rows([v["cmp"] for v in ap.values()])))
    if "model" in only:
        configs = [(1, 1, "float32"), (1, 2, "float32"), (2, 1, "float32"), (2, 2, "float32")]
        configs += [(1, 1, w) for w in wires[1:]]
        m = compare_model(200 if a.quick else 1000, a.repeats, configs)
        local = statistics.median(m["in_process"])
        rows = [["in one process", local, "1.00"]]
        for (w, s, wire), v in m["tether"].items():
            rows.append([f"tether {w} worker(s) x {s} shard(s), {wire} wire", statistics.median(v), f"{statistics.median(v) / local:.2f}"])
        pre = statistics.median(m["in_process_pregenerated"])
        rows.append(["in one process, every batch made before the clock", pre, f"{pre / local:.2f}"])
        print("\n## default model samples/s\n")
        print(markdown_table(["setup", "samples/s", "ratio"], rows))


if __name__ == "__main__":
    main()
