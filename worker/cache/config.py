"""The worker row cache's configuration (``RowCacheConfig``), apart from the cache's code: checking
a job's flags imports neither torch nor the compiled passes (a refused ``tether launch`` answers in
a fraction of a second)."""

from __future__ import annotations

from dataclasses import dataclass

from tether.common.choices import CACHE_ADMISSIONS, CACHE_POLICIES

__all__ = ["POLICIES", "RowCacheConfig"]

POLICIES = CACHE_POLICIES  # eviction policies, declared once in tether.common.choices


@dataclass(frozen=True)
class RowCacheConfig:
    """``rows``: rows cached per table (0: no cache); ``bound``: read bound R in this worker's
    clocks (0: every pull reads the shards); ``write_bound``: W, clocks a row's gradients may be
    held before they are pushed (None: the same as ``bound``); ``policy``: eviction, lru or lfu;
    ``on_device``: where the cached rows live (``tether.worker.cache.device``): None, on the
    training device when it is a GPU (else in host memory); True, on the training device
    whatever it is (the CPU too: how CI tests the device cache); False, in host memory.
    ``hot``: a held row with K gradients is pushed with this step (0: off). ``admission``: which
    missed rows are cached: ``all``, or ``recurring``, those missed again within max(R, W) clocks
    (the others are pulled and pushed in their step, as with no cache)."""

    rows: int = 0
    bound: int = 0
    write_bound: int | None = None
    policy: str = CACHE_POLICIES[0]
    on_device: bool | None = None
    hot: int = 0
    admission: str = CACHE_ADMISSIONS[0]

    def __post_init__(self) -> None:
        for name in ("rows", "bound"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"cache_{name} (--cache-{name}) must be an int >= 0, got {value!r}")
        if self.write_bound is not None and (not isinstance(self.write_bound, int) or self.write_bound < 0):
            raise ValueError(f"cache_write_bound (--cache-write-bound) must be empty or an int >= 0, got {self.write_bound!r}")
        if isinstance(self.hot, bool) or not isinstance(self.hot, int) or self.hot < 0:
            raise ValueError(f"cache_hot (--cache-hot) must be an int >= 0, got {self.hot!r}")
        if self.admission not in CACHE_ADMISSIONS:
            raise ValueError(f"cache_admission (--cache-admission) must be one of {', '.join(CACHE_ADMISSIONS)}, got {self.admission!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"cache_policy (--cache-policy) must be one of {', '.join(POLICIES)}, got {self.policy!r}")

    @property
    def active(self) -> bool:
        return self.rows > 0

    @property
    def writes(self) -> int:
        return self.bound if self.write_bound is None else self.write_bound
