"""A CUDA worker's step overlaps the parameter server's work with the GPU's (issue 26 S1-S4),
checked on CPU-only machines against the fake ``cuda:0`` of tests/fake_cuda.py, which notes
every wait for the GPU and every copy between host and device.

- S4: the host waits for the GPU once a step (the step's gradients); the loss is read only
  when a record is written; lookups' checks and sync's digests are read later, not per call.
- S2: pulled rows are received into pinned memory and go to the GPU in one copy per row
  width, straight from the receive buffer; the ids go in one copy.
- S3: gradients come back in one non-blocking copy into pinned memory, cast to the wire dtype
  on the GPU first (a bf16 wire moves half the bytes), and reach the shard intact.
- S1: the copies to the GPU run on a side stream from the transfer thread, which also sends.

And the result is the CPU's: the same job trained on the fake GPU and on the CPU ends with the
same losses, rows and dense parameters.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_client
from fake_cuda import FakeCuda, on_fake_cuda
from torch import nn

from tether.protos.errors import UsageError
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.client.local import LocalClient
from tether.worker.client.router import PullAnswer, Router
from tether.worker.config import TrainingConfig
from tether.worker.ctr.model import CTRModel
from tether.worker.data.synthetic import Batch, SyntheticClickLog, SyntheticConfig
from tether.worker.training.embedding import PSModel
from tether.worker.training.embedding_bag import ShardedEmbeddingBag
from tether.worker.training.policies import SyncPolicy
from tether.worker.training.run_record import RunRecord
from tether.worker.training.trainer import Trainer

SGD = OptimizerConfig("sgd", 1.0)
STEP = "-- step --"  # marks the start of a step in FakeCuda.syncs
END = "--- fit reads the final dense values ---"


# -- two models: the built-in CTR model (one fused gather) and one of bags of two widths ------------


def _ctr() -> CTRModel:
    return CTRModel(13, 4, 8, bottom_mlp=(16,), top_mlp=(16,), embedding_factory=lambda name, dim: ShardedEmbeddingBag(name, dim))


def _ctr_batches(n: int) -> list[Batch]:
    return list(SyntheticClickLog(SyntheticConfig(num_sparse=4, vocab_size=50)).batches(32, n))


def _ctr_loss(model: nn.Module, b: Batch) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels)


def _ctr_sparse(b: Batch) -> dict[str, torch.Tensor]:
    return {f"cat_{j}": b.sparse[:, j] for j in range(b.sparse.shape[1])}


class WideDeep(nn.Module):
    """A single user id (width 8) and a mean bag of items by offsets (width 4), and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.user = ShardedEmbeddingBag("users", 8)
        self.history = ShardedEmbeddingBag("items", 4, mode="mean", padding_id=-1)
        self.mlp = nn.Sequential(nn.Linear(8 + 4 + 3, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [self.user(batch["user"]), self.history(batch["items"], batch["offsets"]), batch["dense"]]
        return self.mlp(torch.cat(parts, 1)).squeeze(1)


def _wd_batches(n: int, size: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        lengths = torch.randint(1, 5, (size,), generator=g)
        items = torch.randint(0, 40, (int(lengths.sum()),), generator=g) + 2**40
        items[::5] = -1  # padding, never pulled
        out.append({"user": torch.randint(0, 20, (size,), generator=g) * 7_919 - 3, "items": items,
                    "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]),
                    "dense": torch.randn(size, 3, generator=g), "label": torch.randint(0, 2, (size,), generator=g).float()})
    return out


def _wd_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(b), b["label"])


def _wd_sparse(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"users": b["user"], "items": b["items"]}


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], list[Any]], Callable[..., torch.Tensor], Callable[[Any], Any]]] = {
    "ctr": (_ctr, _ctr_batches, _ctr_loss, _ctr_sparse),
    "widedeep": (WideDeep, _wd_batches, _wd_loss, _wd_sparse),
}


def _train(kind: str, mode: str, steps: int, fake: FakeCuda | None) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor]:
    """Train ``kind`` locally (no shards) on the fake GPU or the CPU; the record, the rows of
    every id the data touched and the dense values, as the tables hold them at the end."""
    build, batches_of, loss, sparse = MODELS[kind]
    batches = batches_of(steps)
    torch.manual_seed(0)
    model = build()
    if fake is not None:
        on_fake_cuda(model)
    config = TrainingConfig(shards=(), local=True, mode=mode, device="cuda" if fake else "cpu", steps=steps, log_every=3,
                            optimizer="adagrad", lr=0.1, init_scale=0.2, seed=5)
    with Trainer(model, config, loss=loss, sparse=sparse, printer=lambda line: None) as trainer:
        if fake is not None:
            install = trainer.ps.install

            def marked(*args: Any, **kwargs: Any) -> Any:
                if not kwargs.get("train", True):  # fit's last read of the dense values: not a step
                    fake.syncs.append(END)
                    return install(*args, **kwargs)
                if STEP not in fake.syncs:
                    del fake.copies[:]  # the declaration's are not a step's
                fake.syncs.append(STEP)
                return install(*args, **kwargs)

            trainer.ps.install = marked  # type: ignore[method-assign]
        record = trainer.fit(batches, background=False)
        ids: dict[str, torch.Tensor] = {}
        for b in batches:
            for t, v in sparse(b).items():
                ids[t] = torch.unique(torch.cat([ids.get(t, torch.zeros(0, dtype=torch.int64)), v[v != -1]]))
        final = trainer.client.pull(ids, ["dense"]).result(30)
    return record, final.rows, final.dense["dense"]


def _steps(syncs: list[str]) -> list[list[str]]:
    """The waits for the GPU of each step (from one step's install to the next's)."""
    text = "\n".join(syncs).split(END)[0]
    return [[s for s in part.split("\n") if s] for part in text.split(STEP)[1:]]


@pytest.mark.parametrize(("kind", "mode"), [("ctr", "async"), ("widedeep", "async"), ("widedeep", "ssp:1")])
def test_a_gpu_step_waits_for_the_gpu_once_and_trains_as_the_cpu_does(kind: str, mode: str) -> None:
    steps = 7
    with FakeCuda(available=True) as fake:
        record, rows, dense = _train(kind, mode, steps, fake)
    per_step = _steps(fake.syncs)
    assert len(per_step) == steps
    for i, waits in enumerate(per_step):
        read = ["__float__"] if (i + 1) % 3 == 0 or i + 1 == steps else []  # a record's loss
        # The built-in model's first step checks its fused lookup's ids at once (then never).
        first = ["__bool__"] if i == 0 and kind == "ctr" else []
        assert waits == [*first, "Event.synchronize", *read], (i, waits)
    # Every copy to or from the GPU that the parameter server made is asynchronous and pinned;
    # those to the GPU run on a side stream, from the transfer thread.
    ps_copies = [c for c in fake.copies if c.thread.startswith("tether-transfer") or c.direction == "d2h"]
    to_gpu = [c for c in ps_copies if c.direction == "h2d"]
    assert to_gpu and all(c.pinned and c.non_blocking and c.stream != "default" for c in to_gpu)
    to_host = [c for c in ps_copies if c.direction == "d2h" and c.nbytes > 4]
    assert to_host and all(c.pinned and c.non_blocking for c in to_host)
    # And it is the CPU's training, to the bit.
    cpu_record, cpu_rows, cpu_dense = _train(kind, mode, steps, None)
    assert [h["train_loss"] for h in record["history"]] == [h["train_loss"] for h in cpu_record["history"]]
    assert all(torch.equal(rows[t], cpu_rows[t]) for t in cpu_rows) and torch.equal(dense, cpu_dense)


class ThreeTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = ShardedEmbeddingBag("a", 4)
        self.b = ShardedEmbeddingBag("b", 4)
        self.c = ShardedEmbeddingBag("c", 2)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (self.a(a).sum() + self.b(b).sum() * 2 + self.c(c).sum()) * self.scale


def _declare(client: Any, ps: PSModel, tables: dict[str, int], init_scale: float = 0.5) -> None:
    client.declare([TableConfig(t, d, SGD, init_scale=init_scale) for t, d in tables.items()], ps.dense_tensors() if ps.dense else None, SGD)


def test_pulled_rows_reach_the_gpu_in_one_copy_per_width_from_pinned_receive_buffers(inproc_shard: Any) -> None:
    a, b, c = torch.tensor([3, 9, 4, 3]), torch.tensor([-2, 8]), torch.tensor([5, 6, 7])
    with make_client([f"127.0.0.1:{inproc_shard.port}"]) as host_client:
        cpu = PSModel(ThreeTables(), host_client, torch.device("cpu"))
        _declare(host_client, cpu, {"a": 4, "b": 4, "c": 2})
        expected = cpu.install(cpu.prefetch({"a": a, "b": b, "c": c}), train=False).rows
    with make_client([f"127.0.0.1:{inproc_shard.port}"]) as client, FakeCuda() as fake:
        model = ThreeTables()
        ps = PSModel(on_fake_cuda(model), client, torch.device("cuda"))
        _declare(client, ps, {"a": 4, "b": 4, "c": 2})
        before = len(fake.copies)
        pulled = ps.install(ps.prefetch({"a": a, "b": b, "c": c}))
        copies = fake.copies[before:]
        # Received into pinned memory; the tables of one width back to back in one buffer.
        assert all(pulled.rows[t].is_pinned() for t in "abc")
        assert pulled.rows["b"].data_ptr() == pulled.rows["a"].data_ptr() + pulled.rows["a"].nbytes
        # To the GPU: one copy of each width's rows, straight from the receive buffer, one of
        # every table's ids, one of the dense values; nothing pinned by a host copy first.
        to_gpu = [x for x in copies if x.direction == "h2d"]
        assert sorted(x.nbytes for x in to_gpu) == sorted([5 * 4 * 4, 3 * 2 * 4, 8 * 8, 1 * 4]), to_gpu
        rows_copies = {x.host_ptr for x in to_gpu if x.dtype == torch.float32 and x.nbytes > 4}
        assert rows_copies == {pulled.rows["a"].data_ptr(), pulled.rows["c"].data_ptr()}
        assert all(x.pinned and x.non_blocking and x.stream != "default" and x.thread.startswith("tether-transfer") for x in to_gpu)
        assert fake.pin_calls == 0
        assert not any(x.direction == "d2h" for x in copies) and fake.syncs.count("Event.synchronize") == 0
        for t, bag in (("a", model.a), ("b", model.b), ("c", model.c)):
            assert bag._rows is not None and bag._rows.device.type == "cuda" and torch.equal(bag._rows.cpu(), expected[t])
        model(a.cuda(), b.cuda(), c.cuda()).backward()
        ps.push(clock=1, versions=pulled).result(10)
        after = client.pull({"a": torch.tensor([3, 4, 9]), "c": c}).result(10).rows
    # SGD at lr 1: a's rows less their counts (3 twice), c's less one.
    assert torch.equal(after["a"], expected["a"] - torch.tensor([[2.0], [1.0], [1.0]]))
    assert torch.equal(after["c"], expected["c"] - 1.0)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = ShardedEmbeddingBag("e", 2, mode="sum")
        self.scale = nn.Parameter(torch.full((1,), 1 / 3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.bag(ids) * self.scale).sum()


def test_gradients_come_back_cast_to_a_bf16_wire_on_the_gpu_and_reach_the_shard(inproc_shard: Any) -> None:
    ids = torch.tensor([[5, 7], [5, 9]])
    sent_from: list[str] = []
    with make_client([f"127.0.0.1:{inproc_shard.port}"], wire_dtype=torch.bfloat16) as client, FakeCuda() as fake:
        push = client.push

        def recorded(*args: Any, **kwargs: Any) -> Any:
            sent_from.append(threading.current_thread().name)
            return push(*args, **kwargs)

        client.push = recorded  # type: ignore[method-assign]
        model = Tiny()
        ps = PSModel(on_fake_cuda(model), client, torch.device("cuda"))
        _declare(client, ps, {"e": 2}, init_scale=0.0)
        pulled = ps.install(ps.prefetch({"e": ids}))
        model(ids.cuda()).backward()
        before, waits = len(fake.copies), len(fake.syncs)
        ps.collect()
        back = fake.copies[before:]
        # Row gradients (3 x 2) and the dense one, each in bf16: half the bytes of float32.
        assert [(x.direction, x.dtype, x.nbytes, x.pinned, x.non_blocking) for x in back[:2]] == [
            ("d2h", torch.bfloat16, 3 * 2 * 2, True, True), ("d2h", torch.bfloat16, 2, True, True)]
        assert fake.syncs[waits:] == ["Event.synchronize"]  # the one wait, for those copies
        ps.push(clock=1, versions=pulled).result(10)
        assert sent_from and all(name.startswith("tether-transfer") for name in sent_from)
        rows = client.pull({"e": torch.tensor([5, 7, 9])}).result(10).rows["e"]
    # SGD at lr 1 from zero rows: minus each gradient as bf16 carried it (2/3 and 1/3 rounded).
    grads = torch.tensor([[2 / 3] * 2, [1 / 3] * 2, [1 / 3] * 2])
    assert torch.equal(rows, -grads.to(torch.bfloat16).float())


class TwoTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = ShardedEmbeddingBag("users", 2)
        self.item = ShardedEmbeddingBag("items", 2)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return (self.user(user) * self.item(item)).sum()


def _local_gpu_model(model: nn.Module, tables: dict[str, int]) -> PSModel:
    client = LocalClient()
    ps = PSModel(on_fake_cuda(model), client, torch.device("cuda"))
    _declare(client, ps, tables)
    return ps


def test_ids_sparse_did_not_name_stop_a_gpu_step_when_its_gradients_come_back() -> None:
    user, item = torch.tensor([1, 2]), torch.tensor([7, 8])
    with FakeCuda() as fake:
        model = TwoTables()
        ps = _local_gpu_model(model, {"users": 2, "items": 2})
        ps.install(ps.prefetch({"users": user, "items": item[:1]}))
        waits = len(fake.syncs)
        loss = model(user.cuda(), item.cuda())  # no wait for the GPU in the lookups
        assert fake.syncs[waits:] == []
        loss.backward()
        with pytest.raises(UsageError, match=r"^table 'items': the forward pass looked up 1 id\(s\) that sparse\(batch\) did not name \(id 8 for one\)"):
            ps.collect()
        # A table sparse did not name at all is still stopped in the forward (no device value needed).
        ps._clear()
        ps.install(ps.prefetch({"users": user}))
        with pytest.raises(UsageError, match=r"^table 'items' was looked up by the forward pass but sparse\(batch\) did not name it"):
            model(user.cuda(), item.cuda())


def test_sync_reads_its_flag_after_the_gradient_copies_are_queued_and_that_one_wait_covers_them() -> None:
    user, item = torch.tensor([1, 2]), torch.tensor([7, 8])
    with FakeCuda() as fake:
        model = TwoTables()
        ps = _local_gpu_model(model, {"users": 2, "items": 2})
        ps.install(ps.prefetch({"users": user, "items": item}))
        model(user.cuda(), item.cuda()).backward()
        ps.collect(exact=True, wait=False)  # what Trainer does before the policy's after_backward
        waits = len(fake.syncs)
        assert int(torch.ones(1, device="cuda").item()) == 1  # sync's "every rank goes on" flag
        ps.collect(exact=True)
        assert fake.syncs[waits:] == ["item"]  # and no second wait for the gradients
        sparse, _ = ps.gradients()
    # float32 for sync's combiner, and the values the backward made (landed, not garbage).
    assert sparse["users"][1].dtype == torch.float32 and torch.isfinite(sparse["users"][1]).all()
    assert sparse["items"][0].tolist() == [7, 8]


def test_the_fused_lookup_is_checked_once_then_with_the_gradients() -> None:
    batches = _ctr_batches(3)
    with FakeCuda() as fake:
        torch.manual_seed(0)
        model = _ctr()
        ps = _local_gpu_model(model, {f"cat_{j}": 8 for j in range(4)})
        for i, b in enumerate(batches[:2]):
            ps.install(ps.prefetch(_ctr_sparse(b)))
            waits = len(fake.syncs)
            assert ps.lookup(b.sparse.cuda()) is not None  # what the model's fused_lookup is
            assert fake.syncs[waits:] == (["__bool__"] if i == 0 else [])
            ps._clear()
        # Later steps: other ids of the same shape are caught when the gradients come back.
        ps.install(ps.prefetch(_ctr_sparse(batches[2])))
        _ctr_loss(model, Batch(*(t.cuda() for t in batches[1]))).backward()
        with pytest.raises(UsageError, match="fused lookup got ids"):
            ps.collect()


def test_a_fused_lookup_whose_first_ids_do_not_match_looks_tables_up_one_by_one() -> None:
    b = _ctr_batches(1)[0]
    reordered = {f"cat_{j}": b.sparse[:, j] for j in reversed(range(4))}  # column t is not table t
    with FakeCuda():
        torch.manual_seed(0)
        model = _ctr()
        ps = _local_gpu_model(model, {f"cat_{j}": 8 for j in range(4)})
        ps.install(ps.prefetch(reordered))
        assert ps.lookup(b.sparse.cuda()) is None
        _ctr_loss(model, Batch(*(t.cuda() for t in b))).backward()
        ps.collect()
        grads = {t: g.clone() for t, (_, g) in ps.gradients()[0].items()}
    torch.manual_seed(0)
    cpu_model = _ctr()
    cpu = PSModel(cpu_model, (client := LocalClient()), torch.device("cpu"))
    _declare(client, cpu, {f"cat_{j}": 8 for j in range(4)})
    cpu.install(cpu.prefetch(reordered))
    _ctr_loss(cpu_model, b).backward()
    assert all(torch.equal(grads[t], g) for t, (_, g) in cpu.gradients()[0].items())


class _Dist:
    def barrier(self) -> None:
        pass

    def get_backend(self) -> str:
        return "nccl"


class _View:
    class client:  # what SyncPolicy.finish calls
        @staticmethod
        def clock(clock: int, leave: bool = False) -> None:
            pass


def test_sync_digests_are_read_from_the_gpu_once_at_the_end() -> None:
    with FakeCuda() as fake:
        layer = nn.Linear(3, 2)
        on_fake_cuda(layer)
        policy = SyncPolicy(2, 0, torch.device("cuda"))
        policy.dist = _Dist()  # type: ignore[assignment]
        policy.bind(list(layer.parameters()), None, {})
        waits = len(fake.syncs)
        for _ in range(5):
            with torch.no_grad():
                layer.weight.mul_(0.5).add_(0.25)
            policy.after_push()
        assert fake.syncs[waits:] == []
        record = RunRecord(worker_index=0, mode="sync", device="cuda", steps=5, samples=0, wall_s=0.0, samples_per_sec=0.0,
                           phase_seconds={}, clock_staleness=[], update_staleness=[], start_time=0.0, rejected_too_stale=0,
                           history=[], config={})
        policy.finish(_View(), 5, record)  # type: ignore[arg-type]
        assert fake.syncs[waits:] == ["tolist"]
        digests = record.dense_digests
        assert isinstance(digests, list) and len(digests) == 5 and len(set(digests)) == 5
        assert all(len(d) == 16 and int(d, 16) >= 0 for d in digests)
        # Another rank holding the same parameters has the same digest; one element off, not.
        twin = nn.Linear(3, 2)
        on_fake_cuda(twin)
        with torch.no_grad():
            for p, q in zip(twin.parameters(), layer.parameters(), strict=False):
                p.copy_(q)
        other = SyncPolicy(2, 1, torch.device("cuda"))
        other.bind(list(twin.parameters()), None, {})
        assert other.digest() == digests[-1]
        with torch.no_grad():
            twin.bias[1] = torch.nextafter(twin.bias[1], torch.tensor(2.0))
        assert other.digest() != digests[-1]
    # On the CPU the digest is what it was (SHA-1 of the bytes), taken every step.
    cpu = SyncPolicy(1, 0, torch.device("cpu"))
    cpu.dist = _Dist()  # type: ignore[assignment]
    plain = nn.Linear(3, 2)
    cpu.bind(list(plain.parameters()), None, {})
    cpu.after_push()
    data = torch.cat([p.detach().reshape(-1) for p in plain.parameters()]).numpy().tobytes()
    assert cpu.digests == [hashlib.sha1(data).hexdigest()[:16]]


def test_a_cpu_model_starts_no_thread_and_pins_nothing(inproc_shard: Any) -> None:
    with make_client([f"127.0.0.1:{inproc_shard.port}"]) as client:
        ps = PSModel(Tiny(), client, torch.device("cpu"))
        _declare(client, ps, {"e": 2})
        pulled = ps.install(ps.prefetch({"e": torch.tensor([1, 2])}))
        ps.model(torch.tensor([1, 2])).backward()
        ps.push(clock=1, versions=pulled).result(10)
        assert ps._executor is None and not client.router.pin_memory


def test_a_push_pull_answer_can_be_received_in_place() -> None:
    """``PullAnswer.direct_push_pull`` names the pull blocks of a ``PushPull`` answer as
    ``direct`` does a ``Pull``'s, and ``push_pull`` places them and returns the push's answer."""
    from tether.protos import tether_pb2 as pb
    from tether.protos.codec import wire_dtype
    from tether.worker.client.config import ClientConfig

    router = Router(ClientConfig(addresses=("x:1",), worker_id="w"), 1)
    router.dims["e"] = 2
    _, plan = router.pull_requests({"e": torch.tensor([4, 5, 6])}, [])
    response = pb.PushPullResponse()
    response.push.applied = True
    block = response.pull.sparse.add(table="e", read_version=3)
    block.values.dtype = wire_dtype(torch.float32)
    block.values.shape[:] = [3, 2]
    block.values.payload_offset, block.values.payload_bytes = 64, 24
    answer = PullAnswer(router, plan)
    places = answer.direct_push_pull(0, response.SerializeToString(), 64 + 24)
    assert [(offset, view.nbytes) for offset, view in places] == [(64, 24)]
    payload = bytearray(88)
    payload[64:] = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    places[0][1][:] = payload[64:]  # what the data plane does: the bytes land in the rows
    assert answer.push_pull(0, response, memoryview(bytes(88))).applied  # the buffer's stale bytes are not copied over them
    assert plan.rows["e"].tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert plan.table_versions[(0, "e")] == 3
