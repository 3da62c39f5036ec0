import numpy as np
import pytest

from tether.protos.partition import dense_shard, mix64, shard_of_ids, split_ids


def test_balanced_and_deterministic() -> None:
    ids = np.arange(0, 200_000, 7, dtype=np.int64) * 1024  # shared low bits on purpose
    owner = shard_of_ids(ids, 4)
    counts = np.bincount(owner, minlength=4)
    assert counts.min() > 0.9 * len(ids) / 4
    assert np.array_equal(owner, shard_of_ids(ids.copy(), 4))


def test_owner_is_the_hash_modulo_the_shard_count() -> None:
    # The partition is a contract between workers, shards and checkpoints: powers of two take
    # a mask instead of a division, and must land every id where the modulo does.
    ids = np.random.default_rng(1).integers(0, 2**63 - 1, 4000, dtype=np.int64)
    h = mix64(ids.view(np.uint64))
    for n in (1, 2, 3, 4, 7, 8, 16, 33, 64):
        assert np.array_equal(shard_of_ids(ids, n), (h % np.uint64(n)).astype(np.int64)), n
    assert shard_of_ids(np.array([0, 1, 2**62], dtype=np.int64), 4).tolist() == [int(x) for x in mix64(np.array([0, 1, 2**62], dtype=np.uint64)) % np.uint64(4)]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 8, 9, 100])
def test_split_reassembles(num_shards: int) -> None:
    rng = np.random.default_rng(0)
    ids = rng.choice(2**62, 5000, replace=False).astype(np.int64)
    parts = split_ids(ids, num_shards)
    assert len(parts) == num_shards
    out = np.full_like(ids, -1)
    for s, (pos, part) in enumerate(parts):
        assert (shard_of_ids(part, num_shards) == s).all()
        assert (np.diff(pos) > 0).all()  # each shard's ids keep their order
        out[pos] = part
    assert np.array_equal(out, ids)


def test_dense_chunks_spread() -> None:
    owners = {dense_shard("w", i, 3) for i in range(3)}
    assert owners == {0, 1, 2}
    assert dense_shard("w", 0, 1) == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_shards must be >= 1, got 0"):
        shard_of_ids(np.array([1]), 0)
    with pytest.raises(ValueError, match="chunk index must be >= 0, got -1"):
        dense_shard("w", -1, 2)


def test_every_int64_has_an_owner_negative_ids_included() -> None:
    # Signed 64-bit hashes of strings are half negative: each is hashed as its 64 bits.
    edges = np.array([-(2**63), -(2**63) + 1, -2, -1, 0, 1, 2**63 - 2, 2**63 - 1], dtype=np.int64)
    hashes = np.random.default_rng(5).integers(-(2**63), 2**63 - 1, 4000, dtype=np.int64, endpoint=True)
    ids = np.concatenate([edges, hashes])
    for n in (1, 2, 3, 4, 7, 8, 33):
        owner = shard_of_ids(ids, n)
        assert owner.dtype == np.int64 and owner.min() >= 0 and owner.max() < n, n
        assert np.array_equal(owner, (mix64(ids.view(np.uint64)) % np.uint64(n)).astype(np.int64)), n
        out = np.zeros_like(ids)
        for s, (pos, part) in enumerate(split_ids(ids, n)):
            assert (shard_of_ids(part, n) == s).all()
            out[pos] = part
        assert np.array_equal(out, ids)
    # Negative and non-negative ids spread alike.
    counts = np.bincount(shard_of_ids(hashes[hashes < 0], 4), minlength=4)
    assert counts.min() > 0.8 * (hashes < 0).sum() / 4
