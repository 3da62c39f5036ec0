"""tether: an asynchronous parameter server for PyTorch training.

The names here are tether's stable surface, what a training script needs; every other module is
internal and may move between releases (see docs/your-model.md)::

    import tether

    config = tether.TrainingConfig.from_env()
    with tether.Trainer(model, config, loss=..., sparse=...) as trainer:
        record = trainer.fit(batches)

Each name is imported when it is first used: ``import tether`` alone loads neither torch nor grpc,
so the ``tether`` command starts in a fraction of a second (its help and usage errors need neither).
Old import paths of moved modules still work until tether 0.2, with a ``DeprecationWarning``
(``tether.common.moved``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tether.common import moved

__version__ = "0.1.0"

# Each public name and the module that defines it.
_HOMES: dict[str, str] = {
    # Training your model.
    "Trainer": "tether.worker.training.trainer",
    "TrainingConfig": "tether.worker.config",
    "ShardedEmbeddingBag": "tether.worker.training.embedding_bag",
    "RunRecord": "tether.worker.training.run_record",
    # The tables' rules.
    "TableConfig": "tether.protos.specs",
    "OptimizerConfig": "tether.protos.specs",
    # Data.
    "ParquetStream": "tether.worker.data.parquet_stream",
    "HoldOut": "tether.worker.data.parquet_rows",
    "CriteoStream": "tether.worker.data.criteo",
    # Calling the shards yourself.
    "PSClient": "tether.worker.client.ps_client",
    "ClientConfig": "tether.worker.client.config",
    "ClientSecurity": "tether.common.security",
    # Held-out metrics.
    "log_loss": "tether.worker.training.evaluation",
    "auc": "tether.worker.training.evaluation",
    "constant_baseline_loss": "tether.worker.training.evaluation",
    # Trained models out of tether.
    "load_export": "tether.worker.serving",
    # Errors: one base (TetherError, what a shard answered) and a user's mistake (UsageError).
    "TetherError": "tether.protos.errors",
    "UsageError": "tether.protos.errors",
    "InvalidArgument": "tether.protos.errors",
    "NotFound": "tether.protos.errors",
    "FailedPrecondition": "tether.protos.errors",
    "ResourceExhausted": "tether.protos.errors",
    "Unauthenticated": "tether.protos.errors",
    "TooStale": "tether.protos.errors",
    "Unavailable": "tether.protos.errors",
    "DeadlineExceeded": "tether.protos.errors",
}

# The same names as _HOMES (a literal list, so that linters and IDEs read it).
__all__ = [
    "ClientConfig",
    "ClientSecurity",
    "CriteoStream",
    "DeadlineExceeded",
    "FailedPrecondition",
    "HoldOut",
    "InvalidArgument",
    "NotFound",
    "OptimizerConfig",
    "PSClient",
    "ParquetStream",
    "ResourceExhausted",
    "RunRecord",
    "ShardedEmbeddingBag",
    "TableConfig",
    "TetherError",
    "TooStale",
    "Trainer",
    "TrainingConfig",
    "Unauthenticated",
    "Unavailable",
    "UsageError",
    "auc",
    "constant_baseline_loss",
    "load_export",
    "log_loss",
]

moved.install()

if TYPE_CHECKING:
    from tether.common.security import ClientSecurity
    from tether.protos.errors import (
        DeadlineExceeded,
        FailedPrecondition,
        InvalidArgument,
        NotFound,
        ResourceExhausted,
        TetherError,
        TooStale,
        Unauthenticated,
        Unavailable,
        UsageError,
    )
    from tether.protos.specs import OptimizerConfig, TableConfig
    from tether.worker.client.config import ClientConfig
    from tether.worker.client.ps_client import PSClient
    from tether.worker.config import TrainingConfig
    from tether.worker.data.criteo import CriteoStream
    from tether.worker.data.parquet_rows import HoldOut
    from tether.worker.data.parquet_stream import ParquetStream
    from tether.worker.serving import load_export
    from tether.worker.training.embedding_bag import ShardedEmbeddingBag
    from tether.worker.training.evaluation import auc, constant_baseline_loss, log_loss
    from tether.worker.training.run_record import RunRecord
    from tether.worker.training.trainer import Trainer


def __getattr__(name: str) -> Any:
    """A public name, imported from its module when first asked for."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tether' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
