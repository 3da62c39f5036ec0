import itertools
import math
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tether.worker.data.criteo import CriteoStream, criteo_eval_set, criteo_files, write_criteo_sample
from tether.worker.data.synthetic import Batch, DataError, SyntheticClickLog, SyntheticConfig, SyntheticStream, in_background
from tether.worker.training.evaluation import constant_baseline_loss


def test_synthetic_is_deterministic_and_ranks_are_disjoint() -> None:
    gen = SyntheticClickLog(SyntheticConfig(seed=3))
    a = list(gen.batches(64, 3, rank=0, world_size=2))
    b = list(SyntheticClickLog(SyntheticConfig(seed=3)).batches(64, 3, rank=0, world_size=2))
    other = list(gen.batches(64, 3, rank=1, world_size=2))
    for x, y, z in zip(a, b, other, strict=False):
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
    (train,) = list(CriteoStream(path, 1000, holdout_every=10))
    held_out = criteo_eval_set(path, 1000, holdout_every=10)
    assert train.labels.numel() == 450 and held_out.labels.numel() == 50
    assert train.dense.shape == (450, 13) and train.sparse.shape == (450, 26)
    assert (train.sparse >= 0).all() and (train.dense >= 0).all()
    # The same hex value in two fields maps to two ids; a missing value to one id per field.
    first = [cols for i, cols in enumerate(line.split("\t") for line in lines) if i % 10 != 9]
    missing = [i for i, cols in enumerate(first) if cols[14] == ""]
    if len(missing) >= 2:
        assert train.sparse[missing[0], 0] == train.sparse[missing[1], 0]
    batches = list(CriteoStream(path, 100, rank=1, world_size=2, epochs=2, holdout_every=10))
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
    with pytest.raises(DataError, match=f"bad.tsv:2: {message}"):
        list(CriteoStream(path, 10))


# -- synthetic: streams, ranks, id distribution, calibration -----------------------------------


def test_ranks_interleave_the_single_worker_stream_and_start_resumes_it() -> None:
    gen = SyntheticClickLog(SyntheticConfig(seed=5))
    single = list(gen.batches(32, 6))
    r0 = list(gen.batches(32, 3, rank=0, world_size=2))
    r1 = list(gen.batches(32, 3, rank=1, world_size=2))
    # Batch i of rank r is batch i * world_size + r of the one-worker stream: disjoint by
    # construction, and together they are exactly the one-worker data.
    for i in range(3):
        assert torch.equal(r0[i].dense, single[2 * i].dense) and torch.equal(r1[i].sparse, single[2 * i + 1].sparse)
    resumed = list(gen.batches(32, 2, start=4))
    assert torch.equal(resumed[0].labels, single[4].labels) and torch.equal(resumed[1].dense, single[5].dense)
    other_seed = next(SyntheticClickLog(SyntheticConfig(seed=6)).batches(32, 1))
    assert not torch.equal(other_seed.sparse, single[0].sparse)


def test_a_synthetic_stream_resumed_from_its_position_reads_on_where_it_stopped() -> None:
    """A restarted worker given its saved position neither replays its share nor skips any of it."""
    gen = SyntheticClickLog(SyntheticConfig(seed=5, vocab_size=1000))
    whole = list(SyntheticStream(gen, 32, 7, rank=1, world_size=3, order=2))
    first = SyntheticStream(gen, 32, 7, rank=1, world_size=3, order=2)
    assert len(first) == 7 and first.state_dict() == {"synthetic_batch": 0, "seed": 5, "batch_size": 32, "rank": 1, "world_size": 3, "order": 2}
    saved = first.state_dict(batches=3)
    rest = list(SyntheticStream(gen, 32, 4, rank=1, world_size=3, order=2, resume=saved))
    assert len(rest) == 4
    for a, b in zip(whole[3:], rest, strict=True):
        assert torch.equal(a.sparse, b.sparse) and torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert SyntheticStream(gen, 32, 4, rank=1, world_size=3, order=2, resume=saved).state_dict(batches=2)["synthetic_batch"] == 5
    with pytest.raises(DataError, match=r"another setup .*rank 1, now 0"):
        SyntheticStream(gen, 32, 4, rank=0, world_size=3, order=2, resume=saved)
    with pytest.raises(DataError, match="not a synthetic stream's position"):
        SyntheticStream(gen, 32, 4, rank=1, world_size=3, order=2, resume={"skip": 3})


def test_eval_set_shares_no_sample_with_training() -> None:
    gen = SyntheticClickLog(SyntheticConfig(seed=1))
    held_out = gen.eval_set(2000)
    train_rows = {tuple(r) for b in gen.batches(500, 8, rank=1, world_size=3) for r in b.dense.tolist()}
    assert not train_rows & {tuple(r) for r in held_out.dense.tolist()}
    assert torch.equal(held_out.sparse, gen.eval_set(2000).sparse)  # and it is reproducible


def test_ids_follow_zipf_and_fields_do_not_share_ids() -> None:
    c = SyntheticConfig(vocab_size=100_000, zipf_exponent=1.1)
    batch = next(SyntheticClickLog(c).batches(50_000, 1))
    col = batch.sparse[:, 0]
    _, counts = torch.unique(col, return_counts=True)
    top = counts.sort(descending=True).values.double() / col.numel()
    harmonic = float(np.sum(np.arange(1, c.vocab_size + 1, dtype=np.float64) ** -c.zipf_exponent))
    # Rank-1 probability is 1/H = 0.0896 here; ranks 1 and 2 differ by 2**1.1.
    assert top[0].item() == pytest.approx(1 / harmonic, rel=0.05)
    assert (top[0] / top[1]).item() == pytest.approx(2**1.1, rel=0.1)
    field_sets = [set(batch.sparse[:, j].tolist()) for j in range(c.num_sparse)]
    assert all(not field_sets[0] & s for s in field_sets[1:])
    assert int(batch.sparse.max()) < 2**62 and int(batch.sparse.min()) >= 0


def test_default_generator_numbers() -> None:
    gen = SyntheticClickLog()
    held_out = gen.eval_set(20_000)
    train = next(gen.batches(20_000, 1))
    rate = float(train.labels.mean())
    assert 0.25 < rate < 0.31
    # Labels are Bernoulli(true p): the mean true probability matches the click rate.
    assert float(gen.true_probabilities(held_out).mean()) == pytest.approx(float(held_out.labels.mean()), abs=0.01)
    baseline = constant_baseline_loss(rate, held_out.labels)
    bayes = gen.bayes_log_loss(held_out)
    assert 0.58 < baseline < 0.62 and 0.38 < bayes < 0.42
    p = gen.true_probabilities(held_out)
    y = held_out.labels.double()
    assert bayes == pytest.approx(float(-(y * p.log() + (1 - y) * (1 - p).log()).mean()), rel=1e-9)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_dense": 0}, "num_dense >= 1"),
        ({"zipf_exponent": 0.0}, "zipf_exponent must be > 0, got 0.0"),
        ({"id_scale": -1.0}, "id_scale must be >= 0, got -1.0"),
        ({"interaction_dim": 0}, "interaction_dim must be >= 1, got 0"),
    ],
)
def test_synthetic_config_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyntheticConfig(**kwargs)


def test_stream_arguments_are_checked() -> None:
    gen = SyntheticClickLog()
    with pytest.raises(ValueError, match="start must be >= 0, got -1"):
        next(gen.batches(4, 1, start=-1))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(gen.batches(0, 1))
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        gen.eval_set(0)


# -- Criteo ------------------------------------------------------------------------------------


def _line(label: str, ints: list[str], cats: list[str]) -> str:
    return "\t".join([label, *ints, *cats]) + "\n"


def _read_all(path: Path, num_dense: int = 13, num_sparse: int = 26) -> Batch:
    parts = list(CriteoStream(path, 1 << 16, num_dense=num_dense, num_sparse=num_sparse))
    return Batch(*(torch.cat(ts) for ts in zip(*parts, strict=False)))


def test_criteo_values_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "hand.tsv"
    path.write_text(
        _line("1", ["0", "3", "-2", "", "1000"], ["1f", "", "1f"])
        + _line("0", ["", "", "", "7", ""], ["1F", "", ""]).replace("\n", "\r\n")  # a CRLF line
    )
    data = _read_all(path, num_dense=5, num_sparse=3)
    assert data.labels.tolist() == [1.0, 0.0]
    want = torch.tensor([[0, math.log1p(3), 0, 0, math.log1p(1000)], [0, 0, 0, math.log1p(7), 0]], dtype=torch.float32)
    assert torch.allclose(data.dense, want)
    ids = data.sparse
    assert ids.dtype == torch.int64 and (ids >= 0).all()
    assert ids[0, 0] == ids[1, 0]  # same value, same field (hex is case-insensitive)
    assert ids[0, 0] != ids[0, 2]  # same value, other field
    assert ids[0, 1] == ids[1, 1] and ids[1, 1] != ids[1, 2]  # missing: one reserved id per field ...
    again = _read_all(path, num_dense=5, num_sparse=3)
    assert torch.equal(again.sparse, ids)  # ... and ids are a pure function of (field, value)


@pytest.mark.parametrize("bad", ["0x1f", "-1f", "1_f", " 1f", "1" * 17, "g"])
def test_criteo_rejects_loose_hex(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "hex.tsv"
    path.write_text(_line("0", ["1"], ["a", "b"]) * 2 + _line("1", ["1"], ["a", bad]))
    with pytest.raises(ValueError, match=r"hex.tsv:3: categorical column 2 is not hex \(1-16 digits\): " + re.escape(repr(bad))):
        _read_all(path, num_dense=1, num_sparse=2)


def test_criteo_accepts_16_digit_hex_and_huge_counts(tmp_path: Path) -> None:
    path = tmp_path / "big.tsv"
    path.write_text(_line("1", ["9" * 30], ["ffffffffffffffff", "8000000000000000"]))
    data = _read_all(path, num_dense=1, num_sparse=2)
    assert torch.isfinite(data.dense).all() and float(data.dense[0, 0]) == pytest.approx(math.log1p(2**62))
    assert (data.sparse >= 0).all()


def test_criteo_batches_split_lines_between_ranks(tmp_path: Path) -> None:
    path = tmp_path / "c.tsv"
    write_criteo_sample(path, 103, seed=4)
    everything = _read_all(path)
    per_rank = [list(CriteoStream(path, 20, rank=r, world_size=3)) for r in range(3)]
    assert [[b.labels.numel() for b in bs] for bs in per_rank] == [[20, 15], [20, 14], [20, 14]]
    for r, bs in enumerate(per_rank):
        mine = torch.cat([b.sparse for b in bs])
        assert torch.equal(mine, everything.sparse[r::3])  # line i goes to rank i % 3
    limited = list(itertools.islice(CriteoStream(path, 10, rank=1, world_size=2), 2))
    assert len(limited) == 2 and torch.equal(limited[1].dense, everything.dense[1::2][10:20])
    with pytest.raises(ValueError, match="rank must be in"):
        CriteoStream(path, 10, rank=3, world_size=3)


def test_criteo_empty_and_missing_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty.tsv"):
        list(CriteoStream(empty, 10))
    with pytest.raises(DataError, match=r"nope.tsv: no such file"):
        criteo_files(tmp_path / "nope.tsv")


def test_sample_writer_checks_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_lines must be >= 1, got 0"):
        write_criteo_sample(tmp_path / "x.tsv", 0)
    with pytest.raises(ValueError, match="missing_rate must be in"):
        write_criteo_sample(tmp_path / "x.tsv", 5, missing_rate=1.5)


def test_in_background_keeps_order_and_matches_the_stream() -> None:
    gen = SyntheticClickLog(SyntheticConfig())
    direct = list(gen.batches(32, 6))
    ahead = list(in_background(gen.batches(32, 6), depth=2))
    assert len(ahead) == 6
    for a, b in zip(ahead, direct, strict=False):
        assert torch.equal(a.sparse, b.sparse) and torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)


def test_in_background_raises_the_producers_error_and_stops_when_closed() -> None:
    def failing():
        yield from SyntheticClickLog(SyntheticConfig()).batches(8, 2)
        raise RuntimeError("disk gone")

    stream = in_background(failing())
    assert len([next(stream), next(stream)]) == 2
    with pytest.raises(RuntimeError, match="disk gone"):
        next(stream)

    produced = []

    def endless():
        gen = SyntheticClickLog(SyntheticConfig())
        i = 0
        while True:
            produced.append(i)
            yield next(gen.batches(8, 1, start=i))
            i += 1

    stream = in_background(endless(), depth=2)
    next(stream)
    stream.close()
    time.sleep(0.5)
    count = len(produced)
    time.sleep(0.3)
    assert len(produced) == count <= 5  # stopped: at most depth queued, one waiting, one handed out


def test_in_background_producer_ends_when_closed_with_a_full_queue_at_the_end() -> None:
    # Two batches, room for one: the consumer takes the first, the second fills the queue, and
    # the producer, at the end of its stream, waits to hand over the end marker. Closing the
    # stream must end that wait (the thread used to stay blocked forever).
    before = set(threading.enumerate())
    stream = in_background(SyntheticClickLog(SyntheticConfig()).batches(8, 2), depth=1)
    next(stream)
    (producer,) = [t for t in threading.enumerate() if t not in before and t.name == "tether-data"]
    time.sleep(0.3)  # the producer reaches the end of its stream
    assert producer.is_alive()
    stream.close()
    producer.join(timeout=5.0)
    assert not producer.is_alive()
