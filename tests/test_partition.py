import numpy as np
import pytest

from tether.protos.partition import dense_shard, shard_of_ids, split_ids


def test_balanced_and_deterministic() -> None:
    ids = np.arange(0, 200_000, 7, dtype=np.int64) * 1024  # shared low bits on purpose
    owner = shard_of_ids(ids, 4)
    counts = np.bincount(owner, minlength=4)
    assert counts.min() > 0.9 * len(ids) / 4
    assert np.array_equal(owner, shard_of_ids(ids.copy(), 4))


def test_split_reassembles() -> None:
    rng = np.random.default_rng(0)
    ids = rng.choice(2**62, 5000, replace=False).astype(np.int64)
    parts = split_ids(ids, 3)
    out = np.empty_like(ids)
    for s, (pos, part) in enumerate(parts):
        assert (shard_of_ids(part, 3) == s).all()
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
