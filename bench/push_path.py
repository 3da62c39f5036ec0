"""The client's CPU on a push with and without the worker row cache (issue 29), side by side.

Worker 0 of 4's id stream (the default CTR job, or the MovieLens-format example) goes through a
``CachedClient`` in the async loop's order (bench/traffic.py), in front of a stand-in client
that builds every call's requests with the real ``Router`` (2 shards) and writes what the data
plane would send (each request serialized, each payload copied into a buffer, as
``DataConnection._send`` does through a shared region), then answers at once (rows and table
versions derived from the ids and the clock). Gradients are seeded random numbers.

Prints, per mode (no cache; cache R/W), thread CPU ms per step of the calls that make up a push
(``Router.push_requests``, its ``_split`` calls, the serializing, the cache's ``accumulate``
(``_hold``, ``_take``), ``plan``, ``merge``), the median of ``--rounds`` rounds run alternately,
and a digest of every byte sent: a change that keeps the wire as it was keeps the digest.

    python bench/push_path.py --source ctr --bounds 20 --steps 200 --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import traffic

from tether.common.choices import CACHE_ADMISSIONS
from tether.protos import framing as dp
from tether.protos.specs import TableConfig
from tether.worker.cache import row_cache
from tether.worker.cache.client import CachedClient
from tether.worker.cache.config import RowCacheConfig
from tether.worker.cache.slots import warm_up
from tether.worker.client.config import ClientConfig
from tether.worker.client.results import Handle, PullResult, PushAck
from tether.worker.client.router import Router
from tether.worker.client.traffic import TrafficMeter

SHARDS = 2
CPU: collections.Counter[str] = collections.Counter()
CALLS: collections.Counter[str] = collections.Counter()


def _timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def g(*a: Any, **k: Any) -> Any:
        c = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            CPU[name] += time.thread_time() - c
            CALLS[name] += 1
    return g


def _hook() -> None:
    for cls, names in ((Router, ("push_requests", "pull_requests", "_split")),
                       (row_cache.RowCache, ("accumulate", "plan", "merge", "_hold", "_take"))):
        for n in names:
            if hasattr(cls, n):
                setattr(cls, n, _timed(f"{cls.__name__}.{n}", getattr(cls, n)))


class RouterStandIn:
    """A client whose calls build their requests with a real ``Router`` and write them out."""

    num_shards = SHARDS

    def __init__(self, dims: Mapping[str, int], digest: Any) -> None:
        self.config = ClientConfig(addresses=tuple(f"127.0.0.1:{9000 + s}" for s in range(SHARDS)), worker_id="w0")
        self.router = Router(self.config, 1)
        self.router.declared([TableConfig(name=t, dim=d) for t, d in dims.items()], {})
        self.dims = dims
        self.digest = digest
        self.clock = 0

    def _send(self, requests: Mapping[int, Any], payloads: Mapping[int, dp.PayloadWriter]) -> None:
        c = time.thread_time()
        for s in sorted(requests):
            meta = requests[s].SerializeToString()
            out = payloads.get(s) or dp.PayloadWriter()
            region = bytearray(max(out.nbytes, 1))
            out.copy_into(memoryview(region))
            self.digest.update(s.to_bytes(1, "little") + meta + bytes(region[: out.nbytes]))
        CPU["send"] += time.thread_time() - c

    def _answer(self, sparse: Mapping[str, torch.Tensor] | None) -> PullResult:
        sparse = sparse or {}
        rows = {t: (ids.to(torch.float32)[:, None] * 1e-6 + torch.arange(self.dims[t]) * 1e-3) for t, ids in sparse.items()}
        return PullResult(rows, {}, {(s, t): self.clock for t in sparse for s in range(SHARDS)}, {})

    def pull(self, sparse: Mapping[str, torch.Tensor] | None = None, dense: Sequence[str] = (), splits: Any = None) -> Handle[PullResult]:
        requests, _ = self.router.pull_requests(sparse or {}, dense, splits)
        self._send(requests, {})
        return Handle([traffic._Done(self._answer(sparse))], lambda a: a[0])

    def push(self, sparse: Any = None, dense: Any = None, clock: int = 0, versions: Any = None) -> Handle[PushAck]:
        self.clock = max(self.clock, clock)
        self._send(*self.router.push_requests(sparse or {}, dense or {}, clock, versions))
        return Handle([traffic._Done(PushAck(0, 0, 0))], lambda a: a[0])

    def push_pull(self, push_sparse: Any = None, push_dense: Any = None, pull_sparse: Mapping[str, torch.Tensor] | None = None,
                  pull_dense: Sequence[str] = (), clock: int = 0, versions: Any = None, pull_splits: Any = None) -> Handle[PullResult]:
        self.push(push_sparse, push_dense, clock, versions)
        return self.pull(pull_sparse, pull_dense, pull_splits)


def stand_in_client(dims: Mapping[str, int], cache: RowCacheConfig, digest: Any) -> CachedClient:
    """A ``CachedClient`` (``cache``) in front of ``RouterStandIn``, its tables declared (SGD)."""
    client = CachedClient(RouterStandIn(dims, digest), cache, dims, TrafficMeter(dims, 4, reuse=False))  # type: ignore[arg-type]
    client.use_tables([TableConfig(name=t, dim=d) for t, d in dims.items()])
    return client


def async_loop(client: CachedClient, steps: list[dict[str, torch.Tensor]], dims: Mapping[str, int],
               seen: Callable[[PullResult], None] | None = None) -> Iterator[int]:
    """The async loop's calls (bench/traffic.run's order: two pulls ahead, each step's push
    carrying the pull of the step two on; seeded random gradients), yielding each step's index
    once its push is made; ``seen`` is handed each step's pulled answer."""
    gen = torch.Generator().manual_seed(0)
    pending = [client.pull(steps[0]), client.pull(steps[1])]
    for t in range(len(steps)):
        pulled = pending.pop(0).result()
        if seen is not None:
            seen(pulled)
        grads = {k: (ids, torch.randn(len(ids), dims[k], generator=gen)) for k, ids in steps[t].items()}
        if t + 2 < len(steps):
            pending.append(client.push_pull(grads, None, steps[t + 2], clock=t + 1, versions=pulled))
        else:
            client.push(grads, None, clock=t + 1, versions=pulled).result()
        yield t


def run(steps: list[dict[str, torch.Tensor]], dims: Mapping[str, int], cache: RowCacheConfig) -> tuple[dict[str, float], str]:
    """The async loop's calls; CPU ms per step per call, and the digest of the bytes sent."""
    CPU.clear()
    CALLS.clear()
    digest = hashlib.sha256()
    client = stand_in_client(dims, cache, digest)
    c0 = time.thread_time()
    for _ in async_loop(client, steps, dims, lambda pulled: digest.update(b"".join(pulled.rows[k].numpy().tobytes()
                                                                                    for k in sorted(pulled.rows)))):
        pass
    client.flush()
    CPU["whole loop"] = time.thread_time() - c0
    if client.cache is not None:
        for tab in client.cache.tables.values():
            digest.update(tab.values[: tab.top].numpy().tobytes())
    out = {k: v * 1e3 / len(steps) for k, v in CPU.items()}
    out["_split calls/step"] = CALLS["Router._split"] / len(steps)
    return out, digest.hexdigest()[:16]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--bounds", default="20", help="R or R/W, comma list")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-rows", type=int, default=100_000)
    p.add_argument("--source", choices=("ctr", "movielens"), default="ctr")
    p.add_argument("--admission", default="all", help="the cache's admissions to run at each bound (--cache-admission): all "
                   "and/or recurring, comma list (default all)")
    a = p.parse_args(argv)
    admissions = [x.strip() for x in a.admission.split(",") if x.strip()]
    if not admissions or any(x not in CACHE_ADMISSIONS for x in admissions):
        p.error(f"--admission must be a comma list of {', '.join(CACHE_ADMISSIONS)}, got {a.admission!r}")
    bounds = [[int(x) for x in b.split("/")] for b in a.bounds.split(",")]
    warm_up()
    _hook()
    configs = [("no cache", RowCacheConfig())] + [
        (f"cache {b[0]}/{b[-1]}" + ("" if adm == "all" else f" {adm}"),
         RowCacheConfig(rows=a.cache_rows, bound=b[0], write_bound=b[-1], admission=adm)) for b in bounds for adm in admissions]
    with tempfile.TemporaryDirectory() as tmp:
        steps, dims, name = traffic.ctr_steps(a.steps) if a.source == "ctr" else traffic.movielens_steps(a.steps, Path(tmp))
    runs: dict[str, list[dict[str, float]]] = {n: [] for n, _ in configs}
    digests: dict[str, set[str]] = {n: set() for n, _ in configs}
    for _ in range(a.rounds):
        for n, config in configs:
            got, dig = run(steps, dims, config)
            runs[n].append(got)
            digests[n].add(dig)
    keys = sorted({k for r in runs.values() for x in r for k in x})
    print(f"{name}: {a.steps} steps, {SHARDS} shards; thread CPU ms/step, median of {a.rounds} (alternating)")
    print("| call | " + " | ".join(n for n, _ in configs) + " |")
    print("|---|" + "---|" * len(configs))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{statistics.median(x.get(k, 0.0) for x in runs[n]):.3f}" for n, _ in configs) + " |")
    print("| digest | " + " | ".join(",".join(sorted(digests[n])) for n, _ in configs) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
