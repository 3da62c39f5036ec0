"""The worker's defaults and choices that the job's flags (``TrainingConfig``) share with the
client and the row cache, declared here once and without torch, so that the launcher's help, its
flag parsing and its usage errors run without importing torch: ``ClientConfig``'s defaults
(``tether.worker.client.config`` takes them from here) and the row cache's eviction policies.

The contract's names and defaults (the update rules', the wire dtypes', the transports', a
table's ``init_scale``) are declared in ``tether.protos.names``, as torch-free."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CACHE_ADMISSIONS", "CACHE_POLICIES",
    "CLIENT_CALL_DEADLINE_S", "CLIENT_STALENESS_AWARE", "CLIENT_TIMEOUT_S", "CLIENT_TRANSPORT", "CLIENT_WIRE_DTYPE",
    "or_names",
]

# The row cache's eviction policies (RowCacheConfig.policy, --cache-policy; tether.worker.cache.parts).
CACHE_POLICIES: tuple[str, ...] = ("lru", "lfu")
# Which missed rows the row cache keeps (RowCacheConfig.admission, --cache-admission), the default
# first: those missed again within the bounds (a doorkeeper; the others pass through as with no
# cache), or all (bench/RESULTS.md, "Row cache admission as the default").
CACHE_ADMISSIONS: tuple[str, ...] = ("recurring", "all")
# ClientConfig's defaults that the job's flags share (wire_dtype by its tether.protos.names name).
CLIENT_TIMEOUT_S = 30.0
CLIENT_CALL_DEADLINE_S = 60.0
CLIENT_STALENESS_AWARE = False
CLIENT_TRANSPORT = "auto"
CLIENT_WIRE_DTYPE = "float32"


def or_names(names: Iterable[str]) -> str:
    """``a, b or c``."""
    *first, last = list(names)
    return f"{', '.join(first)} or {last}"
