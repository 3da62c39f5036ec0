import threading

import numpy as np

from tether.protos.partition import mix64
from tether.rules import index_kernels
from tether.server.storage.index import IdIndex


def test_insert_lookup_and_growth() -> None:
    rng = np.random.default_rng(0)
    ids = rng.choice(2**62, 50_000, replace=False).astype(np.int64)
    index = IdIndex(capacity=16)
    for start in range(0, len(ids), 3000):
        part = ids[start : start + 3000]
        assert (index.lookup(part) == -1).all()
        index.insert(part, np.arange(start, start + len(part)))
    assert index.size == len(ids)
    probe = rng.permutation(len(ids))[:5000]
    assert np.array_equal(index.lookup(ids[probe]), probe)
    keys, slots = index.items()
    assert np.all(np.diff(keys) > 0) and np.array_equal(ids[slots], keys)
    assert index.lookup(np.array([0, 1, 2**62 + 5], dtype=np.int64)).tolist() == [-1, -1, -1]
    # int32 cells at a load factor of at most 0.7, and the ids by slot (room to grow by 1.5x).
    assert 0.3 <= index.size / index.cells <= 0.7
    assert index.nbytes <= (4 / 0.3 + 8 * 1.5) * len(ids)


def test_colliding_ids_in_one_batch() -> None:
    index = IdIndex(capacity=16)
    ids = np.arange(7, dtype=np.int64)  # fills most of a 16-cell table: probes collide
    index.insert(ids, ids * 10)
    assert index.lookup(ids).tolist() == (ids * 10).tolist()


def test_long_probe_chains() -> None:
    # 60 ids that all hash to the same home cell (splitmix64's high half scaled to the cells, as
    # the index hashes): one chain of 60 cells that inserts, lookups and misses walk to its end.
    index = IdIndex(capacity=4096)
    n = np.uint64(index.cells)
    rng = np.random.default_rng(2)
    pool = rng.choice(2**62, 400_000, replace=False).astype(np.int64)
    homes = (((mix64(pool.view(np.uint64)) >> np.uint64(32)) * n) >> np.uint64(32)).astype(np.int64)
    home = np.bincount(homes).argmax()
    chain = pool[homes == home]
    assert len(chain) >= 80
    present, absent = chain[:60], chain[60:80]
    others = pool[homes != home][:300]
    index.insert(np.concatenate([others, present]), np.arange(360))
    assert index.size == 360 and index.cells == int(n)  # no rebuild moved the chain
    query = np.concatenate([present[::-1], absent, others[:50]])
    want = [*range(359, 299, -1), *[-1] * 20, *range(50)]
    assert index.lookup(query).tolist() == want
    keys, _slots = index.items()
    assert len(keys) == 360 and np.array_equal(np.sort(keys), np.sort(np.concatenate([others, present])))


def test_a_fingerprint_that_matches_another_id_goes_on_probing() -> None:
    # With 31 slot bits no fingerprint is left: every live cell passed is a candidate whose key
    # must be compared, and a lookup goes on past each wrong one.
    ids = np.array([11, 22, 33, 44, 55], np.int64)
    keys = np.full(8, 99, np.int64)
    cells = np.full(16, index_kernels.EMPTY_SLOT, np.int32)
    slots = np.array([7, 0, 3, 5, 1], np.int64)
    keys[slots] = ids
    index_kernels.slot_place(cells, 31, ids, slots)
    assert index_kernels.slot_lookup(cells, keys, 31, ids).tolist() == slots.tolist()
    assert index_kernels.slot_lookup(cells, keys, 31, np.array([99, 0, 12], np.int64)).tolist() == [-1, -1, -1]
    where = index_kernels.slot_cells(cells, keys, 31, ids)
    assert sorted(cells[where].tolist()) == sorted(slots.tolist())
    # The same ids, many at once (the lookup's prefetching passes) and with a removed cell.
    many = np.tile(ids, 50)
    assert index_kernels.slot_lookup(cells, keys, 31, many).tolist() == np.tile(slots, 50).tolist()
    cells[where[2]] = index_kernels.REMOVED_SLOT
    assert index_kernels.slot_lookup(cells, keys, 31, ids).tolist() == [7, 0, -1, 5, 1]


def test_lookups_in_big_batches_match_one_at_a_time() -> None:
    rng = np.random.default_rng(5)
    ids = rng.choice(2**62, 20_000, replace=False).astype(np.int64)
    index = IdIndex(capacity=16)
    perm = rng.permutation(15_000)
    index.insert(ids[:15_000], perm)
    slot_of = dict(zip(ids[:15_000].tolist(), perm.tolist(), strict=False))
    query = np.concatenate([ids, ids[::-3]])  # present and absent, some twice
    rng.shuffle(query)
    batch = index.lookup(query)
    assert batch.tolist() == [slot_of.get(i, -1) for i in query.tolist()]
    assert batch.tolist()[::97] == [int(index.lookup(query[i : i + 1])[0]) for i in range(0, len(query), 97)]


def test_lock_free_readers_never_see_a_wrong_slot() -> None:
    index = IdIndex(capacity=16)
    ids = np.random.default_rng(1).choice(2**62, 40_000, replace=False).astype(np.int64)
    slot_of = {int(i): s for s, i in enumerate(ids)}
    stop = threading.Event()
    bad: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            got = index.lookup(ids[:2000])
            found = got >= 0
            if not np.array_equal(got[found], np.arange(2000)[found]):
                bad.append(1)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for start in range(0, len(ids), 500):
        index.insert(ids[start : start + 500], np.arange(start, start + 500))
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not bad
    assert index.lookup(ids[:2000]).tolist() == [slot_of[int(i)] for i in ids[:2000]]


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def test_any_int64_is_an_id_including_the_old_markers_and_the_range_edges() -> None:
    # -1 and -2 were the empty and removed markers of the key array: they are ids like any other.
    edges = np.array([INT64_MIN, INT64_MIN + 1, -2, -1, 0, 1, INT64_MAX - 1, INT64_MAX], dtype=np.int64)
    index = IdIndex(capacity=16)
    assert index.lookup(edges).tolist() == [-1] * len(edges)
    index.insert(edges, np.arange(len(edges)) + 100)
    assert index.lookup(edges).tolist() == list(range(100, 100 + len(edges)))
    assert index.lookup(edges[::-1]).tolist() == list(range(100 + len(edges) - 1, 99, -1))
    keys, slots = index.items()
    assert keys.tolist() == sorted(edges.tolist()) and slots.tolist() == list(range(100, 100 + len(edges)))
    # A fresh index has no id, 0 and the markers included.
    assert IdIndex(capacity=16).lookup(np.array([0, -1, -2], dtype=np.int64)).tolist() == [-1, -1, -1]


def test_negative_ids_survive_growth_and_removal() -> None:
    rng = np.random.default_rng(3)
    # Signed 64-bit hashes: about half negative, spread over the whole range.
    ids = np.unique(rng.integers(INT64_MIN, INT64_MAX, 30_000, dtype=np.int64, endpoint=True))
    ids = np.concatenate([ids, [INT64_MIN, -1, -2, INT64_MAX]])
    ids = np.unique(ids)
    rng.shuffle(ids)
    assert (ids < 0).sum() > 10_000
    index = IdIndex(capacity=16)  # grows many times
    for start in range(0, len(ids), 2500):
        index.insert(ids[start : start + 2500], np.arange(start, min(start + 2500, len(ids))))
    assert index.size == len(ids)
    assert np.array_equal(index.lookup(ids), np.arange(len(ids)))
    # Remove the negative half: their cells become tombstones that probes pass over.
    negative = ids < 0
    assert index.remove(ids[negative]) == int(negative.sum())
    assert index.remove(ids[negative]) == 0  # already gone
    assert (index.lookup(ids[negative]) == -1).all()
    assert np.array_equal(index.lookup(ids[~negative]), np.flatnonzero(~negative))
    # Insert them again (new slots), past the tombstones, until a rebuild drops those.
    again = ids[negative]
    index.insert(again, np.arange(len(again)) + len(ids))
    assert np.array_equal(index.lookup(again), np.arange(len(again)) + len(ids))
    assert index.size == len(ids)
    keys, _slots = index.items()
    assert np.all(np.diff(keys) > 0) and len(keys) == len(ids) and keys[0] == INT64_MIN and keys[-1] == INT64_MAX


def test_slots_below_zero_are_refused() -> None:
    import pytest

    index = IdIndex(capacity=16)
    with pytest.raises(ValueError, match="slots must be >= 0, got -1"):
        index.insert(np.array([5], dtype=np.int64), np.array([-1], dtype=np.int64))
    with pytest.raises(ValueError, match=r"slots must be below 2\*\*31 \(rows per table on one shard\), got 2147483648"):
        index.insert(np.array([5], dtype=np.int64), np.array([2**31], dtype=np.int64))
    with pytest.raises(ValueError, match="1 ids but 2 slots"):
        index.insert(np.array([5], dtype=np.int64), np.array([1, 2], dtype=np.int64))
    assert index.size == 0 and index.lookup(np.array([5], np.int64)).tolist() == [-1]


def test_lock_free_readers_never_see_a_wrong_slot_for_negative_ids() -> None:
    index = IdIndex(capacity=16)
    rng = np.random.default_rng(4)
    ids = -rng.choice(2**62, 40_000, replace=False).astype(np.int64) - 1  # all negative
    stop = threading.Event()
    bad: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            got = index.lookup(ids[:2000])
            found = got >= 0
            if not np.array_equal(got[found], np.arange(2000)[found]):
                bad.append(1)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for start in range(0, len(ids), 500):
        index.insert(ids[start : start + 500], np.arange(start, start + 500))
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not bad
    assert np.array_equal(index.lookup(ids[:2000]), np.arange(2000))
