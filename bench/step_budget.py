"""Time budget of one tether step, stage by stage, measured in process (no transport).

    python bench/step_budget.py dense [--size-mib 4]   # push + pull of one fp32 tensor, 1 shard
    python bench/step_budget.py sparse                 # 4096 x 64 pull + push, SGD, 1 shard
    python bench/step_budget.py model                  # one step of the default model, 1 shard
    add --cprofile to list the functions (file:line) with the most own time

Each stage of the request path runs alone, in this process, on the real objects, along the
data plane's shared-memory path: the client builds the requests and lays out their payload
(``Router.push_requests`` / ``pull_requests``) and copies it into the region, protobuf
carries the small messages, the shard's request handler handles them (``RequestHandler.data_call``:
decode, validate, apply; lookup, gather) and copies pulled values into the region, and the
client places them in the result (``Router.place_pull``). The end-to-end step against a real shard
process is measured beside, so what the stages do not explain is the transport (sockets,
wake-ups, scheduling).
One torch thread, as in every benchmark. The client's router (``PSClient.router``) builds and
places the requests, so each of those stages is timed on its own.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["budget_table", "dense_budget", "main", "sparse_budget"]

_LR = 0.01


def _t(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """Median seconds of ``reps`` calls of ``fn`` and the last result."""
    out, times = None, []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


class _Setup:
    """A real shard process (for the end-to-end step), plus an in-process shard and servicer."""

    def __init__(self) -> None:
        from tether.common.allocator import tune_malloc
        from tether.deploy.launch import LocalCluster
        from tether.server.serving.handler import RequestHandler
        from tether.server.storage.shard import Shard
        from tether.worker.client.config import ClientConfig
        from tether.worker.client.ps_client import PSClient

        tune_malloc()  # what tether's own worker processes do at start-up

        self.cluster = LocalCluster(grace_s=5.0)
        addresses = self.cluster.start_shards(1, timeout_s=90)
        self.client = PSClient(ClientConfig(addresses=tuple(addresses), worker_id="budget", timeout_s=60.0))
        self.shard = Shard(0, 1)
        self.handler = RequestHandler(self.shard)

    def declare_local(self, tables: list[Any] = (), dense: dict[str, torch.Tensor] | None = None, opt: Any = None) -> None:
        """Declare on the shard process (through the client) and on the in-process shard alike."""
        from tether.protos import tether_pb2 as pb

        self.client.declare(tables, dense, opt)
        # The same Declare request the client sent, handled by the in-process handler.
        request = pb.DeclareRequest()
        for t in tables:
            request.tables.append(t.to_proto())
        from tether.protos.codec import encode_tensor
        from tether.protos.partition import dense_shard

        for name, tensor in (dense or {}).items():
            flat = tensor.detach().reshape(-1).float()
            for index, a, b in self.client.router.dense[name].chunks:
                if dense_shard(name, index, 1) != 0:
                    raise RuntimeError("one shard owns every chunk")
                d = request.dense.add(name=name, index=index, optimizer=opt.to_proto())
                encode_tensor(flat[a:b], d.init)
        self.handler.call("Declare", request)

    def close(self) -> None:
        self.client.close()
        self.cluster.stop()


def _stages_push_pull(s: _Setup, push_kw: dict[str, Any], pull_kw: dict[str, Any], reps: int) -> list[tuple[str, float]]:
    """Per-stage median seconds of one push followed by one pull, all in this process, along
    the data plane's shared-memory path (what a client on the shard's machine takes)."""
    from tether.protos import framing as dp
    from tether.protos import tether_pb2 as pb

    c, sv = s.client, s.handler
    rows: list[tuple[str, float]] = []
    t, (reqs, payloads) = _t(lambda: c.router.push_requests(push_kw.get("sparse", {}), push_kw.get("dense", {}), 0, None), reps)
    rows.append(("client: build push request (split, lay out payload)", t))
    req, payload = reqs[0], payloads[0]
    region = memoryview(bytearray(dp.align(payload.nbytes) + 2 * 2**20 + dp.align(_pull_bytes(c, pull_kw))))
    t, _ = _t(lambda: payload.copy_into(region), reps)
    rows.append((f"client: write push payload into the shared region ({payload.nbytes / 2**20:.2f} MiB)", t))
    t, wire = _t(req.SerializeToString, reps)
    rows.append((f"protobuf: serialise + parse push message ({len(wire) / 2**10:.1f} KiB)", t + _t(lambda: pb.PushRequest.FromString(wire), reps)[0]))
    parsed = pb.PushRequest.FromString(wire)
    seqs = iter(range(1 << 40, 1 << 62))
    data = region[: payload.nbytes]

    # Each push names the read it came from, as a worker's does (the read just before it: this
    # process is the only writer, so every push moves each of its tables on by one version).
    first = sv.data_call("Pull", pb.PullRequest(sparse=[pb.SparseBlock(table=b.table, ids=b.ids[:8]) for b in parsed.sparse],
                                                   dense=[pb.DenseBlock(name=b.name, index=b.index) for b in parsed.dense]),
                            None, dp.PayloadWriter())[0]
    for b, r in zip(list(parsed.sparse) + list(parsed.dense), list(first.sparse) + list(first.dense), strict=True):
        b.read_version = r.read_version

    def push_once() -> Any:
        parsed.seq = next(seqs)  # a fresh sequence number, or the shard would skip it as a retry
        answer = sv.data_call("Push", parsed, data, dp.PayloadWriter())
        for b in (*parsed.sparse, *parsed.dense):
            b.read_version += 1
        return answer

    t, _ = _t(push_once, reps)
    rows.append(("shard: Push handler (decode, validate, apply)", t))
    t, (preqs, plan) = _t(lambda: c.router.pull_requests(pull_kw.get("sparse", {}), pull_kw.get("dense", ())), reps)
    rows.append(("client: build pull request", t))
    pwire = preqs[0].SerializeToString()
    t, pparsed = _t(lambda: pb.PullRequest.FromString(pwire), reps)
    rows.append(("protobuf: serialise + parse pull request", t + _t(preqs[0].SerializeToString, reps)[0]))
    out = dp.PayloadWriter()
    t, resp = _t(lambda: sv.data_call("Pull", pparsed, None, dp.PayloadWriter())[0], reps)
    rows.append(("shard: Pull handler (validate, look up rows)", t))
    sv.data_call("Pull", pparsed, None, out)
    t, _ = _t(lambda: out.copy_into(region), reps)
    rows.append((f"shard: write pulled values into the shared region (rows gathered there) ({out.nbytes / 2**20:.2f} MiB)", t))
    t, rwire = _t(resp.SerializeToString, reps)
    rows.append((f"protobuf: serialise + parse pull answer ({len(rwire) / 2**10:.1f} KiB)", t + _t(lambda: pb.PullResponse.FromString(rwire), reps)[0]))
    rparsed = pb.PullResponse.FromString(rwire)
    t, _ = _t(lambda: c.router.place_pull(plan, 0, rparsed, region[: out.nbytes]), reps)
    rows.append(("client: place pulled values (decode_tensor, copy or scatter rows)", t))
    return rows


def _pull_bytes(c: Any, pull_kw: dict[str, Any]) -> int:
    _, plan = c.router.pull_requests(pull_kw.get("sparse", {}), pull_kw.get("dense", ()))
    return sum(plan.response_bytes.values())


def budget_table(rows: list[tuple[str, float]], e2e: float) -> str:
    """Markdown table of stage times against the end-to-end step."""
    total = sum(t for _, t in rows)
    lines = ["| stage | ms | share of end-to-end |", "|---|---:|---:|"]
    lines += [f"| {name} | {t * 1e3:.3f} | {t / e2e:.0%} |" for name, t in rows]
    lines.append(f"| **stages in process, total** | **{total * 1e3:.3f}** | **{total / e2e:.0%}** |")
    lines.append(f"| transport and threads (end-to-end minus stages) | {max(e2e - total, 0) * 1e3:.3f} | {max(e2e - total, 0) / e2e:.0%} |")
    lines.append(f"| **end-to-end step against a shard process** | **{e2e * 1e3:.3f}** | 100% |")
    return "\n".join(lines)


def _profile(fn: Callable[[], Any], reps: int, top: int = 18) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
    print("\n```\n" + "\n".join(buf.getvalue().strip().splitlines()[:top + 8]) + "\n```")


def dense_budget(size_mib: float, reps: int, cprofile: bool = False) -> tuple[list[tuple[str, float]], float]:
    """Stage seconds and the end-to-end step of a dense push + pull of one fp32 tensor."""
    from tether.protos.specs import OptimizerConfig

    s = _Setup()
    try:
        n = int(size_mib * 2**20) // 4
        s.declare_local(dense={"d": torch.zeros(n)}, opt=OptimizerConfig("sgd", lr=_LR))
        grad = torch.randn(n)
        push_kw, pull_kw = {"dense": {"d": grad}}, {"dense": ["d"]}
        rows = _stages_push_pull(s, push_kw, pull_kw, reps)

        def e2e_step() -> None:
            s.client.push(dense={"d": grad}).result()
            s.client.pull(dense=["d"]).result()

        for _ in range(3):
            e2e_step()
        e2e, _ = _t(e2e_step, reps)
        if cprofile:
            _profile(lambda: _stages_push_pull(s, push_kw, pull_kw, 1), max(reps // 2, 3))
        return rows, e2e
    finally:
        s.close()


def sparse_budget(reps: int, cprofile: bool = False, num_ids: int = 4096, dim: int = 64) -> tuple[list[tuple[str, float]], float]:
    """Stage seconds and the end-to-end step of a sparse pull + push of ``num_ids`` x ``dim`` (SGD)."""
    from tether.protos.specs import OptimizerConfig, TableConfig

    s = _Setup()
    try:
        s.declare_local([TableConfig("emb", dim=dim, optimizer=OptimizerConfig("sgd", lr=_LR))])
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 2**40, (2 * num_ids,), generator=gen).unique()[:num_ids]
        ids = ids[torch.randperm(len(ids), generator=gen)]
        grads = torch.randn(num_ids, dim).mul_(0.01)
        push_kw, pull_kw = {"sparse": {"emb": (ids, grads)}}, {"sparse": {"emb": ids}}
        rows = _stages_push_pull(s, push_kw, pull_kw, reps)

        def e2e_step() -> None:
            pulled = s.client.pull({"emb": ids}).result()
            s.client.push({"emb": (ids, pulled.rows["emb"].mul(0.01))}, versions=pulled).result()

        for _ in range(3):
            e2e_step()
        e2e, _ = _t(e2e_step, reps)
        if cprofile:
            _profile(lambda: _stages_push_pull(s, push_kw, pull_kw, 1), max(reps // 2, 3))
        return rows, e2e
    finally:
        s.close()


def budget_model(steps: int, cprofile: bool) -> None:
    """One training step of the default model, serial (no prefetch), stage by stage."""
    import torch.nn.functional as F

    from tether.deploy.launch import LocalCluster
    from tether.worker.config import WorkerConfig
    from tether.worker.ctr.job import ctr_sparse, ctr_trainer, open_dataset

    torch.set_num_threads(1)
    with LocalCluster(grace_s=5.0) as cluster:
        addresses = cluster.start_shards(1, timeout_s=90)
        cfg = WorkerConfig(shards=tuple(addresses), steps=steps, batch_size=256, eval_samples=1000, device="cpu")
        ds = open_dataset(cfg)
        trainer = ctr_trainer(cfg, ds, printer=lambda line: None)
        model, ps = trainer.model, trainer.ps
        batches = list(ds.train_batches(cfg.batch_size, steps + 20, 0, 1))
        names = ["unique ids + build pull request (ps.prefetch)", "wait for pull (handle.result)", "bind rows + copy dense (install)",
                 "forward", "backward", "gradients + build push request (ps.push)", "wait for push ack"]
        times: dict[str, list[float]] = {n: [] for n in names}
        client = ps.client

        def step(b: Any, record: bool) -> None:
            clock = time.perf_counter
            t0 = clock()
            pre = ps.prefetch(ctr_sparse(b))
            t1 = clock()
            pre.handle.result(60)
            t2 = clock()
            pulled = ps.install(pre, train=True, timeout=60)
            t3 = clock()
            loss = F.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels)
            t4 = clock()
            loss.backward()
            t5 = clock()
            h = ps.push(clock=0, versions=pulled)
            t6 = clock()
            h.result(60)
            t7 = clock()
            if record:
                for n, a, z in zip(names, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7), strict=True):
                    times[n].append(z - a)

        for b in batches[:20]:
            step(b, False)
        t0 = time.perf_counter()
        for b in batches[20:]:
            step(b, True)
        wall = (time.perf_counter() - t0) / steps
        # The same model trained in one process: forward + backward + Adagrad.
        from tether.worker.ctr.model import CTRModel

        torch.manual_seed(0)
        local = CTRModel(ds.num_dense, ds.num_sparse)
        opt = torch.optim.Adagrad(local.parameters(), lr=0.05)

        def local_step(b: Any) -> None:
            loss = F.binary_cross_entropy_with_logits(local(b.dense, b.sparse), b.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()

        for b in batches[:20]:
            local_step(b)
        local_batches = iter(batches[20:] * 2)
        t_local, _ = _t(lambda: local_step(next(local_batches)), steps)
        rows = [(n, statistics.median(v)) for n, v in times.items()]
        print(f"\n## default model, one serial step (batch 256, {cfg.num_sparse} tables x dim {cfg.embedding_dim}, "
              f"{len(ps.dense)} dense tensors), 1 shard\n")
        print("| stage | ms (median) |")
        print("|---|---:|")
        for n, t in rows:
            print(f"| {n} | {t * 1e3:.3f} |")
        print(f"| **serial step, mean wall** | **{wall * 1e3:.3f}** |")
        print(f"| in one process: forward + backward + Adagrad step | {t_local * 1e3:.3f} |")
        uniq = {t: int(torch.unique(v).numel()) for t, v in ctr_sparse(batches[-1]).items()}
        print(f"\nunique ids per table in one batch: {uniq}")
        if cprofile:
            again = iter(batches[20:])
            _profile(lambda: step(next(again), False), min(steps, 200))
        client.close()


def main(argv: list[str] | None = None) -> int:
    """Print the stage budget of one workload."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", choices=["dense", "sparse", "model"])
    p.add_argument("--size-mib", type=float, default=4.0, help="dense tensor size (default 4)")
    p.add_argument("--reps", type=int, default=30, help="repetitions per stage (medians are reported)")
    p.add_argument("--steps", type=int, default=200, help="model steps timed")
    p.add_argument("--cprofile", action="store_true", help="also list the functions with the most own time")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.workload == "dense":
        rows, e2e = dense_budget(a.size_mib, a.reps, a.cprofile)
        print(f"\n## dense {a.size_mib:g} MiB fp32: push then pull, 1 shard\n\n{budget_table(rows, e2e)}")
    elif a.workload == "sparse":
        rows, e2e = sparse_budget(a.reps, a.cprofile)
        print(f"\n## sparse 4096 ids x 64: pull then push, 1 shard, SGD\n\n{budget_table(rows, e2e)}")
    else:
        budget_model(a.steps, a.cprofile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
