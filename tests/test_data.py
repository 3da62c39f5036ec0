from pathlib import Path

import pytest
import torch

from tether.worker.data import SyntheticClickLog, SyntheticConfig, iterate, load_criteo, write_criteo_sample
from tether.worker.evaluation import constant_baseline_loss


def test_synthetic_is_deterministic_and_ranks_are_disjoint() -> None:
    gen = SyntheticClickLog(SyntheticConfig(seed=3))
    a = list(gen.batches(64, 3, rank=0, world_size=2))
    b = list(SyntheticClickLog(SyntheticConfig(seed=3)).batches(64, 3, rank=0, world_size=2))
    other = list(gen.batches(64, 3, rank=1, world_size=2))
    for x, y, z in zip(a, b, other):
        assert torch.equal(x.sparse, y.sparse) and torch.equal(x.labels, y.labels)
        assert not torch.equal(x.dense, z.dense)
    batch = a[0]
    assert batch.sparse.dtype == torch.int64 and batch.sparse.shape == (64, 8)
    assert (batch.sparse >= 0).all() and batch.sparse.max() > 2**40  # hashed-looking ids
    assert batch.dense.dtype == torch.float32 and batch.labels.dtype == torch.float32


def test_synthetic_has_zipf_ids_and_a_known_best_loss() -> None:
    gen = SyntheticClickLog(SyntheticConfig(vocab_size=10_000))
    train = next(gen.batches(20_000, 1))
    held_out = gen.eval_set(20_000)
    _, counts = torch.unique(train.sparse[:, 0], return_counts=True)
    top = counts.sort(descending=True).values
    assert top[0] > 20 * top[min(100, len(top) - 1)]  # a heavy head
    rate = float(train.labels.mean())
    assert 0.15 < rate < 0.45
    baseline = constant_baseline_loss(rate, held_out.labels)
    bayes = gen.bayes_log_loss(held_out)
    assert 0.5 < baseline < 0.69 and bayes < baseline - 0.1
    # The eval stream is not a training batch.
    assert not torch.equal(held_out.sparse[:100], train.sparse[:100])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 2, got 1"):
        SyntheticConfig(vocab_size=1)
    with pytest.raises(ValueError, match="rank must be in"):
        next(SyntheticClickLog().batches(4, 1, rank=2, world_size=2))


def test_criteo_round_trip_with_missing_values(tmp_path: Path) -> None:
    path = tmp_path / "c.tsv"
    write_criteo_sample(path, 500, seed=1, missing_rate=0.2)
    lines = path.read_text().splitlines()
    assert len(lines) == 500 and all(len(line.split("\t")) == 40 for line in lines)
    assert any("\t\t" in line for line in lines)  # some values are missing
    train, held_out = load_criteo(path, eval_fraction=0.1)
    assert train.labels.numel() == 450 and held_out.labels.numel() == 50
    assert train.dense.shape == (450, 13) and train.sparse.shape == (450, 26)
    assert (train.sparse >= 0).all() and (train.dense >= 0).all()
    # The same hex value in two fields maps to two ids; a missing value to one id per field.
    first = [line.split("\t") for line in lines[:450]]
    missing = [i for i, cols in enumerate(first) if cols[14] == ""]
    if len(missing) >= 2:
        assert train.sparse[missing[0], 0] == train.sparse[missing[1], 0]
    batches = list(iterate(train, 100, rank=1, world_size=2, epochs=2))
    assert sum(b.labels.numel() for b in batches) == 450  # 225 per epoch for rank 1


@pytest.mark.parametrize(
    "line, message",
    [
        ("1\t2\n", "expected 40 tab-separated columns, got 2"),
        ("x" + "\t" * 39 + "\n", "label must be 0 or 1"),
        ("1\tabc" + "\t" * 38 + "\n", "integer column 1 is not an integer"),
        ("0" + "\t" * 14 + "zz" + "\t" * 25 + "\n", "categorical column 1 is not hex"),
    ],
)
def test_criteo_malformed_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.tsv"
    good = "0" + "\t1" * 13 + "\tabc" * 26 + "\n"
    path.write_text(good + line)
    with pytest.raises(ValueError, match=f"bad.tsv:2: {message}"):
        load_criteo(path)
