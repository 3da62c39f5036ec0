"""MovieLens-format rating files: a generator (nothing is downloaded) and a reader.

The generator writes MovieLens 1M's ``ratings.dat`` format: one
``UserID::MovieID::Rating::Timestamp`` per line, ratings 1..5, drawn from a hidden low-rank model
(user and movie factors plus biases), so a model that learns the factors beats the mean rating.
The reader also takes the real files as GroupLens publishes them: MovieLens 100K's ``u.data``
(tab-separated), 1M's and 10M's ``ratings.dat`` (``::``) and the later sets' ``ratings.csv``
(comma-separated, a ``userId,movieId,rating,timestamp`` header first).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

__all__ = ["rating_batches", "read_ratings", "write_ratings"]


def write_ratings(path: str | Path, num_ratings: int, num_users: int = 2000, num_movies: int = 1500, rank: int = 4, seed: int = 0) -> None:
    """Write ``num_ratings`` lines of synthetic ratings to ``path``."""
    rng = np.random.default_rng(seed)
    users = rng.normal(0, 0.6, (num_users, rank))
    movies = rng.normal(0, 0.6, (num_movies, rank))
    user_bias, movie_bias = rng.normal(0, 0.3, num_users), rng.normal(0, 0.4, num_movies)
    # Popular movies are rated more often (Zipf-like), as in the real data.
    popularity = 1.0 / np.arange(1, num_movies + 1) ** 0.8
    u = rng.integers(0, num_users, num_ratings)
    m = rng.choice(num_movies, num_ratings, p=popularity / popularity.sum())
    score = 3.6 + user_bias[u] + movie_bias[m] + (users[u] * movies[m]).sum(1) + rng.normal(0, 0.4, num_ratings)
    rating = np.clip(np.rint(score), 1, 5).astype(int)
    stamps = 978_300_000 + rng.integers(0, 10_000_000, num_ratings)
    with open(path, "w") as f:
        for row in zip(u + 1, m + 1, rating, stamps, strict=False):
            f.write("::".join(str(int(x)) for x in row) + "\n")


def read_ratings(
    path: str | Path, rank: int = 0, world_size: int = 1, held_out_every: int = 10
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This worker's training ratings (line i with i % world_size == rank) and the held-out
    set (every ``held_out_every``-th line, the same on every worker, never trained on), from
    any of the formats in the module docstring (a CSV file's header line is not a rating and
    is not counted).

    Raises:
        ValueError: a line that is not ``user<sep>movie<sep>rating[<sep>timestamp]`` with one of
            the separators ``::``, tab or comma (file and line named).
    """
    train: list[tuple[int, int, float]] = []
    held: list[tuple[int, int, float]] = []
    with open(path) as f:
        lineno = 0
        for fileno, line in enumerate(f, 1):
            text = line.strip()
            sep = "::" if "::" in text else "\t" if "\t" in text else ","
            parts = text.split(sep)
            if fileno == 1 and sep == "," and parts[:2] == ["userId", "movieId"]:
                continue  # ratings.csv's header
            lineno += 1
            try:
                user, movie, rating = int(parts[0]), int(parts[1]), float(parts[2])
            except (IndexError, ValueError):
                raise ValueError(f"{path}:{fileno}: not a MovieLens rating line: {text[:60]!r}") from None
            if lineno % held_out_every == 0:
                held.append((user, movie, rating))
            elif (lineno - 1) % world_size == rank:
                train.append((user, movie, rating))
    return _tensors(train), _tensors(held)


def _tensors(rows: list[tuple[int, int, float]]) -> dict[str, torch.Tensor]:
    a = np.array(rows, dtype=np.float64).reshape(-1, 3)
    return {"user": torch.from_numpy(a[:, 0].astype(np.int64)), "movie": torch.from_numpy(a[:, 1].astype(np.int64)),
            "rating": torch.from_numpy(a[:, 2].astype(np.float32))}


def rating_batches(data: dict[str, torch.Tensor], batch_size: int, seed: int = 0,
                   epochs: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Shuffled batches of ``data`` (whole batches only), ``epochs`` passes over it (None: epoch
    after epoch, until the trainer stops at its step count)."""
    g = torch.Generator().manual_seed(seed)
    n = len(data["rating"])
    epoch = 0
    while epochs is None or epoch < epochs:
        order = torch.randperm(n, generator=g)
        for start in range(0, n - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield {k: v[idx] for k, v in data.items()}
        epoch += 1
