"""What one worker's ``Trainer.fit`` returns and writes to ``<out>/worker-<i>.json``: a
``RunRecord``, and the points of its history.

Read it by attribute (``record.steps``, ``record.final_eval``); ``record.to_json()`` is the
file's JSON and ``RunRecord.load(path)`` reads a file back. ``record["steps"]`` still reads a
key of that JSON, for code written when the record was a dict.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["POINT_KEYS", "Point", "RunRecord"]


@dataclass(frozen=True)
class Point:
    """A history point's own fields (one per logged step, and the initial model's evaluation at
    step 0); in the JSON the held-out metrics sit beside them, under ``evaluate``'s names."""

    step: int
    samples: int  # this worker's, so far
    wall_s: float  # training time so far, evaluations left out
    time: float  # Unix time
    train_loss: float | None = None  # mean over the steps since the last point (None at step 0)
    staleness_mean: float | None = None  # clock staleness of the pushes acknowledged since the last point
    staleness_max: int | None = None

    def to_json(self, evals: Mapping[str, float] | None = None) -> dict[str, Any]:
        """The point as the history holds it: its fields that are set, then ``evals``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        out.update(evals or {})
        return out


# Keys of a history point that are not held-out metrics (``evaluate``'s must not reuse them).
POINT_KEYS = frozenset(f.name for f in fields(Point))


@dataclass
class RunRecord:
    """One worker's run: what it trained, how fast, how stale, and its history."""

    worker_index: int
    mode: str
    device: str
    steps: int  # steps this run took
    samples: int
    wall_s: float  # training time, evaluations left out
    samples_per_sec: float
    phase_seconds: dict[str, float]  # staleness_wait, pull_wait, compute, push: summed over the steps
    clock_staleness: list[int]  # each acknowledged push's
    update_staleness: list[int]  # each acknowledged push's
    start_time: float  # Unix time training started
    rejected_too_stale: int  # pushes the shards rejected as too stale (dropped)
    history: list[dict[str, Any]]  # ``Point.to_json`` of each point, held-out metrics included
    config: dict[str, Any]  # the TrainingConfig, auth token left out
    final_eval: dict[str, float] | None = None  # worker 0 when it evaluated: the last evaluation
    data_position: dict[str, Any] | None = None  # the stream's position after the run, when the data can say
    dense_digests: list[str] | None = None  # sync: a digest of the dense parameters after each step
    backend: str | None = None  # sync: the process group's backend
    # Per table: rows wanted, and rows and bytes pulled and pushed (wanted_rows, pulled_rows,
    # pushed_rows, pulled_bytes, pushed_bytes; after the row cache, when one is on)
    traffic: dict[str, dict[str, int]] | None = None
    # With a row cache: the seconds its own calls took over the run (its bookkeeping, within the
    # pull_wait and push phases; ``TrafficMeter.cache_seconds``)
    cache_seconds: float | None = None

    def bytes_per_sample(self) -> float | None:
        """Bytes of embedding rows pulled and pushed per sample of this run (None: not counted)."""
        if self.traffic is None or not self.samples:
            return None
        return sum(v["pulled_bytes"] + v["pushed_bytes"] for v in self.traffic.values()) / self.samples

    def to_json(self) -> dict[str, Any]:
        """The record as ``worker-<i>.json`` holds it (unset optional fields left out)."""
        return {f.name: getattr(self, f.name) for f in _FIELDS if f.name in _REQUIRED or getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunRecord:
        """A record from ``to_json``'s form.

        Raises:
            ValueError: a field is missing, or a key is not a record's.
        """
        missing = sorted(_REQUIRED - set(data))
        unknown = sorted(set(data) - {f.name for f in _FIELDS})
        if missing or unknown:
            raise ValueError(f"not a worker record: missing {missing}, unknown {unknown}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> RunRecord:
        """Read a ``worker-<i>.json``.

        Raises:
            OSError: the file cannot be read; ValueError: it is not a worker record.
        """
        return cls.from_json(json.loads(Path(path).read_text()))

    def write(self, folder: str | Path) -> Path:
        """Write ``folder/worker-<worker_index>.json`` (the folder made if missing); its path."""
        path = Path(folder) / f"worker-{self.worker_index}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2))
        return path

    # -- the JSON's keys, for code written when the record was a dict -------------------------------

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in _NAMES and (key in _REQUIRED or getattr(self, key) is not None)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default


_FIELDS = fields(RunRecord)
_NAMES = frozenset(f.name for f in _FIELDS)
_REQUIRED = frozenset(f.name for f in _FIELDS if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
