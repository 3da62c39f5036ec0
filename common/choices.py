"""The names and defaults the job's flags declare (``TrainingConfig``), torch-free, so that the
launcher's help, its flag parsing and its usage errors run without importing torch (about 2.5
CPU-seconds per command).

Each is a copy of what the module that uses it declares beside torch, and
``tests/test_cli_torch_free.py`` asserts that the copies agree: a change to one of those
declarations fails that test until it is made here too (or the module imports it from here)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CACHE_POLICIES", "CLIENT_CALL_DEADLINE_S", "CLIENT_STALENESS_AWARE", "CLIENT_TIMEOUT_S", "CLIENT_TRANSPORT", "CLIENT_WIRE_DTYPE",
    "INIT_SCALE", "OPTIMIZER", "OPTIMIZERS", "OPTIMIZER_LR", "TRANSPORTS", "WIRE_DTYPES", "or_names",
]

# tether.protos.optimizers: OPTIMIZERS (the update rules' names, in that order), and
# OptimizerConfig's default rule and learning rate.
OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "adam", "rowwise_adagrad", "ftrl")
OPTIMIZER = "adagrad"
OPTIMIZER_LR = 0.05
# tether.protos.specs: TableConfig's default init_scale.
INIT_SCALE = 0.05
# tether.protos.codec: the names of WIRE_DTYPES, in order.
WIRE_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
# tether.protos.framing: TRANSPORTS.
TRANSPORTS: tuple[str, ...] = ("auto", "tcp", "grpc")
# tether.worker.cache_parts: POLICIES (the row cache's eviction policies).
CACHE_POLICIES: tuple[str, ...] = ("lru", "lfu")
# tether.worker.client_config: ClientConfig's defaults that the job's flags share (wire_dtype by
# its WIRE_DTYPES name).
CLIENT_TIMEOUT_S = 30.0
CLIENT_CALL_DEADLINE_S = 60.0
CLIENT_STALENESS_AWARE = False
CLIENT_TRANSPORT = "auto"
CLIENT_WIRE_DTYPE = "float32"


def or_names(names: Iterable[str]) -> str:
    """``a, b or c``."""
    *first, last = list(names)
    return f"{', '.join(first)} or {last}"
