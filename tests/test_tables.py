import numpy as np
import pytest
import torch

from tether.protos.specs import OptimizerConfig, TableConfig
from tether.rules.initial import init_rows
from tether.server.storage.dense import DenseChunk
from tether.server.storage.tables import EmbeddingTable


def test_rows_created_on_first_touch_deterministically() -> None:
    cfg = TableConfig("emb", 8, init_scale=0.1, seed=3)
    a, b = EmbeddingTable(cfg), EmbeddingTable(cfg)
    ids = np.array([10, 2**40, 7, 99], dtype=np.int64)
    rows_a, v = a.pull(ids)
    # Touch in another order and in pieces: the same id gets the same row.
    b.pull(ids[::-1].copy())
    rows_b, _ = b.pull(ids)
    assert v == 0 and a.rows == 4
    assert torch.equal(rows_a, rows_b)
    assert rows_a.abs().max() <= 0.1 and rows_a.std() > 0.01
    other_seed = EmbeddingTable(TableConfig("emb", 8, init_scale=0.1, seed=4)).pull(ids)[0]
    assert not torch.equal(rows_a, other_seed)
    assert torch.equal(init_rows(ids, 8, 3, "emb", 0.1), rows_a)


def test_growth_keeps_rows_and_state() -> None:
    table = EmbeddingTable(TableConfig("t", 4, OptimizerConfig("adagrad", 0.5)), initial_capacity=2)
    first = np.arange(3, dtype=np.int64)
    table.push(first, torch.ones(3, 4))
    before = table.snapshot()
    table.pull(np.arange(3, 5000, dtype=np.int64))
    after = table.snapshot()
    assert table.rows == 5000
    assert torch.equal(after["weights"][:3], before["weights"])
    assert torch.equal(after["state"]["sum"][:3], torch.ones(3, 4))


def test_push_sgd_exact() -> None:
    table = EmbeddingTable(TableConfig("t", 2, OptimizerConfig("sgd", 1.0), init_scale=0.0))
    for _ in range(3):
        version = table.push(np.array([5, 6]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert version == 3
    rows, v = table.pull(np.array([6, 5]))
    assert v == 3
    assert rows.tolist() == [[-9.0, -12.0], [-3.0, -6.0]]


def test_a_table_of_200k_rows_pulls_a_batch_and_snapshots_every_id_sorted() -> None:
    """200k rows created by one pull (the id index grown on the way), then a batch of them pulled
    again, and a snapshot that holds each id once, in order (what a checkpoint writes)."""
    table = EmbeddingTable(TableConfig("big", 4, OptimizerConfig("sgd", 1.0)))
    ids = np.random.default_rng(0).choice(2**62, 200_000, replace=False).astype(np.int64)
    table.pull(ids)
    rows, _ = table.pull(ids[:4096])
    assert rows.shape == (4096, 4)
    snap = table.snapshot()
    assert np.all(np.diff(snap["ids"]) > 0) and len(snap["ids"]) == 200_000


def test_dense_chunk() -> None:
    chunk = DenseChunk("w", 0, torch.zeros(4), OptimizerConfig("sgd", 0.5))
    assert chunk.push(torch.ones(4)) == 1
    assert chunk.pull()[0].tolist() == [-0.5] * 4


@pytest.mark.parametrize(
    "kwargs, message",
    [({"name": ""}, "table name"), ({"dim": 0}, "dim must be in"), ({"init_scale": -1.0}, "init_scale")],
)
def test_table_config_validation(kwargs: dict, message: str) -> None:
    base = {"name": "t", "dim": 4}
    with pytest.raises(ValueError, match=message):
        TableConfig(**{**base, **kwargs})


def test_a_million_rows_with_adagrad_fit_in_twice_their_raw_bytes() -> None:
    """DESIGN.md: contiguous rows and a vectorised index, not a Python object per row."""
    table = EmbeddingTable(TableConfig("big", 64, OptimizerConfig("adagrad", 0.1)))
    ids = np.random.default_rng(7).choice(2**62, 1_000_000, replace=False).astype(np.int64)
    for start in range(0, len(ids), 65_536):
        table.pull(ids[start : start + 65_536])
    raw = 1_000_000 * 64 * 4 * 2  # rows + Adagrad accumulators, float32
    assert table.rows == 1_000_000
    assert table.memory_bytes <= 2 * raw, table.memory_bytes / raw
    rows, _ = table.pull(ids[:4096])
    assert torch.equal(rows, table.pull(ids[:4096])[0])


def test_push_after_pull_lands_on_the_right_rows_also_after_a_restore() -> None:
    # A push naming exactly the ids of a recent pull reuses that pull's slots; the rows it
    # updates must be those ids' rows, and a restore (which renumbers slots) must not let an
    # older pull's slots through.
    cfg = TableConfig("t", 2, OptimizerConfig("sgd", 1.0), init_scale=0.0)
    table = EmbeddingTable(cfg)
    table.pull(np.array([30, 10, 20], dtype=np.int64))
    ids = np.array([20, 30], dtype=np.int64)
    table.pull(ids)
    table.push(ids.copy(), torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    rows, _ = table.pull(np.array([10, 20, 30], dtype=np.int64))
    assert torch.equal(rows, torch.tensor([[0.0, 0.0], [-1.0, -1.0], [-2.0, -2.0]]))
    # Restore rows in another order: slot 0 is now id 20's, not id 30's.
    snap = table.snapshot()
    table.load(np.array([20, 30], dtype=np.int64), snap["weights"][1:], {}, snap["version"])
    table.push(ids.copy(), torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    rows, _ = table.pull(np.array([20, 30], dtype=np.int64))
    assert torch.equal(rows, torch.tensor([[-2.0, -2.0], [-4.0, -4.0]]))


def test_a_push_of_pulled_ids_checks_uniqueness_on_slots() -> None:
    from tether.protos.errors import InvalidArgument
    from tether.server.storage.shard import Shard
    from tether.server.storage.shard_records import SparseUpdate

    shard = Shard(0, 1)
    shard.declare([TableConfig("t", 2, OptimizerConfig("sgd", 1.0), init_scale=0.0)], [])
    table = shard.tables["t"]
    # A pull may name an id twice; the push of those very ids must still be refused whole.
    twice = np.array([4, 9, 4], dtype=np.int64)
    shard.pull([("t", twice)], [])
    pulled = table.pulled(twice)
    assert pulled is not None and not pulled.unique
    with pytest.raises(InvalidArgument, match="must be unique"):
        shard.push("w", 1, [SparseUpdate("t", twice, torch.ones(3, 2))], [], incarnation=1)
    assert table.version == 0 and table.pull(np.array([4, 9]))[0].abs().sum() == 0
    # The same rows without the repeat: known slots, applied once each.
    once = np.array([9, 4], dtype=np.int64)
    shard.pull([("t", once)], [])
    assert table.pulled(once).unique
    shard.push("w", 2, [SparseUpdate("t", once, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))], [], incarnation=1)
    assert table.pull(np.array([4, 9]))[0].tolist() == [[-3.0, -4.0], [-1.0, -2.0]]
    # Ids that are not rows yet go through the full checks (here: the sort-based duplicate check).
    assert table.pulled(np.array([7, 7], dtype=np.int64)) is None
    with pytest.raises(InvalidArgument, match="must be unique"):
        shard.push("w", 3, [SparseUpdate("t", np.array([7, 7], dtype=np.int64), torch.ones(2, 2))], [], incarnation=1)


def test_locate_hands_out_storage_only_where_reads_take_no_lock() -> None:
    ids = np.array([3, 1, 2], dtype=np.int64)
    free = EmbeddingTable(TableConfig("t", 4, init_scale=0.1))
    source, index, _ = free.locate(ids)
    assert index is not None and torch.equal(source.index_select(0, index), free.pull(ids)[0])
    bounded = EmbeddingTable(TableConfig("t", 4, init_scale=0.1, capacity=8))
    rows, index, _ = bounded.locate(ids)
    assert index is None and torch.equal(rows, init_rows(ids, 4, 0, "t", 0.1))


# -- memory per row (issue 28 item 5) --------------------------------------------------------------


def test_row_versions_past_their_int32_span_keep_staleness_exact_for_recent_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.server.storage import tables

    monkeypatch.setattr(tables, "_VERSION_SPAN", 15)  # int32 offsets from a base: rebased every 8 pushes here
    monkeypatch.setattr(tables, "_LOG_UPDATES", 4)  # and the last 4 updates logged
    table = EmbeddingTable(TableConfig("t", 2, OptimizerConfig("sgd", 0.1)))
    quiet, busy = np.array([1], np.int64), np.array([2], np.int64)
    table.push(quiet, torch.ones(1, 2))  # version 1, then never again
    oldest = table.version
    for _ in range(40):  # five rebases
        read = table.version
        table.push(busy, torch.ones(1, 2))
        # The busy row missed exactly the one update since each read; the quiet row none.
        assert table.staleness(np.array([1, 2], np.int64), read).tolist() == [0, 1]
    assert table._versions.base > oldest and table._versions.array.max() <= 15
    assert table.staleness(np.array([1, 2], np.int64), table.version - 3).tolist() == [0, 3]
    # A read older than the base (and the log): rows last updated before the base read as "any
    # time since", so every row counts as updated by every update since the read: the quiet
    # row's true count is 0 after its one update, never more than counted.
    assert table.staleness(quiet, oldest).tolist() == [table.version - oldest]
    assert table.largest_staleness(quiet, oldest) == table.version - oldest
    # Restoring keeps the table's version; restored rows are not stale for any read.
    snap = table.snapshot()
    table.load(snap["ids"], snap["weights"], snap["state"], snap["version"])
    assert table.staleness(np.array([1, 2], np.int64), 0) is None
    table.push(busy, torch.ones(1, 2))
    assert table.staleness(np.array([1, 2], np.int64), snap["version"]).tolist() == [0, 1]


def test_update_log_counts_each_rows_updates_since_a_read_by_its_own_entries() -> None:
    """The log's per-row counts against a count over every update kept, through ring wraps, the
    ring's growth, updates falling out of the log (a read older than it counts every update
    since), slots not rows (-1), a slot asked twice and a slot reused by another row."""
    from tether.server.storage.update_log import RowVersions, UpdateLog

    rng = np.random.default_rng(0)
    log, rows = UpdateLog(max_updates=40, max_slots=3000), RowVersions(4096)
    history: list[np.ndarray] = []
    for version in range(1, 400):
        n = int(rng.integers(1, 160))
        slots = np.unique(rng.zipf(1.3, 3 * n) % 4096)[:n].astype(np.int64)
        rng.shuffle(slots)
        if version % 3:
            log.record(version, slots, rows, 4096)
        else:  # counted in the record's pass: what ``count`` says just before
            read = version - 1 - int(rng.integers(0, 70))
            want = log.count(slots, rows, version - 1, read, per_row=False)
            assert log.record(version, slots, rows, 4096, read) == want, version
        history.append(slots)
        if version % 7:
            continue
        for read in (version - 1, version - 5, version - 30, version - 60, 0):
            ask = np.concatenate([rng.integers(0, 4096, 40), history[-1][:5], history[-1][:1], [-1]]).astype(np.int64)
            kept = log._versions[log._head:]
            after = rows.after(read)
            if kept and kept[0] <= read + 1:
                want = [0 if s < 0 else sum(int(s in set(h.tolist())) for h in history[read:]) for s in ask.tolist()]
            else:
                want = [0 if s < 0 or rows.array[s] <= after else version - read for s in ask.tolist()]
            got = log.count(ask, rows, version, read, per_row=True)
            assert (got.tolist() if got is not None else [0] * len(ask)) == want, (version, read)
            assert log.count(ask, rows, version, read, per_row=False) == max(want)
    # The ring grew from its first 4,096 entries to hold 3,000 slots or 40 updates at most.
    assert log.nbytes <= 8 * 3000
    # Only the rows asked are read: a row with no entry in the log counts 0, whatever its slot held.
    fresh, rows = UpdateLog(max_updates=4, max_slots=10), RowVersions(16)
    for version, slots in enumerate(([1, 2], [2, 3], [2], [5, 6, 7, 8], [2, 9]), start=1):
        fresh.record(version, np.array(slots, np.int64), rows, 16)
    # Version 1 went (11 slots held, more than 10); 2..5 remain, 8 bytes an entry (a slot and its link).
    assert fresh.nbytes == 8 * 9
    slots = np.array([2, 3, 9, 4, -1], np.int64)  # 4 was never updated; -1 is not a row
    assert fresh.count(slots, rows, 5, 2, per_row=True).tolist() == [2, 0, 1, 0, 0]  # type: ignore[union-attr]
    assert fresh.count(slots, rows, 5, 2, per_row=False) == 2
    # A read older than the log: every row updated since the read stale by every update since.
    assert fresh.count(slots, rows, 5, 0, per_row=True).tolist() == [5, 5, 5, 0, 0]  # type: ignore[union-attr]
    assert fresh.count(np.array([4], np.int64), rows, 5, 0, per_row=True) is None
    assert fresh.count(np.array([4], np.int64), rows, 5, 0, per_row=False) == 0
    # Counted as a push is logged: row 5 was updated once since version 3, the first entry since.
    assert fresh.record(6, np.array([5], np.int64), rows, 16, read_version=3) == 1
    # A read whose entries this very update pushes out of the log (version 3 goes): counted
    # before it is logged (row 2 at versions 3 and 5).
    assert fresh.record(7, np.array([3, 4, 6, 7, 8, 10, 11, 9, 2], np.int64), rows, 16, read_version=2) == 2
    assert fresh.count(np.array([2, 5], np.int64), rows, 7, 5, per_row=True).tolist() == [1, 1]  # type: ignore[union-attr]


def test_storage_from_mappings_is_zeroed_writable_and_unbacked_until_written() -> None:
    from tether.server.storage.zeroed import MAPPED_BYTES, zeros

    small, big = zeros(10, np.int32), zeros((MAPPED_BYTES // 256, 64), np.float32)
    assert small.tolist() == [0] * 10 and big.shape == (MAPPED_BYTES // 256, 64) and not big.any()
    assert big.flags.writeable and big.flags.c_contiguous and big.ctypes.data % 4096 == 0
    big[3] = 1.5
    assert torch.from_numpy(big)[3].tolist() == [1.5] * 64

    def resident() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    before = resident()
    room = zeros(256 << 20, np.uint8)  # 256 MiB of room, one page written
    room[0] = 1
    assert resident() - before < 64 << 20
    del room


def test_a_table_holds_about_25_bytes_a_row_beyond_its_rows_and_state() -> None:
    # Row-wise Adagrad, dim 16: 64 B of values and 4 of state a row; the ids by slot (8), the
    # hash cells (5.7-6.7) and the row versions (4, and 4 for where each row's last update is in
    # the update log) are the rest.
    table = EmbeddingTable(TableConfig("t", 16, OptimizerConfig("rowwise_adagrad", 0.1)))
    ids = np.random.default_rng(1).choice(2**62, 50_000, replace=False).astype(np.int64)
    for a in range(0, len(ids), 5000):
        part = np.sort(ids[a : a + 5000])
        table.push(part, torch.ones(len(part), 16), 1.0, table.pulled(part))
    index = table._index
    assert index.size == 50_000 and 0.59 <= index.size / index.cells <= 0.7
    assert table._versions.nbytes <= 8 * (table._weights.shape[0] + 1)  # two int32 a slot
    assert 4 * index.cells + 8 * index.size + 8 * table.rows <= 24.7 * table.rows
    assert table.pull(ids[:3])[0].shape == (3, 16) and table.snapshot()["ids"].tolist() == np.sort(ids).tolist()


def test_update_log_ring_counts_as_a_list_of_every_update_would() -> None:
    """The log's ring (grown from 2 slots, wrapping, dropping the oldest updates past either
    cap) counts what a plain list of the updates it keeps counts."""
    from tether.server.storage.update_log import RowVersions, UpdateLog

    every = RowVersions(60)
    every.array[:] = 1 << 30  # every row updated after any read here
    rng = np.random.default_rng(7)
    for max_updates, max_slots in ((3, 50), (40, 25), (8, 1000)):
        log, kept = UpdateLog(max_updates, max_slots), []
        log._ring = np.empty((2, 2), np.int32)
        for version in range(1, 120):
            slots = rng.choice(60, int(rng.integers(0, 30)), replace=False).astype(np.int64)
            log.record(version, slots, every, 60)
            every.array[:] = 1 << 30
            kept.append((version, slots))
            while len(kept) > max_updates or sum(len(s) for _, s in kept) > max_slots:
                kept.pop(0)
            assert log.nbytes == 8 * sum(len(s) for _, s in kept)
            read = int(rng.integers(0, version + 1))
            ids = rng.choice(60, 15, replace=False).astype(np.int64)
            got = log.count(ids, every, version, read, per_row=True)
            assert got is not None
            if not kept or kept[0][0] > read + 1:
                assert got.tolist() == [version - read] * 15
            else:
                assert got.tolist() == [sum(int((s == i).sum()) for v, s in kept if v > read) for i in ids]
