"""Straggler models for experiments: how much slower a worker computes at a given step.

A spec is parsed from a short string (``--straggler``):

- ``none``: nobody is slowed.
- ``persistent:K[:W]``: worker ``W`` (default: the last one) computes ``K`` times slower at every step.
- ``transient:P:K``: at each step, each worker is independently ``K`` times slower with
  probability ``P`` (the transient stragglers of Ho et al. 2013, which a bound S > 0 absorbs).
- ``pareto:A[:CAP]``: at each step, each worker's factor is drawn from a Pareto distribution
  with shape ``A`` and minimum 1 (heavy-tailed; mean ``A / (A - 1)`` for ``A > 1``), capped at
  ``CAP`` (default 50).

``delay_factor`` is a pure function of (spec, seed, worker, step): every consistency mode run
with the same seed sees the same delays at the same worker and step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["KINDS", "StragglerSpec", "delay_factor", "parse_straggler"]

KINDS = ("none", "persistent", "transient", "pareto")
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class StragglerSpec:
    """Who is slowed, when and by how much (see the module docstring)."""

    kind: str = "none"
    # persistent and transient: the slowdown factor (>= 1).
    factor: float = 1.0
    # transient: the probability that a worker is delayed at a step.
    probability: float = 0.0
    # pareto: the shape A (> 0) and the largest factor.
    shape: float = 0.0
    cap: float = 50.0
    # persistent: the slow worker (None: the last worker of the job).
    worker: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"straggler kind must be one of {KINDS}, got {self.kind!r}")
        if not 1.0 <= self.factor < math.inf:
            raise ValueError(f"straggler factor must be a finite number >= 1, got {self.factor!r}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"straggler probability must be in [0, 1], got {self.probability!r}")
        if self.kind == "pareto" and not 0.0 < self.shape < math.inf:
            raise ValueError(f"pareto shape must be a finite number > 0, got {self.shape!r}")
        if not 1.0 <= self.cap < math.inf:
            raise ValueError(f"straggler cap must be a finite number >= 1, got {self.cap!r}")
        if self.worker is not None and self.worker < 0:
            raise ValueError(f"straggler worker must be >= 0, got {self.worker!r}")

    @property
    def active(self) -> bool:
        """Whether anyone is ever slowed."""
        if self.kind == "persistent":
            return self.factor > 1.0
        if self.kind == "transient":
            return self.factor > 1.0 and self.probability > 0.0
        return self.kind == "pareto"

    def __str__(self) -> str:
        if self.kind == "persistent":
            return f"persistent:{self.factor:g}" + ("" if self.worker is None else f":{self.worker}")
        if self.kind == "transient":
            return f"transient:{self.probability:g}:{self.factor:g}"
        if self.kind == "pareto":
            return f"pareto:{self.shape:g}" + ("" if self.cap == 50.0 else f":{self.cap:g}")
        return "none"


def parse_straggler(text: str | float | StragglerSpec | None) -> StragglerSpec:
    """``StragglerSpec`` of ``persistent:K[:W]``, ``transient:P:K``, ``pareto:A[:CAP]`` or
    ``none``; a bare number ``K`` means ``persistent:K`` (the older ``--straggler K``).

    Raises:
        ValueError: a malformed spec, named.
    """
    if isinstance(text, StragglerSpec):
        return text
    if text is None or text == "":
        return StragglerSpec()
    if isinstance(text, (int, float)):
        return StragglerSpec("persistent", factor=float(text)) if text != 1 else StragglerSpec()
    raw = str(text).strip()
    kind, _, rest = raw.partition(":")
    parts = rest.split(":") if rest else []
    try:
        if kind not in KINDS:
            factor = float(raw)
            return StragglerSpec("persistent", factor=factor) if factor != 1 else StragglerSpec()
        if kind == "none" and not parts:
            return StragglerSpec()
        if kind == "persistent" and len(parts) in (1, 2):
            return StragglerSpec("persistent", factor=float(parts[0]), worker=int(parts[1]) if len(parts) == 2 else None)
        if kind == "transient" and len(parts) == 2:
            return StragglerSpec("transient", probability=float(parts[0]), factor=float(parts[1]))
        if kind == "pareto" and len(parts) in (1, 2):
            return StragglerSpec("pareto", shape=float(parts[0]), cap=float(parts[1]) if len(parts) == 2 else 50.0)
    except ValueError as exc:
        raise ValueError(f"--straggler {raw!r}: {exc}") from None
    raise ValueError(f"--straggler {raw!r}: expected persistent:K[:WORKER], transient:P:K, pareto:A[:CAP] or none")


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _uniform(seed: int, worker: int, step: int) -> float:
    """A uniform number in [0, 1) from (seed, worker, step) alone."""
    h = _mix(_mix(_mix(seed & _MASK) ^ (worker & _MASK)) ^ (step & _MASK))
    return (h >> 11) / float(1 << 53)


def delay_factor(spec: StragglerSpec, seed: int, worker: int, step: int, num_workers: int) -> float:
    """How many times slower ``worker`` computes at ``step`` (1: full speed).

    Args:
        spec: the straggler model.
        seed: the job's seed (the same seed gives the same delays in every mode).
        worker: this worker's index.
        step: the step (0-based).
        num_workers: workers in the job (a persistent straggler is the last by default).
    """
    if spec.kind == "persistent":
        slow = num_workers - 1 if spec.worker is None else spec.worker
        return spec.factor if worker == slow else 1.0
    if spec.kind == "transient":
        return spec.factor if _uniform(seed, worker, step) < spec.probability else 1.0
    if spec.kind == "pareto":
        u = _uniform(seed, worker, step)
        return min((1.0 - u) ** (-1.0 / spec.shape), spec.cap)
    return 1.0
