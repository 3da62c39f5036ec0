"""Checkpoints: atomic parts with a manifest, restore (same or another shard count), dedup windows,
periodic and on-demand triggers, pruning, and a writer that dies before its manifest."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import make_client
from prometheus_client import CollectorRegistry

from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.codec import encode_ids, encode_tensor
from tether.protos.errors import FailedPrecondition, InvalidArgument, Unavailable
from tether.protos.partition import shard_of_ids
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.checkpoints.checkpoint import Checkpointer
from tether.server.checkpoints.checkpoint_files import Manifest, file_checksum, manifest_checksum
from tether.server.checkpoints.restore import choose_restore, list_manifests, restore_candidates
from tether.server.config import CRASH_BEFORE_MANIFEST_ENV, ShardConfig
from tether.server.metrics import ShardMetrics
from tether.server.serving.serve import RunningShard, start_shard
from tether.server.storage.dedup import dedup_key
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import DenseDecl, DenseUpdate, SparseUpdate

ADAM = OptimizerConfig("adam", 0.01)
ADAGRAD = OptimizerConfig("adagrad", 0.1)
IDS = torch.arange(0, 3000, 3, dtype=torch.int64)


def _start(n: int, root: Path, **kw: object) -> list[RunningShard]:
    return [start_shard(ShardConfig(port=0, shard_index=i, num_shards=n, checkpoint_dir=str(root), **kw)) for i in range(n)]


def _stop(shards: list[RunningShard]) -> None:
    for s in shards:
        s.stop(0)


def _addresses(shards: list[RunningShard]) -> list[str]:
    return [f"127.0.0.1:{s.port}" for s in shards]


def _declare(client) -> None:
    client.declare(
        [TableConfig("user", 8, ADAGRAD, init_scale=0.1), TableConfig("item", 4, ADAM, init_scale=0.1)],
        {"w": torch.zeros(10), "b": torch.zeros(3)},
        ADAM,
    )


def _train(client, steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        client.push(
            {"user": (IDS, torch.randn(len(IDS), 8, generator=gen)), "item": (IDS[:50], torch.randn(50, 4, generator=gen))},
            {"w": torch.randn(10, generator=gen), "b": torch.randn(3, generator=gen)},
        ).result(10)


def _read(client) -> dict[str, torch.Tensor]:
    pulled = client.pull({"user": IDS, "item": IDS[:50]}, ["w", "b"]).result(10)
    return {**pulled.rows, **pulled.dense}


def _versions(client) -> dict[str, int]:
    return {t.name: t.version for info in client.info() for t in info.tables if t.rows}


@pytest.mark.parametrize("after", [2, 3, 1])
def test_restore_with_another_shard_count_continues_exactly(tmp_path: Path, after: int) -> None:
    """A checkpoint of 2 shards restores into `after` shards: same rows, state and results."""
    shards = _start(2, tmp_path)
    client = make_client(_addresses(shards), "w")
    _declare(client)
    _train(client, 3)
    before = _read(client)
    results = client.checkpoint("step-3")
    assert [r.id for r in results] == ["step-3", "step-3"] and all(r.bytes > 0 for r in results)
    _train(client, 2, seed=1)  # where the original job goes from here
    expected = _read(client)
    client.close()
    _stop(shards)

    # stop(), not shutdown(): no final checkpoint, so "step-3" is what every layout restores.
    shards = _start(after, tmp_path)
    client = make_client(_addresses(shards), "w2")
    infos = client.info()
    assert {i.restored_checkpoint for i in infos} == {"step-3"}
    assert sum(t.rows for i in infos for t in i.tables if t.name == "user") == len(IDS)
    _declare(client)  # the job declares its model again: a no-op on restored tables
    restored = _read(client)
    for name in before:
        assert torch.equal(restored[name], before[name]), name
    # Optimizer state came back too: the same next steps give the same parameters.
    _train(client, 2, seed=1)
    after_steps = _read(client)
    for name in expected:
        assert torch.allclose(after_steps[name], expected[name], atol=1e-6), name
    client.close()
    _stop(shards)


def test_dedup_window_survives_checkpoint_and_restore(tmp_path: Path) -> None:
    shards = _start(1, tmp_path)
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(_addresses(shards)[0]))
    stub.Declare(pb.DeclareRequest(tables=[TableConfig("t", 2, OptimizerConfig("sgd", 1.0), init_scale=0.0).to_proto()]), timeout=10)
    push = pb.PushRequest(incarnation=1, worker_id="w", seq=7, sparse=[pb.SparseBlock(table="t", ids=encode_ids(np.array([1])), values=encode_tensor(torch.ones(1, 2)))])
    assert stub.Push(push, timeout=10).applied
    stub.Checkpoint(pb.CheckpointRequest(id="c1"), timeout=30)
    _stop(shards)
    shards = _start(1, tmp_path)
    stub = pb_grpc.ParameterServerStub(grpc.insecure_channel(_addresses(shards)[0]))
    # The ack was lost before the crash; the worker retries seq 7 against the restored shard.
    assert not stub.Push(push, timeout=10).applied
    pulled = stub.Pull(pb.PullRequest(sparse=[pb.SparseBlock(table="t", ids=encode_ids(np.array([1])))]), timeout=10)
    assert np.frombuffer(pulled.sparse[0].values.data, np.float32).tolist() == [-1.0, -1.0]
    info = stub.Info(pb.InfoRequest(), timeout=10)
    assert (info.duplicate_pushes, info.restored_checkpoint) == (1, "c1")
    _stop(shards)


def test_export_is_consistent_with_concurrent_pushes() -> None:
    """Every push is either wholly in a snapshot (rows and seq) or wholly out of it."""
    import threading

    shard = Shard()
    shard.declare([TableConfig("t", 4, OptimizerConfig("sgd", 1.0), init_scale=0.0)], [])
    ids = np.arange(100, dtype=np.int64)
    stop = threading.Event()

    def pusher() -> None:
        seq = 0
        while not stop.is_set():
            seq += 1
            shard.push("w", seq, [SparseUpdate("t", ids, torch.ones(100, 4))], [], incarnation=1)

    thread = threading.Thread(target=pusher)
    thread.start()
    seen = 0
    try:
        deadline = time.monotonic() + 10
        while shard.applied_pushes == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        for _ in range(20):
            state = shard.export_state()
            (table,) = state.tables
            applied = len(state.seqs.get(dedup_key("w", 1), ()))
            assert applied == 0 or len(table.ids) == 100
            assert torch.equal(table.weights, torch.full((len(table.ids), 4), -float(applied)))
            assert table.version == applied
            seen = max(seen, applied)
        assert seen > 0, "no push landed in any snapshot: the check above compared nothing"
    finally:
        stop.set()
        thread.join(10)


def test_checkpoint_ids_are_checked_and_a_shard_without_a_dir_refuses(tmp_path: Path) -> None:
    shards = _start(1, tmp_path)
    client = make_client(_addresses(shards))
    for bad in ("../escape", ".hidden", "a/b", "", "x" * 129, "white space"):
        with pytest.raises(InvalidArgument, match="checkpoint id"):
            client.checkpoint(bad)
    assert [p.name for p in tmp_path.iterdir()] == []
    client.close()
    _stop(shards)
    plain = start_shard(ShardConfig(port=0))
    client = make_client([f"127.0.0.1:{plain.port}"])
    with pytest.raises(FailedPrecondition, match="checkpoint directory"):
        client.checkpoint("c1")
    client.close()
    plain.stop(0)


def test_metrics_and_pruning(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = ShardMetrics(registry)
    shard = Shard(metrics=metrics)
    shard.declare([TableConfig("t", 4, ADAGRAD)], [])
    ckpt = Checkpointer(shard, tmp_path, keep=2, metrics=metrics)
    for k in range(4):
        shard.push("w", k + 1, [SparseUpdate("t", np.arange(10, dtype=np.int64), torch.ones(10, 4))], [], incarnation=1)
        info = ckpt.checkpoint(f"step-{k}")
        assert info.bytes == (tmp_path / f"step-{k}" / "shard-0-of-1.pt").stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]
    assert registry.get_sample_value("tether_shard_checkpoint_duration_seconds_count") == 4
    assert abs(registry.get_sample_value("tether_shard_last_checkpoint_timestamp_seconds") - time.time()) < 60
    manifest = json.loads((tmp_path / "step-3" / "shard-0-of-1.manifest.json").read_text())
    assert manifest["tables"] == {"t": 10} and manifest["id"] == "step-3"
    # Nothing changed since step-3: no final checkpoint is needed.
    assert ckpt.final() is None


def test_periodic_checkpoints_share_an_id_across_shards(tmp_path: Path) -> None:
    shards = _start(2, tmp_path, checkpoint_every_s=0.5)
    client = make_client(_addresses(shards))
    _declare(client)
    _train(client, 1)
    deadline = time.monotonic() + 10
    # Until both shards wrote a checkpoint holding everything they were sent.
    while any(s.checkpointer.dirty for s in shards) or choose_restore(tmp_path, 0, 2) is None:
        assert time.monotonic() < deadline, "no periodic checkpoint within 10 s"
        time.sleep(0.05)
    manifests = list_manifests(tmp_path)
    ids = {m.id for m in manifests}
    complete = [i for i in ids if {m.shard_index for m in manifests if m.id == i} == {0, 1}]
    assert complete and all(i.startswith("auto-") for i in ids), ids
    # An unchanged shard writes no more checkpoints.
    count = len(manifests)
    time.sleep(1.2)
    assert len(list_manifests(tmp_path)) == count
    client.close()
    _stop(shards)


def test_a_shard_restores_its_newest_own_part_not_a_checkpoint_another_shard_finished_late(tmp_path: Path) -> None:
    """A checkpoint the shards were asked for together (step-<clock>, auto-<t>) that one shard
    wrote late (it was stopped, or down and back) is complete only then, but another shard's
    part of it holds that shard's rows as they were when *it* wrote it: a shard killed after
    writing a newer part of its own restores that one, or it loses the updates in between."""

    def part(ckpt_id: str, shard: int, created: float) -> Manifest:
        folder = tmp_path / ckpt_id
        return Manifest(ckpt_id, shard, 2, created, folder / f"shard-{shard}-of-2.manifest.json", folder / f"shard-{shard}-of-2.pt", 1, "")

    manifests = [part("step-500", 0, 100.0), part("auto-115", 0, 115.0), part("step-500", 1, 120.0)]
    plans = restore_candidates(manifests, 0, 2)
    assert [(p.id, p.complete, p.created) for p in plans] == [("auto-115", False, 115.0), ("step-500", True, 100.0)]
    assert restore_candidates(manifests, 1, 2)[0].id == "step-500"
    # Onto another shard count every part is read: the checkpoint is as new as its last part.
    (plan,) = restore_candidates(manifests, 0, 3)
    assert (plan.id, plan.created, len(plan.parts)) == ("step-500", 120.0, 2)


def test_restore_prefers_the_newest_usable_part(tmp_path: Path) -> None:
    """A complete checkpoint, then a newer part of shard 0 only (say its final one at SIGTERM)."""
    shards = _start(2, tmp_path)
    client = make_client(_addresses(shards))
    _declare(client)
    _train(client, 1)
    client.checkpoint("both")
    shards[0].checkpointer.checkpoint("only-0")
    assert choose_restore(tmp_path, 0, 2).id == "only-0"  # its own newer part holds all its rows
    assert choose_restore(tmp_path, 1, 2).id == "both"
    plan = choose_restore(tmp_path, 0, 3)  # resharding needs every part of one id
    assert plan.id == "both" and plan.complete and len(plan.parts) == 2
    # A part whose data file is damaged is skipped for the next older one.
    (tmp_path / "only-0" / "shard-0-of-2.pt").write_bytes(b"not a checkpoint")
    assert choose_restore(tmp_path, 0, 2).id == "both"
    client.close()
    _stop(shards)


def test_a_corrupt_part_with_a_matching_size_falls_back_to_an_older_checkpoint(tmp_path: Path) -> None:
    shard = Shard()
    shard.declare([TableConfig("t", 4, ADAGRAD)], [])
    ckpt = Checkpointer(shard, tmp_path)
    ckpt.checkpoint("old")
    shard.push("w", 1, [SparseUpdate("t", np.arange(5, dtype=np.int64), torch.ones(5, 4))], [], incarnation=1)
    ckpt.checkpoint("new")
    data = tmp_path / "new" / "shard-0-of-1.pt"
    data.write_bytes(b"\0" * data.stat().st_size)
    fresh = Shard()
    assert Checkpointer(fresh, tmp_path).restore().id == "old"
    assert fresh.restored_checkpoint == "old" and fresh.tables["t"].rows == 0


def _flip_16_bits(path: Path, tensor: torch.Tensor) -> None:
    """Invert two bytes in the middle of ``tensor``'s bytes inside ``path`` (size unchanged)."""
    raw = bytearray(path.read_bytes())
    needle = tensor.contiguous().numpy().tobytes()
    at = raw.find(needle)
    assert at >= 0 and raw.find(needle, at + 1) < 0, "the tensor's bytes are not in the file exactly once"
    mid = at + len(needle) // 2
    raw[mid] ^= 0xFF
    raw[mid + 1] ^= 0xFF
    path.write_bytes(bytes(raw))


def _old_and_new(root: Path, shard_index: int = 0, num_shards: int = 1) -> Shard:
    """A shard with a table (Adagrad) and a dense chunk, checkpointed as "old", then pushed to
    and checkpointed as "new"."""
    gen = torch.Generator().manual_seed(shard_index)
    shard = Shard(shard_index, num_shards)
    chunks = [DenseDecl("w", 0, torch.randn(16, generator=gen), ADAGRAD)] if shard_index == 0 else []
    shard.declare([TableConfig("t", 4, ADAGRAD, init_scale=0.1)], chunks)
    ids = np.arange(200, dtype=np.int64)
    ids = ids[shard_of_ids(ids, num_shards) == shard_index]
    shard.pull([("t", ids)], [])
    ckpt = Checkpointer(shard, root)
    ckpt.checkpoint("old")
    dense = [DenseUpdate("w", 0, torch.randn(16, generator=gen))] if chunks else []
    shard.push("w", 1, [SparseUpdate("t", ids, torch.randn(len(ids), 4, generator=gen))], dense, incarnation=1)
    ckpt.checkpoint("new")
    return shard


@pytest.mark.parametrize("where", ["rows", "state", "dense", "manifest-value", "manifest-bits"])
def test_a_flipped_bit_in_any_file_of_a_checkpoint_restores_the_previous_one(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """16 bits flipped in the rows, the optimizer state, a dense chunk or the manifest (size
    unchanged): restore names the file and restores the checkpoint before."""
    _old_and_new(tmp_path)
    data = tmp_path / "new" / "shard-0-of-1.pt"
    manifest = tmp_path / "new" / "shard-0-of-1.manifest.json"
    recorded = json.loads(manifest.read_text())["data"]["checksum"]
    assert recorded == file_checksum(data) and recorded.startswith("sha256:")
    doc = torch.load(data, weights_only=True)
    (table,) = doc["tables"]
    (chunk,) = doc["dense"]
    if where == "rows":
        _flip_16_bits(data, table["weights"])
    elif where == "state":
        _flip_16_bits(data, table["state"]["sum"])
    elif where == "dense":
        _flip_16_bits(data, chunk["value"])
    elif where == "manifest-value":
        # Still valid JSON, still the data file's size and checksum: only a value changed.
        text = manifest.read_text()
        changed = text.replace('"t": 200', '"t": 208')
        assert changed != text and len(changed) == len(text)
        manifest.write_text(changed)
    else:
        raw = bytearray(manifest.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        raw[len(raw) // 2 + 1] ^= 0xFF
        manifest.write_bytes(bytes(raw))
    if where.startswith("manifest"):
        assert choose_restore(tmp_path, 0, 1).id == "old"  # the damaged manifest is no commit marker
    fresh = Shard()
    with caplog.at_level(logging.WARNING, logger="tether.server.checkpoints.checkpoint"):
        assert Checkpointer(fresh, tmp_path).restore().id == "old"
    assert fresh.restored_checkpoint == "old"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    named = manifest if where.startswith("manifest") else data
    # Both digests, except for a manifest that no longer parses (the parse error is named).
    digests = 0 if where == "manifest-bits" else 2
    assert any(str(named) in w and w.count("sha256:") >= digests for w in warnings), warnings
    if not where.startswith("manifest"):
        assert any(recorded in w and file_checksum(data) in w for w in warnings), warnings
    # What came back is "old" exactly.
    old = torch.load(tmp_path / "old" / "shard-0-of-1.pt", weights_only=True)
    assert torch.equal(fresh.tables["t"].snapshot()["weights"], old["tables"][0]["weights"])


@pytest.mark.parametrize("into", [1, 3])
def test_restore_into_another_shard_count_verifies_every_part_it_reads(tmp_path: Path, into: int, caplog: pytest.LogCaptureFixture) -> None:
    """Parts of 2 shards, one of them damaged in "new": any other shard count falls back to "old"."""
    for i in range(2):
        _old_and_new(tmp_path, i, 2)
    damaged = tmp_path / "new" / "shard-1-of-2.pt"
    _flip_16_bits(damaged, torch.load(damaged, weights_only=True)["tables"][0]["weights"])
    for i in range(into):
        fresh = Shard(i, into)
        with caplog.at_level(logging.WARNING, logger="tether.server.checkpoints.checkpoint"):
            assert Checkpointer(fresh, tmp_path).restore().id == "old", i
        assert any(str(damaged) in r.getMessage() for r in caplog.records), i
        caplog.clear()
    # The same shard count: shard 0's own part is intact and enough alone; shard 1's is not.
    assert Checkpointer(Shard(0, 2), tmp_path).restore().id == "new"
    assert Checkpointer(Shard(1, 2), tmp_path).restore().id == "old"


def test_a_writer_killed_before_its_manifest_leaves_the_previous_checkpoint(tmp_path: Path, cluster) -> None:
    """Real processes: the shard exits between data file and manifest (test hook)."""
    ckpt_dir = tmp_path / "ckpt"
    (address,) = cluster.start_shards(1, extra_args=["--checkpoint-dir", str(ckpt_dir)], env={CRASH_BEFORE_MANIFEST_ENV: "0"})
    client = make_client([address], retries=0)
    _declare(client)
    _train(client, 2)
    client.checkpoint("good")
    good = _read(client)
    client.close()
    cluster.signal_shard(0, 9)
    cluster.stop()

    (address,) = cluster.start_shards(1, extra_args=["--checkpoint-dir", str(ckpt_dir)], env={CRASH_BEFORE_MANIFEST_ENV: "1"})
    client = make_client([address], retries=0)
    _declare(client)
    _train(client, 3, seed=5)
    with pytest.raises(Unavailable):  # the shard is gone mid-call, and the client does not retry
        client.checkpoint("torn", timeout_s=30)
    assert cluster.shard_process(0).wait(timeout=30) == 1
    client.close()
    assert (ckpt_dir / "torn" / "shard-0-of-1.pt").exists()
    assert not (ckpt_dir / "torn" / "shard-0-of-1.manifest.json").exists()
    cluster.stop()

    (address,) = cluster.start_shards(1, extra_args=["--checkpoint-dir", str(ckpt_dir)])
    client = make_client([address])
    assert client.info()[0].restored_checkpoint == "good"
    _declare(client)
    restored = _read(client)
    for name in good:
        assert torch.equal(restored[name], good[name]), name
    client.close()


def test_a_restarted_shard_skips_a_corrupted_latest_checkpoint(tmp_path: Path, cluster) -> None:
    """Real processes: bits flipped in the rows of the newest checkpoint; the restarted shard
    restores the one before, Info names it, and its log names the damaged file."""
    ckpt_dir = tmp_path / "ckpt"
    (address,) = cluster.start_shards(1, extra_args=["--checkpoint-dir", str(ckpt_dir)])
    client = make_client([address])
    _declare(client)
    _train(client, 2)
    client.checkpoint("good")
    good = _read(client)
    _train(client, 2, seed=3)
    client.checkpoint("latest")
    assert not torch.equal(_read(client)["user"], good["user"])
    client.close()
    cluster.signal_shard(0, 9)
    cluster.stop()

    data = ckpt_dir / "latest" / "shard-0-of-1.pt"
    size = data.stat().st_size
    _flip_16_bits(data, torch.load(data, weights_only=True)["tables"][0]["weights"])
    assert data.stat().st_size == size

    (address,) = cluster.start_shards(1, extra_args=["--checkpoint-dir", str(ckpt_dir)])
    client = make_client([address])
    assert client.info()[0].restored_checkpoint == "good"
    _declare(client)
    restored = _read(client)
    for name in good:
        assert torch.equal(restored[name], good[name]), name
    client.close()
    log = (cluster.log_dir / "shard-0.log").read_text()
    assert "not restoring checkpoint latest" in log and str(data) in log, log[-2000:]


def test_restore_cli_flags_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.server.config import load_config

    monkeypatch.setenv("TETHER_CHECKPOINT_DIR", str(tmp_path))
    cfg = load_config(["--checkpoint-every", "30", "--checkpoint-keep", "5"])
    assert (cfg.checkpoint_dir, cfg.checkpoint_every_s, cfg.checkpoint_keep) == (str(tmp_path), 30.0, 5)
    with pytest.raises(ValueError, match="checkpoint_every_s"):
        ShardConfig(checkpoint_every_s=0.0, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs a checkpoint_dir"):
        ShardConfig(checkpoint_every_s=5.0)


def test_partition_filtering_is_exact_for_a_large_table(tmp_path: Path) -> None:
    """200k rows written by 1 shard, restored by 4: each keeps exactly its ids."""
    shard = Shard()
    shard.declare([TableConfig("big", 8, ADAGRAD)], [])
    ids = np.random.default_rng(0).choice(2**62, 200_000, replace=False).astype(np.int64)
    shard.pull([("big", ids)], [])
    Checkpointer(shard, tmp_path).checkpoint("one")
    total = 0
    for i in range(4):
        part = Shard(i, 4)
        Checkpointer(part, tmp_path).restore()
        kept = part.tables["big"].snapshot()["ids"]
        assert (shard_of_ids(kept, 4) == i).all()
        total += len(kept)
    assert total == len(ids)


def test_checkpoint_files_load_without_pickle(tmp_path: Path) -> None:
    """The data file is plain containers and tensors: torch.load(weights_only=True) reads it."""
    shard = Shard()
    shard.declare([TableConfig("t", 4, ADAM)], [])
    shard.pull([("t", np.arange(3, dtype=np.int64))], [])
    Checkpointer(shard, tmp_path).checkpoint("c")
    doc = torch.load(tmp_path / "c" / "shard-0-of-1.pt", weights_only=True)
    assert doc["tables"][0]["ids"].tolist() == [0, 1, 2]
    # A file that needs arbitrary unpickling is refused, and restore skips it.
    (tmp_path / "c" / "shard-0-of-1.pt").unlink()
    import pickle

    class Evil:
        def __reduce__(self):
            return (subprocess.call, ([sys.executable, "-c", "open('pwned','w')"],))

    with open(tmp_path / "c" / "shard-0-of-1.pt", "wb") as f:
        torch.save({"format": "tether-checkpoint/1", "x": Evil()}, f, pickle_module=pickle)
    manifest = tmp_path / "c" / "shard-0-of-1.manifest.json"
    doc = json.loads(manifest.read_text())
    doc["data"]["bytes"] = (tmp_path / "c" / "shard-0-of-1.pt").stat().st_size
    # A manifest that vouches for the file: only the refusal to unpickle stands in the way.
    doc["data"]["checksum"] = file_checksum(tmp_path / "c" / "shard-0-of-1.pt")
    doc["checksum"] = manifest_checksum(doc)
    manifest.write_text(json.dumps(doc))
    assert choose_restore(tmp_path, 0, 1).id == "c"
    fresh = Shard()
    assert Checkpointer(fresh, tmp_path).restore() is None
    assert not Path("pwned").exists() and not (tmp_path / "pwned").exists()
