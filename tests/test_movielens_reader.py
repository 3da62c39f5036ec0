"""The two-tower example's rating reader takes the files GroupLens publishes (MovieLens 100K's
tab-separated ``u.data``, 1M's ``ratings.dat``, the later sets' ``ratings.csv`` with its header)
the same way: the same ratings, the same held-out lines, the same split between workers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "movielens_two_tower"))
from movielens import read_ratings

ROWS = [(196, 242, 3, 881250949), (186, 302, 3, 891717742), (22, 377, 1, 878887116), (244, 51, 2, 880606923),
        (166, 346, 1, 886397596), (298, 474, 4, 884182806), (115, 265, 2, 881171488)]


def _write(path: Path, sep: str, header: str = "") -> Path:
    path.write_text(header + "".join(sep.join(map(str, r)) + "\n" for r in ROWS))
    return path


@pytest.mark.parametrize("rank", [0, 1])
def test_every_format_reads_the_same_ratings(tmp_path: Path, rank: int) -> None:
    files = [_write(tmp_path / "u.data", "\t"), _write(tmp_path / "ratings.dat", "::"),
             _write(tmp_path / "ratings.csv", ",", "userId,movieId,rating,timestamp\n")]
    got = [read_ratings(f, rank, 2, held_out_every=3) for f in files]
    # Lines 3 and 6 held out; of the others, rank 0 trains on lines 1, 5, 7 and rank 1 on 2, 4.
    want_users = [196, 166, 115] if rank == 0 else [186, 244]
    for train, held in got:
        assert train["user"].tolist() == want_users
        assert held["user"].tolist() == [22, 298] and held["movie"].tolist() == [377, 474]
        assert held["rating"].tolist() == [1.0, 4.0] and held["rating"].dtype == torch.float32
    assert all(torch.equal(got[0][0][k], g[0][k]) for g in got[1:] for k in ("user", "movie", "rating"))


def test_a_line_of_another_shape_is_refused_with_its_place(tmp_path: Path) -> None:
    path = tmp_path / "ratings.txt"
    path.write_text("1\t2\t3\t4\n1 2 3 4\n")
    with pytest.raises(ValueError, match=r"ratings.txt:2: not a MovieLens rating line: '1 2 3 4'"):
        read_ratings(path)


def test_rating_batches_end_after_their_epochs_or_run_on() -> None:
    from movielens import rating_batches

    data = {"user": torch.arange(10), "movie": torch.arange(10), "rating": torch.ones(10)}
    two = list(rating_batches(data, 4, seed=1, epochs=2))
    assert len(two) == 4 and all(len(b["user"]) == 4 for b in two)  # 2 whole batches an epoch
    assert len(set(torch.cat([b["user"] for b in two[:2]]).tolist())) == 8  # one epoch: no id twice
    forever = rating_batches(data, 4, seed=1)
    assert [next(forever)["user"].tolist() for _ in range(4)] == [b["user"].tolist() for b in two]
    assert len(next(forever)["user"]) == 4  # no end
