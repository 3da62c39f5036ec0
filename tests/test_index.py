import threading

import numpy as np

from tether.protos.partition import mix64
from tether.server.index import IdIndex


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
    assert index.nbytes <= 16 * 6 * len(ids)  # load factor in (1/6, 1/3]


def test_colliding_ids_in_one_batch() -> None:
    index = IdIndex(capacity=16)
    ids = np.arange(7, dtype=np.int64)  # fills most of a 16-cell table: probes collide
    index.insert(ids, ids * 10)
    assert index.lookup(ids).tolist() == (ids * 10).tolist()


def test_long_probe_chains() -> None:
    # 60 ids that all hash to the same home cell (splitmix64, as the index hashes): one chain
    # of 60 cells that inserts, lookups and misses walk to its end.
    index = IdIndex(capacity=4096)
    mask = 4096 - 1
    rng = np.random.default_rng(2)
    pool = rng.choice(2**62, 400_000, replace=False).astype(np.int64)
    homes = (mix64(pool.view(np.uint64)) & np.uint64(mask)).astype(np.int64)
    home = np.bincount(homes).argmax()
    chain = pool[homes == home]
    assert len(chain) >= 80
    present, absent = chain[:60], chain[60:80]
    others = pool[homes != home][:300]
    index.insert(np.concatenate([others, present]), np.arange(360))
    assert index.size == 360
    query = np.concatenate([present[::-1], absent, others[:50]])
    want = [*range(359, 299, -1), *[-1] * 20, *range(50)]
    assert index.lookup(query).tolist() == want
    keys, slots = index.items()
    assert len(keys) == 360 and np.array_equal(np.sort(keys), np.sort(np.concatenate([others, present])))


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
