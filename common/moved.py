"""Old import paths of moved modules, kept working until tether 0.2 with a ``DeprecationWarning``.

tether 0.1 moved its modules into rooms by concept (docs/layout.md): ``tether.worker.embedding`` is
now ``tether.worker.training.embedding``, the update rules moved from ``tether.protos`` to
``tether.rules``, and so on. ``install`` (called by ``import tether``, which every ``tether.*``
import runs first) puts a finder on ``sys.meta_path`` that answers only the old names in
``MOVED``: the old name becomes the new module itself (one module object, one set of classes),
and the import warns once where the user's code made it. Three old modules have a package of the
same name now (``tether.worker.client``, ``.data``, ``.training``); those packages forward the old
module's names with ``forward_names``. A name an old module re-exported from another module is no
longer in the module that replaced it: that module gives it from its home with a warning
(``RE_EXPORTED``, ``old_names``). New code imports ``tether`` (the stable surface) or the new
paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "RE_EXPORTED", "forward_names", "install", "old_names"]

# Each old dotted name and the module that is there now.
MOVED: dict[str, str] = {
    "tether.protos.ctr_rules": "tether.rules.ctr_rules",
    "tether.protos.initial": "tether.rules.initial",
    "tether.protos.kernel_helpers": "tether.rules.kernel_helpers",
    "tether.protos.optimizers": "tether.rules.optimizers",
    "tether.protos.update_rules": "tether.rules.update_rules",
    "tether.server.admission": "tether.server.storage.admission",
    "tether.server.auth": "tether.server.serving.auth",
    "tether.server.checkpoint": "tether.server.checkpoints.checkpoint",
    "tether.server.checkpoint_files": "tether.server.checkpoints.checkpoint_files",
    "tether.server.clocks": "tether.server.storage.clocks",
    "tether.server.connection": "tether.server.serving.connection",
    "tether.server.data_handshake": "tether.server.serving.data_handshake",
    "tether.server.data_port": "tether.server.serving.data_port",
    "tether.server.dedup": "tether.server.storage.dedup",
    "tether.server.dense": "tether.server.storage.dense",
    "tether.server.gate": "tether.server.storage.gate",
    "tether.server.handler": "tether.server.serving.handler",
    "tether.server.index": "tether.server.storage.index",
    "tether.server.index_kernels": "tether.rules.index_kernels",
    "tether.server.kernel_cache": "tether.rules.kernel_cache",
    "tether.server.kernel_threads": "tether.rules.kernel_threads",
    "tether.server.push_hooks": "tether.rules.push_hooks",
    "tether.server.restore": "tether.server.checkpoints.restore",
    "tether.server.row_kernels": "tether.rules.row_kernels",
    "tether.server.serve": "tether.server.serving.serve",
    "tether.server.service": "tether.server.serving.service",
    "tether.server.shard": "tether.server.storage.shard",
    "tether.server.shard_records": "tether.server.storage.shard_records",
    "tether.server.tables": "tether.server.storage.tables",
    "tether.server.update_log": "tether.server.storage.update_log",
    "tether.server.zeroed": "tether.server.storage.zeroed",
    "tether.worker.batches": "tether.worker.training.batches",
    "tether.worker.cache_batch": "tether.worker.cache.batch",
    "tether.worker.cache_kernels": "tether.worker.cache.kernels",
    "tether.worker.cache_parts": "tether.worker.cache.parts",
    "tether.worker.cache_push": "tether.worker.cache.row_cache",
    "tether.worker.cache_split": "tether.worker.cache.split",
    "tether.worker.channel": "tether.worker.client.channel",
    "tether.worker.client": "tether.worker.client.ps_client",
    "tether.worker.client_config": "tether.worker.client.config",
    "tether.worker.criteo": "tether.worker.data.criteo",
    "tether.worker.criteo_parser": "tether.worker.data.criteo_parser",
    "tether.worker.ctr_job": "tether.worker.ctr.job",
    "tether.worker.cuda_steps": "tether.worker.training.cuda_steps",
    "tether.worker.data": "tether.worker.data.synthetic",
    "tether.worker.data_channel": "tether.worker.client.data_channel",
    "tether.worker.data_checks": "tether.worker.data.checks",
    "tether.worker.embedding": "tether.worker.training.embedding",
    "tether.worker.embedding_bag": "tether.worker.training.embedding_bag",
    "tether.worker.evaluation": "tether.worker.training.evaluation",
    "tether.worker.local": "tether.worker.client.local",
    "tether.worker.local_table": "tether.worker.client.local_table",
    "tether.worker.mode": "tether.worker.training.mode",
    "tether.worker.model": "tether.worker.ctr.model",
    "tether.worker.parquet": "tether.worker.data.parquet",
    "tether.worker.parquet_convert": "tether.worker.data.parquet_convert",
    "tether.worker.parquet_rows": "tether.worker.data.parquet_rows",
    "tether.worker.parquet_schema": "tether.worker.data.parquet_schema",
    "tether.worker.parquet_stream": "tether.worker.data.parquet_stream",
    "tether.worker.policies": "tether.worker.training.policies",
    "tether.worker.results": "tether.worker.client.results",
    "tether.worker.router": "tether.worker.client.router",
    "tether.worker.row_cache": "tether.worker.cache.row_cache",
    "tether.worker.row_slots": "tether.worker.cache.slots",
    "tether.worker.run_record": "tether.worker.training.run_record",
    "tether.worker.step": "tether.worker.training.step",
    "tether.worker.stragglers": "tether.worker.training.stragglers",
    "tether.worker.table_rules": "tether.worker.training.table_rules",
    "tether.worker.tensorboard_writer": "tether.worker.training.tensorboard_writer",
    "tether.worker.traffic": "tether.worker.client.traffic",
    "tether.worker.training": "tether.worker.training.trainer",
    "tether.worker.transfer": "tether.worker.training.transfer",
}

# Names an old module (or a module still there) re-exported from another module, by the module that
# is there now, with the module each lives in: the new module no longer holds them, and gives them
# from there with a warning (``old_names``; a package of an old module's name too, ``forward_names``).
# Only names a user could have imported are here: a server's internal records, say, are not.
RE_EXPORTED: dict[str, dict[str, str]] = {
    # tether.worker.training (now .trainer) gave the config; tether.worker.embedding (now .embedding) the module.
    "tether.worker.training.trainer": {"TrainingConfig": "tether.worker.config"},
    "tether.worker.training.embedding": {"ShardedEmbeddingBag": "tether.worker.training.embedding_bag"},
    # The rules' registry (and tether.protos.optimizers before it) gave the rules, their config and their names.
    "tether.rules.optimizers": {
        "OptimizerConfig": "tether.protos.specs",
        "OPTIMIZERS": "tether.protos.names",
        **dict.fromkeys(("SGD", "Adagrad", "Adam", "RuleOptimizer", "UpdateRule"), "tether.rules.update_rules"),
        **dict.fromkeys(("RowwiseAdagrad", "Ftrl"), "tether.rules.ctr_rules"),
    },
    # The local launcher gave the errors a LocalCluster raises.
    "tether.deploy.launch": dict.fromkeys(("ClusterError", "Interrupted"), "tether.deploy.errors"),
}

# Old names that are packages now: the package forwards the old module's names (``forward_names``).
_NOW_PACKAGES = frozenset(old for old in MOVED if any(new.startswith(old + ".") for new in MOVED.values()))


def _warn(old: str, new: str) -> None:
    """Warn once per old name, where the user's code imported it: ``stacklevel`` counts the frames
    of this module (``warnings`` itself passes over the import system's)."""
    if old in _warned:
        return
    _warned.add(old)
    depth, frame = 1, sys._getframe(1)  # noqa: SLF001 - the frames between the user's import and here
    while frame is not None and (frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith("<frozen importlib")):
        if frame.f_code.co_filename == __file__:
            depth += 1
        frame = frame.f_back  # type: ignore[assignment]
    warnings.warn(f"{old} moved to {new}; the old path goes in tether 0.2 (import tether gives the stable names)",
                  DeprecationWarning, stacklevel=depth + 1)


_warned: set[str] = set()


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds only the old module names: each is loaded as the new module it became."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED or fullname in _NOW_PACKAGES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, MOVED[spec.name])
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


_FINDER = _OldPaths()


def install() -> None:
    """Put the old-path finder on ``sys.meta_path`` (once per process)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


def forward_names(package: str) -> Callable[[str], Any]:
    """A package's ``__getattr__`` that gives the names of the old module of the same name, with a
    warning (``tether.worker.training.Trainer`` as before, from ``tether.worker.training.trainer``;
    a name that old module re-exported from its home, ``RE_EXPORTED``)."""
    new = MOVED[package]

    def __getattr__(name: str) -> Any:
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            # A submodule not imported yet (``from tether.worker.training import embedding_bag``):
            # the import system imports it, without the old module being loaded first.
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        home = RE_EXPORTED.get(new, {}).get(name)
        if home is not None:
            _warn(f"{package}.{name}", f"{home}.{name}")
            return getattr(importlib.import_module(home), name)
        module = importlib.import_module(new)
        if name.startswith("__") or not hasattr(module, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn(f"{package}.{name}", f"{new}.{name}")
        return getattr(module, name)

    return __getattr__


def old_names(module: str) -> Callable[[str], Any]:
    """A module's ``__getattr__`` that gives the names its old module re-exported (``RE_EXPORTED``)
    from their homes, with a warning: ``from tether.worker.embedding import ShardedEmbeddingBag``
    as before, from ``tether.worker.training.embedding_bag``, with no re-export in the module."""
    homes = RE_EXPORTED[module]

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", f"{home}.{name}")
        return getattr(importlib.import_module(home), name)

    return __getattr__
